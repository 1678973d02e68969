"""LossSpikeGuard on real runs with spikes injected at known steps, checked against independent records.

The spike: a small ReLU classifier whose inputs are scaled x30 at chosen optimizer steps (or batches); its
loss jumps ~3x and its gradient norm ~20x. The thresholds are passed explicitly (``THRESHOLDS``), so the
tests hold whatever the defaults become. ``Recorder`` keeps, without gradguard, the weights, the optimizer
and scheduler states and the learning rate around every step; the model keeps its own losses and true
gradient norms.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import MemoryLogger, make_trainer, random_loader, reference_total_norm, run_ddp_script
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_gradguard import LossSpikeError, LossSpikeGuard
from lightning_gradguard.monitors.spike.records import FORMAT, SpikeRecord, read_skip_batches

THRESHOLDS: dict[str, Any] = dict(
    loss_threshold=6.0, grad_norm_threshold=6.0, min_ratio=2.0, window_steps=16, warmup_steps=8
)


class SpikeModel(pl.LightningModule):
    """ReLU MLP; inputs x30 at the optimizer steps ``spike_steps`` or the batches ``spike_batches``.

    ``losses[(epoch, batch_idx)]`` is each micro-batch's loss, ``grad_norms[step]`` the true total
    gradient norm after the step's backward (accumulated over its micro-batches).
    """

    def __init__(
        self,
        spike_steps: set[int] | range = frozenset(),
        spike_batches: set[int] = frozenset(),
        optimizer: str = "sgd",
        scheduler: str | None = None,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.spike_steps, self.spike_batches = spike_steps, spike_batches
        self.optimizer_kind, self.scheduler_kind = optimizer, scheduler
        self.losses: dict[tuple[int, int], float] = {}
        self.grad_norms: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step in self.spike_steps or batch_idx in self.spike_batches:
            x = x * 30.0
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses[(self.current_epoch, batch_idx)] = float(loss.detach())
        return loss

    def on_after_backward(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms[self.trainer.global_step] = float(reference_total_norm(grads))

    def configure_optimizers(self) -> Any:
        if self.optimizer_kind == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.scheduler_kind is None:
            return opt
        sched: Any = (
            torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            if self.scheduler_kind == "step"
            else torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.2 * e))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


#: the schedules above, written out (the LR factor at scheduler position ``e``)
SCHEDULES = {"step": lambda e: 0.5 ** (e // 5), "lambda": lambda e: 1.0 / (1.0 + 0.2 * e)}


class Recorder(pl.Callback):
    """Copies of the weights and optimizer state before and after every step's batches; at the optimizer
    step (placed after the guard): the LR, whether every gradient was dropped, weights and states."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.opt_before: dict[int, dict[str, Any]] = {}
        self.opt_after: dict[int, dict[str, Any]] = {}
        self.sched_after: dict[int, dict[str, Any]] = {}
        self.at_step: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step not in self.before:  # the first micro-batch of the step
            self.before[step] = copy.deepcopy(pl_module.state_dict())
            self.opt_before[step] = copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.at_step[trainer.global_step] = {
            "lr": float(optimizer.param_groups[0]["lr"]),
            "dropped": all(p.grad is None for p in pl_module.parameters()),
            "weights": copy.deepcopy(pl_module.state_dict()),
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step - 1
        self.after[step] = copy.deepcopy(pl_module.state_dict())
        self.opt_after[step] = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.sched_after[step] = [
            copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs
        ]

    def dropped(self) -> set[int]:
        return {s for s, seen in self.at_step.items() if seen["dropped"]}


def _same(a: Any, b: Any) -> None:
    """Exactly equal (nested dicts and lists of tensors and numbers)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _hand_zscore(value: float, window: list[float]) -> float:
    """The robust log-space z-score by hand: median and 1.4826 * MAD of the logs (NumPy)."""
    logs = np.log(window)
    center = float(np.median(logs))
    scale = max(1.4826 * float(np.median(np.abs(logs - center))), 0.01)
    return (math.log(value) - center) / scale


def _fit(
    model: pl.LightningModule, guard: LossSpikeGuard, tmp_path: Path, n: int = 256, **kwargs: Any
) -> tuple[pl.Trainer, Recorder, MemoryLogger]:
    recorder, logger = Recorder(), MemoryLogger(str(tmp_path))
    before = kwargs.pop("callbacks", [])
    trainer = make_trainer([*before, guard, recorder], logger, default_root_dir=str(tmp_path), **kwargs)
    trainer.fit(model, random_loader(n=n))
    return trainer, recorder, logger


def test_skip_drops_the_update_and_leaves_adam_untouched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, guard = SpikeModel({12}, optimizer="adam"), LossSpikeGuard(action="skip", **THRESHOLDS)
    trainer, rec, logger = _fit(model, guard, tmp_path)
    assert trainer.global_step == 32  # a dropped update still counts as a step
    assert rec.dropped() == {12}
    _same(rec.after[12], rec.before[12])  # the spiking update was not applied
    before, after = rec.opt_before[12]["state"], rec.opt_after[12]["state"]
    for idx in before:  # Adam's step count and moments untouched
        assert float(before[idx]["step"]) == float(after[idx]["step"]) == 12.0
        _same(before[idx]["exp_avg"], after[idx]["exp_avg"])
        _same(before[idx]["exp_avg_sq"], after[idx]["exp_avg_sq"])
    assert float(rec.opt_after[13]["state"][0]["step"]) == 13.0  # the next step updates again
    assert not torch.equal(rec.after[13]["net.0.weight"], rec.before[13]["net.0.weight"])

    (record,) = guard.records
    assert (record.step, record.epoch, record.batch_idx, record.action) == (12, 0, [12], "skip")
    assert record.loss == pytest.approx(model.losses[(0, 12)], rel=1e-6)
    assert record.grad_norm == pytest.approx(model.grad_norms[12], rel=1e-5)
    healthy = [model.losses[(0, i)] for i in range(12)]  # the window at step 12: every earlier step
    assert record.loss_zscore == pytest.approx(_hand_zscore(model.losses[(0, 12)], healthy), rel=1e-4)
    grads = [model.grad_norms[i] for i in range(12)]
    assert record.grad_norm_zscore == pytest.approx(_hand_zscore(model.grad_norms[12], grads), rel=1e-4)
    assert record.loss_zscore > 6.0 and record.grad_norm_zscore > 6.0
    # the spike never enters the window: the last 16 accepted losses
    accepted = [model.losses[(0, i)] for i in range(32) if i != 12][-16:]
    assert list(guard.windows["loss"]) == pytest.approx(accepted, rel=1e-6)
    assert (guard.dropped_steps, guard.rollbacks) == (1, 0)

    (alert,) = guard.alerts
    assert (alert.kind, alert.step, alert.severity) == ("loss_spike", 12, "warning")
    assert "Action: skip." in alert.message and "step 12" in alert.message
    skipped = logger.series("spike/skipped_steps")
    assert skipped[12] == 1.0 and max(v for s, v in skipped.items() if s < 12) == 0.0
    assert logger.series("spike/loss_zscore")[12] == pytest.approx(record.loss_zscore, rel=1e-6)

    content = json.loads((tmp_path / "spikes.json").read_text())
    assert content == {"format": FORMAT, "spikes": [record.to_dict()]}
    assert [SpikeRecord(**s) for s in content["spikes"]] == guard.records
    assert read_skip_batches(str(tmp_path / "spikes.json")) == {(0, 12)}


@pytest.mark.parametrize("schedule", ["step", "lambda"])
def test_rollback_restores_the_snapshot_and_cools_the_lr(schedule: str, tmp_path: Path) -> None:
    """Snapshots every 4 healthy steps: after steps 3, 7, 11. The spike at step 14 goes back to the one
    taken after step 11 (scheduler at position 12), so from step 14 the schedule runs 2 positions behind.
    The LR is 0.25x the schedule's for the 3 updates after the rollback (and the dropped step itself)."""
    torch.manual_seed(0)
    model = SpikeModel({14}, optimizer="sgd", scheduler=schedule)
    guard = LossSpikeGuard(
        action="rollback",
        snapshot_every_n_steps=4,
        lr_cooldown_factor=0.25,
        lr_cooldown_steps=3,
        **THRESHOLDS,
    )
    _, rec, _ = _fit(model, guard, tmp_path)
    assert [(r.step, r.action) for r in guard.records] == [(14, "rollback")]
    assert (guard.rollbacks, guard.dropped_steps, guard.cooldown_left) == (1, 1, 0)
    at = rec.at_step[14]  # just after the rollback, before the (dropped) update
    assert at["dropped"]
    _same(at["weights"], rec.after[11])
    _same(at["optimizer"]["state"], rec.opt_after[11]["state"])  # the momentum buffers
    (sched_now,), (sched_then,) = at["scheduler"], rec.sched_after[11]
    assert sched_then["last_epoch"] == 12
    scaled = {"base_lrs", "_last_lr"}
    _same(
        {k: v for k, v in sched_now.items() if k not in scaled},
        {k: v for k, v in sched_then.items() if k not in scaled},
    )
    assert sched_now["base_lrs"] == pytest.approx([0.25 * b for b in sched_then["base_lrs"]])
    _same(rec.after[14], rec.after[11])  # the run goes on from the snapshot
    assert not torch.equal(rec.after[15]["net.0.weight"], rec.after[14]["net.0.weight"])

    for step, seen in rec.at_step.items():
        position = step if step < 14 else step - 2
        cool = 0.25 if 14 <= step <= 14 + 3 else 1.0
        expected = 0.05 * SCHEDULES[schedule](position) * cool
        assert seen["lr"] == pytest.approx(expected, rel=1e-9), step


def test_a_lasting_spike_escalates_skip_rollback_raise(tmp_path: Path) -> None:
    """escalate_after=2: spikes 1-2 skipped (steps 12, 13), 3-4 rolled back (14, 15), the 5th (16) raises."""
    torch.manual_seed(0)
    model = SpikeModel(range(12, 100))
    guard = LossSpikeGuard(action="skip", escalate_after=2, snapshot_every_n_steps=4, **THRESHOLDS)
    rec = Recorder()
    trainer = make_trainer([guard, rec], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    with pytest.raises(LossSpikeError) as info:
        trainer.fit(model, random_loader(n=256))
    assert [(r.step, r.action) for r in guard.records] == [
        (12, "skip"), (13, "skip"), (14, "rollback"), (15, "rollback"), (16, "raise")
    ]  # fmt: skip
    assert trainer.global_step == 16 and (guard.rollbacks, guard.streak) == (2, 5)
    assert [a.severity for a in guard.alerts] == ["warning"] * 4 + ["error"]
    assert info.value.alerts == guard.alerts[-1:] and "step 16" in str(info.value)
    assert rec.dropped() == {12, 13, 14, 15}
    for step in (12, 13, 14, 15):  # skips keep the weights; rollbacks go back to the snapshot (step 11)
        _same(rec.after[step], rec.after[11])
    spikes = json.loads((tmp_path / "spikes.json").read_text())["spikes"]
    assert [s["action"] for s in spikes] == ["skip", "skip", "rollback", "rollback", "raise"]


@pytest.mark.parametrize(
    ("spikes", "expected"),
    [
        ({12, 15, 18}, [(12, "rollback"), (15, "rollback"), (18, "raise")]),
        ({12, 20, 28}, [(12, "rollback"), (20, "rollback"), (28, "rollback")]),
    ],
)
def test_a_rollback_that_does_not_hold_escalates(
    spikes: set[int], expected: list[tuple[int, str]], tmp_path: Path
) -> None:
    """action="rollback", escalate_after=2, a snapshot every 4 steps. A spike within 4 healthy steps of a
    rollback means the rollback did not hold: the streak goes on (12, 15) and the third spike (18) raises.
    Spikes 8 steps apart are each recovered from (a new snapshot after 4 calm steps) and never escalate."""
    torch.manual_seed(0)
    model = SpikeModel(spikes)
    guard = LossSpikeGuard(action="rollback", escalate_after=2, snapshot_every_n_steps=4, **THRESHOLDS)
    trainer = make_trainer([guard], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    if expected[-1][1] == "raise":
        with pytest.raises(LossSpikeError):
            trainer.fit(model, random_loader(n=256))
    else:
        trainer.fit(model, random_loader(n=320))
        assert (guard.streak, guard.probation) == (0, False)  # the last rollback held: a new snapshot
    assert [(r.step, r.action) for r in guard.records] == expected


def test_the_first_snapshot_is_taken_at_the_end_of_the_warmup(tmp_path: Path) -> None:
    """Snapshots every 100 steps, warm-up 8: the first one is taken after step 7, not step 99, so spikes
    right after the warm-up can be rolled back (escalate_after=1: 9 is skipped, 10 goes back to step 7)
    instead of escalating straight to a raise."""
    torch.manual_seed(0)
    model = SpikeModel({9, 10})
    guard = LossSpikeGuard(action="skip", escalate_after=1, snapshot_every_n_steps=100, **THRESHOLDS)
    _, rec, _ = _fit(model, guard, tmp_path)
    assert [(r.step, r.action) for r in guard.records] == [(9, "skip"), (10, "rollback")]
    _same(rec.after[10], rec.after[7])


def test_loss_only_guard_skips_the_gradient_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """grad_norm_threshold=None: the loss alone is judged (its jump is 1.8x: min_ratio 1.5) and the
    gradients are never read."""
    import lightning_gradguard.monitors.spike.measure as module

    calls: list[int] = []
    real = module.step_stats
    monkeypatch.setattr(module, "step_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    guard = LossSpikeGuard(action="skip", **{**THRESHOLDS, "grad_norm_threshold": None, "min_ratio": 1.5})
    _, rec, _ = _fit(SpikeModel({12}), guard, tmp_path)
    assert [(r.step, r.grad_norm, r.grad_norm_zscore) for r in guard.records] == [(12, None, None)]
    assert rec.dropped() == {12} and set(guard.windows) - {"inputs"} == {"loss"} and calls == []


def test_warmup_only_fills_the_window(tmp_path: Path) -> None:
    """warmup_steps=8: the spikes at steps 4 and 7 are not judged (they enter the window), step 8 is."""
    torch.manual_seed(0)
    model = SpikeModel({4, 7, 8})
    guard = LossSpikeGuard(action="skip", **THRESHOLDS)
    _, rec, _ = _fit(model, guard, tmp_path, n=128)
    assert [(r.step, r.action) for r in guard.records] == [(8, "skip")]
    assert rec.dropped() == {8}
    window = list(guard.windows["loss"])
    assert window == pytest.approx([model.losses[(0, i)] for i in range(16) if i != 8], rel=1e-6)
    assert guard.judged == 16


def test_healthy_noisy_digits_run_gives_no_alert(tmp_path: Path) -> None:
    """Small-batch SGD on real data (sklearn's 8x8 digits): a fast-falling, noisy loss is not a spike."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(
        torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    torch.manual_seed(0)
    model = Digits()
    guard = LossSpikeGuard(
        action="skip",
        loss_threshold=6.0,
        grad_norm_threshold=6.0,
        min_ratio=2.0,
        window_steps=128,
        warmup_steps=20,
    )
    trainer = make_trainer([guard], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    trainer.fit(model, loader)
    assert trainer.global_step == 225 and guard.judged == 225
    assert guard.alerts == [] and guard.records == [] and guard.dropped_steps == 0
    losses = model.losses  # the run is what the test claims: a fast fall, then small noisy batches
    assert losses[0] > 2.0 and float(np.median(losses[-50:])) < 0.25 * losses[0]
    assert max(losses[100:]) > 4.0 * float(np.median(losses[100:]))  # noisy: single batches well above


class OverflowOnce(SpikeModel):
    """Under a GradScaler, step ``overflow_step`` leaves an inf gradient (an fp16 overflow): skipped."""

    def __init__(self, overflow_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overflow_step = overflow_step

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.overflow_step:
            self.net[0].weight.grad[0, 0] = float("inf")


def test_16_mixed_scaler_skip_is_no_spike_and_a_rollback_works(tmp_path: Path) -> None:
    """16-mixed with a CPU GradScaler: the overflow at step 10 is the scaler's skip (no spike, nothing
    enters the windows); the loss judged is the true one, not the scaled one; the spike at step 16 rolls
    back to the snapshot of the 12th healthy step (step 12: the skipped step does not count)."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = OverflowOnce(10, spike_steps={16})
    guard = LossSpikeGuard(action="rollback", snapshot_every_n_steps=4, **{**THRESHOLDS, "window_steps": 64})
    _, rec, _ = _fit(
        model, guard, tmp_path, n=192, plugins=[MixedPrecision("16-mixed", device="cpu", scaler=scaler)]
    )
    _same(rec.after[10], rec.before[10])  # the scaler skipped the overflow
    assert scaler.get_scale() == 2.0**9  # halved once, at the overflow (no growth in 24 steps)
    assert [(r.step, r.action) for r in guard.records] == [(16, "rollback")]
    assert [a.step for a in guard.alerts] == [16] and guard.rollbacks == 1
    kept = [s for s in range(24) if s not in (10, 16)]
    assert list(guard.windows["loss"]) == pytest.approx([model.losses[(0, s)] for s in kept], rel=1e-5)
    assert len(guard.windows["grad_norm"]) == len(kept)
    assert all(math.isfinite(v) for v in guard.windows["grad_norm"])
    assert guard.records[0].loss == pytest.approx(model.losses[(0, 16)], rel=1e-5)
    _same(rec.after[16], rec.after[12])  # rolled back, and the scaler stepped on without complaint
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_accumulation_judges_the_mean_micro_batch_loss(tmp_path: Path) -> None:
    """accumulate_grad_batches=4 over 51 batches: step 9 is batches 36-39 (batch 37 spikes), the last
    step (12) holds batches 48-50 only. The loss judged is the mean of the step's micro-batch losses."""
    torch.manual_seed(0)
    model = SpikeModel(spike_batches={37})
    guard = LossSpikeGuard(action="skip", **{**THRESHOLDS, "window_steps": 32})
    trainer, rec, _ = _fit(model, guard, tmp_path, n=8 * 51, accumulate_grad_batches=4)
    assert trainer.global_step == 13
    (record,) = guard.records
    assert (record.step, record.batch_idx, record.action) == (9, [36, 37, 38, 39], "skip")

    def mean_loss(step: int) -> float:
        return float(np.mean([model.losses[(0, b)] for b in range(4 * step, min(4 * step + 4, 51))]))

    assert record.loss == pytest.approx(mean_loss(9), rel=1e-5)
    assert record.grad_norm == pytest.approx(model.grad_norms[9], rel=1e-5)
    expected = [mean_loss(s) for s in range(13) if s != 9]
    assert list(guard.windows["loss"]) == pytest.approx(expected, rel=1e-5)
    # the window cut short: the mean of its three losses, not three quarters of it
    assert expected[-1] == pytest.approx(np.mean([model.losses[(0, b)] for b in (48, 49, 50)]), rel=1e-6)
    assert rec.dropped() == {9}
    _same(rec.after[9], rec.before[9])


@pytest.mark.parametrize(("last", "judged"), [(2, False), (6, True)])
def test_a_partial_last_batch_under_half_the_size_is_not_judged(
    last: int, judged: bool, tmp_path: Path
) -> None:
    """20 batches of 8 and a last one of ``last`` samples, which spikes. A batch of 2 has a gradient ~2x
    noisier than one of 8 (sqrt(8/2)): it is neither judged nor remembered, its update is applied. A batch
    of 6 (over half) is judged like any other: the spike is skipped."""
    torch.manual_seed(0)
    model = SpikeModel(spike_batches={20})
    guard = LossSpikeGuard(action="skip", **THRESHOLDS)
    trainer, rec, _ = _fit(model, guard, tmp_path, n=8 * 20 + last, max_epochs=1)
    assert trainer.global_step == 21
    assert [(r.step, r.batch_idx) for r in guard.records] == ([(20, [20])] if judged else [])
    assert rec.dropped() == ({20} if judged else set())
    assert guard.judged == (21 if judged else 20) and len(guard.windows["loss"]) == 16  # full: 16 of 20
    assert guard.windows["loss"][-1] == pytest.approx(model.losses[(0, 19)], rel=1e-6)


class GuardState(pl.Callback):
    """The guard's state as a fit starts (after a checkpoint was loaded)."""

    def __init__(self, guard: LossSpikeGuard) -> None:
        self.guard = guard
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        g = self.guard
        self.seen = {
            "windows": {k: list(v) for k, v in g.windows.items()},
            "records": list(g.records),
            "counters": (g.dropped_steps, g.rollbacks, g.streak, g.judged, g.cooldown_left),
        }


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_restores_windows_counters_and_records(tmp_path: Path) -> None:
    """A checkpoint after epoch 0 (step 16) holds the guard under "LossSpikeGuard{}"; a fresh guard resumed
    from it starts with the windows, counters and records of then, and the rest of the run is the one
    the uninterrupted run had (the same spike at step 20, with the same z-scores)."""
    torch.manual_seed(0)
    first, guard = SpikeModel({12, 20}), LossSpikeGuard(action="skip", **THRESHOLDS)
    ckpts = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    _fit(first, guard, tmp_path / "run1", n=128, max_epochs=2, enable_checkpointing=True, callbacks=[ckpts])
    assert [(r.step, r.epoch, r.batch_idx) for r in guard.records] == [(12, 0, [12]), (20, 1, [4])]
    path = tmp_path / "ckpt" / "epoch=0-step=16.ckpt"
    saved = torch.load(path, weights_only=False)["callbacks"]["LossSpikeGuard{}"]
    assert saved["counters"] == {
        "dropped_steps": 1, "rollbacks": 0, "streak": 0, "judged": 16, "cooldown_left": 0, "calm": 3
    }  # fmt: skip
    assert saved["probation"] is False and saved["step"] == {"full": 8}

    resumed = LossSpikeGuard(action="skip", **THRESHOLDS)
    probe = GuardState(resumed)
    trainer = make_trainer(
        [resumed, probe], MemoryLogger(str(tmp_path / "run2")), default_root_dir=str(tmp_path / "run2"),
        max_epochs=2,
    )  # fmt: skip
    trainer.fit(SpikeModel({12, 20}), random_loader(n=128), ckpt_path=str(path))
    seen = probe.seen
    assert seen["counters"] == (1, 0, 0, 16, 0)  # skipped, rollbacks, streak, judged, cool-down
    assert seen["records"] == guard.records[:1]
    expected = [first.losses[(0, i)] for i in range(16) if i != 12]
    assert seen["windows"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert len(seen["windows"]["grad_norm"]) == 15
    assert resumed.records == guard.records  # bit for bit: step 20 judged against the restored window
    spikes = json.loads((tmp_path / "run2" / "spikes.json").read_text())["spikes"]
    assert [s["step"] for s in spikes] == [12, 20]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_resumed_fit_rolls_back_its_own_model_to_a_point_taken_after_the_resume(tmp_path: Path) -> None:
    """The same guard fits 20 steps, then resumes from the checkpoint in a new Trainer with a new model.
    The snapshot of the first fit (another model and optimizer) is dropped at fit start; a snapshot is not
    in a checkpoint, so the resumed fit takes one at its first calm step (20), then after steps 23 and 27
    (every 4 judged steps); the spike at 30 goes back to the live model's state after step 27."""
    torch.manual_seed(0)
    guard = LossSpikeGuard(action="rollback", snapshot_every_n_steps=4, **THRESHOLDS)
    ckpts = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _fit(SpikeModel(), guard, tmp_path / "run1", max_steps=20, enable_checkpointing=True, callbacks=[ckpts])
    assert guard._snapshot is None  # not kept past the fit
    model, rec = SpikeModel({30}), Recorder()
    trainer = make_trainer([guard, rec], default_root_dir=str(tmp_path / "run2"), max_steps=32, max_epochs=3)
    trainer.fit(model, random_loader(n=256), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert [(r.step, r.action) for r in guard.records] == [(30, "rollback")]
    _same(rec.after[30], rec.after[27])


def test_a_rollback_leaves_torchmetrics_state_alone(tmp_path: Path) -> None:
    """A metric updated every step keeps counting through a rollback (the data moves on: its updates
    happened), where restoring the snapshot's copy would rewind it to the step the snapshot was taken."""
    import torchmetrics

    class WithMetric(SpikeModel):
        def __init__(self) -> None:
            super().__init__({14})
            self.metric = torchmetrics.MeanMetric()
            self.counts: dict[int, int] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.metric.update(torch.tensor(1.0))
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, *args: Any) -> None:
            self.counts[self.trainer.global_step - 1] = self.metric.update_count

    torch.manual_seed(0)
    model = WithMetric()
    guard = LossSpikeGuard(action="rollback", snapshot_every_n_steps=4, **THRESHOLDS)
    _fit(model, guard, tmp_path)
    assert [(r.step, r.action) for r in guard.records] == [(14, "rollback")]
    assert model.counts[14] == 15 and model.counts[20] == 21


def test_skip_batches_path_replays_the_recorded_steps_without_the_spike(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first, guard = SpikeModel({12, 20}, optimizer="adam"), LossSpikeGuard(action="skip", **THRESHOLDS)
    _fit(first, guard, tmp_path / "run1")
    assert [r.step for r in guard.records] == [12, 20]

    torch.manual_seed(0)  # the same initial weights; the data are clean this time
    second = SpikeModel(optimizer="adam")
    replay = LossSpikeGuard(skip_batches_path=str(tmp_path / "run1" / "spikes.json"), **THRESHOLDS)
    _, rec, _ = _fit(second, replay, tmp_path / "run2")
    assert [(r.step, r.batch_idx, r.action) for r in replay.records] == [
        (12, [12], "replayed"), (20, [20], "replayed")
    ]  # fmt: skip
    assert replay.alerts == [] and replay.dropped_steps == 2
    assert replay.records[0].loss == pytest.approx(second.losses[(0, 12)], rel=1e-6)  # the clean loss
    assert rec.dropped() == {12, 20}
    _same(rec.after[12], rec.before[12])
    _same(second.state_dict(), first.state_dict())  # exactly the updates of the first run were applied
    content = json.loads((tmp_path / "run2" / "spikes.json").read_text())
    assert [s["action"] for s in content["spikes"]] == ["replayed", "replayed"]

    (tmp_path / "bad.json").write_text("{not json")
    bad = LossSpikeGuard(skip_batches_path=str(tmp_path / "bad.json"), **THRESHOLDS)
    with pytest.raises(ValueError, match="skip_batches_path"):
        _fit(SpikeModel(), bad, tmp_path / "run3")


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: a linear model ``a`` and a ReLU MLP ``b``, each with its own SGD, stepped in
    that order on every batch (global steps 2k and 2k+1 on batch k). On batch ``spike_batch`` the loss of
    ``b`` is scaled x1000: its gradient norm spikes, ``a``'s does not."""

    def __init__(self, spike_batch: int | range | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 4)
        self.b = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.spike_batch = spike_batch
        self.norms: dict[str, dict[int, float]] = {"a": {}, "b": {}}
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.before[batch_idx] = copy.deepcopy(self.state_dict())
        for name, opt in zip("ab", self.optimizers(), strict=True):
            net = getattr(self, name)
            loss = nn.functional.cross_entropy(net(x), y)
            spiking = (
                batch_idx in self.spike_batch
                if isinstance(self.spike_batch, range)
                else (batch_idx == self.spike_batch)
            )
            loss = loss * (1000.0 if name == "b" and spiking else 1.0)
            opt.zero_grad()
            self.manual_backward(loss)
            self.norms[name][batch_idx] = float(reference_total_norm([p.grad for p in net.parameters()]))
            opt.step()
        self.after[batch_idx] = copy.deepcopy(self.state_dict())

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)]


def _moved(model: TwoOptimizers, batch_idx: int, prefix: str) -> bool:
    before, after = model.before[batch_idx], model.after[batch_idx]
    return any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix))


def test_manual_optimization_judges_each_optimizer_norm_and_rolls_back_as_a_skip(tmp_path: Path) -> None:
    """Checked: one window per optimizer holding its true gradient norms ("grad_norm@0", "grad_norm@1")
    and no loss window; the spike of ``b`` on batch 14 (global step 29) is recorded with that batch, no
    loss, and action "skip" although "rollback" was asked with snapshots every 2 steps (rollbacks stay
    0); ``b``'s update of batch 14 is dropped, ``a``'s is applied. A replay of the file drops both
    optimizers' updates of batch 14 (the batch is what is named, not the optimizer)."""
    torch.manual_seed(0)
    model = TwoOptimizers(spike_batch=14)
    guard = LossSpikeGuard(action="rollback", snapshot_every_n_steps=2, **{**THRESHOLDS, "window_steps": 64})
    make_trainer([guard], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path)).fit(
        model, random_loader(n=256)
    )
    assert set(guard.windows) == {"grad_norm@0", "grad_norm@1", "inputs"}  # the inputs: the run's
    (record,) = guard.records
    assert (record.step, record.epoch, record.batch_idx, record.action) == (29, 0, [14], "skip")
    assert record.loss is None and record.loss_zscore is None
    assert record.grad_norm == pytest.approx(model.norms["b"][14], rel=1e-5)
    assert (guard.rollbacks, guard.dropped_steps) == (0, 1)
    assert "Action: skip." in guard.alerts[0].message
    assert not _moved(model, 14, "b.") and _moved(model, 14, "a.") and _moved(model, 15, "b.")
    assert list(guard.windows["grad_norm@0"]) == pytest.approx(
        [model.norms["a"][i] for i in range(32)], rel=1e-5
    )
    b_kept = [model.norms["b"][i] for i in range(32) if i != 14]
    assert list(guard.windows["grad_norm@1"]) == pytest.approx(b_kept, rel=1e-5)

    torch.manual_seed(0)
    again = TwoOptimizers(spike_batch=None)
    replay = LossSpikeGuard(skip_batches_path=str(tmp_path / "spikes.json"), **THRESHOLDS)
    make_trainer([replay], default_root_dir=str(tmp_path / "replay")).fit(again, random_loader(n=256))
    assert [(r.step, r.batch_idx, r.action) for r in replay.records] == [
        (28, [14], "replayed"),
        (29, [14], "replayed"),
    ]
    assert not _moved(again, 14, "a.") and not _moved(again, 14, "b.") and _moved(again, 13, "a.")


