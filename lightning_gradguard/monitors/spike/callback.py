r"""
LossSpikeGuard
==============

Catches a spike of the training loss or of the gradient norm before the optimizer applies it, and
recovers: warn, skip the update, roll back to a recent snapshot, or raise; escalating while spikes keep
coming, so that a real divergence is not skipped forever. While its windows warm up it compares the loss
with the run's own start instead, and says so when the loss climbs far above it (an early divergence).

The callback holds the hooks, the windows, the counters and its checkpoint state, and logs the ``spike/*``
scalars. What a step gathers and reads is :mod:`~lightning_gradguard.monitors.spike.measure`, what makes a
spike, the escalation and the rules with their checks (the alerts' words)
:mod:`~lightning_gradguard.monitors.spike.rules`, the early divergence's watch
:mod:`~lightning_gradguard.monitors.spike.early`, ``spikes.json``
:mod:`~lightning_gradguard.monitors.spike.records`, the score :mod:`lightning_gradguard.functional.spikes`.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.alerts import Alert, LossSpikeError
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.buffers import keep_step_buffers, step_buffers
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step, optimizer_index
from lightning_gradguard.core.lr import group_lr, rescale_learning_rates
from lightning_gradguard.core.runstate import RunField, Streaks
from lightning_gradguard.core.skips import skip_update
from lightning_gradguard.core.snapshot import TrainingSnapshot, rollback_point
from lightning_gradguard.core.validate import check_choice, check_float, check_int, check_path
from lightning_gradguard.functional.spikes import SpikeScore, spike_score
from lightning_gradguard.monitors.spike.early import EarlyWatch
from lightning_gradguard.monitors.spike.measure import StepInputs, read_step_values
from lightning_gradguard.monitors.spike.records import SpikeRecord, read_skip_batches, record_spike
from lightning_gradguard.monitors.spike.rules import (
    EARLY_RULES,
    STEP_RULES,
    Diverged,
    Spiked,
    batch_variance_outlier,
    escalated_action,
    snapshot_due,
    step_verdict,
)
from lightning_gradguard.monitors.spike.tags import CHARTS, SPIKE

#: the accepted steps whose inputs must be seen before a batch's inputs are judged against them
_INPUTS_WARM = 8


@dataclass(frozen=True, kw_only=True)
class _Judged:
    """One step scored against its windows.

    Attributes:
        batches: the batch indices of its micro-batches.
        values: its host values by name (``"loss"``, ``"grad_norm"``), judged or not.
        scores: the judged values' scores against their windows.
        suffix: whose windows and streak: ``""``, or under manual optimization ``"@<optimizer index>"``.
        verdict: ``"spike"``, ``"excursion"`` (a gradient-norm spike the loss did not confirm: applied like a
            calm step, but no rollback point is taken after it) or ``"calm"``; always ``"calm"`` while the
            windows are cold (:func:`~lightning_gradguard.monitors.spike.rules.step_verdict`).
    """

    batches: list[int]
    values: dict[str, float]
    scores: dict[str, SpikeScore]
    suffix: str
    verdict: str

    @property
    def manual(self) -> bool:
        return bool(self.suffix)


def _windows(guard: LossSpikeGuard, saved: dict[str, list[float]]) -> dict[str, deque[float]]:
    return {k: deque(v, maxlen=guard.window_steps) for k, v in saved.items()}


def _records_saved(_: Any, records: list[SpikeRecord]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]


def _records_loaded(_: Any, saved: list[dict[str, Any]]) -> list[SpikeRecord]:
    return [SpikeRecord(**r) for r in saved]


class LossSpikeGuard(GradGuardCallback):
    r"""Detect loss and gradient-norm spikes before the update; skip, roll back or raise.

    Before each update it scores the step's loss (the mean over micro-batches and ranks) and total gradient
    norm (the shared statistics pass) against the last ``window_steps`` accepted steps: a robust z-score
    (median/MAD, log space; :mod:`lightning_gradguard.functional.spikes`) at its threshold, and at least
    ``min_ratio`` times the median, is a spike; a gradient-norm spike only when the loss confirms it (its
    z-score 2 or more: a large gradient with a falling loss is left alone). A spike gets ``action``,
    escalating every ``escalate_after`` consecutive spikes along ``skip -> rollback -> raise``: a skip drops
    the update (optimizer state untouched), a rollback restores the last CPU snapshot (weights, optimizer,
    scheduler, GradScaler, RNG) and drops the update while the data moves on. Every rank decides alike (one
    all-reduce). Each spike is an alert ``loss_spike`` and a record in ``spikes.json``. While the windows warm
    up, a loss that stays at ``early_divergence_factor`` times the run's start (the median of its first 3
    losses) for 5 steps in a row is an alert ``early_divergence`` (an error: the learning rate is too high),
    once; nothing is skipped (no good state exists yet), ``action="raise"`` raises. The rules, in full:
    docs/loss_spike.md.

    Args:
        action: ``"skip"`` (default), ``"rollback"``, ``"warn"`` or ``"raise"``.
        loss_threshold: robust z-score of the loss that makes a spike (``None``: the loss is not judged).
        grad_norm_threshold: the same for the total gradient norm (``None``: not judged).
        min_ratio: a spike must also be this many times the recent median.
        window_steps: how many recent accepted steps the statistics cover (was ``window``).
        warmup_steps: steps that only fill the window at the start of a run (the MAD's standard error is
            about 16 % of the spread from 50 values, 26 % from 20).
        escalate_after: consecutive spikes before the action escalates one rung (was ``patience``).
        snapshot_every_n_steps: take a rollback snapshot after every this many healthy steps (``None``:
            100 when a rollback can happen, else never; ``0``: never, and rollbacks become skips).
        snapshot_device: ``"cpu"`` (default: spares the accelerator's memory) or ``"same"``.
        lr_cooldown_factor: after a rollback, multiply the learning rate by this (``None``: unchanged).
        lr_cooldown_steps: how many applied updates the lower learning rate lasts.
        skip_batches_path: a ``spikes.json`` of an earlier run whose batches are skipped again.
        early_divergence_factor: while the windows warm up, how many times its start the loss must stay at
            (in units of the start's magnitude: a difference, for a loss at or below zero) for 5 steps in a
            row to be an early divergence (``None``: not watched).
        batch_variance_factor: a step whose batch has, in some BatchNorm layer, a variance this many times
            over or under the layer's running variance, or floating inputs (images, audio, features) whose
            mean square is this many times over or under the median of the recent accepted steps' (from 8
            of them on), is an outlier (alert ``batch_statistics_outlier``)
            and gets the action like a spike, even when the loss does not move (BatchNorm normalises a
            batch x1000 away in training mode, but its running statistics keep it). Judged once the
            running statistics hold the run's data (three time constants of the layer's momentum: 30
            steps at PyTorch's 0.1), from the running variance before and after the forward (``None``:
            not judged).
        cooldown_steps: minimum steps between two alerts of the same kind and place. ``0`` by default:
            every spike is an intervention whose alert must be reported.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import LossSpikeGuard

        guard = LossSpikeGuard(action="rollback", lr_cooldown_factor=0.5)
        Trainer(callbacks=[guard]).fit(model)
        print(guard.dropped_steps, guard.rollbacks, guard.records)
    """

    charts = CHARTS

    error_type = LossSpikeError
    skip_cause = "loss_spike"
    allowed_actions = ("skip", "rollback", "warn", "raise")
    #: 0.x names: ``window`` was a count of steps here and of sampled steps in DeadReLUMonitor, and
    #: ``patience`` counted spikes before an escalation here, checks before an alert elsewhere
    renamed_args = {"window": "window_steps", "patience": "escalate_after"}

    # what a run remembers (a checkpoint holds it: a resumed run judges on as it would have)
    #: "<loss|grad_norm><suffix>" (and "inputs") -> the recent accepted steps' values
    windows: RunField[dict[str, deque[float]]] = RunField(dict, load=_windows)
    records: RunField[list[SpikeRecord]] = RunField(list, save=_records_saved, load=_records_loaded)
    dropped_steps: RunField[int] = RunField(
        int, key="counters.dropped_steps", old_keys=("counters.skipped_steps",)
    )
    rollbacks: RunField[int] = RunField(int, key="counters.rollbacks")
    streak: RunField[int] = RunField(int, key="counters.streak")
    judged: RunField[int] = RunField(int, key="counters.judged")
    cooldown_left: RunField[int] = RunField(int, key="counters.cooldown_left")
    #: healthy judged steps since the last spike
    calm: RunField[int] = RunField(int, key="counters.calm")
    #: a rollback was made and the run has not yet earned a new snapshot
    probation: RunField[bool] = RunField(bool)
    #: manual optimization: a streak of spikes per optimizer
    manual_streaks: RunField[Streaks] = RunField(Streaks)
    #: the step being gathered; its ``full`` (the most samples a step has had) outlives the runs
    _step: RunField[StepInputs] = RunField(StepInputs, per_run=False)
    #: the early-divergence watch (a checkpoint from before the rule: as far along as its judged steps)
    _early: RunField[EarlyWatch] = RunField(
        from_settings=lambda g: EarlyWatch(g.early_divergence_factor, min(g.warmup_steps, g.window_steps)),
        if_missing=lambda g: {"seen": g.judged},
    )
    last_scores: RunField[dict[str, SpikeScore]] = RunField(dict, key=None)

    def __init__(
        self,
        *,
        action: Literal["skip", "rollback", "warn", "raise"] = "skip",
        loss_threshold: float | None = 6.0,
        grad_norm_threshold: float | None = 6.0,
        min_ratio: float = 2.0,
        window_steps: int = 128,
        warmup_steps: int = 50,
        escalate_after: int = 3,
        snapshot_every_n_steps: int | None = None,
        snapshot_device: Literal["cpu", "same"] = "cpu",
        lr_cooldown_factor: float | None = None,
        lr_cooldown_steps: int = 100,
        skip_batches_path: str | None = None,
        early_divergence_factor: float | None = 6.0,
        batch_variance_factor: float | None = 100.0,
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
        self.window_steps: int = check_int("window_steps", window_steps, 8)
        self.warmup_steps: int = check_int("warmup_steps", warmup_steps, 8)
        self.escalate_after: int = check_int("escalate_after", escalate_after, 1)
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
        self.early_divergence_factor = check_float(
            "early_divergence_factor", early_divergence_factor, 1.0, low_open=True, allow_none=True
        )
        self.batch_variance_factor = check_float(
            "batch_variance_factor", batch_variance_factor, 1.0, low_open=True, allow_none=True
        )
        self._skip: set[tuple[int, int]] = set()
        self._forget()

    def _forget(self) -> None:
        """What lives within one fit only: the rollback point and the step being gathered."""
        self._snapshot: TrainingSnapshot | None = None
        self._step.clear()  # keeps `full`, the most samples a step has had
        self._outcome: str | None = None  # this step: "calm", "applied" (a warned spike) or "dropped"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
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
        if self.action != "warn" or self.batch_variance_factor is not None:
            # what the forward writes: put back on a dropped step, and the batch's BatchNorm statistics
            keep_step_buffers(trainer, pl_module, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._step.add_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        manual = not pl_module.automatic_optimization
        step = self._step.take(trainer, manual)
        self._outcome = "applied"
        read = read_step_values(
            trainer,
            pl_module,
            optimizer,
            loss=None if manual else step.loss,  # manual: no telling which optimizer a loss belongs to
            grad_norm=self.grad_norm_threshold is not None,
            short=step.short,
            batch_variance=self._batch_variance(trainer, manual),
            inputs=None if self.batch_variance_factor is None else step.inputs,
        )  # the one transfer (and collective) of the step, on every path
        if step.replay:  # a batch an earlier run recorded: its update is dropped again, unjudged
            self._drop_replayed(trainer, optimizer, step.batches, read.values)
        elif not read.finite:
            self._outcome = "dropped"  # NaN/inf: the GradScaler's skip or NaNSentinel's finding, no spike
        elif not read.short:
            suffix = f"@{optimizer_index(trainer, optimizer)}" if manual else ""
            judged = self._judge(step.batches, read.values, suffix)
            if self._early.active and "loss" in read.values and self._early.observe(read.values["loss"]):
                self._on_early_divergence(trainer, optimizer, read.values["loss"])
            outliers = self._outliers(read.values)
            if judged.verdict == "spike" or outliers:
                self._on_spike(trainer, optimizer, judged, outliers)
            else:
                self._on_calm(trainer, judged)

    def _outliers(self, values: dict[str, float]) -> dict[str, float]:
        """How far out the batch's statistics are, for those past ``batch_variance_factor``: its BatchNorm
        batch variance over the running one (``"batch_variance"``), its inputs' mean square over the
        median of the recent accepted steps' (``"inputs"``, from :data:`_INPUTS_WARM` of them on)."""
        factor, out = self.batch_variance_factor, {}
        if batch_variance_outlier(values.get("batch_variance"), factor):
            out["batch_variance"] = values["batch_variance"]
        window = self.windows.get("inputs")
        if "inputs" in values and window is not None and len(window) >= _INPUTS_WARM:
            level = statistics.median(window)  # 0: inputs that are mostly all-zero have no scale to judge
            if level > 0 and batch_variance_outlier(values["inputs"] / level, factor):
                out["inputs"] = values["inputs"] / level
        return out

    def _batch_variance(self, trainer: pl.Trainer, manual: bool) -> Tensor | None:
        """The step's largest BatchNorm batch-variance ratio (``|log10|``), on the device, once its
        running statistics hold the run's data; ``None`` when not judged."""
        kept = None if manual or self.batch_variance_factor is None else step_buffers(trainer)
        if kept is None or trainer.global_step < kept.warm_after:
            return None
        return kept.batch_variance_ratio()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        outcome, self._outcome = self._outcome, None
        if not pl_module.automatic_optimization:
            self._step.clear()  # the batch's optimizers have all stepped
            return
        if outcome is None:
            return
        if outcome != "dropped":
            self._count_down_lr(trainer)
        if outcome == "calm" and not self.cooldown_left and self._snapshot_due():
            self._snapshot = rollback_point(pl_module, trainer, self.snapshot_device)
            self.streak, self.probation = 0, False

    # ------------------------------------------------------------------ one step
    def _judge(self, batches: list[int], values: dict[str, float], suffix: str) -> _Judged:
        """Score the judged values against their windows; a spike needs warm windows."""
        thresholds = {"loss": self.loss_threshold, "grad_norm": self.grad_norm_threshold}
        scores: dict[str, SpikeScore] = {}
        warm = True
        for key, value in values.items():
            if thresholds.get(key) is None:  # not judged by a window (the batch's BatchNorm statistics)
                continue
            window = self.windows.setdefault(key + suffix, deque(maxlen=self.window_steps))
            scores[key] = spike_score(value, window)
            warm &= len(window) >= min(self.warmup_steps, self.window_steps)
        self.last_scores = scores
        self.judged += 1
        verdict = step_verdict(scores, thresholds, self.min_ratio) if warm else "calm"
        return _Judged(batches=batches, values=values, scores=scores, suffix=suffix, verdict=verdict)

    def _on_calm(self, trainer: pl.Trainer, judged: _Judged) -> None:
        """A healthy step: its values join their windows and the streak ends (not while on probation)."""
        for key, score in judged.scores.items():
            self.windows[key + judged.suffix].append(score.value)
        if "inputs" in judged.values:  # what the run's inputs look like, for the next batches' statistics
            self.windows.setdefault("inputs", deque(maxlen=self.window_steps)).append(judged.values["inputs"])
        self.calm += 1
        if judged.manual:
            self.manual_streaks.miss(judged.suffix)
        elif not self.probation:  # after a rollback the streak lasts until the run earns a new snapshot
            self.streak = 0
        self._outcome = "applied" if judged.verdict == "excursion" else "calm"  # no rollback point after it
        self._log_scalars(trainer, judged.scores, force=False)

    def _on_spike(
        self, trainer: pl.Trainer, optimizer: Any, judged: _Judged, outliers: dict[str, float]
    ) -> None:
        """A spike (or a batch whose statistics are ``outliers``): one more in its streak, the action that
        streak has escalated to, a record, an alert, and the action carried out."""
        streak = self._lengthen_streak(judged)
        can_roll_back = self._snapshot is not None and not judged.manual
        action = escalated_action(self.action, streak, self.escalate_after, can_roll_back)
        self.dropped_steps += action != "warn"
        values = {k: v for k, v in judged.values.items() if k not in ("batch_variance", "inputs")}
        values.update(outliers)
        record_spike(
            trainer, self.records, batches=judged.batches, values=values, scores=judged.scores, action=action
        )
        self._log_scalars(trainer, judged.scores, force=True)
        spiked = Spiked(
            step=int(trainer.global_step),
            spike=judged.verdict == "spike",
            action=action,
            values=values,
            scores=judged.scores,
            streak=streak,
        )
        self.run_rules(trainer, STEP_RULES, spiked, then=lambda _: self._act(trainer, optimizer, action))

    def _on_early_divergence(self, trainer: pl.Trainer, optimizer: Any, loss: float) -> None:
        """The loss has stayed far above the run's start: say so, with the learning rate; raise under
        ``action="raise"``. Nothing is dropped: before the warm-up ends no good state exists to return to."""
        groups = getattr(optimizer, "param_groups", None) or [{}]
        diverged = Diverged(
            step=int(trainer.global_step),
            first=self._early.first,
            loss=loss,
            factor=self.early_divergence_factor or 0.0,
            lr=group_lr(groups[0]),
        )
        self.run_rules(trainer, EARLY_RULES, diverged, then=self._early_action(trainer))

    def _early_action(self, trainer: pl.Trainer) -> Callable[[list[Alert]], None]:
        """After an early divergence: ``action="raise"`` raises; nothing else is done (nothing dropped)."""

        def act(alerts: list[Alert]) -> None:
            if self.action == "raise":
                message = alerts[0].message if alerts else "early divergence (within the cooldown)"
                self.apply_action(trainer, "raise", error=LossSpikeError(message, alerts))

        return act

    def _lengthen_streak(self, judged: _Judged) -> int:
        """The spike's place in its streak: the optimizer's own under manual optimization, else the run's
        (which also ends the calm)."""
        if judged.manual:
            return self.manual_streaks.hit(judged.suffix)
        self.streak, self.calm = self.streak + 1, 0
        return self.streak

    def _act(self, trainer: pl.Trainer, optimizer: Any, action: str) -> None:
        """The (possibly escalated) ``action`` on this step, as every callback applies it
        (:meth:`~lightning_gradguard.core.base.GradGuardCallback.apply_action`): raise with the last alert;
        or drop the update (and roll back); or (``"warn"``) let it be applied."""
        last = self.alerts[-1:]
        error = LossSpikeError(last[0].format() if last else "loss spike", last)
        self.apply_action(trainer, action, alerts=last, optimizer=optimizer, error=error)
        if action in ("skip", "rollback"):
            self._outcome = "dropped"

    @override
    def roll_back(self, trainer: pl.Trainer, optimizer: Any) -> None:
        if self._snapshot is not None:
            self._roll_back(trainer, optimizer, self._snapshot)

    def _roll_back(self, trainer: pl.Trainer, optimizer: Any, snapshot: TrainingSnapshot) -> None:
        """Restore the rollback point, go on probation and start the LR cool-down (when one is set)."""
        snapshot.restore(mid_step=True)  # taken outside any cool-down: the schedule's own LRs
        self.rollbacks += 1
        self.probation = True
        if self.lr_cooldown_factor is not None:
            factor = self.lr_cooldown_factor
            rescale_learning_rates(trainer, optimizer, lambda v: v * factor)
            self.cooldown_left = self.lr_cooldown_steps

    def _drop_replayed(
        self, trainer: pl.Trainer, optimizer: Any, batches: list[int], values: dict[str, float]
    ) -> None:
        """Drop the update of a step whose batch an earlier run's ``spikes.json`` names, and record it."""
        skip_update(trainer, optimizer, self.skip_cause)
        self._outcome = "dropped"
        self.dropped_steps += 1
        record_spike(trainer, self.records, batches=batches, values=values, scores={}, action="replayed")

    def _count_down_lr(self, trainer: pl.Trainer) -> None:
        """One applied update of the LR cool-down less; at its end, the schedule's own learning rate."""
        if not self.cooldown_left or self.lr_cooldown_factor is None:
            return
        self.cooldown_left -= 1
        if self.cooldown_left == 0:
            factor = self.lr_cooldown_factor
            rescale_learning_rates(trainer, trainer.optimizers[0], lambda v: v / factor)

    def _snapshot_due(self) -> bool:
        """Whether a calm step that ended outside a cool-down is followed by a new rollback point."""
        return snapshot_due(
            self.judged,
            self.warmup_steps,
            self.snapshot_every_n_steps,
            streak=self.streak,
            calm=self.calm,
            probation=self.probation,
            have=self._snapshot is not None,  # not in a checkpoint: a resumed run takes one at once
        )

    def _log_scalars(self, trainer: pl.Trainer, scores: dict[str, SpikeScore], force: bool) -> None:
        """``spike/*`` on Lightning's logging steps (and, with ``force``, at a spike): z-scores, counters."""
        at = log_step(trainer)
        if not (force or on_logging_step(at, logging_interval(trainer))):
            return
        metrics = {SPIKE.tag(f"{k}_zscore"): s.zscore for k, s in scores.items() if math.isfinite(s.zscore)}
        metrics |= {
            SPIKE.tag("skipped_steps"): float(self.dropped_steps),
            SPIKE.tag("rollbacks"): float(self.rollbacks),
        }
        _emit.log_scalars(trainer, metrics, at)

    @property
    def skipped_steps(self) -> int:
        """Deprecated: :attr:`dropped_steps` (``skipped_steps`` is the GradScaler's count, in NaNSentinel)."""
        warnings.warn(
            "LossSpikeGuard.skipped_steps is deprecated: use dropped_steps (the updates the guard dropped)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.dropped_steps
