"""DeadReLUMonitor in real Trainer runs on networks with a known number of dead units; its pieces on their own
(the window math of ``monitors.dead_units.rules``, the ``monitors.dead_units.measure`` context
manager)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, make_trainer, random_loader, run_ddp_script
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_gradguard.alerts import Finding, GradGuardError
from lightning_gradguard.core.sampling import NextCall
from lightning_gradguard.functional.health import activity_counts, dead_units, saturation_counts, unit_dim
from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor
from lightning_gradguard.monitors.dead_units.measure import MODE_ORDER, OUTSIDE_MODULES, ActivationCapture
from lightning_gradguard.monitors.dead_units.rules import (
    RULES,
    Sampled,
    StepVerdict,
    UnitCounts,
    UnitWindows,
    pool,
    window_summary,
)

F = nn.functional
DEAD, UNITS = 12, 16
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


# ---------------------------------------------------------------------------------------------- pure math
def test_activity_counts_linear_sequence_and_conv_against_loops() -> None:
    g = torch.Generator().manual_seed(0)
    for shape, channel_first in (
        ((5, 7), False),
        ((4, 3, 7), False),
        ((2, 6, 5, 5), True),
        ((2, 6, 9), True),
    ):
        x = F.relu(torch.randn(*shape, generator=g))
        dim = unit_dim(x.dim(), channel_first)
        counts, n = activity_counts(x, dim)
        moved = x.movedim(dim, 0).reshape(x.shape[dim], -1)
        assert counts.tolist() == [int((row > 0).sum()) for row in moved]
        assert n == moved.shape[1]
    assert unit_dim(2, True) == 1 and unit_dim(3, False) == 2 and unit_dim(4, True) == 1


def test_saturation_counts_use_the_literature_bounds() -> None:
    x = torch.tensor([[-30.0, -10.0, 0.0, 18.0], [-24.0, 9.6, 1.0, 16.0]])
    assert saturation_counts(x, "sigmoid", 1)[0].tolist() == [2, 0, 0, 1]  # x < -23 or x > 17
    assert saturation_counts(x, "tanh", 1)[0].tolist() == [2, 2, 0, 2]  # |x| > 9.5
    with pytest.raises(ValueError, match="`kind`"):
        saturation_counts(x, "relu", 1)


def test_dead_means_never_active_in_the_window() -> None:
    window = [torch.tensor([0, 3, 0, 0]), torch.tensor([0, 0, 1, 0])]
    assert dead_units(window).tolist() == [True, False, False, True]
    assert dead_units(torch.stack(window)).tolist() == [True, False, False, True]


def test_window_summary_and_pooling() -> None:
    steps = [torch.tensor([0.0, 3.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 0.0])]
    relu = window_summary(steps, [4.0, 4.0], saturation=False)
    assert (relu.fraction, relu.units, relu.steps) == (0.5, 4, 2)
    assert relu.rates.tolist() == [0.0, 3 / 8, 1 / 8, 0.0]
    sat = window_summary([torch.tensor([5.0, 1.0])], [8.0], saturation=True)
    assert sat.fraction == 0.5  # saturated more than half of the time: the first unit only
    step: dict[str, UnitCounts] = {}
    pool(step, {"a": UnitCounts(saturation=False, counts=torch.tensor([1, 0]), samples=8)})
    pool(step, {"a": UnitCounts(saturation=False, counts=torch.tensor([2, 0]), samples=8), "b": step["a"]})
    assert list(step) == ["a", "b"] and step["a"].counts.tolist() == [3, 0] and step["a"].samples == 16
    pool(step, {"a": UnitCounts(saturation=False, counts=torch.tensor([1, 1, 1]), samples=4)})  # resized
    assert step["a"].counts.tolist() == [1, 1, 1] and step["a"].samples == 4


def _found(verdict: StepVerdict, learning: bool = False) -> list[Finding]:
    """What the monitor's rules find in ``verdict``, run from their declarations."""
    return [f for rule in RULES for f in rule.findings(Sampled(verdict=verdict, learning=learning))]


