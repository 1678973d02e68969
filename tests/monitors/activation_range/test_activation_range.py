"""ActivationRangeMonitor on real Trainer runs, against brute-force numbers the tests compute themselves.

The model is a small transformer: an ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``, through
``F.scaled_dot_product_attention``), a block calling ``nn.MultiheadAttention`` with ``need_weights`` on or
off (``bmm`` + ``softmax`` or SDPA), and a hand-written block calling ``F.scaled_dot_product_attention``.
The tests' own forward hooks keep every block output and every attention input of each step; block
statistics are recomputed from those outputs in float64, the largest logit as ``q @ k^T / sqrt(d)`` from
the module's weights on the same inputs (masks applied), and the attention entropy as the softmax of
those scores.
"""

from __future__ import annotations

import json
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import MemoryLogger, make_trainer, run_ddp_script
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn.modules import module as module_globals

from lightning_gradguard import ActivationRangeMonitor
from lightning_gradguard.functional.activation_range import (
    max_attention_logit,
    mha_max_logit,
    output_moments,
    pool_moments,
)
from lightning_gradguard.monitors.activation_range.measure import find_blocks

D, HEADS, L = 16, 2, 6


class SdpaBlock(nn.Module):
    """Causal self-attention written by hand: ``F.scaled_dot_product_attention``; ``gain`` scales q."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.gain = 1.0

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = x.shape[0]
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.reshape(b, L, HEADS, D // HEADS).transpose(1, 2) for t in (q, k, v))
        return q * self.gain, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(x.shape))


class MhaBlock(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn, self.need_weights = nn.MultiheadAttention(D, HEADS, batch_first=True), need_weights

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # True: masked out (MHA's convention)
        y, _ = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=self.need_weights)
        return x + y


class Tiny(pl.LightningModule):
    """embed -> [TransformerEncoderLayer, MhaBlock, SdpaBlock] -> mean pool -> head; records the truth."""

    def __init__(
        self, need_weights: bool = False, scale: float = 1.0, lr: float = 0.05, record: bool = True
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
        self.layers = nn.ModuleList([layer, MhaBlock(need_weights), SdpaBlock()])
        self.head = nn.Linear(D, 3)
        self.scale, self.lr = scale, lr
        self.outputs: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.logits: dict[int, dict[str, list[float]]] = {}
        self.scores: dict[int, dict[str, list[torch.Tensor]]] = {}  # -inf where masked
        self.attached: dict[int, bool] = {}
        if record:
            self._record(layer)

    def _record(self, layer: nn.TransformerEncoderLayer) -> None:
        for name, m in [("embed", self.embed), ("head", self.head), *self.layers.named_children()]:
            name = name if name in ("embed", "head") else f"layers.{name}"
            m.register_forward_hook(self._keep(name))
        for name, m in [("layers.0.self_attn", layer.self_attn), ("layers.1.attn", self.layers[1].attn)]:
            m.register_forward_pre_hook(self._mha_truth(name), with_kwargs=True)
        self.layers[2].register_forward_pre_hook(self._sdpa_truth)

    def _step(self) -> int:
        return int(self.trainer.global_step)

    def _keep(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self.outputs.setdefault(self._step(), {}).setdefault(name, []).append(out.detach().double())

        return hook

    def _note(self, name: str, value: torch.Tensor) -> None:
        self.logits.setdefault(self._step(), {}).setdefault(name, []).append(float(value.detach().max()))
        self.scores.setdefault(self._step(), {}).setdefault(name, []).append(value.detach().double())

    def _mha_truth(self, name: str) -> Any:
        def hook(mha: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any]) -> None:
            x = args[0].detach().double()  # batch_first, self-attention
            w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
            q, k = (F.linear(x, w[i * D : (i + 1) * D], b[i * D : (i + 1) * D]) for i in (0, 1))
            q, k = (t.reshape(x.shape[0], L, HEADS, D // HEADS).transpose(1, 2) for t in (q, k))
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
            for mask in (kwargs.get("attn_mask"), kwargs.get("key_padding_mask")):
                if mask is None:
                    continue
                mask = mask if mask.dim() == 2 and mask.shape == (L, L) else mask[:, None, None, :]
                scores = scores.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else scores + mask
            self._note(name, scores)

        return hook

    def _sdpa_truth(self, block: SdpaBlock, args: Any) -> None:
        with torch.no_grad():
            q, k, _ = (t.double() for t in block.heads(args[0]))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
        self._note("layers.2", scores.masked_fill(torch.ones(L, L).triu(1).bool(), -math.inf))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.attached[self._step()] = bool(
            torch._C._len_torch_function_stack() or module_globals._global_forward_hooks
        )
        x, y = batch
        pad = torch.zeros(x.shape[0], L, dtype=torch.bool)
        pad[0, -2:] = True  # the last two positions of the first sample are padding
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # True: masked out
        h = self.layers[0](self.embed(x * self.scale), src_mask=causal, src_key_padding_mask=pad)
        h = self.layers[2](self.layers[1](h, pad))
        return F.cross_entropy(self.head(h.mean(1)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 64, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, L, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def truth(outputs: list[torch.Tensor]) -> dict[str, float]:
    """max|x|, RMS, kurtosis and fp16 headroom of every entry of the outputs, in float64."""
    x = torch.cat([o.reshape(-1) for o in outputs])
    d = x - x.mean()
    max_abs = float(x.abs().max())
    return {
        "max_abs": max_abs,
        "rms": float(x.pow(2).mean().sqrt()),
        "kurtosis": float(d.pow(4).mean() / d.pow(2).mean() ** 2),
        "fp16_headroom": math.log2(65504 / max_abs),
    }


def entropy_truth(scores: list[torch.Tensor]) -> dict[str, float]:
    """The mean attention entropy (nats) over every (call, batch, head, query) row with two keys or more,
    the lowest head's, and the mean of entropy / ln(keys), from the score matrices ``(batch, heads, L, S)``
    (-inf: masked)."""
    s = torch.cat(scores)
    valid = torch.isfinite(s).sum(-1) >= 2
    p = s.softmax(-1)
    h = -(p * torch.where(p > 0, p.log(), torch.zeros((), dtype=p.dtype))).sum(-1)
    h = torch.where(valid, h, torch.zeros((), dtype=h.dtype))
    per_head = h.sum((0, 2)) / valid.sum((0, 2))
    ratio = h / torch.isfinite(s).sum(-1).clamp(min=2).double().log()
    return {
        "entropy": float(h.sum() / valid.sum()),
        "entropy_min_head": float(per_head.min()),
        "ratio": float(ratio.sum() / valid.sum()),
    }


BLOCKS = ["embed", "layers.0", "layers.1", "layers.2", "head"]
ATTENTION = ["layers.0.self_attn", "layers.1.attn", "layers.2"]


@pytest.mark.parametrize(("need_weights", "accumulate"), [(False, 1), (True, 2)])
def test_logged_ranges_and_logits_equal_a_brute_force_recomputation(
    need_weights: bool, accumulate: int
) -> None:
    torch.manual_seed(0)
    logger, model = MemoryLogger(), Tiny(need_weights, scale=3.0)
    monitor = ActivationRangeMonitor()
    trainer = make_trainer(
        [monitor], logger, max_steps=6, log_every_n_steps=2, accumulate_grad_batches=accumulate
    )
    trainer.fit(model, loader(n=96))
    sampled = [0, 1, 3, 5]  # step 0, then Lightning's rule (x + 1) % 2 == 0
    assert sorted(s for s, on in model.attached.items() if on) == sampled  # nothing attached elsewhere
    assert find_blocks(model).keys() == set(BLOCKS) and monitor.sampled_steps == len(sampled)
    for step in sampled:
        for block in BLOCKS:
            outs = model.outputs[step][block]
            assert len(outs) == accumulate  # every micro-batch of the step, pooled
            for stat, value in truth(outs).items():
                logged = logger.series(f"activation/{stat}/{block}")[step]
                assert logged == pytest.approx(value, rel=1e-4), (step, block, stat)
        for owner in ATTENTION:
            logged = logger.series(f"attention/max_logit/{owner}")[step]
            assert logged == pytest.approx(max(model.logits[step][owner]), rel=1e-4, abs=1e-5), (step, owner)
            for stat, value in entropy_truth(model.scores[step][owner]).items():
                if stat == "ratio":  # not logged; the latest sampled step's is on the monitor
                    if step == sampled[-1]:
                        assert monitor.entropies[owner].ratio == pytest.approx(value, rel=1e-4)
                    continue
                logged = logger.series(f"attention/{stat}/{owner}")[step]
                assert logged == pytest.approx(value, rel=1e-4), (step, owner, stat)
        total = max(max(v) for v in model.logits[step].values())
        assert logger.series("attention/max_logit/total")[step] == pytest.approx(total, rel=1e-4)
        headroom = min(truth(model.outputs[step][b])["fp16_headroom"] for b in BLOCKS)
        assert logger.series("activation/fp16_headroom/min")[step] == pytest.approx(headroom, rel=1e-4)
    assert not monitor.alerts  # float32: headroom is never judged; logits far below 100


class Overflowing(pl.LightningModule):
    """A block whose output holds 3e4: within 1.13 bits of float16's 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        with torch.no_grad():
            self.net[0].bias[0] = 3e4
            self.net[1].weight[:, 0] = 0.0
        self.seen: list[float] = []
        self.net[0].register_forward_hook(lambda m, a, out: self.seen.append(float(out.detach().abs().max())))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_headroom_alert_fires_under_16_mixed_only(precision: str) -> None:
    torch.manual_seed(0)
    logger, model, monitor = MemoryLogger(), Overflowing(), ActivationRangeMonitor()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    )
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None  # fp16 autocast on the CPU
    plugin = MixedPrecision(precision, device="cpu", scaler=scaler)
    make_trainer([monitor], logger, max_steps=4, plugins=[plugin]).fit(
        model, torch.utils.data.DataLoader(data, 8)
    )
    bits = logger.series("activation/fp16_headroom/net.0")
    assert bits[0] == pytest.approx(math.log2(65504 / model.seen[0]), rel=1e-6) and bits[0] < 2
    if precision == "bf16-mixed":
        assert not monitor.alerts  # logged, never judged: bf16 has float32's range
        return
    (alert,) = monitor.alerts  # one per cooldown
    assert (alert.kind, alert.severity, alert.where, alert.step) == (
        "fp16_headroom_low",
        "warning",
        "net.0",
        0,
    )
    assert alert.data["max_abs"] == pytest.approx(model.seen[0]) and "bf16" in alert.hint


