r"""
LossSpikeGuard
==============

Catches a spike of the training loss or of the gradient norm before the optimizer applies it, and
recovers: warn, skip the update, roll back to a recent snapshot, or raise; escalating while spikes keep
coming, so that a real divergence is not skipped forever.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.alerts import LossSpikeError
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.cadence import optimizer_index
from lightning_gradguard.core.lr import rescale_learning_rates
from lightning_gradguard.core.skips import skip_update
from lightning_gradguard.core.snapshot import TrainingSnapshot, rollback_point
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.validate import check_choice, check_float, check_int, check_path
from lightning_gradguard.functional.spikes import (
    SpikeScore,
    is_spike,
    spike_score,
)
from lightning_gradguard.monitors.spike.records import (
    SpikeRecord,
    StepInputs,
    log_spike_scalars,
    read_skip_batches,
    record_spike,
    spike_alert,
)
from lightning_gradguard.monitors.spike.rules import escalated_action, snapshot_due

__all__ = ["LossSpikeGuard"]


class LossSpikeGuard(GradGuardCallback):
    r"""Detect loss and gradient-norm spikes before the update; skip, roll back or raise.

    Before each update it scores the step's loss (the mean over micro-batches and ranks) and total gradient
    norm (the shared statistics pass) against the last ``window`` accepted steps: a robust z-score
    (median/MAD, log space; :mod:`lightning_gradguard.functional.spikes`) at its threshold, and at least
    ``min_ratio`` times the median, is a spike. It gets ``action``, escalating every ``patience``
    consecutive spikes along ``skip -> rollback -> raise``: a skip drops the update (optimizer state
    untouched), a rollback restores the last CPU snapshot (weights, optimizer, scheduler, GradScaler, RNG)
    and drops the update while the data moves on. Every rank decides alike (one all-reduce). Each spike is
    an alert ``loss_spike`` and a record in ``spikes.json``. The rules, in full: docs/loss_spike.md.

    Args:
        action: ``"skip"`` (default), ``"rollback"``, ``"warn"`` or ``"raise"``.
        loss_threshold: robust z-score of the loss that makes a spike (``None``: the loss is not judged).
        grad_norm_threshold: the same for the total gradient norm (``None``: not judged).
        min_ratio: a spike must also be this many times the recent median.
        window: how many recent accepted steps the statistics cover.
        warmup_steps: steps that only fill the window at the start of a run (the MAD's standard error is
            about 16 % of the spread from 50 values, 26 % from 20).
        patience: consecutive spikes before the action escalates one rung.
        snapshot_every_n_steps: take a rollback snapshot after every this many healthy steps (``None``:
            100 when a rollback can happen, else never; ``0``: never, and rollbacks become skips).
        snapshot_device: ``"cpu"`` (default: spares the accelerator's memory) or ``"same"``.
        lr_cooldown_factor: after a rollback, multiply the learning rate by this (``None``: unchanged).
        lr_cooldown_steps: how many applied updates the lower learning rate lasts.
        skip_batches_path: a ``spikes.json`` of an earlier run whose batches are skipped again.
        cooldown_steps: minimum steps between two alerts of the same kind and place.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import LossSpikeGuard

        guard = LossSpikeGuard(action="rollback", lr_cooldown_factor=0.5)
        Trainer(callbacks=[guard]).fit(model)
        print(guard.skipped_steps, guard.rollbacks, guard.records)
    """

    error_type = LossSpikeError
    allowed_actions = ("skip", "rollback", "warn", "raise")

    def __init__(
        self,
        action: Literal["skip", "rollback", "warn", "raise"] = "skip",
        loss_threshold: float | None = 6.0,
        grad_norm_threshold: float | None = 6.0,
        min_ratio: float = 2.0,
        window: int = 128,
        warmup_steps: int = 50,
        patience: int = 3,
        snapshot_every_n_steps: int | None = None,
        snapshot_device: Literal["cpu", "same"] = "cpu",
        lr_cooldown_factor: float | None = None,
        lr_cooldown_steps: int = 100,
        skip_batches_path: str | None = None,
        cooldown_steps: int = 0,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.loss_threshold = check_float(
            "loss_threshold", loss_threshold, 0.0, low_open=True, allow_none=True
        )
        self.grad_norm_threshold = check_float(
            "grad_norm_threshold", grad_norm_threshold, 0.0, low_open=True, allow_none=True
        )
        self.min_ratio: float = check_float("min_ratio", min_ratio, 1.0)
        self.window: int = check_int("window", window, 8)
        self.warmup_steps: int = check_int("warmup_steps", warmup_steps, 8)
        self.patience: int = check_int("patience", patience, 1)
        every = check_int("snapshot_every_n_steps", snapshot_every_n_steps, 0, allow_none=True)
        self.snapshot_every_n_steps: int = (
            (100 if action in ("skip", "rollback") else 0) if every is None else every
        )
        self.snapshot_device: str = check_choice("snapshot_device", snapshot_device, ("cpu", "same"))
        self.lr_cooldown_factor = check_float(
            "lr_cooldown_factor", lr_cooldown_factor, 0.0, 1.0, low_open=True, allow_none=True
        )
        self.lr_cooldown_steps: int = check_int("lr_cooldown_steps", lr_cooldown_steps, 1)
        self.skip_batches_path: str | None = check_path("skip_batches_path", skip_batches_path)
        self._skip: set[tuple[int, int]] = set()
        self._reset()

    def _reset(self) -> None:
        self.windows: dict[str, deque[float]] = {}
        self.records: list[SpikeRecord] = []
        self.skipped_steps = self.rollbacks = self.streak = self.judged = self.cooldown_left = 0
        self.calm = 0  # healthy judged steps since the last spike
        self.probation = False  # a rollback was made and the run has not yet earned a new snapshot
        self.last_scores: dict[str, SpikeScore] = {}
        self.manual_streaks: dict[str, int] = {}  # manual optimization: a streak per optimizer
        self._forget()

    def _forget(self) -> None:
        """What lives within one fit only: the rollback point and the step being gathered."""
        self._snapshot: TrainingSnapshot | None = None
        self._step = StepInputs(getattr(getattr(self, "_step", None), "full", 0))
        self._outcome: str | None = None  # this step: "calm", "applied" (a warned spike) or "dropped"

    @override
    def layout_charts(self) -> dict[str, list[str]]:
        return {"Loss spikes: robust z-score of the loss and the gradient norm": ["spike/.*zscore"]} | {
            "Loss spikes: skipped steps and rollbacks": ["spike/skipped_steps", "spike/rollbacks"]
        }

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):
            self._reset()
        self._forget()  # a snapshot of an earlier fit holds another fit's objects
        self._skip = read_skip_batches(self.skip_batches_path) if self.skip_batches_path else set()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._snapshot = None  # a copy of the weights and optimizer: not kept past the fit

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._snapshot = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step.add_batch(trainer, batch, batch_idx, self._skip)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._step.add_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        manual = not pl_module.automatic_optimization
        scale = getattr(active_scaler(trainer), "_scale", None)  # 16-mixed: backward got the loss x scale
        loss, batches, replay, short = self._step.take(trainer.accumulate_grad_batches, scale, manual)
        self._outcome = "applied"
        transfer = HostTransfer()
        judged_loss = loss if loss is not None and not manual else None
        if self.grad_norm_threshold is not None or judged_loss is None:  # the shared statistics pass
            stats = step_stats(trainer, pl_module, optimizer)  # DeepSpeed: none (then the loss alone)
            if stats.unsupported is None or judged_loss is None:
                transfer.add_norms(
                    "grad_norm", total := stats.grad_total(2.0)
                )  # sharded: summed in the fetch
                anchor = total.values
        if judged_loss is not None:
            transfer.add("loss", anchor := judged_loss)
        transfer.add("short", anchor.new_full((1,), float(short)))  # any rank's: every rank passes alike
        host = transfer.fetch(trainer, reduce_op="mean")  # the one transfer (and collective) of the step
        values = {k: float(v) for k, v in host.items() if k != "short"}
        if replay:  # a batch an earlier run recorded: its update is dropped again, unjudged
            skip_update(trainer, optimizer, "loss_spike")
            self._outcome = "dropped"
            self.skipped_steps += 1
            record_spike(trainer, self.records, batches=batches, values=values, scores={}, action="replayed")
            return
        if not all(math.isfinite(v) for v in values.values()):
            self._outcome = "dropped"  # NaN/inf: the GradScaler's skip or NaNSentinel's finding, no spike
            return
        if float(host["short"]) > 0:
            return
        suffix = f"@{optimizer_index(trainer, optimizer)}" if manual else ""
        thresholds = {"loss": self.loss_threshold, "grad_norm": self.grad_norm_threshold}
        judged = {k: v for k, v in values.items() if thresholds[k] is not None}
        windows = {k: self.windows.setdefault(k + suffix, deque(maxlen=self.window)) for k in judged}
        scores = {k: spike_score(v, windows[k]) for k, v in judged.items()}
        self.last_scores = scores
        self.judged += 1
        warm = all(len(w) >= min(self.warmup_steps, self.window) for w in windows.values())
        spike = warm and any(is_spike(scores[k], thresholds[k] or 0.0, self.min_ratio) for k in judged)
        if not spike:
            for k, v in judged.items():
                windows[k].append(v)
            self.calm += 1
            if manual:
                self.manual_streaks[suffix] = 0
            elif not self.probation:  # after a rollback the streak lasts until the run earns a new snapshot
                self.streak = 0
            self._outcome = "calm"
            log_spike_scalars(trainer, scores, self.skipped_steps, self.rollbacks, force=False)
            return
        if manual:
            streak = self.manual_streaks[suffix] = self.manual_streaks.get(suffix, 0) + 1
        else:
            self.streak, self.calm = self.streak + 1, 0
            streak = self.streak
        can_roll_back = self._snapshot is not None and not manual
        action = escalated_action(self.action, streak, self.patience, can_roll_back)
        self.skipped_steps += action != "warn"
        record_spike(trainer, self.records, batches=batches, values=values, scores=scores, action=action)
        log_spike_scalars(trainer, scores, self.skipped_steps, self.rollbacks, force=True)
        self.report(
            trainer, "loss_spike", *spike_alert(int(trainer.global_step), action, values, scores, streak)
        )
        if action == "raise":
            raise LossSpikeError(self.alerts[-1].format() if self.alerts else "loss spike", self.alerts[-1:])
        if action == "rollback" and self._snapshot is not None:
            self._snapshot.restore(mid_step=True)  # taken outside any cool-down: the schedule's own LRs
            self.rollbacks += 1
            self.probation = True
            if self.lr_cooldown_factor is not None:
                factor = self.lr_cooldown_factor
                rescale_learning_rates(trainer, optimizer, lambda v: v * factor)
                self.cooldown_left = self.lr_cooldown_steps
        if action in ("skip", "rollback"):
            skip_update(trainer, optimizer, "loss_spike")
            self._outcome = "dropped"

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        outcome, self._outcome = self._outcome, None
        if not pl_module.automatic_optimization:
            self._step.clear()
        if outcome is None or not pl_module.automatic_optimization:
            return
        if self.cooldown_left and self.lr_cooldown_factor is not None and outcome != "dropped":
            self.cooldown_left -= 1
            if self.cooldown_left == 0:  # the cool-down is over: the schedule's own learning rate again
                factor = self.lr_cooldown_factor
                rescale_learning_rates(trainer, trainer.optimizers[0], lambda v: v / factor)
        every = self.snapshot_every_n_steps
        have = self._snapshot is not None  # not in a checkpoint: a resumed run takes one at once
        due = snapshot_due(
            self.judged, self.warmup_steps, every, self.streak, self.calm, self.probation, have
        )
        if outcome == "calm" and not self.cooldown_left and due:
            self._snapshot = rollback_point(pl_module, trainer, self.snapshot_device)
            self.streak, self.probation = 0, False

    # ------------------------------------------------------------------ helpers
    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        windows, records = {k: list(v) for k, v in self.windows.items()}, [r.to_dict() for r in self.records]
        counters = [self.skipped_steps, self.rollbacks, self.streak, self.judged, self.cooldown_left]
        counters += [self.calm, int(self.probation), self._step.full]
        extra = {"manual_streaks": dict(self.manual_streaks)}
        return super().state_dict() | {"windows": windows, "records": records, "counters": counters} | extra

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.windows = {k: deque(v, maxlen=self.window) for k, v in state_dict.get("windows", {}).items()}
        self.records = [SpikeRecord(**r) for r in state_dict.get("records", [])]
        counters = [int(c) for c in state_dict.get("counters", [])] + [0] * 8  # an older state: fewer
        self.skipped_steps, self.rollbacks, self.streak, self.judged, self.cooldown_left = counters[:5]
        self.calm, self.probation, self._step.full = counters[5], bool(counters[6]), counters[7]
        self.manual_streaks = {k: int(v) for k, v in state_dict.get("manual_streaks", {}).items()}
