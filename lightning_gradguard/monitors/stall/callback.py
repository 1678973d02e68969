r"""
StallDetector
=============

Says when a run has quietly stopped learning (no crash, no NaN: the loss just stops moving) and names
the likely cause: an LR the scheduler drove to ~0 or never let rise, an LR that jumped, updates that are
zero or clipped to nothing, a weight decay that shrinks the weights away, 16-bit weights whose updates are
rounded away, a loss stuck at the chance level (of a classifier, or of a sequence model's tokens), a loader
sorted by class. The rules are
:mod:`lightning_gradguard.monitors.stall.rules`; the measuring is
:mod:`lightning_gradguard.monitors.stall.measure`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import fields, replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback, guarded
from lightning_gradguard.core.cadence import DENSE_STEPS, log_step, optimizer_index
from lightning_gradguard.core.lr import adaptive_eps, orthogonalized_share
from lightning_gradguard.core.runstate import RunField, nothing
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.stats import StepStats, step_stats
from lightning_gradguard.core.validate import check_float, check_int
from lightning_gradguard.monitors.stall.ahead import (
    HORIZON,
    Ahead,
    decay_rates,
    dropout_rates,
    lr_ahead,
)
from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds
from lightning_gradguard.monitors.stall.evidence import NO_EVIDENCE, LabelLean
from lightning_gradguard.monitors.stall.measure import (
    StallProbe,
    StallReading,
    has_low_precision,
    lr_configured,
    lr_now,
)
from lightning_gradguard.monitors.stall.rules import RULES, Judged, evidence_wanted
from lightning_gradguard.monitors.stall.state import StallState
from lightning_gradguard.monitors.stall.tags import CHARTS, STALL


class StallDetector(GradGuardCallback):
    r"""Alert when training has stopped learning, with the likely cause and the fix.

    It keeps, on the device and without a sync, the sum of the training losses, and on the host the LR
    of every step (free: it is a Python number). Every ``check_every_n_steps`` optimizer steps it takes
    one check: the update/weight ratio of every layer (a snapshot of the weights before the update, as
    GradientNormLogger takes it, from the shared statistics) and, under a decoupled weight decay, the
    decay's part of that update and the rest of it; the gradient norm before clipping and the norm of the
    gradient the optimizer used, the mean loss since the last check and its standard error, and the class
    counts of the batch (class-index targets) or its token counts (token targets ``(batch, T)``, padding
    ``-100`` left out), read in one transfer (one collective under DDP: losses, labels and tokens are
    summed over the ranks, so every rank reaches the same verdict). When the model has 16-bit trainable
    weights (``precision="bf16-true"`` / ``"16-true"``; decided once, at the start of training), the check
    also samples their gradients at the update sample's entries and counts the entries with a non-zero
    gradient whose value did not change (their update was rounded away), in the same transfer.

    Alerts (each at most once per run; see :mod:`~lightning_gradguard.monitors.stall.rules` for the rules):
    ``no_update``, ``clipped_updates``, ``lr_decayed`` / ``updates_collapsed``, ``weight_decay_collapse``,
    ``update_below_precision``, ``chance_level``, ``loss_plateau``, ``lr_jump``, ``warmup_never_ends``,
    ``warmup_missing``, ``dropout_too_high``, ``sorted_labels``, all of severity warning (a dropout rate
    of 0.8 to 0.9 is an INFO line).

    At the start of a fresh run it also reads what the settings say before they act: the LR of every
    step ahead (a copy of the schedulers stepped as Lightning steps them, over the planned run or 2,000
    steps), the rate at which a decoupled weight decay will shrink the weights at that schedule's peak,
    and every dropout rate. The first checks judge them: the dropout rates at step 0; the schedule
    (``lr_decayed``, ``warmup_never_ends``, ``weight_decay_collapse``) once the first ``patience``
    checked steps used the LRs read ahead (step 2 at the defaults).

    Args:
        action: what a finding does (every stall finding, although its severity is warning):
            ``"warn"`` (default) reports it, ``"stop"`` ends the run (``trainer.should_stop``), ``"raise"``
            raises :class:`~lightning_gradguard.GradGuardError` on every rank.
        check_every_n_steps: take a check every this many optimizer steps (Lightning's logging rule:
            ``(step + 1) % n == 0``, and step 0), after the dense start.
        dense_steps: check every step while the step is below this (a fault visible at step 0, a clip
            that shrinks every update or weights that never move, is named within a few steps).
        patience: consecutive checks a condition must hold.
        warmup_steps: no ``chance_level`` / ``loss_plateau`` verdict before this step.
        num_classes: the number of classes, for the chance level when the targets cannot be read from
            the batch (``None``: from the labels seen; without labels the chance rule is off); for token
            targets, the vocabulary size ``V`` (``None``: the largest token id seen plus one).
        collapse_factor: an update ratio this many times below its highest level has collapsed.
        clip_factor: a used gradient this many times smaller than the raw one is clipped to nothing.
        lr_jump_factor: an LR this many times the configured maximum is a jump.
        warmup_lr_fraction: an LR never above this fraction of the configured one is a warm-up that never
            ends.
        plateau_checks: checks without a new best loss before ``loss_plateau``.
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import StallDetector

        Trainer(callbacks=[stall := StallDetector()]).fit(model)
        print(stall.alerts)
    """

    charts = CHARTS

    allowed_actions = ("warn", "stop", "raise")
    state_key_args = ("check_every_n_steps",)
    acted_severities = frozenset({"warning", "error", "critical"})

    def __init__(
        self,
        *,
        action: Literal["warn", "stop", "raise"] = "warn",
        check_every_n_steps: int = 10,
        dense_steps: int = DENSE_STEPS,
        patience: int = 3,
        warmup_steps: int = 40,
        num_classes: int | None = None,
        collapse_factor: float = 100.0,
        clip_factor: float = 100.0,
        lr_jump_factor: float = 10.0,
        warmup_lr_fraction: float = 0.05,
        plateau_checks: int = 30,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.check_every_n_steps: int = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.dense_steps: int = check_int("dense_steps", dense_steps, 0)
        self.patience: int = check_int("patience", patience, 1)
        self.warmup_steps: int = check_int("warmup_steps", warmup_steps, 0)
        self.num_classes: int | None = check_int("num_classes", num_classes, 2, allow_none=True)
        self.collapse_factor: float = check_float("collapse_factor", collapse_factor, 1.0, low_open=True)
        self.clip_factor: float = check_float("clip_factor", clip_factor, 1.0, low_open=True)
        self.lr_jump_factor: float = check_float("lr_jump_factor", lr_jump_factor, 1.0, low_open=True)
        self.warmup_lr_fraction: float = check_float(
            "warmup_lr_fraction", warmup_lr_fraction, 0.0, 1.0, low_open=True
        )
        self.plateau_checks: int = check_int("plateau_checks", plateau_checks, 1)
        # set in on_train_start, for the fit: the Trainer's optimizers, whether it optimizes automatically,
        # 16-bit weights (the checks measure their rounding), an optimizer that divides its step by the
        # gradient's running size, an orthogonalized one, attention layers, what the settings said
        self._optimizers: list[Any] = []
        self._automatic, self._low_precision, self._adaptive = True, False, False
        self._orthogonalized, self._attention = False, False
        self._ahead: Ahead | None = None

    def thresholds(self) -> StallThresholds:
        """The rules' thresholds: this detector's arguments, the defaults for the rest."""
        names = {f.name for f in fields(StallThresholds)}
        return StallThresholds(**{k: v for k, v in vars(self).items() if k in names})

    # ------------------------------------------------------------------ run state (core.runstate)
    #: what the rules remember (:mod:`~lightning_gradguard.monitors.stall.rules` judges each check on it);
    #: the checkpoint key of 0.1
    state: RunField[StallState] = RunField(
        from_settings=lambda d: StallState(d.thresholds(), d.num_classes), key="rules"
    )
    lr_max: RunField[float] = RunField(float)  # the largest LR any step used so far
    lr_configured: RunField[float] = RunField(float)
    _lr_used: RunField[float] = RunField(float, key=None)  # the LR of the current step
    #: the losses since the last check (saved: a checkpoint between two checks loses none of them)
    _probe: RunField[StallProbe] = RunField(StallProbe, key="pending")
    #: the outputs' lean toward the labels, measured on every training batch while a chance rule may still
    #: judge (``_leaning``): the evidence that a plateau at chance is learning (its hook leaves the model at
    #: the end of each fit)
    _lean: RunField[LabelLean] = RunField(LabelLean, key="pending_profile")
    _leaning: RunField[bool] = RunField(lambda: True, key=None)
    _checking: RunField[bool] = RunField(bool, key=None)  # the current optimizer step is a check
    _checked_at: RunField[int] = RunField(lambda: -1, key=None)
    #: the checked step's statistics, until it is read
    _check_stats: RunField[StepStats | None] = RunField(nothing, key=None)
    last_logged: RunField[dict[str, float]] = RunField(dict, key=None)
    #: what the latest check measured (per-layer update ratios, clip ratio, loss, labels, LRs)
    last_check: RunField[StallCheck | None] = RunField(nothing, key=None)

    @override
    @guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.lr_configured = max(self.lr_configured, lr_configured(trainer))  # schedulers exist now
        self._optimizers, self._automatic = trainer.optimizers, pl_module.automatic_optimization
        self._low_precision = has_low_precision(pl_module)  # float32 models: no extra work, ever
        self._adaptive = any(adaptive_eps(o) is not None for o in trainer.optimizers)
        self._orthogonalized = any(orthogonalized_share(o) >= 0.5 for o in trainer.optimizers)
        self._attention = any(_is_attention(m) for m in pl_module.modules())
        self._read_ahead(trainer, pl_module)

    @guarded
    def _read_ahead(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """What the settings say before the first step (a fresh run only): the schedule read ahead, the
        weight decay's rate, the dropout rates; the first check judges them."""
        self._ahead = None
        if trainer.global_step > 0 or not trainer.optimizers:
            return
        estimated = trainer.estimated_stepping_batches
        planned = int(estimated) if estimated != float("inf") else None
        optimizer = trainer.optimizers[0]
        steps = min(planned, HORIZON) if planned is not None else HORIZON
        lrs = lr_ahead(trainer, pl_module, optimizer, steps) if self._automatic else []
        self._ahead = Ahead(
            lrs=lrs,
            planned=planned,
            decay=decay_rates(optimizer, lrs),
            trainable=sum(p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad),
            dropouts=dropout_rates(pl_module),
        )

    # Every step: the LR in use and the loss (a plain read, and one detach); the rest on check steps only.
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._lr_used = lr_now(self._optimizers)  # the LR this step will use (a scheduler changes it after)
        self.lr_max = max(self.lr_max, self._lr_used)
        at = log_step(trainer)
        if self.due(at) and at != self._checked_at:
            self._note_labels(trainer, batch)  # the labels of every micro-batch of the check's step
        if self._leaning and self._lean.off is None:  # a head it cannot measure costs no call per step
            self._lean_batch(trainer, pl_module, batch)

    @guarded
    def _note_labels(self, trainer: pl.Trainer, batch: Any) -> None:
        self._probe.note_labels(batch, self.num_classes)

    @guarded
    def _lean_end(self, trainer: pl.Trainer) -> None:
        self._lean.batch_end()  # (on the first batch: the head is chosen here)

    @guarded
    def _lean_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._lean.batch_start(pl_module, batch)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        at = log_step(trainer)
        if self.due(at) and at != self._checked_at:
            self._start_check(trainer, pl_module, optimizer, at)

    @guarded
    def _start_check(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, at: int
    ) -> None:
        if optimizer_index(trainer, optimizer) != 0:
            return
        self._checking, self._checked_at = True, at
        stats = step_stats(trainer, pl_module, optimizer)
        self._probe.start(stats, self._automatic, optimizer, self._low_precision)
        self._check_stats = stats  # the step's facts: whether a callback dropped its update

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._leaning and self._lean.off is None:
            self._lean_end(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            scale = trainer.accumulate_grad_batches if self._automatic else 1
            self._probe.add_loss(loss if scale == 1 else loss * scale)  # Lightning divided it by the scale
        if self._checking:
            self._check(trainer, pl_module)

    @guarded
    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The check: one transfer, the rules, the alerts and the action."""
        self._checking = False
        reading = self._probe.read(trainer, pl_module.device, self._lean.queue if self._leaning else None)
        if reading.labels:
            self._lean.check_width(len(reading.labels))
        self.lr_configured = max(self.lr_configured, lr_configured(trainer))
        stats, self._check_stats = self._check_stats, None
        if (stats is not None and stats.dropped is not None) or reading.scaler_skipped:
            # NaNSentinel or LossSpikeGuard dropped it, or the GradScaler skipped it (its first steps while
            # the scale backs off from 65536): no update of the run's to judge
            reading = _without_update(reading)
        planned = trainer.estimated_stepping_batches
        check = StallCheck(
            step=self._checked_at,
            lr=self._lr_used,
            lr_max=self.lr_max,
            lr_configured=self.lr_configured,
            loss=reading.loss,
            loss_stderr=reading.loss_stderr,
            update_ratios=reading.update_ratios,
            update_total=reading.update_total,
            weight_norms=reading.weight_norms,
            decay=reading.decay,
            decay_groups=reading.decay_groups,
            clip_ratio=reading.clip_ratio,
            labels=reading.labels,
            tokens=reading.tokens,
            rounding=reading.rounding,
            planned_steps=int(planned) if planned != float("inf") else None,
            adaptive=self._adaptive,
            orthogonalized=self._orthogonalized,
            attention=self._attention,
            ahead=self._ahead,
            class_profile=reading.class_profile,
        )
        self.last_check = check
        self.state.update(check)
        self._emit(trainer, check)
        # each kind once per run; the symptoms read the causes named before them (``state.fired``)
        evidence = Judged(state=self.state, check=check)
        self.run_rules(trainer, RULES, evidence, step=check.step, admit=self.state.first_time)
        # from the state alone (the same on every rank, so that the ranks queue the same transfer)
        self._leaning = evidence_wanted(self.state)
        self._lean.want(self._leaning)
        if self._lean.error is not None:
            warn_once(trainer, "stall:evidence", f"StallDetector: {self._lean.off}; {NO_EVIDENCE}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._lean.close()  # no hook of ours stays on the model after the fit

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._lean.close()

    def _emit(self, trainer: pl.Trainer, c: StallCheck) -> None:
        """The check's numbers on the dashboard (rank zero writes)."""
        ratios = sorted(v for v in c.update_ratios.values() if math.isfinite(v))
        values = {
            STALL.tag("loss"): c.loss,
            STALL.tag("chance_level"): self.state.chance(),
            STALL.tag("update_ratio_median"): statistics.median(ratios) if ratios else None,
            STALL.tag("clip_ratio"): c.clip_ratio,
            STALL.tag("label_lean"): lean[0] if (lean := self.state.leaning()) is not None else None,
            STALL.tag("label_lean_p"): lean[1] if lean is not None else None,
        }
        self.last_logged = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        _emit.log_scalars(trainer, self.last_logged, c.step)


def _without_update(reading: StallReading) -> StallReading:
    """A check whose update another callback dropped (a skip or a rollback) or the GradScaler skipped: its
    update measurements are the drop's, not the run's (every weight unchanged: no update, nothing rounded
    away), so they are not judged; the loss and the labels still are."""
    return replace(reading, update_ratios={}, update_total=None, decay={}, clip_ratio=None, rounding=None)


def _is_attention(module: nn.Module) -> bool:
    """An attention layer: ``nn.MultiheadAttention``, or a module whose class is named one (Hugging Face's
    ``BertSelfAttention``, ``LlamaAttention``, ``ViTAttention``, ...)."""
    return isinstance(module, nn.MultiheadAttention) or "Attention" in type(module).__name__