def rule(peaks: list[float], ceiling: float, factor: float, window: int) -> list[tuple[int, str]]:
    """The documented logit rule on the brute-force largest logit of each sampled step."""
    found = []
    for i, value in enumerate(peaks):
        earlier = [p for p in peaks[max(0, i - window) : i] if p > 0]
        if value > ceiling:
            found.append((i, "ceiling"))
        elif value > ceiling / factor and earlier and value >= factor * min(earlier):
            found.append((i, "growth"))
    return found


class Growing(Tiny):
    """The SDPA block's queries are scaled up step by step: its logits grow ~20x over the run."""

    GAINS = [1.0, 1.0, 1.0, 1.0, 1.5, 8.0, 10.0, 40.0]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.layers[2].gain = self.GAINS[self.trainer.global_step]


def test_attention_logit_growth_alerts_follow_the_rule_on_the_true_logits() -> None:
    torch.manual_seed(0)
    model = Growing(lr=0.0)
    with torch.no_grad():
        model.layers[2].qkv.weight.mul_(3.0)
    monitor = ActivationRangeMonitor(sample_every_n_steps=1, growth_window=3, cooldown_steps=0)
    make_trainer([monitor], MemoryLogger(), max_steps=8).fit(model, loader())
    peaks = [max(max(v) for v in model.logits[s].values()) for s in range(8)]
    expected = rule(peaks, 100.0, 4.0, 3)
    assert {r for _, r in expected} == {"growth", "ceiling"}  # the run exercises both rules
    growth = [a for a in monitor.alerts if a.kind == "attention_logit_growth"]
    assert [(a.step, "ceiling" if a.data["reference"] == 100.0 else "growth") for a in growth] == expected
    assert all(a.where == "layers.2" for a in growth) and "QK-norm" in growth[0].hint
    # the entropy rule on the true entropies: below 0.2 of ln(keys) with a logit of 25 or more
    collapsed = []
    for step in range(8):
        low = {
            owner: ratio
            for owner, scores in model.scores[step].items()
            if (ratio := entropy_truth(scores)["ratio"]) < 0.2 and max(model.logits[step][owner]) >= 25
        }
        if low:
            collapsed.append((step, min(low, key=low.__getitem__)))
    entropy = [(a.step, a.where) for a in monitor.alerts if a.kind == "attention_entropy_collapse"]
    assert entropy == collapsed and collapsed  # the growing logits made the attention one-hot
    assert {a.kind for a in monitor.alerts} == {"attention_logit_growth", "attention_entropy_collapse"}


