"""StallDetector on sequence models (issue 24, item 4): token-level targets at the chance level, and a
weight decay that shrinks the weights away.

Real Trainer runs of a tiny next-token model on a synthetic language (a 48-token Markov chain: each token
is followed by its fixed successor 3 times in 4, else by a Zipf-distributed token; sequences of 16
targets, some padded with ``ignore_index`` -100). Each fault is checked against what the run really did
(the token counts of the checked batches, the weight norms and the decay's part of the update recomputed
from the weights before and after the step), each next to its healthy twin.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from torch import nn

from lightning_gradguard.core.lr import decay_factors
from lightning_gradguard.monitors.stall.callback import StallDetector
from lightning_gradguard.monitors.stall.check import loss_trend, token_entropy
from lightning_gradguard.monitors.stall.measure import class_targets, token_targets

V, T = 48, 16


def token_data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets ``(n, T)``; the chain runs 32 tokens before the kept window, so every
    position's token frequencies are the chain's own (no position tells more than another)."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, V + 1).float()
    zipf /= zipf.sum()
    successor = torch.multinomial(zipf, V, replacement=True, generator=g)[torch.randperm(V, generator=g)]
    seq = torch.empty(n, T + 1 + 32, dtype=torch.long)
    seq[:, 0] = torch.multinomial(zipf, n, replacement=True, generator=g)
    for t in range(seq.shape[1] - 1):
        keep = torch.rand(n, generator=g) < 0.75
        other = torch.multinomial(zipf, n, replacement=True, generator=g)
        seq[:, t + 1] = torch.where(keep, successor[seq[:, t]], other)
    seq = seq[:, 32:]
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
    y[torch.arange(T)[None] >= lengths[:, None]] = -100  # padding: no target there
    return x, y


class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Hugging Face-style samples: ``input_ids``, ``attention_mask`` and ``labels``."""

    def __init__(self) -> None:
        self.x, self.y = token_data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.x[i],
            "attention_mask": torch.ones(T, dtype=torch.long),
            "labels": self.y[i],
        }


def loader(tuples: bool = False, seed: int = 0) -> Any:
    data: Any = torch.utils.data.TensorDataset(*token_data()) if tuples else Batches()
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, drop_last=True, generator=g)


class TokenModel(pl.LightningModule):
    """A token model: an embedding, a residual MLP per position (``"mlp"``) or a 2-layer post-LN causal
    transformer (``"post_ln"``), and a linear head over the 48 tokens; ``feed="attention_mask"`` is the bug
    of feeding the attention mask where the ids belong (the output no longer depends on the input)."""

    def __init__(
        self, arch: str = "mlp", optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.01,
        feed: str = "input_ids", seed: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(seed)
        self.arch, self.optimizer, self.lr, self.weight_decay, self.feed = (
            arch,
            optimizer,
            lr,
            weight_decay,
            feed,
        )
        self.emb = nn.Embedding(V, 32)
        if arch == "mlp":
            self.body: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        else:
            self.pos = nn.Parameter(torch.randn(T, 32) * 0.02)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=False)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, V)
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.arch == "mlp":
            return self.head(h + self.body(h))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.body(h + self.pos[: ids.shape[1]], mask=mask, is_causal=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = (batch[self.feed], batch["labels"]) if isinstance(batch, dict) else batch
        logits = self(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))  # ignore_index=-100
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def fit(model: TokenModel, steps: int, tuples: bool = False, *callbacks: Any) -> StallDetector:
    detector = StallDetector()
    make_trainer([detector, *callbacks], max_steps=steps, max_epochs=-1).fit(model, loader(tuples))
    return detector


def kinds(detector: StallDetector) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in detector.alerts]


def settled(losses: list[float], level: float, tolerance: float = 0.03) -> int:
    """The first step from which every 10-step mean of the loss stays within ``tolerance`` of ``level``."""
    means = [sum(losses[i : i + 10]) / 10 for i in range(len(losses) - 9)]
    return next(i for i in range(len(means)) if all(abs(m / level - 1) < tolerance for m in means[i:]))


