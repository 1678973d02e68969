"""Nothing lost includes buffers: a step that NaNSentinel, LossSpikeGuard or the GradScaler drops leaves
BatchNorm's running statistics (and ``num_batches_tracked``) as they were before that step, in memory and
in ``last_good.ckpt``; a rollback brings back the rollback point's buffers.

``Buffers`` records, independently of gradguard, every buffer of the model at the start and at the end of
each batch; the faults are constructed (a NaN input, a corrupt batch at a known step), so exact steps hold
on any machine.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, make_trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_gradguard import LossSpikeGuard, NaNSentinel, NonFiniteError

sys.path.insert(0, str(ROOT / "examples"))

from zoo import digits


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )


class Faulty(pl.LightningModule):
    """A BatchNorm CNN on the digits; the batches of ``faults`` (global step -> kind) are made bad:
    ``"nan"``: one NaN pixel in one sample; ``"corrupt"``: inputs x1000 and every label wrong; ``"scaled"``:
    inputs x1000 alone (BatchNorm in training mode normalises it away: the loss does not move)."""

    def __init__(self, faults: dict[int, str] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _cnn()
        self.faults = faults or {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        fault = self.faults.get(self.trainer.global_step)
        if fault == "nan":
            x = x.clone()
            x[3, 0, 4, 4] = float("nan")
        elif fault == "corrupt":
            x, y = x * 1000.0, (y + 1) % 10
        elif fault == "scaled":
            x = x * 1000.0
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


class Buffers(pl.Callback):
    """Every buffer at the start of each optimizer step (its first micro-batch) and at its end, and the
    parameters at its end, by global step."""

    def __init__(self) -> None:
        self.start: dict[int, dict[str, torch.Tensor]] = {}
        self.end: dict[int, dict[str, torch.Tensor]] = {}
        self.params: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start.setdefault(trainer.global_step, _buffers(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step - 1
        if step in self.end or step + 1 in self.start:  # a micro-batch before the step's last
            return
        self.end[step] = _buffers(pl_module)
        self.params[step] = [p.detach().clone() for p in pl_module.parameters()]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fit(model: Faulty, callbacks: list[Any], steps: int, root: Any, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(callbacks, max_steps=steps, max_epochs=-1, default_root_dir=str(root), **kwargs)
    trainer.fit(model, digits(shape=(1, 8, 8), batch_size=64))
    return trainer


def test_a_nan_batch_leaves_the_running_statistics_of_before_it_in_memory_and_in_last_good(
    tmp_path: Any,
) -> None:
    """Regression: the forward of the NaN batch wrote NaN into running_mean/var before the sentinel raised;
    last_good.ckpt and the model left in memory held them (every eval-mode output NaN after a resume)."""
    model, seen = Faulty({7: "nan"}), Buffers()
    sentinel = NaNSentinel()
    with pytest.raises(NonFiniteError):
        _fit(model, [seen, sentinel], 20, tmp_path)
    before = seen.start[7]
    assert _same(_buffers(model), before)  # in memory
    assert int(before["net.1.num_batches_tracked"]) == 7 and not _same(before, seen.start[6])
    assert sentinel.last_report_dir is not None
    ckpt = torch.load(f"{sentinel.last_report_dir}/last_good.ckpt", weights_only=False)
    saved = {k: v for k, v in ckpt["state_dict"].items() if "running" in k or "tracked" in k}
    assert saved and all(torch.equal(v, before[k]) for k, v in saved.items())  # and on disk
    model.eval()
    x, _ = next(iter(digits(shape=(1, 8, 8), batch_size=16)))
    assert torch.isfinite(model.net(x)).all()


@pytest.mark.parametrize("accumulate", [1, 2], ids=["plain", "accumulate_2"])
def test_a_nan_step_skipped_leaves_the_buffers_of_its_start(accumulate: int, tmp_path: Any) -> None:
    """``action="skip"``: the step is dropped and the run goes on with the buffers of the step's start (under
    accumulation: of its first micro-batch, before any of its forwards)."""
    model, seen = Faulty({5: "nan"}), Buffers()
    _fit(model, [seen, NaNSentinel(action="skip")], 8, tmp_path, accumulate_grad_batches=accumulate)
    assert _same(seen.end[5], seen.start[5])
    assert all(torch.isfinite(b.float()).all() for b in seen.end[7].values())
    assert not _same(seen.end[4], seen.start[4])  # a healthy step writes them (the check can fail)


@pytest.mark.parametrize("fault", ["corrupt", "scaled"])
def test_a_corrupt_batch_is_named_and_skipped_by_the_guard_with_the_statistics_of_before_it(
    fault: str, tmp_path: Any
) -> None:
    """Regression: LossSpikeGuard skipped the update of a corrupt batch (inputs x1000, labels wrong) but its
    statistics stayed in running_var (x1000 of the inputs: a million times their variance); and inputs
    x1000 alone, which the loss never shows, went by unnoticed. At its defaults the guard now names the
    batch by its BatchNorm statistics (inside its 50-step warm-up) and skips it, buffers included."""
    model, seen = Faulty({40: fault}), Buffers()
    guard = LossSpikeGuard()
    _fit(model, [seen, guard], 42, tmp_path)
    assert [(r.step, r.action) for r in guard.records] == [(40, "skip")] and guard.dropped_steps == 1
    assert guard.records[0].batch_variance_factor is not None and guard.records[0].batch_variance_factor > 1e5
    alerts = [a for a in guard.alerts if a.kind == "batch_statistics_outlier"]
    assert [a.step for a in alerts] == [40] and "BatchNorm" in alerts[0].message
    assert _same(seen.end[40], seen.start[40])
    var_before, var_next = seen.start[40]["net.1.running_var"], seen.end[41]["net.1.running_var"]
    assert float((var_next / var_before).max()) < 2  # without the fix: about 1e5 times


def test_healthy_batchnorm_steps_are_no_outliers(tmp_path: Any) -> None:
    """The twin: the same run without the fault: no step of it is an outlier (its largest factors, as the
    guard read them, BatchNorm's from step 30 and the inputs' once 8 steps are known, stay far under the
    limit of 100)."""
    guard = LossSpikeGuard(action="warn", batch_variance_factor=1.0 + 1e-9)  # every read step is recorded
    _fit(Faulty(), [guard], 42, tmp_path)
    variance = [r.batch_variance_factor for r in guard.records if r.batch_variance_factor is not None]
    inputs = [r.inputs_factor for r in guard.records if r.inputs_factor is not None]
    assert len(variance) == 42 - 30 and all(1 / 3 < f < 3 for f in variance), variance
    assert len(inputs) >= 42 - 30 and all(1 / 3 < f < 3 for f in inputs), inputs


def test_a_rollback_brings_back_the_buffers_of_its_rollback_point(tmp_path: Any) -> None:
    """The rollback point holds the buffers: after the rollback the weights and the buffers are both those
    of the step after which the point was taken, not the buffers of the spiking step's start."""
    model, seen = Faulty(dict.fromkeys((42, 43, 44), "corrupt")), Buffers()
    guard = LossSpikeGuard(action="rollback", warmup_steps=20, snapshot_every_n_steps=5)
    _fit(model, [seen, guard], 45, tmp_path)
    assert guard.rollbacks >= 1
    rolled = min(r.step for r in guard.records if r.action == "rollback")
    point = [s for s in range(rolled) if all(map(torch.equal, seen.params[s], seen.params[rolled]))]
    assert point and point[-1] < rolled - 1  # the weights went back to an earlier step's
    assert _same(seen.end[rolled], seen.end[point[-1]])  # and so did the buffers


def test_a_step_the_grad_scaler_skips_leaves_the_buffers_of_its_start(tmp_path: Any) -> None:
    """16-mixed with a GradScaler: an inf gradient (set after backward) makes the scaler skip the step; the
    running statistics its forward wrote go back too."""

    class InfGradient(pl.Callback):
        def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.global_step == 4:
                pl_module.net[7].weight.grad[0, 0] = float("inf")

    model, seen, sentinel = Faulty(), Buffers(), NaNSentinel()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    _fit(model, [seen, InfGradient(), sentinel], 7, tmp_path, plugins=[plugin])
    assert sentinel.skipped_steps == 1
    assert _same(seen.end[4], seen.start[4])
    assert not _same(seen.end[5], seen.start[5])
