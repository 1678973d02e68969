"""GradientNormLogger in real Trainer runs, checked against norms the module computes itself."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, RecordingMLP, make_trainer, random_loader, reference_total_norm
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.amp.grad_scaler import OptState

from lightning_gradguard import GradientNormLogger
from lightning_gradguard.functional.clipping import clip_window_stats, clipping_norm_type, push_norm
from lightning_gradguard.functional.stats import suggest_clip_value
from lightning_gradguard.functional.updates import update_norms, update_ratio, weight_snapshot


def _assert_matches(logged: dict[int, float], truth: dict[int, float], rel: float = 1e-5) -> None:
    assert logged, "nothing was logged"
    for step, value in logged.items():
        assert value == pytest.approx(truth[step], rel=rel), f"step {step}"


def test_total_and_layer_norms_equal_independent_computation(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    cb = GradientNormLogger(log_every_n_steps=3)
    make_trainer([cb], memory_logger).fit(model, random_loader(n=80))
    logged = memory_logger.series("grad_norm/total")
    assert sorted(logged) == [0, 2, 5, 8]  # the first step, then Lightning's (k + 1) % 3 == 0
    _assert_matches(logged, model.true_total)
    for layer in ("net.0", "net.2"):
        _assert_matches(
            memory_logger.series(f"grad_norm/{layer}"), {s: v[layer] for s, v in model.true_layers.items()}
        )
    assert memory_logger.series("grad_nonfinite/total") == dict.fromkeys(logged, 0.0)


def test_default_cadence_follows_trainer(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    make_trainer([GradientNormLogger()], memory_logger, log_every_n_steps=4).fit(model, random_loader(n=80))
    ours = memory_logger.series("grad_norm/total")
    assert sorted(ours) == [0, 3, 7]
    # the same x positions as the loss Lightning logs itself, plus the first step
    assert set(ours) - set(memory_logger.series("train_loss")) == {0}


def test_accumulated_gradients_are_measured_once_per_optimizer_step(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger, accumulate_grad_batches=3).fit(
        model, random_loader(n=72)
    )
    logged = memory_logger.series("grad_norm/total")
    assert sorted(logged) == [0, 1, 2]  # 9 batches / 3 = 3 optimizer steps
    _assert_matches(logged, model.true_total)
    n_total_calls = sum("grad_norm/total" in m for _, m in memory_logger.calls)
    assert n_total_calls == 3


def test_bf16_mixed_on_cpu(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger, precision="bf16-mixed").fit(
        model, random_loader()
    )
    _assert_matches(memory_logger.series("grad_norm/total"), model.true_total)


class _ScaledMLP(RecordingMLP):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        self.seen_scale = float(self.trainer.precision_plugin.scaler.get_scale())


def test_16_mixed_grad_scaler_values_are_unscaled(memory_logger: MemoryLogger) -> None:
    model = _ScaledMLP()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger, plugins=[plugin]).fit(
        model, random_loader()
    )
    assert model.seen_scale >= 1024.0  # the scaler really was active
    logged = memory_logger.series("grad_norm/total")
    _assert_matches(logged, model.true_total, rel=1e-3)  # the hook sees unscaled gradients too
    assert all(v < 100 for v in logged.values())


class _Rescale(pl.Callback):
    """Puts the gradients back into the scaled state a fused optimizer leaves them in (or undoes that)."""

    def __init__(self, undo: bool) -> None:
        self.undo = undo

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        scaler = trainer.precision_plugin.scaler
        state = scaler._per_optimizer_states[id(getattr(optimizer, "optimizer", optimizer))]
        factor = 1.0 / scaler.get_scale() if self.undo else scaler.get_scale()
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
        state["stage"] = OptState.UNSCALED if self.undo else OptState.READY


def test_still_scaled_gradients_are_divided_by_the_scale(memory_logger: MemoryLogger) -> None:
    """Fused optimizers unscale inside ``step``: our hook then sees scaled gradients and must divide."""
    model = _ScaledMLP()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=512.0))
    callbacks = [_Rescale(undo=False), GradientNormLogger(log_every_n_steps=1), _Rescale(undo=True)]
    make_trainer(callbacks, memory_logger, plugins=[plugin]).fit(model, random_loader())
    _assert_matches(memory_logger.series("grad_norm/total"), model.true_total, rel=1e-3)


class _TwoOptimizerGAN(pl.LightningModule):
    """Manual optimization with two optimizers, each stepped once per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Linear(8, 8)
        self.disc = nn.Linear(8, 1)
        self.true: list[tuple[int, str, float]] = []

    def _record(self, which: str, module: nn.Module) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.true.append((self.trainer.global_step, which, float(reference_total_norm(grads))))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        loss_d = self.disc(x).mean() - self.disc(self.gen(x).detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self._record("d", self.disc)
        opt_d.step()
        loss_g = self.disc(self.gen(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        self._record("g", self.gen)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.gen.parameters()), torch.optim.SGD(self.disc.parameters(), lr=0.01)


def test_manual_optimization_two_optimizers(memory_logger: MemoryLogger) -> None:
    model = _TwoOptimizerGAN()
    make_trainer([GradientNormLogger(log_every_n_steps=2)], memory_logger).fit(model, random_loader(n=48))
    # 6 batches, 12 optimizer steps; logging follows batches like Lightning's own logging
    g = memory_logger.series("grad_norm/total_opt0")
    d = memory_logger.series("grad_norm/total_opt1")
    assert sorted(g) == sorted(d) == [0, 1, 3, 5]
    truth_d = [v for _, w, v in model.true if w == "d"]
    truth_g = [v for _, w, v in model.true if w == "g"]
    for batch, value in d.items():
        assert value == pytest.approx(truth_d[batch], rel=1e-5)
    for batch, value in g.items():
        assert value == pytest.approx(truth_g[batch], rel=1e-5)
    # the generator's update is logged against its own weights only
    first_batch = set().union(*(m for step, m in memory_logger.calls if step == 0))
    assert first_batch >= {"update_ratio/gen", "update_ratio/disc", "grad_norm/gen", "grad_norm/disc"}


class _FrozenBackbone(RecordingMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


def test_frozen_parameters_are_skipped(memory_logger: MemoryLogger) -> None:
    model = _FrozenBackbone()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger).fit(model, random_loader())
    tags = set().union(*(m for _, m in memory_logger.calls))
    assert "grad_norm/net.2" in tags and "weight_norm/net.2" in tags
    assert not any("net.0" in t for t in tags)
    _assert_matches(memory_logger.series("grad_norm/total"), model.true_total)


class _UnusedBranch(RecordingMLP):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 8)


def test_unused_parameters_have_no_gradient_tag_but_keep_weight_tag(memory_logger: MemoryLogger) -> None:
    model = _UnusedBranch()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger).fit(model, random_loader(n=16))
    tags = set().union(*(m for _, m in memory_logger.calls))
    assert "grad_norm/unused" not in tags
    assert "weight_norm/unused" in tags
    assert memory_logger.series("update_ratio/unused") == {0: 0.0, 1: 0.0}