# ---------------------------------------------------------------------------------------------- weight decay
class DecayAround(pl.Callback):
    """The weights before and after each optimizer step, and the LR and weight decay the step used."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        group = trainer.optimizers[0].param_groups[0]
        self.factor = group["lr"] * group["weight_decay"]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.layers: dict[str, list[float]] = {}  # per layer: ||w||^2, ||decay||^2, ||rest||^2
        for n, p in pl_module.named_parameters():
            w0 = self.before[n].double()
            decay = self.factor * w0
            rest = (w0 - p.detach().double()) - decay
            acc = self.layers.setdefault(n.rsplit(".", 1)[0], [0.0, 0.0, 0.0])
            for i, v in enumerate((w0, decay, rest)):
                acc[i] += float(v.square().sum())


def test_adamw_with_a_huge_weight_decay_is_named_from_the_weight_norms() -> None:
    """AdamW(lr=1e-3, weight_decay=100) removes 10 % of every weight per step: the weights fall 10x every
    ~22 steps and the loss sits at ln V (every logit ~0) from the start. Named from the settings read at
    the start once steps 0-2 confirm the schedule (step 49 before issue 38, from the weight norms); the
    weight norms then fall as the setting said. Its twin (weight_decay=0.01) learns and stays quiet. The
    decay's part and the rest of the update each check measured are those of the step, recomputed from
    the weights before and after it."""
    model, brute = TokenModel(weight_decay=100.0), DecayAround()
    detector = fit(model, 60, False, brute)
    assert kinds(detector) == [("weight_decay_collapse", 2)]
    alert = detector.alerts[0]
    assert alert.where == "weight_decay" and alert.data["decay_rate"] == pytest.approx(0.1)
    assert "halves those weights every 6.93 steps" in alert.message and alert.data["share"] == 1.0
    assert abs(sum(model.losses[-10:]) / 10 - math.log(V)) < 0.02  # the loss of a uniform guess
    check = detector.last_check  # step 59, measured like the brute force on the same step
    assert check is not None and check.step == 59 and set(check.decay) == set(brute.layers)
    for layer, (w2, d2, r2) in brute.layers.items():
        assert check.weight_norms[layer] == pytest.approx(math.sqrt(w2), rel=1e-4)
        assert check.decay[layer][0] == pytest.approx(math.sqrt(d2), rel=1e-4)
        assert check.decay[layer][1] == pytest.approx(math.sqrt(r2), rel=1e-2, abs=1e-9)

    twin = TokenModel(weight_decay=0.01)
    assert fit(twin, 200).alerts == []
    assert sum(twin.losses[-10:]) / 10 < 0.6 * math.log(V)  # it learned the successors


def test_decay_factors_follow_the_optimizers_own_decay() -> None:
    w, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(1))
    groups = [{"params": [w], "weight_decay": 0.5}, {"params": [b], "weight_decay": 0.0}]
    adamw = decay_factors(torch.optim.AdamW(groups, lr=0.1), [w, b])
    assert adamw is not None and adamw.factors == pytest.approx([0.05, 0.0]) and adamw.groups == [(0.1, 0.5)]
    sgd = decay_factors(torch.optim.SGD([w], lr=0.2, weight_decay=0.1), [w])
    assert sgd is not None and sgd.factors == pytest.approx([0.02])
    # Adam's L2 is folded into the gradient it normalizes: no term of its own
    assert decay_factors(torch.optim.Adam([w], lr=0.1, weight_decay=0.5), [w]) is None
    assert decay_factors(torch.optim.AdamW([w], lr=0.1, weight_decay=0.0), [w]) is None


# ---------------------------------------------------------------------------------------------- chance level
class CheckedTargets(pl.Callback):
    """The token targets of every checked step's batch."""

    def __init__(self) -> None:
        self.counts = torch.zeros(V, dtype=torch.float64)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        at = trainer.global_step
        if at < 5 or (at + 1) % 10 == 0:  # the dense start, then every 10th step
            y = batch["labels"].reshape(-1)
            self.counts += torch.bincount(y[y != -100], minlength=V).double()