def test_unit_windows_strikes_patience_and_state() -> None:
    windows = UnitWindows(size=2)
    dead = {"l": UnitCounts(saturation=False, counts=torch.tensor([0.0, 0.0, 5.0]), samples=8.0)}
    first = windows.update(dead, 0.5, 0.5, 2)
    assert first.checks[0].full is False and first.dead_fractions == {} and _found(first) == []
    assert first.scalars == {"dead_relu/l": pytest.approx(2 / 3)} and first.suspicious
    assert list(first.rates) == ["activation_rate/l"]
    second = windows.update(dead, 0.5, 0.5, 2)
    assert second.dead_fractions == {"l": pytest.approx(2 / 3)} and _found(second) == []
    assert windows.strikes == {"dead_relu@l": 1}
    verdict = windows.update(dead, 0.5, 0.5, 2)
    assert _found(verdict, learning=True) == []  # a run that learns: dead units cost it nothing
    (finding,) = _found(verdict)
    assert (finding.kind, finding.severity, finding.where) == ("dead_relu", "error", "l")
    assert finding.message.startswith("67% of the 3 units of l output 0") and "LeakyReLU" in finding.hint
    assert finding.data == {"fraction": pytest.approx(2 / 3), "threshold": 0.5, "units": 3.0, "window": 2.0}
    again = UnitWindows(size=2)
    again.load_state_dict(windows.state_dict())
    assert again.strikes == windows.strikes and [c.tolist() for c, _ in again["l"]] == [[0, 0, 5]] * 2


# ---------------------------------------------------------------------------------------------- capture
class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden1, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(F.relu(self.hidden1(x)))
        return self.out(torch.sigmoid(self.block(h)))  # the block twice: ``block.1#2``


def nothing_attached() -> bool:
    hooks = module_globals._global_forward_pre_hooks or module_globals._global_forward_hooks
    return torch._C._len_torch_function_stack() == 0 and not hooks


def test_capture_is_a_scope_that_names_pools_and_leaves_nothing_behind() -> None:
    net, x = Hidden(), torch.randn(5, 8)
    said: list[tuple[str, str]] = []
    capture = ActivationCapture(net, warn=lambda key, text: said.append((key, text)))
    with capture:
        assert torch._C._len_torch_function_stack() == 1 and capture.active
        net(x)
        F.relu(x)  # outside every module's forward: not a layer
    assert nothing_attached() and not capture.active
    assert list(capture.records) == ["relu(hidden1)", "block.1", "block.1#2", "sigmoid(block)"]
    assert capture.records["sigmoid(block)"].saturation and not capture.records["block.1"].saturation
    assert capture.records["block.1"].samples == 5 and said == [("outside_modules", OUTSIDE_MODULES)]
    net(x)  # outside the scope: nothing recorded
    assert capture.records["block.1"].samples == 5
    with capture:  # a second pass is pooled (names restart with each pass)
        net(x)
    assert capture.records["block.1"].samples == 10 and len(capture.records) == 4
    with pytest.raises(RuntimeError, match="boom"), ActivationCapture(net, check_saturation=False) as other:
        net(x)
        raise RuntimeError("boom")
    assert nothing_attached() and "sigmoid(block)" not in other.records


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_mode_entered_above_the_capture_is_left_alone() -> None:
    net, said = Hidden(), []
    capture = ActivationCapture(net, warn=lambda key, text: said.append(key))
    capture.__enter__()
    theirs = PassThrough().__enter__()
    try:
        capture.close()
        assert capture.left_inert and said == ["mode_order"] and "left inert" in MODE_ORDER
        net(torch.randn(2, 8))  # our mode is still on the stack, inert
        assert capture.records == {}
    finally:
        theirs.__exit__(None, None, None)
        torch.overrides._get_current_function_mode().__exit__(None, None, None)  # ours, inert
    assert nothing_attached()