def test_per_parameter_and_group_depth(memory_logger: MemoryLogger, tmp_path: Any) -> None:
    model = RecordingMLP()
    make_trainer([GradientNormLogger(log_every_n_steps=1, per_parameter=True)], memory_logger).fit(
        model, random_loader(n=16)
    )
    tags = set(memory_logger.calls[0][1])
    assert {"grad_norm/net.0.weight", "grad_norm/net.0.bias", "grad_norm/net.2.weight"} <= tags
    other = MemoryLogger(str(tmp_path))
    model2 = RecordingMLP()
    make_trainer([GradientNormLogger(log_every_n_steps=1, group_depth=1)], other).fit(
        model2, random_loader(n=16)
    )
    assert {t for t in other.calls[0][1] if t.startswith("grad_norm/")} == {
        "grad_norm/total",
        "grad_norm/net",
    }
    _assert_matches(other.series("grad_norm/net"), model2.true_total)


def test_inf_norm(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    truth: dict[int, float] = {}

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters()]
            truth[trainer.global_step] = float(reference_total_norm(grads, norm_type=math.inf))

    make_trainer([Probe(), GradientNormLogger(log_every_n_steps=1, norm_type="inf")], memory_logger).fit(
        model, random_loader()
    )
    _assert_matches(memory_logger.series("grad_norm/total"), truth)