# ------------------------------------------------------------------------------------------ the math
def test_pooled_moments_equal_the_moments_of_everything() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [
        torch.randn(n, generator=g) * s + m for n, s, m in [(100, 1.0, 50.0), (7, 3.0, -2.0), (1, 0.0, 9.0)]
    ]
    pooled = pool_moments([output_moments(p).tolist() for p in parts])
    assert pooled is not None and pooled.count == 108
    for stat, value in truth([p.double() for p in parts]).items():
        assert pooled.scalars()[stat] == pytest.approx(value, rel=1e-5), stat


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
def test_max_attention_logit_in_chunks_with_gqa_equals_the_full_score_matrix(mask: str) -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) * 0.3
    attn = {"bool": torch.rand(5, 7, generator=g) > 0.4, "float": torch.randn(2, 1, 5, 7, generator=g)}.get(
        mask
    )
    if mask == "bool":
        scores = scores.masked_fill(~attn, -math.inf)
    elif mask == "float":
        scores = scores + attn
    elif mask == "causal":
        scores = scores.masked_fill(torch.ones(5, 7).tril().logical_not().bool(), -math.inf)
    got = max_attention_logit(q, k, attn, mask == "causal", 0.3, enable_gqa=True, chunk_elements=50)
    assert float(got) == pytest.approx(float(scores.max()), rel=1e-6)