def test_manual_optimization_keeps_a_streak_per_optimizer(tmp_path: Path) -> None:
    """``b`` spikes on every batch from 14 while ``a`` stays calm: ``a``'s calm steps between them do not
    end ``b``'s streak (escalate_after 2, no rollback under manual optimization: skip, skip, raise)."""
    torch.manual_seed(0)
    model = TwoOptimizers(spike_batch=range(14, 100))
    guard = LossSpikeGuard(action="skip", escalate_after=2, **{**THRESHOLDS, "window_steps": 64})
    trainer = make_trainer([guard], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    with pytest.raises(LossSpikeError):
        trainer.fit(model, random_loader(n=256))
    assert [(r.step, r.action) for r in guard.records] == [(29, "skip"), (31, "skip"), (33, "raise")]
    assert guard.manual_streaks == {"@0": 0, "@1": 3}


def test_ddp_a_spike_on_one_rank_is_judged_alike_on_both(tmp_path: Path) -> None:
    """tests/scripts/ddp_loss_spike.py: rank 1's data alone spike at step 12 (a hang times out here)."""
    proc = run_ddp_script("ddp_loss_spike.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in seen:  # the same decision at the same step on both ranks: skip step 12
        assert [(r["step"], r["batch_idx"], r["action"]) for r in rank["records"]] == [(12, [12], "skip")]
        assert rank["dropped"] == [12] and rank["unchanged_at_12"] and rank["steps"] == 16
        assert [a[0] for a in rank["alerts"]] == [12]
    assert seen[0]["records"] == seen[1]["records"] and seen[0]["alerts"] == seen[1]["alerts"]
    # the loss judged is the mean over the ranks (rank 1's alone spiked)
    mean = (seen[0]["losses"]["12"] + seen[1]["losses"]["12"]) / 2
    assert seen[0]["records"][0]["loss"] == pytest.approx(mean, rel=1e-5)
    assert seen[1]["losses"]["12"] > 2 * seen[0]["losses"]["12"]
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    _same(weights[0], weights[1])  # identical across ranks
    skip_json = tmp_path / "skip" / "spikes.json"
    written = [Path(w).relative_to(Path(w).parents[1]).as_posix() for w in seen[0]["writes"]]
    assert written == ["skip/spikes.json"] and seen[1]["writes"] == []  # rank 0 writes it, once
    assert [s["step"] for s in json.loads(skip_json.read_text())["spikes"]] == [12]
    # action="raise": both ranks raise at step 12, close in time
    assert [r["raised"][:3] for r in seen] == [["LossSpikeError", [12], 12]] * 2
    assert abs(seen[0]["raised"][3] - seen[1]["raised"][3]) < 10