def test_update_ratio_matches_the_applied_update(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP(lr=0.05)
    before: dict[int, list[torch.Tensor]] = {}
    ratio: dict[int, float] = {}

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            step = trainer.global_step - 1
            old = torch.cat([p.reshape(-1) for p in before[step]])
            new = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            ratio[step] = float((new - old).norm() / old.norm())

    make_trainer([Probe(), GradientNormLogger(log_every_n_steps=2)], memory_logger).fit(
        model, random_loader()
    )
    _assert_matches(memory_logger.series("update_ratio/total"), ratio, rel=1e-4)


def test_clipping_statistics(memory_logger: MemoryLogger) -> None:
    model = RecordingMLP()
    cb = GradientNormLogger(log_every_n_steps=4, clip_window=10)
    make_trainer([cb], memory_logger, gradient_clip_val=0.3).fit(model, random_loader(n=128))
    # at the last logged step the window holds the pre-clip norms of the 10 latest steps
    last = max(memory_logger.series("grad_clip/fraction_clipped"))
    window = [model.true_total[s] for s in range(last - 9, last + 1)]
    expected_fraction = sum(v > 0.3 for v in window) / len(window)
    assert memory_logger.series("grad_clip/fraction_clipped")[last] == pytest.approx(expected_fraction)
    p90 = float(torch.quantile(torch.tensor(window, dtype=torch.float64), 0.9))
    assert memory_logger.series("grad_clip/pre_clip_norm_p90")[last] == pytest.approx(p90, rel=1e-5)
    assert memory_logger.series("grad_clip/suggested_clip_val")[last] >= p90


class _InfNormMLP(RecordingMLP):
    """Also records the largest absolute gradient entry (the infinity norm) before clipping."""

    def __init__(self) -> None:
        super().__init__()
        self.true_inf: dict[int, float] = {}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.true_inf[self.trainer.global_step] = float(max(g.abs().max() for g in grads))


@pytest.mark.parametrize(("algorithm", "clip"), [("norm", 1.0), ("value", 0.25)])
def test_clipping_statistics_follow_the_clip_algorithm(
    memory_logger: MemoryLogger, algorithm: str, clip: float
) -> None:
    """Clipping by value changes a step exactly when some |g| exceeds the value: the infinity norm decides.

    Here the largest |g| is about 0.1-0.4 and the total 2-norm 0.55-1.15: each clip value sits inside the
    range of the norm that decides and outside the other's, so reading the wrong norm would give another
    fraction (checked below, so the test can tell the two apart).
    """
    torch.manual_seed(0)
    model = _InfNormMLP()
    cb = GradientNormLogger(log_every_n_steps=4, clip_window=10)
    make_trainer([cb], memory_logger, gradient_clip_val=clip, gradient_clip_algorithm=algorithm).fit(
        model, random_loader(n=128)
    )
    last = max(memory_logger.series("grad_clip/fraction_clipped"))
    steps = range(last - 9, last + 1)
    l2 = [model.true_total[s] for s in steps]
    inf = [model.true_inf[s] for s in steps]
    deciding, other = (inf, l2) if algorithm == "value" else (l2, inf)
    expected = sum(v > clip for v in deciding) / 10
    assert expected != sum(v > clip for v in other) / 10  # the test tells the two norms apart
    assert memory_logger.series("grad_clip/fraction_clipped")[last] == pytest.approx(expected)
    for q in (50, 90, 99):
        truth = float(torch.quantile(torch.tensor(deciding, dtype=torch.float64), q / 100))
        assert memory_logger.series(f"grad_clip/pre_clip_norm_p{q}")[last] == pytest.approx(truth, rel=1e-5)
    assert not [a for a in cb.alerts if a.kind == "clipping_always_active"]  # a mixed window is healthy


def test_all_zero_gradients_while_clipping_do_not_crash_the_run(memory_logger: MemoryLogger) -> None:
    """A window of exactly-zero gradients has no suggested clip value: the alert must still be written."""

    class Frozen(RecordingMLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            return 0.0 * self.net(x).sum()  # a loss that never depends on the weights' values

    model = Frozen()
    cb = GradientNormLogger(log_every_n_steps=5, clip_window=10)
    make_trainer([cb], memory_logger, gradient_clip_val=1.0, max_steps=20).fit(model, random_loader(n=200))
    assert model.trainer.global_step == 20  # the run was not crashed by its monitor
    (alert,) = [a for a in cb.alerts if a.kind == "clipping_never_active"]
    assert "exactly 0" in alert.hint and "None" not in alert.hint + alert.message
    assert "grad_clip/suggested_clip_val" not in cb.last_logged  # no value is made up
    assert memory_logger.series("grad_clip/pre_clip_norm_p90")[19] == 0.0


def test_log_every_n_steps_zero_turns_periodic_logging_off(memory_logger: MemoryLogger) -> None:
    """``Trainer(log_every_n_steps=0)`` means no logging in Lightning; ours follows, clipping alerts go on."""
    model = RecordingMLP()
    cb = GradientNormLogger()
    make_trainer([cb], memory_logger, log_every_n_steps=0, gradient_clip_val=1e-5, max_steps=120).fit(
        model, random_loader(n=1000)
    )
    tags = {tag for _, metrics in memory_logger.calls for tag in metrics}
    assert not [
        t for t in tags if t.split("/")[0] in ("grad_norm", "weight_norm", "update_ratio", "grad_clip")
    ]
    assert [a.kind for a in cb.alerts] == ["clipping_always_active"]  # detection still runs
    assert cb.alerts[0].step == 99  # checked every 100 steps with logging off
    # an explicit cadence on the callback wins over the Trainer's
    other = MemoryLogger()
    make_trainer([GradientNormLogger(log_every_n_steps=10)], other, log_every_n_steps=0, max_steps=20).fit(
        RecordingMLP(), random_loader(n=200)
    )
    assert sorted(other.series("grad_norm/total")) == [0, 9, 19]


def test_clip_below_every_norm_raises_actionable_alert(memory_logger: MemoryLogger, tmp_path: Any) -> None:
    cb = GradientNormLogger(log_every_n_steps=5, clip_window=10)
    make_trainer([cb], memory_logger, gradient_clip_val=1e-5).fit(RecordingMLP(), random_loader(n=128))
    kinds = [a.kind for a in cb.alerts]
    assert kinds == ["clipping_always_active"]  # reported once: the cooldown holds the repeats back
    alert = cb.alerts[0]
    assert alert.severity == "warning" and alert.source == "GradientNormLogger"
    assert "gradient_clip_val=" in alert.hint and alert.data["fraction_clipped"] == 1.0
    jsonl = (tmp_path / "gradguard_alerts.jsonl").read_text().splitlines()
    assert len(jsonl) == 1 and '"clipping_always_active"' in jsonl[0]
    assert memory_logger.series("alerts/clipping_always_active")


def test_no_logger_means_one_info_line_and_no_crash(caplog: pytest.LogCaptureFixture) -> None:
    cb = GradientNormLogger(log_every_n_steps=1)
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([cb], logger=False).fit(RecordingMLP(), random_loader())
    lines = [r for r in caplog.records if "has no logger" in r.getMessage()]
    assert len(lines) == 1
    assert cb.last_logged["grad_norm/total"] > 0


def test_nonfinite_gradients_are_counted(memory_logger: MemoryLogger) -> None:
    class Poison(RecordingMLP):
        def on_after_backward(self) -> None:
            if self.trainer.global_step == 1:
                self.net[2].weight.grad[0, :3] = float("nan")
                self.net[2].bias.grad[1] = float("inf")

    make_trainer([GradientNormLogger(log_every_n_steps=1)], memory_logger, max_steps=2).fit(
        Poison(), random_loader()
    )
    assert memory_logger.series("grad_nonfinite/total") == {0: 0.0, 1: 4.0}
    assert memory_logger.series("grad_nonfinite/net.2") == {1: 4.0}
    assert math.isnan(memory_logger.series("grad_norm/total")[1])


def test_no_host_sync_on_steps_that_do_not_log() -> None:
    """Between logging steps the hook must not read a single value back (no ``.item()``-style call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountScalarReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                CountScalarReads.reads += 1
            return func(*args, **(kwargs or {}))

    cb = GradientNormLogger(log_every_n_steps=1000)
    hook = cb.on_before_optimizer_step
    per_step: list[int] = []

    def counted(*args: Any) -> None:
        before = CountScalarReads.reads
        with CountScalarReads():
            hook(*args)
        per_step.append(CountScalarReads.reads - before)

    cb.on_before_optimizer_step = counted  # type: ignore[method-assign]
    make_trainer([cb], logger=False, gradient_clip_val=1.0).fit(RecordingMLP(), random_loader())
    assert len(per_step) == 8 and per_step[1:] == [0] * 7


def test_state_dict_round_trip(memory_logger: MemoryLogger) -> None:
    cb = GradientNormLogger(log_every_n_steps=2, clip_window=10)
    make_trainer([cb], memory_logger, gradient_clip_val=1e-5).fit(RecordingMLP(), random_loader(n=128))
    state = cb.state_dict()
    other = GradientNormLogger(log_every_n_steps=2, clip_window=10)
    other.load_state_dict(state)
    assert other._clip_seen == cb._clip_seen == 16
    assert other._clip_norms is not None and cb._clip_norms is not None
    torch.testing.assert_close(other._clip_norms, cb._clip_norms)
    assert other._last_reported == cb._last_reported == {"clipping_always_active@None": 9}


class _UnfreezeLater(RecordingMLP):
    """The first layer starts frozen (still in the optimizer) and is unfrozen after two steps."""

    def on_fit_start(self) -> None:
        self.net[0].requires_grad_(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 2:
            self.net[0].requires_grad_(True)


def test_a_layer_unfrozen_mid_run_is_measured_from_then_on(memory_logger: MemoryLogger) -> None:
    model = _UnfreezeLater()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], logger=memory_logger).fit(model, random_loader())
    logged = memory_logger.series("grad_norm/net.0")
    assert sorted(logged) == [s for s in range(2, 8)]
    for step, value in logged.items():
        assert value == pytest.approx(model.true_layers[step]["net.0"], rel=1e-5)
    assert memory_logger.series("grad_norm/total")[5] == pytest.approx(model.true_total[5], rel=1e-5)


# ---------------------------------------------------------------------------------------------- pure math
def test_clip_window_statistics_skip_empty_slots() -> None:
    window = torch.tensor([0.5, 2.0, float("nan"), 1.0, 4.0])  # NaN: a slot the ring has not filled yet
    s = clip_window_stats(window, clip_val=1.5)
    assert s is not None and s.steps == 4 and s.largest == 4.0
    assert s.fraction_clipped == 0.5  # 2.0 and 4.0 of the four finite norms
    finite = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=torch.float64)
    for q in (50, 90, 99):
        assert s.percentiles[q] == pytest.approx(float(torch.quantile(finite, q / 100)))
    assert s.suggested == suggest_clip_value(finite)
    names = ["fraction_clipped", "pre_clip_norm_p50", "pre_clip_norm_p90", "pre_clip_norm_p99"]
    assert list(s.metrics()) == [*names, "suggested_clip_val"]
    assert clip_window_stats(torch.full((3,), float("nan")), 1.0) is None
    zeros = clip_window_stats(torch.zeros(4), 1.0)
    assert zeros is not None and zeros.suggested is None and list(zeros.metrics()) == names


def test_clipping_norm_type_and_the_ring_buffer() -> None:
    assert clipping_norm_type("norm") == 2.0 and clipping_norm_type("value") == math.inf
    with pytest.raises(ValueError, match="algorithm"):
        clipping_norm_type("l1")
    window = None
    for seen, x in enumerate([1.0, 2.0, 3.0]):
        window = push_norm(window, seen, torch.tensor(x), size=2)
    assert window is not None and window.tolist() == [3.0, 2.0]


def test_update_norms_measure_the_applied_change() -> None:
    params = [torch.ones(3), torch.full((2,), 2.0)]
    before = weight_snapshot(params)
    params[0].add_(torch.tensor([3.0, 0.0, 4.0]))
    params[1].sub_(1.0)
    norms = update_norms(before, params, torch.tensor([0, 1]), 2)
    assert norms.layers.tolist() == pytest.approx([5.0, math.sqrt(2.0)])
    assert norms.total.tolist() == pytest.approx([math.sqrt(27.0)])
    assert update_ratio(5.0, 10.0) == 0.5 and update_ratio(1.0, 0.0) == pytest.approx(1e30)


@pytest.mark.parametrize("pattern", ["gaussian", "one_column", "sign"])
def test_a_sampled_snapshot_estimates_the_update_norm(pattern: str) -> None:
    """A 2048x1024 weight (over the 65 536-entry sample limit) keeps an odd-strided sample of ~63 500
    entries (stride 33); its update norm is within 1 % of the exact one (25 % for an update in one column
    only: the sample meets that column ~62 times), and a small tensor is copied whole and exact."""
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(2048, 1024, generator=g), torch.randn(10, generator=g)
    before_big, before_small = big.clone(), small.clone()
    snap = weight_snapshot([big, small])
    assert snap.strides == [33, 1] and snap.values[0].numel() < 65_536 and snap.scales[1] == 1.0
    if pattern == "gaussian":
        big.add_(1e-3 * torch.randn(2048, 1024, generator=g))
    elif pattern == "one_column":
        big[:, 0] += torch.randn(2048, generator=g)
    else:  # an Adam-like step: the same magnitude, random signs
        big.add_(1e-3 * torch.sign(torch.randn(2048, 1024, generator=g)))
    small.mul_(1.5)
    norms = update_norms(snap, [big, small], torch.tensor([0, 1]), 2)
    exact_big = float(torch.linalg.vector_norm(big - before_big))
    tolerance = 0.25 if pattern == "one_column" else 0.01
    assert float(norms.layers[0]) == pytest.approx(exact_big, rel=tolerance)
    assert float(norms.layers[1]) == pytest.approx(
        float(torch.linalg.vector_norm(small - before_small)), rel=1e-6
    )


@pytest.mark.parametrize("prefix", ["", "run1"])
def test_tensorboard_gets_every_scalar_of_a_step_in_one_event(tmp_path: Any, prefix: str) -> None:
    """A logging step's scalars go to TensorBoard as one event with many values (not one event per scalar),
    read back equal to what every other logger got; a logger with a ``prefix`` keeps its own path."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    memory, tb = MemoryLogger(), TensorBoardLogger(str(tmp_path), name="tb", prefix=prefix)
    make_trainer([GradientNormLogger()], logger=[tb, memory], max_steps=3).fit(
        RecordingMLP(), random_loader()
    )
    events = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    head = f"{prefix}-" if prefix else ""
    ours = [(s, m) for s, m in memory.calls if "grad_norm/total" in m]
    assert [s for s, _ in ours] == [0, 1, 2]
    for step, metrics in ours:
        for tag, value in metrics.items():
            got = {e.step: e.value for e in events.Scalars(head + tag)}
            assert got[step] == pytest.approx(value, rel=1e-6, nan_ok=True)
    (path,) = [str(p) for p in tmp_path.glob("tb/version_0/events.out.tfevents.*")]
    sizes = [len(e.summary.value) for e in EventFileLoader(path).Load() if e.summary.value]
    n = len(ours[0][1])
    assert (max(sizes) == n) is (not prefix)  # packed: one event holds the whole step; else one per scalar
