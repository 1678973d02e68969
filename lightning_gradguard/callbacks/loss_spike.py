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
from lightning_gradguard.callbacks.spike_records import SpikeRecord, read_skip_batches, record_spike
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step, optimizer_index
from lightning_gradguard.core.lr import rescale_learning_rates
from lightning_gradguard.core.snapshot import TrainingSnapshot
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.trial import drop_update
from lightning_gradguard.core.validate import check_choice, check_float, check_int, check_path
from lightning_gradguard.functional.spikes import (
    SpikeScore,
    escalated_action,
    explain_spike,
    is_spike,
    spike_score,
)

__all__ = ["LossSpikeGuard"]


class LossSpikeGuard(GradGuardCallback):
    r"""Detect loss and gradient-norm spikes before the update; skip, roll back or raise.

    In ``on_before_optimizer_step`` it judges the step's loss (what ``training_step`` returned, averaged
    over micro-batches and ranks) and total gradient norm (the shared statistics: no second pass) against
    the last ``window`` accepted steps: a robust z-score (median and MAD, log space for positive values,
    :mod:`lightning_gradguard.functional.spikes`) that reaches its threshold, with the value also
    ``min_ratio`` times the recent median. ``warmup_steps`` steps fill the window first; a spike never
    enters it. One small transfer (one all-reduce under DDP) per step: every rank decides alike. GradScaler
    skips and NaN/inf are the scaler's and :class:`~lightning_gradguard.NaNSentinel`'s business.

    A spike gets ``action``, escalating every ``patience`` consecutive spikes along ``skip -> rollback ->
    raise`` (``"warn"`` never escalates): ``"warn"`` only alerts; ``"skip"`` drops the update (every
    gradient set to ``None``: Adam's moments and step count untouched); ``"rollback"`` restores weights,
    optimizer, scheduler, GradScaler and RNG from the last snapshot (every ``snapshot_every_n_steps``
    healthy steps, on the CPU by default), drops the update and lets the data move on (``global_step``
    keeps counting), optionally multiplying the LR by ``lr_cooldown_factor`` for ``lr_cooldown_steps``
    steps; ``"raise"`` raises :class:`~lightning_gradguard.LossSpikeError` on every rank.

    Each spike is an alert ``loss_spike`` and a record in ``spikes.json`` beside the logs; a later run given
    it as ``skip_batches_path`` drops the updates holding those batches. Logged: ``spike/loss_zscore``,
    ``spike/grad_norm_zscore``, ``spike/skipped_steps``, ``spike/rollbacks``. Manual optimization: the
    gradient norm is judged per optimizer, the loss is not, and a rollback is done as a skip.

    Args:
        action: ``"skip"`` (default), ``"rollback"``, ``"warn"`` or ``"raise"``.
        loss_threshold: robust z-score of the loss that makes a spike (``None``: the loss is not judged).
        grad_norm_threshold: the same for the total gradient norm (``None``: not judged).
        min_ratio: a spike must also be this many times the recent median.
        window: how many recent accepted steps the statistics cover.
        warmup_steps: steps that only fill the window at the start of a run.
        patience: consecutive spikes before the action escalates one rung.
        snapshot_every_n_steps: take a rollback snapshot after every this many healthy steps (``None``:
            100 when a rollback can happen, else never; ``0``: never, and rollbacks become skips).
        snapshot_device: ``"cpu"`` (default: spares the accelerator's memory) or ``"same"``.
        lr_cooldown_factor: after a rollback, multiply the learning rate by this (``None``: unchanged).
        lr_cooldown_steps: how many steps the lower learning rate lasts.
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
        warmup_steps: int = 20,
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
        self.last_scores: dict[str, SpikeScore] = {}
        self._snapshot: TrainingSnapshot | None = None
        self._loss: Tensor | None = None
        self._batches: list[int] = []
        self._stepped = self._replay = False
        self._micro = 0

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
        self._skip = read_skip_batches(self.skip_batches_path) if self.skip_batches_path else set()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batches.append(batch_idx)
        self._replay |= (int(trainer.current_epoch), batch_idx) in self._skip

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        value = loss.detach().float().reshape(())  # Lightning divides it by accumulate_grad_batches
        self._loss = value if self._loss is None else self._loss + value
        self._micro += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        manual = not pl_module.automatic_optimization
        loss, micro, self._loss, self._micro = self._loss, self._micro, None, 0
        scale = getattr(active_scaler(trainer), "_scale", None)  # 16-mixed: backward got the loss x scale
        if loss is not None and micro:  # the mean, also over a last accumulation window cut short
            loss = loss * (trainer.accumulate_grad_batches / micro) / (1.0 if scale is None else scale)
        batches, replay = list(self._batches), self._replay
        if not manual:  # manual optimization: a batch's optimizers share its batch, cleared at its end
            self._batches, self._replay = [], False
        self._stepped = True
        transfer = HostTransfer()
        transfer.add("grad_norm", step_stats(trainer, pl_module, optimizer).grad_total(2.0))
        if loss is not None and not manual:
            transfer.add("loss", loss)
        host = transfer.fetch(trainer, reduce_op="mean")  # the one transfer (and collective) of the step
        values = {k: float(v) for k, v in host.items()}
        if replay:  # a batch an earlier run recorded: its update is dropped again, unjudged
            drop_update(optimizer)
            self._record(trainer, batches, values, {}, "replayed")
            return
        if not all(math.isfinite(v) for v in values.values()):
            return  # NaN/inf: the GradScaler's skip (16-mixed) or NaNSentinel's finding, not a spike
        suffix = f"@{optimizer_index(trainer, optimizer)}" if manual else ""
        thresholds = {"loss": self.loss_threshold, "grad_norm": self.grad_norm_threshold}
        judged = {k: v for k, v in values.items() if thresholds[k] is not None}
        windows = {k: self.windows.setdefault(k + suffix, deque(maxlen=self.window)) for k in judged}
        scores = {k: spike_score(v, windows[k]) for k, v in judged.items()}
        self.last_scores = scores
        self.judged += 1
        spike = self.judged > self.warmup_steps and any(
            is_spike(scores[k], thresholds[k] or 0.0, self.min_ratio) for k in judged
        )
        if not spike:
            for k, v in judged.items():
                windows[k].append(v)
            self.streak = 0
            self._log(trainer, scores, force=False)
            return
        self.streak += 1
        can_roll_back = self._snapshot is not None and not manual
        action = escalated_action(self.action, self.streak, self.patience, can_roll_back)
        self._record(trainer, batches, values, scores, action)
        self._log(trainer, scores, force=True)
        self._alert(trainer, action, values, scores)
        if action == "raise":
            raise LossSpikeError(self.alerts[-1].format() if self.alerts else "loss spike", self.alerts[-1:])
        if action == "rollback" and self._snapshot is not None:
            # this step's unscale_ is done and scaler.step() follows: keep the GradScaler's bookkeeping of it
            pending = dict(getattr(active_scaler(trainer), "_per_optimizer_states", {}))
            self._snapshot.restore()  # taken outside any cool-down: the schedule's own learning rates
            if pending:
                active_scaler(trainer)._per_optimizer_states.update(pending)
            self.rollbacks += 1
            if self.lr_cooldown_factor is not None:
                factor = self.lr_cooldown_factor
                rescale_learning_rates(trainer, optimizer, lambda v: v * factor)
                self.cooldown_left = self.lr_cooldown_steps + 1  # + this step, whose update is dropped
        if action in ("skip", "rollback"):
            drop_update(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._stepped = self._stepped, False
        if not pl_module.automatic_optimization:
            self._batches, self._replay = [], False
        if not stepped or not pl_module.automatic_optimization:
            return
        if self.cooldown_left and self.lr_cooldown_factor is not None:
            self.cooldown_left -= 1
            if self.cooldown_left == 0:  # the cool-down is over: the schedule's own learning rate again
                factor = self.lr_cooldown_factor
                rescale_learning_rates(trainer, trainer.optimizers[0], lambda v: v / factor)
        every = self.snapshot_every_n_steps
        if every and not self.streak and not self.cooldown_left and self.judged and self.judged % every == 0:
            store = "cpu" if self.snapshot_device == "cpu" else None
            self._snapshot = TrainingSnapshot(pl_module, trainer=trainer, keep_progress=False, store=store)

    # ------------------------------------------------------------------ helpers
    def _record(
        self,
        trainer: pl.Trainer,
        batches: list[int],
        values: dict[str, float],
        scores: dict[str, SpikeScore],
        action: str,
    ) -> None:
        self.skipped_steps += action != "warn"
        record_spike(trainer, self.records, batches=batches, values=values, scores=scores, action=action)

    def _log(self, trainer: pl.Trainer, scores: dict[str, SpikeScore], force: bool) -> None:
        at = log_step(trainer)
        if not (force or on_logging_step(at, logging_interval(trainer))):
            return
        metrics = {f"spike/{k}_zscore": s.zscore for k, s in scores.items() if math.isfinite(s.zscore)}
        metrics |= {
            "spike/skipped_steps": float(self.skipped_steps),
            "spike/rollbacks": float(self.rollbacks),
        }
        _emit.log_scalars(trainer, metrics, at)

    def _alert(
        self, trainer: pl.Trainer, action: str, values: dict[str, float], scores: dict[str, SpikeScore]
    ) -> None:
        message, hint = explain_spike(int(trainer.global_step), action, values, scores, self.streak)
        data = {f"{k}_zscore": s.zscore for k, s in scores.items()} | {"streak": float(self.streak)}
        self.report(
            trainer, "loss_spike", "error" if action == "raise" else "warning", None, message, hint, data
        )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        windows, records = {k: list(v) for k, v in self.windows.items()}, [r.to_dict() for r in self.records]
        counters = [self.skipped_steps, self.rollbacks, self.streak, self.judged, self.cooldown_left]
        return super().state_dict() | {"windows": windows, "records": records, "counters": counters}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.windows = {k: deque(v, maxlen=self.window) for k, v in state_dict.get("windows", {}).items()}
        self.records = [SpikeRecord(**r) for r in state_dict.get("records", [])]
        counters = [int(c) for c in state_dict.get("counters", [0, 0, 0, 0, 0])]
        self.skipped_steps, self.rollbacks, self.streak, self.judged, self.cooldown_left = counters
