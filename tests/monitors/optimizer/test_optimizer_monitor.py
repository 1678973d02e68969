"""OptimizerMonitor on real runs, checked against independent computations.

``Brute`` records, without gradguard, full float64 copies of every weight and gradient before each step,
the learning rate each parameter is stepped with, and the weights and ``optimizer.state`` after it; from
those it computes every logged number by hand (step size, cosine, moments). The skip counters are checked
against the steps the tests poison and against what the other callbacks and the GradScaler saw.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, RecordingMLP, make_trainer, random_loader
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_gradguard import LossSpikeGuard, NaNSentinel, OptimizerMonitor
from lightning_gradguard.core import stats as core_stats


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0]


class Brute(pl.Callback):
    """Every logged number of every step, by hand in float64 from full copies (keyed by global step)."""

    def __init__(self) -> None:
        self.truth: dict[int, dict[str, float]] = {}
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor | None, float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        lr = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        self._before = {
            n: (p.detach().double().clone(), None if p.grad is None else p.grad.double().clone(), lr[id(p)])
            for n, p in pl_module.named_parameters()
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        opt = trainer.optimizers[0]
        sums: dict[str, dict[str, float]] = {}
        for name, p in pl_module.named_parameters():
            w0, g, lr = self._before[name]
            d = p.detach().double() - w0
            s = sums.setdefault(_layer(name), dict.fromkeys(("u", "s", "g", "dot", "m", "v", "n", "b"), 0.0))
            s["u"] += float(d.square().sum())
            s["s"] += float(d.square().sum()) / lr**2 if lr > 0 else 0.0
            if g is not None:
                s["g"] += float(g.square().sum())
                s["dot"] += float((d * -g).sum())
            state = opt.state.get(p, {})
            if "exp_avg" in state:
                s["m"] += float(state["exp_avg"].double().square().sum())
                beta2 = next(gr["betas"][1] for gr in opt.param_groups if any(q is p for q in gr["params"]))
                s["v"] += float(state["exp_avg_sq"].double().sum()) / (1 - beta2 ** float(state["step"]))
                s["n"] += p.numel()
            if isinstance(state.get("momentum_buffer"), torch.Tensor):
                s["b"] += float(state["momentum_buffer"].double().square().sum())
        truth: dict[str, float] = {}
        total = dict.fromkeys(("u", "s", "g", "dot", "m", "v", "n", "b"), 0.0)
        for layer, s in [*sums.items(), ("total", total)]:
            if layer != "total":
                for k in total:
                    total[k] += s[k]
            truth[f"optimizer/step_size/{layer}"] = math.sqrt(s["s"])
            if s["u"] > 0 and s["g"] > 0:
                truth[f"optimizer/update_cosine/{layer}"] = s["dot"] / math.sqrt(s["u"] * s["g"])
            if s["n"]:
                truth[f"optimizer/exp_avg_norm/{layer}"] = math.sqrt(s["m"])
                truth[f"optimizer/exp_avg_sq_rms/{layer}"] = math.sqrt(s["v"] / s["n"])
            if s["b"]:
                truth[f"optimizer/momentum_norm/{layer}"] = math.sqrt(s["b"])
        self.truth[trainer.global_step - 1] = truth


class Model(RecordingMLP):
    """RecordingMLP with a chosen optimizer; ``groups`` puts ``net.0.bias`` (and ``net.2``) in param groups
    of their own, so layer ``net.0`` is split over two learning rates."""

    def __init__(self, make_opt: Any, groups: bool = False, width: int = 16, loss_scale: float = 1.0) -> None:
        super().__init__(hidden=width)
        self.make_opt, self.groups, self.loss_scale = make_opt, groups, loss_scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.loss_scale

    def configure_optimizers(self) -> Any:
        if not self.groups:
            return self.make_opt(self.parameters())
        net = self.net
        return self.make_opt(
            [
                {"params": [net[0].weight]},
                {"params": [net[0].bias], "lr": 3e-3},
                {"params": list(net[2].parameters()), "lr": 2e-2},
            ]
        )


def _check(logger: MemoryLogger, brute: Brute, family: str, rel: float = 1e-4) -> int:
    """Every logged ``optimizer/<family>/*`` value equals the brute-force one; returns how many."""
    checked = 0
    for step, metrics in logger.calls:
        for tag, value in metrics.items():
            if tag.startswith(f"optimizer/{family}/"):
                assert value == pytest.approx(brute.truth[step][tag], rel=rel, abs=1e-7), (step, tag)
                checked += 1
    return checked


ADAMW = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
SGD_MOMENTUM = lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAGRAD = lambda params: torch.optim.Adagrad(params, lr=5e-2)  # noqa: E731


@pytest.mark.parametrize(
    ("make_opt", "families"),
    [
        (ADAMW, ("step_size", "update_cosine", "exp_avg_norm", "exp_avg_sq_rms")),
        (SGD_MOMENTUM, ("step_size", "update_cosine", "momentum_norm")),
        (ADAGRAD, ("step_size", "update_cosine")),
    ],
    ids=["adamw", "sgd_momentum", "adagrad"],
)
def test_every_value_equals_a_brute_force_computation(
    make_opt: Any,
    families: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    snapshots: list[int] = []
    real = core_stats.weight_snapshot
    monkeypatch.setattr(
        core_stats, "weight_snapshot", lambda ps, *a: snapshots.append(len(ps)) or real(ps, *a)
    )
    grads: list[int] = []
    real_grads = core_stats.UpdateSample.sample_grads
    monkeypatch.setattr(
        core_stats.UpdateSample,
        "sample_grads",
        lambda self, gs: grads.append(len(gs)) or real_grads(self, gs),
    )
    logger, brute = MemoryLogger(), Brute()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([brute, OptimizerMonitor(log_every_n_steps=3, dense_steps=0)], logger).fit(
            Model(make_opt, groups=True), random_loader(n=80)
        )
    steps = sorted(s for s, m in logger.calls if "optimizer/step_size/total" in m)
    assert steps == [0, 2, 5, 8]  # Lightning's rule plus the first step, nothing measured in between
    # one update sample (weights, and the gradient at the same entries) on logging steps only
    assert len(snapshots) == len(grads) == len(steps)
    for family in families:
        assert _check(logger, brute, family) == len(steps) * 3, family  # net.0, net.2 and the total
    logged = {t.split("/")[1] for _, m in logger.calls for t in m if t.startswith("optimizer/")}
    assert logged == {*families, "skipped_updates"}
    notes = [r.getMessage() for r in caplog.records if "keeps no moment" in r.getMessage()]
    assert len(notes) == (1 if make_opt is ADAGRAD else 0)


def test_plain_sgd_steps_along_the_gradient() -> None:
    """Plain SGD: the update is -lr * g, so the cosine is 1 and the step size is the gradient norm that
    the model itself recorded."""
    model, logger = RecordingMLP(), MemoryLogger()
    make_trainer([OptimizerMonitor(log_every_n_steps=1)], logger).fit(model, random_loader())
    for step, value in logger.series("optimizer/step_size/total").items():
        assert value == pytest.approx(model.true_total[step], rel=1e-5)
        for layer in ("net.0", "net.2"):
            assert logger.series(f"optimizer/step_size/{layer}")[step] == pytest.approx(
                model.true_layers[step][layer], rel=1e-5
            )
            assert logger.series(f"optimizer/update_cosine/{layer}")[step] == pytest.approx(1.0, abs=1e-5)


def test_a_large_tensor_is_measured_on_a_sample_within_its_error() -> None:
    """A 1024 x 600 layer (614 400 entries, over the 65 536-entry limit) is sampled with stride 11: its
    step size, cosine and moments are within 2 % of the full computation; the small layers stay exact."""
    torch.manual_seed(0)
    logger, brute = MemoryLogger(), Brute()
    model = Model(ADAMW, width=600)
    model.net[0] = nn.Linear(8, 1024)
    model.net[2] = nn.Linear(1024, 600)
    model.net.append(nn.Linear(600, 4))
    make_trainer([brute, OptimizerMonitor(log_every_n_steps=2)], logger, max_steps=4).fit(
        model, random_loader()
    )
    families = ("step_size", "update_cosine", "exp_avg_norm", "exp_avg_sq_rms")
    errors = [
        abs(v / brute.truth[s][t] - 1)
        for s, m in logger.calls
        for t, v in m.items()
        if t in {f"optimizer/{f}/net.2" for f in families}
    ]
    assert len(errors) == 12 and max(errors) < 0.02  # log steps 0, 1, 3; measured: at most 0.85 %
    assert max(errors) > 1e-5  # it was sampled (the full computation agrees to ~1e-7)
    for layer in ("net.0", "net.3"):  # under the limit: exact
        for family in families:
            for s, m in logger.calls:
                if (tag := f"optimizer/{family}/{layer}") in m:
                    assert m[tag] == pytest.approx(brute.truth[s][tag], rel=1e-4, abs=1e-7), (s, tag)


# ------------------------------------------------------------------------------------------ skip counters
def _counts(logger: MemoryLogger, cause: str) -> dict[int, float]:
    return logger.series(f"optimizer/skipped_updates/{cause}")


class PoisonAt(RecordingMLP):
    """NaN in the input of optimizer step ``nan_step``; inputs x30 (a loss spike) at ``spike_step``; an
    inf gradient entry (what an fp16 overflow leaves) after the backward of the ``overflow`` steps."""

    def __init__(
        self, nan_step: int = -1, spike_step: int = -1, overflow: frozenset[int] = frozenset()
    ) -> None:
        super().__init__()
        self.net[1] = nn.ReLU()
        self.nan_step, self.spike_step, self.overflow = nan_step, spike_step, overflow
        self.scales: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == self.nan_step:
            x = x.clone()
            x[0, 2] = float("nan")
        if self.trainer.global_step == self.spike_step:
            x = x * 30.0
        return super().training_step((x, y), batch_idx)

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.overflow:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, *args: Any) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales[self.trainer.global_step - 1] = float(scaler.get_scale())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _adam_steps(model: pl.LightningModule) -> float:
    return float(model.trainer.optimizers[0].state[model.net[0].weight]["step"])


def test_nan_sentinel_skip_is_counted_from_its_step_on() -> None:
    model, logger = PoisonAt(nan_step=3), MemoryLogger()
    sentinel = NaNSentinel(action="skip", save_checkpoint=False, find_origin=False)
    make_trainer([sentinel, OptimizerMonitor(log_every_n_steps=1)], logger).fit(model, random_loader())
    assert [a.step for a in sentinel.alerts] == [3]
    assert _counts(logger, "nan_sentinel") == {s: float(s >= 3) for s in range(8)}
    assert _adam_steps(model) == 8 - 1  # independent: Adam itself counted one update fewer
    assert (
        set(_counts(logger, "grad_scaler").values()) == set(_counts(logger, "loss_spike").values()) == {0.0}
    )


def test_loss_spike_skip_is_counted() -> None:
    torch.manual_seed(0)
    model, logger = PoisonAt(spike_step=12), MemoryLogger()
    guard = LossSpikeGuard(action="skip", window_steps=16, warmup_steps=8, loss_threshold=6.0, min_ratio=2.0)
    make_trainer([guard, OptimizerMonitor(log_every_n_steps=1)], logger).fit(model, random_loader(n=128))
    assert guard.dropped_steps == 1 and [r.step for r in guard.records] == [12]
    assert _counts(logger, "loss_spike") == {s: float(s >= 12) for s in range(16)}
    assert _adam_steps(model) == 16 - 1


def test_grad_scaler_overflows_are_counted_without_a_sync_per_step() -> None:
    model, logger = PoisonAt(overflow=frozenset({2, 5})), MemoryLogger()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    make_trainer([OptimizerMonitor(log_every_n_steps=4)], logger, plugins=[plugin]).fit(
        model, random_loader()
    )
    # independent: the steps where the scale the model read fell
    fell = [s for s in sorted(model.scales) if model.scales[s] < model.scales.get(s - 1, 2.0**10)]
    assert fell == [2, 5]
    assert _counts(logger, "grad_scaler") == {0: 0.0, 3: 1.0, 7: 2.0}
    assert _adam_steps(model) == 8 - 2


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint")
def test_skip_counts_survive_a_resume(tmp_path: Any) -> None:
    sentinel = NaNSentinel(action="skip", save_checkpoint=False, find_origin=False)
    trainer = make_trainer([sentinel, OptimizerMonitor(log_every_n_steps=1)], MemoryLogger(), max_steps=5)
    trainer.fit(PoisonAt(nan_step=3), random_loader())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    logger, monitor = MemoryLogger(), OptimizerMonitor(log_every_n_steps=1)
    make_trainer([NaNSentinel(action="skip"), monitor], logger, max_steps=8, max_epochs=2).fit(
        PoisonAt(), random_loader(), ckpt_path=tmp_path / "run.ckpt"
    )
    assert _counts(logger, "nan_sentinel") == {5: 1.0, 6: 1.0, 7: 1.0}
    assert monitor.state_dict()["skipped_updates"]["nan_sentinel"] == 1.0


# ------------------------------------------------------------------------------------------ rules
def test_epsilon_rule_fires_on_tiny_gradients_and_not_on_a_healthy_run() -> None:
    adam = lambda params: torch.optim.Adam(params, lr=1e-3, eps=1e-8)  # noqa: E731
    for scale, expected in ((1e-10, {"net.0", "net.2"}), (1.0, set())):
        torch.manual_seed(0)
        monitor, brute = OptimizerMonitor(log_every_n_steps=1, patience=3), Brute()
        make_trainer([brute, monitor], MemoryLogger()).fit(Model(adam, loss_scale=scale), random_loader())
        alerts = [a for a in monitor.alerts if a.kind == "adam_epsilon_dominates"]
        assert {a.where for a in alerts} == expected
        for a in alerts:
            assert a.step == 2  # the third consecutive check
            rms = brute.truth[a.step][f"optimizer/exp_avg_sq_rms/{a.where}"]
            assert rms < 1e-8 and a.data["rms_sqrt_v_hat"] == pytest.approx(rms, rel=1e-4)
            assert "eps" in a.hint and a.severity == "warning"
        assert not [a for a in monitor.alerts if a.kind != "adam_epsilon_dominates"]


class Deep(pl.LightningModule):
    """Four linear layers with Adam at 1e-4; ``net.4`` in a param group of its own at ``odd_lr``."""

    def __init__(self, odd_lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.Tanh(),
            nn.Linear(32, 32),
            nn.Tanh(),
            nn.Linear(32, 32),
            nn.Tanh(),
            nn.Linear(32, 4),
        )
        self.odd_lr = odd_lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        odd = set(map(id, self.net[4].parameters()))
        rest = [p for p in self.parameters() if id(p) not in odd]
        return torch.optim.Adam(
            [{"params": rest}, {"params": list(self.net[4].parameters()), "lr": self.odd_lr}], lr=1e-4
        )


@pytest.mark.parametrize(("odd_lr", "expected"), [(1e-1, {"net.4"}), (0.0, {"net.4"}), (1e-4, set())])
def test_update_ratio_outlier_names_the_odd_layer(odd_lr: float, expected: set[str]) -> None:
    """A 1000x learning rate and a zero one (frozen by mistake) are flagged; the same lr everywhere is not."""
    torch.manual_seed(0)
    monitor, brute = OptimizerMonitor(log_every_n_steps=1), Brute()
    make_trainer([brute, monitor], MemoryLogger()).fit(Deep(odd_lr), random_loader())
    alerts = [a for a in monitor.alerts if a.kind == "update_ratio_outlier"]
    assert {a.where for a in alerts} == expected
    for a in alerts:
        assert a.step == 2  # patience 3
        ratio = a.data["update_ratio"] / a.data["median"]
        assert (ratio > 300) if odd_lr > 0 else ratio == 0
        assert ("too high" if odd_lr > 0 else "lr 0") in a.hint


class ZeroGradient(Deep):
    """``idle`` is in the graph with a gradient of exact zeros (a query and key that see one token, a layer
    scale after a dead branch); AdamW's weight decay alone moves it, under 1/1000 of what the others move."""

    def __init__(self) -> None:
        super().__init__(odd_lr=1e-4)
        self.idle = nn.Linear(32, 32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[:4](x)
        return nn.functional.cross_entropy(self.net[4:](h), y) + 0.0 * self.idle(h).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=1e-3)


def test_a_layer_with_a_gradient_of_exact_zeros_is_left_out_of_the_comparison() -> None:
    """Found by the sweep of every transformers architecture (MobileViT, SwiftFormer, PoolFormer at 32 px):
    a layer that learns nothing this step is no LR's doing; the layers that learn are still compared."""

    class Ratios(pl.Callback):  # ||delta w|| / ||w|| of two layers, by brute force
        def __init__(self) -> None:
            self.before: dict[str, torch.Tensor] = {}
            self.ratios: list[tuple[float, float]] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.before = {
                "idle": module.idle.weight.detach().clone(),
                "net": module.net[2].weight.detach().clone(),
            }

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            now = {"idle": module.idle.weight, "net": module.net[2].weight}
            r = {k: float((now[k] - w).norm() / w.norm()) for k, w in self.before.items()}
            self.ratios.append((r["idle"], r["net"]))

    torch.manual_seed(0)
    monitor, brute = OptimizerMonitor(log_every_n_steps=1), Ratios()
    make_trainer([brute, monitor], MemoryLogger(), max_steps=8).fit(ZeroGradient(), random_loader())
    assert all(idle < net / 1000 for idle, net in brute.ratios), brute.ratios  # the premise: far below
    assert not [a.format() for a in monitor.alerts if a.kind == "update_ratio_outlier"]


def test_include_exclude_and_a_cap_select_layers_but_not_the_totals() -> None:
    torch.manual_seed(0)
    full, cut, capped = MemoryLogger(), MemoryLogger(), MemoryLogger()
    for logger, monitor in (
        (full, OptimizerMonitor(log_every_n_steps=2)),
        (cut, OptimizerMonitor(log_every_n_steps=2, exclude=r"net\.2")),
        (capped, OptimizerMonitor(log_every_n_steps=2, max_layers=1)),
    ):
        torch.manual_seed(0)
        make_trainer([monitor], logger, max_steps=3).fit(Model(ADAMW), random_loader())
    tags = {t for _, m in cut.calls for t in m}
    assert not [t for t in tags if t.endswith("net.2")] and "optimizer/step_size/net.0" in tags
    assert cut.series("optimizer/step_size/total") == full.series("optimizer/step_size/total")
    for m in [
        m for _, m in capped.calls if "optimizer/step_size/total" in m
    ]:  # one layer, whichever stands out
        shown = {t.rsplit("/", 1)[1] for t in m if t.startswith("optimizer/step_size/")}
        assert len(shown - {"total", "min", "median", "max"}) == 1
    assert capped.series("optimizer/step_size/across_layers/max") == {
        s: max(full.series(f"optimizer/step_size/{n}")[s] for n in ("net.0", "net.2")) for s in (0, 1)
    }


class Gated(Deep):
    """``gate`` (``rows`` x 32 entries, weights 1) scales the hidden features by ``1 + 1e-8 * gate``: its
    gradient is about 1e-10, far under Adam's eps, by design (a state-space layer's ``A_log``, a router's
    gate). One row is a sliver of the model (1.2 % of its entries); 16 rows are 17 %."""

    def __init__(self, rows: int) -> None:
        super().__init__(odd_lr=1e-4)
        self.gate = nn.Parameter(torch.ones(rows, 32))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[:6](x) * (1.0 + 1e-8 * self.gate.sum(0))
        return nn.functional.cross_entropy(self.net[6](h), y)


@pytest.mark.parametrize("rows", [1, 16])
def test_a_sliver_of_tiny_gradients_by_design_is_not_named_and_a_sizeable_share_is(rows: int) -> None:
    """Found by the sweep of every transformers architecture (Mamba's A_log in Bamba, Falcon-H1 and
    GraniteMoeHybrid, DeepSeek-V4's routers, Bailing's forget gate, MobileBERT's bottleneck LayerNorm):
    the share of vanishing_gradient's rule under Adam (functional.health.SLIVER_SHARE) holds for the eps
    and the outlier rules too; the same gradient on a sizeable share is still named by both."""

    class Gate(pl.Callback):  # the premise, by hand: the gate's RMS gradient and its share of the model
        rms: list[float] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.rms.append(float(module.gate.grad.double().square().mean().sqrt()))

    torch.manual_seed(0)
    model, gate, monitor = Gated(rows), Gate(), OptimizerMonitor(log_every_n_steps=1)
    make_trainer([gate, monitor], MemoryLogger()).fit(model, random_loader())
    share = model.gate.numel() / sum(p.numel() for p in model.parameters())
    assert max(gate.rms) < 1e-9 and (share < 0.02 if rows == 1 else share > 0.1), (gate.rms, share)
    named = {a.kind for a in monitor.alerts if a.where == "gate"}
    assert named == (set() if rows == 1 else {"adam_epsilon_dominates", "update_ratio_outlier"})
    assert not [a.format() for a in monitor.alerts if a.where != "gate"]


class Downsample(pl.LightningModule):
    """SwiftFormer's last downsampling at 32 px: a 3x3 convolution with stride 2 and padding 1 over 2x2
    maps, 73 728 entries (over the 65 536-entry sample limit). Its kernel's left column and top row only
    ever see the padding: a gradient of exact zeros on 5 of its 9 positions, by the geometry alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(64, 128, 3, stride=2, padding=1)
        self.mid = nn.Linear(128, 32)
        self.head = nn.Linear(32, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.conv(x.view(len(x), 64, 2, 2)).flatten(1)
        return nn.functional.cross_entropy(self.head(torch.tanh(self.mid(h))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_sampled_kernel_is_read_on_every_position_of_it() -> None:
    """Found by the sweep of every transformers architecture (SwiftFormer): the sample's stride was only
    odd, 3 here, and a stride of 3 over a 3x3 kernel keeps one column of it, the one that only sees the
    padding: the layer read an RMS sqrt(v_hat) of 0 (adam_epsilon_dominates) and an update of 0
    (update_ratio_outlier) while it learned. Now the stride shares no factor with a dimension."""

    class Truth(pl.Callback):  # the conv's RMS of sqrt(v_hat), from Adam's whole state
        rms: dict[int, float] = {}

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            state = trainer.optimizers[0].state[module.conv.weight]
            v_hat = state["exp_avg_sq"] / (1 - 0.999 ** float(state["step"]))
            self.rms[trainer.global_step - 1] = float(v_hat.mean().sqrt())

    logger, truth, monitor = MemoryLogger(), Truth(), OptimizerMonitor(log_every_n_steps=1)
    make_trainer([truth, monitor], logger).fit(Downsample(), random_loader(features=256))
    measured = {
        s: m["optimizer/exp_avg_sq_rms/conv"] for s, m in logger.calls if "optimizer/exp_avg_sq_rms/conv" in m
    }
    assert len(measured) == 8 and min(truth.rms.values()) > 1e-4, truth.rms
    for step, rms in measured.items():  # the layer's bias (128 entries) moves its RMS by under 1 %
        assert rms == pytest.approx(truth.rms[step], rel=0.05), (step, rms, truth.rms[step])
    assert not [a.format() for a in monitor.alerts]