def test_mha_max_logit_handles_bias_k_zero_attention_and_separate_weights() -> None:
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, kdim=6, vdim=6)
    x, kv = torch.randn(5, 3, 8), torch.randn(4, 3, 6)
    seen: list[Any] = []

    class Keep(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is F.multi_head_attention_forward:
                seen.append(mha_max_logit(args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Keep(), torch.no_grad():
        mha(x, kv, kv)
    with torch.no_grad():
        q = F.linear(x, mha.q_proj_weight, mha.in_proj_bias[:8]).reshape(5, 3, 2, 4).permute(1, 2, 0, 3)
        k = F.linear(kv, mha.k_proj_weight, mha.in_proj_bias[8:16])
        k = (
            torch.cat([k, mha.bias_k.expand(1, 3, 8), torch.zeros(1, 3, 8)])
            .reshape(6, 3, 2, 4)
            .permute(1, 2, 0, 3)
        )
        expected = float((q @ k.transpose(-2, -1) / 2).max())
    assert float(seen[0]) == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------------ compile, DDP
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_model_is_never_recompiled_for_the_monitor() -> None:
    from torch._dynamo.utils import counters

    def run(callbacks: list[Any]) -> tuple[dict[str, Any], Tiny]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Tiny(record=False)
        model.layers[2] = torch.compile(model.layers[2], backend="eager")  # the SDPA block
        make_trainer(callbacks, MemoryLogger(), max_steps=6, log_every_n_steps=2).fit(model, loader(n=48))
        found = {"graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"])}
        torch._dynamo.reset()
        return found, model

    bare, _ = run([])
    monitor = ActivationRangeMonitor()
    found, _ = run([monitor])
    assert found == bare and bare["graphs"] >= 1 and monitor.sampled_steps == 4  # steps 0, 1, 3, 5
    assert set(monitor.max_logits) == set(ATTENTION) and set(monitor.ranges) == set(BLOCKS)  # no _orig_mod


def test_ddp_ranks_pool_their_numbers_and_agree(tmp_path: Any) -> None:
    proc = run_ddp_script("ddp_activation_range.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reported"] == ranks[1]["reported"] and ranks[0]["reported"]  # the same numbers
    truths = [torch.load(tmp_path / f"truth{r}.pt") for r in (0, 1)]
    assert sorted(map(int, ranks[0]["reported"])) == [0, 1, 3, 5]
    for step, seen in ranks[0]["reported"].items():
        for block, stats in seen["ranges"].items():
            both = truths[0]["outputs"][int(step)][block] + truths[1]["outputs"][int(step)][block]
            for stat, value in truth(both).items():  # pooled over both ranks' outputs, exactly
                assert stats[stat] == pytest.approx(value, rel=1e-4), (step, block, stat)
        assert set(seen["ranges"]) == {"embed", "encoder", "head"}
        both = [max(t["logits"][int(step)]) for t in truths]
        assert seen["logits"]["encoder.self_attn"] == pytest.approx(max(both), rel=1e-4)