def test_next_call_wraps_exactly_one_call_and_keeps_the_signature() -> None:
    import inspect

    model = Module(Net("nn.ReLU"))
    seen = []
    call = NextCall(model, "training_step", ActivationCapture(model))
    assert "training_step" in vars(model)
    assert list(inspect.signature(model.training_step).parameters) == ["batch", "batch_idx"]
    model._probe = lambda where: seen.append(torch._C._len_torch_function_stack())  # type: ignore[method-assign]
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model.training_step(batch, 0)
    model.training_step(batch, 1)
    assert seen == [1, 0] and "training_step" not in vars(model) and nothing_attached()
    NextCall(model, "training_step", ActivationCapture(model)).remove()  # the call never came
    assert "training_step" not in vars(model)
    call.remove()  # idempotent


def test_a_wrapper_kept_past_its_one_call_runs_plain() -> None:
    """Someone (a module's own on_train_batch_start, a profiler) kept a reference to the wrapper and calls
    it again later: only the first call is captured, the later ones are plain calls."""
    model = Module(Net("nn.ReLU"))
    seen: list[int] = []
    NextCall(model, "training_step", ActivationCapture(model))
    kept = model.training_step
    model._probe = lambda where: seen.append(torch._C._len_torch_function_stack())  # type: ignore[method-assign]
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    kept(batch, 0)
    kept(batch, 1)
    kept(batch, 2)
    assert seen == [1, 0, 0] and nothing_attached()