def test_a_model_fed_the_attention_mask_sits_at_the_token_entropy_and_is_named_within_tens_of_steps() -> None:
    """The bug: ``self(batch["attention_mask"])`` instead of ``input_ids``: the output cannot depend on the
    input, the model learns the token frequencies and its loss settles at their entropy (2.61, well under
    ln 48 = 3.87) by step ~40; named 30-50 steps later. Its twin, fed the ids, learns and stays quiet."""
    model, seen = TokenModel(feed="attention_mask"), CheckedTargets()
    detector = fit(model, 100, False, seen)
    ((kind, step),) = kinds(detector)
    # the chance level is the entropy of the tokens of the checked batches, padding left out
    p = seen.counts[seen.counts > 0] / seen.counts.sum()
    plugin = float(-(p * p.log()).sum())
    chance = plugin + (len(p) - 1) / (2 * float(seen.counts.sum()))
    assert detector.state.token_counts is not None
    assert torch.equal(detector.state.token_counts[:V], seen.counts) and seen.counts.sum() < 15 * 16 * T
    assert detector.state.chance() == pytest.approx(chance) and detector.state.uniform() == pytest.approx(
        math.log(V)
    )
    onset = settled(model.losses, chance)
    assert kind == "chance_level" and 20 <= step - onset <= 50, (onset, step)
    assert "output does not depend on its input" in detector.alerts[0].hint

    twin = TokenModel()
    assert fit(twin, 200).alerts == [] and sum(twin.losses[-10:]) / 10 < 0.6 * chance


def test_a_post_ln_transformer_without_warmup_is_named_before_it_collapses() -> None:
    """A post-LN transformer, Adam at LR 0.1 from the first step: it collapses to an output that ignores
    its input by step ~20 and sits at the token entropy. Its first updates rewrite far more than 3 % of its
    weights a step: warmup_missing on the dense start's third check (step 2), the cause, which stands for
    the chance level it leads to. The same model at LR 0.01 learns and stays quiet (batches are
    ``(ids, targets)`` tuples here)."""
    model = TokenModel(arch="post_ln", optimizer="adam", lr=0.1)
    detector = fit(model, 60, True)
    chance = detector.state.chance()
    onset = settled(model.losses[:60], chance, tolerance=0.05)
    assert kinds(detector) == [("warmup_missing", 2)] and onset <= 30, onset
    assert detector.alerts[0].data["update_ratio"] > 3 * 0.03 and "warm-up" in detector.alerts[0].hint

    twin = TokenModel(arch="post_ln", optimizer="adam", lr=0.01)
    assert fit(twin, 150, True).alerts == [] and sum(twin.losses[-10:]) / 10 < 0.6 * chance


def test_a_slow_learner_passing_through_the_chance_band_stays_quiet() -> None:
    """AdamW at LR 1e-4 (ten times below the usual): the loss spends the whole run inside the chance band
    (between the token entropy and ln V) but keeps falling, 1-2 % per check interval, more than its noise."""
    model = TokenModel(lr=1e-4)
    detector = fit(model, 300)
    low, high = detector.state.chance_band()
    means = [sum(model.losses[i : i + 10]) / 10 for i in range(60, 250, 10)]
    assert all(low <= m <= high for m in means)  # a rule on the level alone would fire
    assert detector.alerts == [] and means[-1] < 0.8 * means[0]