# ---------------------------------------------------------------------------------------------- modules
class Net(nn.Module):
    """16 hidden units; units 0..11 have bias -100 (dead for any input), units 12..15 bias +100."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, UNITS)
        self.out = nn.Linear(UNITS, 4)
        acts: dict[str, Callable[[], nn.Module]] = {
            "nn.ReLU": nn.ReLU,
            "nn.ReLU6": nn.ReLU6,
            "nn.ReLU(inplace)": lambda: nn.ReLU(inplace=True),
            "nn.GELU": nn.GELU,
            "nn.SiLU": nn.SiLU,
            "nn.LeakyReLU": nn.LeakyReLU,
        }
        self.act = acts[kind]() if kind in acts else nn.Identity()
        with torch.no_grad():
            self.fc.bias[:DEAD] = -100.0
            self.fc.bias[DEAD:] = 100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "F.relu":
            h = F.relu(h)
        elif self.kind == "torch.relu":
            h = torch.relu(h)
        elif self.kind == "Tensor.relu_":
            h = h.relu_()
        elif self.kind == "F.relu6":
            h = F.relu6(h)
        else:
            h = self.act(h)
        return self.out(h)


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.val_act = nn.ReLU()
        self.seen: list[tuple[str, int, int, int]] = []

    def _probe(self, where: str) -> None:
        modes = torch._C._len_torch_function_stack()
        hooks = len(module_globals._global_forward_pre_hooks) + len(module_globals._global_forward_hooks)
        self.seen.append((where, int(self.trainer.global_step), modes, hooks))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._probe("train")
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._probe("val")
        x, _ = batch
        self.val_act(x - 1000.0)  # dead on purpose: must never be watched

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _passthrough(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's decorator (or Lightning's compile wrapper): ``(*args, **kwargs)`` one level up."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class DecoratedNoBatchIdx(Module):
    @_passthrough
    def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def test_a_decorated_training_step_without_batch_idx_is_called_as_lightning_would() -> None:
    """Lightning reads one ``__wrapped__`` level to decide whether to pass ``batch_idx``: our wrapper must
    not make a decorated ``training_step(self, batch)`` look like it takes one (TypeError on step 0)."""
    monitor = DeadReLUMonitor()
    trainer = make_trainer([monitor], max_steps=6)
    trainer.fit(DecoratedNoBatchIdx(Net("nn.ReLU")), random_loader())
    assert trainer.global_step == 6 and monitor.sampled_batches == 5  # steps 0-4 sampled, all captured
    assert nothing_attached()


def run(kind: str, monitor: DeadReLUMonitor, logger: Any = None, steps: int = 8, **kw: Any) -> Module:
    model = Module(Net(kind))
    val = random_loader(n=16, seed=1) if "val_check_interval" in kw else None
    make_trainer([monitor], logger, max_steps=steps, **kw).fit(model, random_loader(n=8 * steps), val)
    return model


RELU_KINDS = {
    "nn.ReLU": "net.act",
    "nn.ReLU6": "net.act",
    "nn.ReLU(inplace)": "net.act",
    "F.relu": "net:relu(fc)",
    "torch.relu": "net:relu(fc)",
    "Tensor.relu_": "net:relu(fc)",
    "F.relu6": "net:relu6(fc)",
}


@pytest.mark.parametrize("kind", list(RELU_KINDS))
def test_every_relu_flavour_is_watched_and_named(kind: str, memory_logger: MemoryLogger) -> None:
    monitor = DeadReLUMonitor()
    run(kind, monitor, memory_logger)
    layer = RELU_KINDS[kind]
    assert monitor.dead_fractions == {layer: DEAD / UNITS}
    tag = "dead_relu/" + layer.replace("(", "[").replace(")", "]")  # a "(" in a tag breaks Custom Scalars
    assert memory_logger.series(tag) == dict.fromkeys(range(5), DEAD / UNITS)
    assert [(a.kind, a.where, a.step, a.severity) for a in monitor.alerts] == [
        ("dead_relu", layer, 4, "error")
    ]
    assert a_hint_mentions(monitor, "LeakyReLU")


def a_hint_mentions(monitor: DeadReLUMonitor, word: str) -> bool:
    return all(word in a.hint for a in monitor.alerts)


@pytest.mark.parametrize("kind", ["nn.GELU", "nn.SiLU", "nn.LeakyReLU"])
def test_units_that_cannot_die_are_never_reported(kind: str) -> None:
    monitor = DeadReLUMonitor(threshold=0.0, patience=1)
    run(kind, monitor)
    assert monitor.dead_fractions == {} and monitor.alerts == []


def test_below_threshold_is_quiet() -> None:
    monitor = DeadReLUMonitor(threshold=0.8)
    run("nn.ReLU", monitor)
    assert monitor.dead_fractions == {"net.act": 0.75} and monitor.alerts == []


def test_hooks_and_mode_exist_only_during_sampled_training_forward() -> None:
    monitor = DeadReLUMonitor(sample_every_n_steps=4, window_samples=1, patience=1)
    model = run("nn.ReLU", monitor, steps=12, val_check_interval=3, num_sanity_val_steps=1)
    train = {step: (modes, hooks) for where, step, modes, hooks in model.seen if where == "train"}
    # this layer is 75 % dead: each regular sample (4, 8) is followed up at once by window_samples +
    # patience - 1 = 1 more sampled step (5, 9); the dense start (step 0) is never followed up
    # sampled: step 0, then Lightning's logging steps 3, 7, 11, each followed up once (window_samples 1)
    assert train == {s: ((1, 2) if s in (0, 3, 4, 7, 8, 11) else (0, 0)) for s in range(12)}
    assert {(m, h) for where, _, m, h in model.seen if where == "val"} == {(0, 0)}
    assert sum(where == "val" for where, *_ in model.seen) > 1
    assert "val_act" not in str(monitor.dead_fractions) and monitor.sampled_batches == 6
    assert torch._C._len_torch_function_stack() == 0
    assert not module_globals._global_forward_pre_hooks and not module_globals._global_forward_hooks


class ConvNet(nn.Module):
    """6 channels on 8x8 images: channels 0..3 dead, 4..5 always active (the width is 8, not 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(6, 4)
        assert self.conv.bias is not None
        with torch.no_grad():
            self.conv.bias[:4] = -100.0
            self.conv.bias[4:] = 100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x.reshape(-1, 1, 8, 8))).mean(dim=(2, 3)))


def test_conv_units_are_channels() -> None:
    monitor = DeadReLUMonitor()
    model = Module(ConvNet())
    make_trainer([monitor], max_steps=6).fit(model, random_loader(n=48, features=64))
    assert monitor.dead_fractions == {"net.act": pytest.approx(4 / 6)}


class Reused(nn.Module):
    """One ReLU module used at two places, plus a functional ReLU in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 4)
        with torch.no_grad():
            self.b.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.act(self.b(self.act(self.a(x))))))


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_module_used_twice_gets_two_layers(accumulate: int) -> None:
    monitor = DeadReLUMonitor()  # with accumulation too: `#2` counts within one forward pass, not one step
    trainer = make_trainer([monitor], max_steps=6, accumulate_grad_batches=accumulate)
    trainer.fit(Module(Reused()), random_loader(n=48 * accumulate))
    assert set(monitor.dead_fractions) == {"net.act", "net.act#2", "net:relu(act)"}
    assert monitor.dead_fractions["net.act#2"] == 1.0 and monitor.dead_fractions["net:relu(act)"] == 1.0
    assert {a.where for a in monitor.alerts} == {"net.act#2", "net:relu(act)"}


def test_histogram_of_activation_rates_in_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    run("nn.ReLU", DeadReLUMonitor(), logger)
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"histograms": 0})
    acc.Reload()
    assert "activation_rate/net.act" in acc.Tags()["histograms"]
    last = acc.Histograms("activation_rate/net.act")[-1].histogram_value
    assert last.num == UNITS and last.min == 0.0 and last.max == 1.0
    assert last.bucket[0] == DEAD and sum(last.bucket) == UNITS


def test_saturated_tanh_is_a_warning_and_optional() -> None:
    class Saturated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)
            with torch.no_grad():
                self.fc.weight.mul_(1000.0)
                self.fc.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.act(self.fc(x)) + torch.sigmoid(self.fc(x) * 1e-3))

    monitor = DeadReLUMonitor()
    make_trainer([monitor], max_steps=6).fit(Module(Saturated()), random_loader(n=48))
    assert monitor.saturated_fractions["net.act"] > 0.5
    assert monitor.saturated_fractions["net:sigmoid(fc)"] == 0.0
    assert [(a.kind, a.where, a.severity) for a in monitor.alerts] == [
        ("saturated_activation", "net.act", "warning")
    ]
    off = DeadReLUMonitor(check_saturation=False)
    make_trainer([off], max_steps=6).fit(Module(Saturated()), random_loader(n=48))
    assert off.saturated_fractions == {} and off.alerts == []


def test_action_raise() -> None:
    with pytest.raises(GradGuardError, match="dead_relu"):
        run("nn.ReLU", DeadReLUMonitor(action="raise"))


def test_cadence_and_state_dict() -> None:
    monitor = DeadReLUMonitor(sample_every_n_steps=10, window_samples=3, patience=2)
    assert [s for s in range(31) if monitor.due(s)] == [0, 1, 2, 3, 9, 19, 29]
    run("nn.ReLU", monitor)
    other = DeadReLUMonitor(sample_every_n_steps=10, window_samples=3, patience=2)
    other.load_state_dict(monitor.state_dict())
    assert other.sampled_batches == monitor.sampled_batches == 4  # steps 0..3 of 8
    assert other._windows.strikes == monitor._windows.strikes
    assert [c.tolist() for c, _ in other._windows["net.act"]] == [
        c.tolist() for c, _ in monitor._windows["net.act"]
    ]


def test_ddp_both_detectors_reach_the_same_verdict_on_every_rank(tmp_path: Path) -> None:
    import json

    proc = run_ddp_script("ddp_detectors.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    seen = ranks[0]
    assert seen["steps"] == 12 and seen["sampled_batches"] == 5
    # act1 fires only on rank 0's data: alive once the counts are all-reduced (rank 1 alone: 75 % dead)
    assert seen["dead_fractions"] == {"net.act1": 0.0, "net.act2": 1.0}
    assert ["dead_relu", "net.act2", 4] in seen["alerts"]
    assert next(a for a in seen["alerts"] if a[0] == "exploding_gradient")[2] == 7
    assert {a[0] for a in seen["alerts"]} == {"dead_relu", "exploding_gradient"}
    assert seen["raised"] == ["GradGuardError", [7]]  # action="raise": every rank, the same step
    # one rank without any activation on the sampled steps: skipped on both, nobody left waiting
    assert seen["branching"] == [6, 0]


class Exploding(Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.net(batch[0])  # inside the sampled forward: the capture mode is on the stack
        raise RuntimeError("boom")


def test_an_exception_in_the_sampled_forward_leaves_nothing_behind() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([DeadReLUMonitor()], max_steps=4).fit(Exploding(Net("nn.ReLU")), random_loader())
    assert torch._C._len_torch_function_stack() == 0
    assert not module_globals._global_forward_pre_hooks and not module_globals._global_forward_hooks


class ManualCheckpointed(Module):
    """Manual optimization: one forward (activation checkpointing: recomputed during backward), the backward
    and the step inside ``training_step``, then a second forward of another network for a second optimizer."""

    def __init__(self, plain_backward: bool) -> None:
        super().__init__(Net("nn.ReLU"))
        self.automatic_optimization = False
        self.other = Net("F.relu")
        self.plain_backward = plain_backward

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        first = cast(list[torch.optim.Optimizer], self.optimizers())[0]
        loss = F.cross_entropy(checkpoint(self.net, x, use_reentrant=False), y)
        if self.plain_backward:  # not through Lightning: no on_before_backward, the scope is still open
            loss.backward()
        else:
            self.manual_backward(loss)
        first.step()
        F.cross_entropy(self.other(x), y).sum()  # after the first backward

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD
        return sgd(self.net.parameters(), lr=0.0), sgd(self.other.parameters(), lr=0.0)


@pytest.mark.parametrize("plain_backward", [False, True])
def test_manual_optimization_records_each_forward_once(plain_backward: bool) -> None:
    monitor = DeadReLUMonitor()
    make_trainer([monitor], max_steps=10).fit(ManualCheckpointed(plain_backward), random_loader(n=80))
    # the scope ends at the first backward; the recompute during backward is never seen (no ``#2``)
    expected = {"net.act", "other:relu(fc)"} if plain_backward else {"net.act"}
    assert set(monitor.dead_fractions) == expected and monitor.dead_fractions["net.act"] == DEAD / UNITS
    assert monitor.sampled_batches == 5 and nothing_attached()


# --------------------------------------------------------------------------- gradient accumulation
K = 4  # accumulate_grad_batches in these runs


class Gated(nn.Module):
    """fc -> ReLU -> out on inputs whose features 0..3 one-hot the batch's place in its optimizer step.

    ``mode``: ``"dead"``: units 0..11 dead from the start (bias -100), 12..15 always on (+100);
    ``"dies"``: all on until global step ``kill_at``, then units 0..11 are killed;
    ``"one_micro_batch"``: unit j fires only on micro-batch j % 4 of every step (fc frozen).
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.fc, self.act, self.out = nn.Linear(8, UNITS), nn.ReLU(), nn.Linear(UNITS, 4)
        with torch.no_grad():
            if mode == "one_micro_batch":
                self.fc.weight.zero_()
                for j in range(UNITS):
                    self.fc.weight[j, j % K] = 10.0
                self.fc.bias.fill_(-5.0)  # +5 on its own micro-batch, -5 on the three others
                self.fc.requires_grad_(False)
            else:
                self.fc.bias.fill_(100.0)
                if mode == "dead":
                    self.fc.bias[:DEAD] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Counting(Module):
    """Counts each unit's non-zero outputs per micro-batch with its own hook: ``(global_step, counts)``."""

    def __init__(self, net: Gated, kill_at: int = -1) -> None:
        super().__init__(net)
        self.kill_at = kill_at
        self.micro: list[tuple[int, torch.Tensor]] = []
        net.act.register_forward_hook(self._count)

    def _count(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.training:
            self.micro.append((int(self.trainer.global_step), (out.detach() != 0).sum(0)))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.kill_at:
            with torch.no_grad():
                cast(Gated, self.net).fc.bias[:DEAD] = -100.0


def placed_loader(steps: int) -> Any:
    """8 samples a batch, ``K`` batches a step; features 0..3 one-hot the batch's place in its step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * K * 8, 8, generator=g)
    place = (torch.arange(len(x)) // 8) % K
    x[:, :K] = F.one_hot(place, K).float()
    y = torch.randint(0, 4, (len(x),), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def rule(
    steps: list[torch.Tensor], every: int, window: int, patience: int, threshold: float
) -> tuple[list[int], dict[int, float], list[int]]:
    """The documented rule on per-step active counts: sampled steps, dead fraction logged at each, alerts."""
    dense = window + patience - 1
    sampled: list[int] = []
    fractions: dict[int, float] = {}
    alerts: list[int] = []
    recent: list[torch.Tensor] = []
    follow = strikes = 0
    for s, counts in enumerate(steps):
        regular = s < dense or (s + 1) % every == 0
        if not (regular or follow):
            continue
        sampled.append(s)
        recent = [*recent, counts][-window:]
        fractions[s] = float((torch.stack(recent).sum(0) == 0).float().mean())
        if len(recent) == window:
            strikes = strikes + 1 if fractions[s] > threshold else 0
            if strikes >= patience:
                alerts.append(s)
        if not regular:
            follow -= 1
        elif s >= dense and float((counts == 0).float().mean()) > threshold:
            follow = dense  # a regular sample that looks dead: the next window + patience - 1 steps too
    return sampled, fractions, alerts


@pytest.mark.parametrize(
    ("mode", "kill_at", "steps", "kwargs"),
    [
        ("dead", -1, 8, {"sample_every_n_steps": 100}),  # defaults: window 4, patience 2
        ("dies", 6, 15, {"sample_every_n_steps": 5, "window": 2, "patience": 2}),  # follow-ups after step 9
        ("one_micro_batch", -1, 6, {"sample_every_n_steps": 3, "window": 1, "patience": 2}),
    ],
)
def test_accumulation_samples_windows_and_patience_count_optimizer_steps(
    mode: str, kill_at: int, steps: int, kwargs: dict[str, Any], memory_logger: MemoryLogger
) -> None:
    monitor = DeadReLUMonitor(**kwargs)
    model = Counting(Gated(mode), kill_at)
    trainer = make_trainer([monitor], memory_logger, max_steps=steps, accumulate_grad_batches=K)
    trainer.fit(model, placed_loader(steps))
    assert trainer.global_step == steps
    # our own hook: every micro-batch, pooled per optimizer step (a unit is active if any sample fired it)
    per_step = [torch.stack([c for s, c in model.micro if s == step]) for step in range(steps)]
    assert [len(m) for m in per_step] == [K] * steps
    if mode == "one_micro_batch":  # each unit fires on exactly one of its step's micro-batches
        assert all(((m > 0).sum(0) == 1).all() for m in per_step)
    pooled = [m.sum(0) for m in per_step]
    sampled, fractions, alert_steps = rule(
        pooled, monitor.sample_every_n_steps, monitor.window_samples, monitor.patience, monitor.threshold
    )
    assert monitor.sampled_batches == len(sampled)
    assert memory_logger.series("dead_relu/net.act") == fractions
    assert [a.step for a in monitor.alerts] == alert_steps[:1]  # later ones fall within the cooldown
    expected = {"dead": ([0, 1, 2, 3, 4], [4]), "dies": ([0, 1, 2, 4, 9, 10, 11, 12, 14], [11])}
    assert (sampled, alert_steps[:1]) == expected.get(mode, ([0, 1, 2, 5], []))
    # the window holds one entry per sampled step: its micro-batches' counts and all their samples
    assert [(c.tolist(), n) for c, n in monitor._windows["net.act"]] == [
        (pooled[s].tolist(), float(K * 8)) for s in sampled[-monitor.window_samples :]
    ]