# ---------------------------------------------------------------------------------------------- the pieces
def test_token_targets_are_found_where_class_targets_are_not() -> None:
    ids, y = torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long)
    assert class_targets((ids, y)) is None and token_targets((ids, y)) is y
    assert token_targets({"input_ids": ids, "labels": y}) is y
    flat = y.reshape(-1)  # targets flattened like the logits, (B * T,)
    assert token_targets((ids, flat)) is flat and class_targets((ids, flat)) is None
    column = torch.arange(4).reshape(4, 1)  # (B, 1) class indices
    assert torch.equal(class_targets((torch.zeros(4, 3), column)), column.reshape(-1))  # type: ignore[arg-type]
    assert token_targets((torch.zeros(4, 3), torch.zeros(4, 6))) is None  # float targets: a regression


def test_token_entropy_is_the_plugin_entropy_plus_the_miller_madow_term() -> None:
    counts = torch.tensor([0.0, 30.0, 10.0, 60.0])
    p = counts[counts > 0] / 100
    assert token_entropy(counts) == pytest.approx(float(-(p * p.log()).sum()) + 2 / 200)
    assert math.isnan(token_entropy(torch.zeros(5)))


def test_loss_trend_is_the_least_squares_fall_and_its_standard_error() -> None:
    import numpy as np

    steps, losses, errors = [9, 19, 29, 39], [3.0, 2.9, 2.95, 2.7], [0.05, 0.02, 0.04, 0.03]
    trend = loss_trend(list(zip(steps, losses, errors, strict=True)))
    assert trend is not None
    slope = np.polyfit(steps, losses, 1)[0]
    assert trend.fall == pytest.approx(-slope * 30) and trend.level == pytest.approx(np.mean(losses))
    x = np.array(steps) - np.mean(steps)  # var(slope) = sum(x^2 e^2) / (sum x^2)^2
    se = math.sqrt(float((x**2 * np.array(errors) ** 2).sum())) / float((x**2).sum())
    assert trend.noise == pytest.approx(se * 30)
    residual = loss_trend([(s, v, None) for s, v in zip(steps, losses, strict=True)])
    cov = np.polyfit(steps, losses, 1, cov="unscaled")[1]  # the residuals' variance, n - 2 degrees
    rss = float(((np.polyval(np.polyfit(steps, losses, 1), steps) - losses) ** 2).sum())
    assert residual is not None and residual.noise == pytest.approx(math.sqrt(cov[0, 0] * rss / 2) * 30)


def test_what_the_token_rules_remember_survives_a_checkpoint() -> None:
    """The token counts (trimmed of the unseen tail), the loss window and the weight-decay bookkeeping go
    through ``state_dict``: a state restored after two of the three shrinking checks names the weight
    decay on the third, as the uninterrupted one does."""
    from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds
    from lightning_gradguard.monitors.stall.rules import observe
    from lightning_gradguard.monitors.stall.state import StallState

    def check(step: int, loss: float) -> StallCheck:
        tokens = torch.zeros(1 << 16)
        tokens[:V] = torch.arange(1, V + 1, dtype=torch.float32)
        return StallCheck(
            step=step, lr=1e-3, lr_max=1e-3, lr_configured=1e-3, loss=loss, loss_stderr=0.01, tokens=tokens,
            weight_norms={"a": 10.0 if step < 40 else 0.9 - (step - 40) / 100}, decay={"a": (1.0, 0.1)},
            decay_groups=[(1e-3, 100.0)],
        )  # fmt: skip

    whole, first = StallState(StallThresholds()), StallState(StallThresholds())
    for step in range(0, 60, 10):
        observe(whole, check(step, 3.0))
        observe(first, check(step, 3.0))
    state = first.state_dict()
    assert state["token_counts"].numel() == V and len(state["window"]) == 4
    resumed = StallState(StallThresholds())
    resumed.load_state_dict(state)
    assert resumed.chance() == pytest.approx(whole.chance()) and resumed.window == whole.window
    assert resumed.peak_weight == whole.peak_weight and resumed.streaks == whole.streaks
    later = check(60, 3.0)  # the third check in a row with the weights 10x down: named now
    assert [f.kind for f in observe(resumed, later)] == [f.kind for f in observe(whole, later)]
    assert resumed.fired == whole.fired == {"weight_decay_collapse"}
