r"""
NaNSentinel
===========

Fails a run the moment a loss, gradient or parameter turns NaN/inf: on every rank, before the optimizer
applies the poisoned update, with a forensic report that says where the value was born. This module holds
the callback: its hooks, and the failure path in its order (the verdict, the report and its files while
the callback is still as it was before the bad step, then the alert and the skip counters, then the
action). What it sees of a step is :mod:`lightning_gradguard.monitors.nan.measure`; the verdict and the
rules with their checks (the alerts' words) are :mod:`lightning_gradguard.monitors.nan.rules`; the report
and its files are :mod:`lightning_gradguard.monitors.nan.report`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.alerts import Alert, NonFiniteError
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback
from lightning_gradguard.core.buffers import keep_step_buffers, restore_step_buffers
from lightning_gradguard.core.cadence import every_nth
from lightning_gradguard.core.runstate import RunField
from lightning_gradguard.core.sharding import is_sharded, unsupported_reason
from lightning_gradguard.core.skips import skip_update
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.validate import check_bool, check_float, check_int, check_path
from lightning_gradguard.monitors.nan import measure as _nan
from lightning_gradguard.monitors.nan.measure import Flags, MicroBatch, SkipCounters
from lightning_gradguard.monitors.nan.report import Filed, ReportSettings, build_report, write_report
from lightning_gradguard.monitors.nan.rules import NONFINITE_PARAMETER, RULES, Detection, decide


def _skips_saved(_: Any, skips: SkipCounters) -> dict[str, int]:
    return {"skipped_steps": skips.skipped_steps, "consecutive_skips": skips.consecutive_skips}


def _skips_loaded(_: Any, state: dict[str, Any]) -> SkipCounters:
    return SkipCounters(
        skipped_steps=int(state.get("skipped_steps", 0)),
        consecutive_skips=int(state.get("consecutive_skips", 0)),
    )


class NaNSentinel(GradGuardCallback):
    r"""Stop at the first NaN/inf loss, gradient or parameter, with nothing lost.

    Checks, at almost no cost (one fused finiteness reduction and one host read per optimizer step):

    * the loss, in ``on_before_backward`` (every micro-batch);
    * the gradients, in ``on_before_optimizer_step``, from the statistics every gradguard callback shares
      (no extra pass over the gradients when GradientNormLogger also runs);
    * optionally the parameters after the update, every ``check_parameters_every_n_steps``.

    The loss and gradient verdicts of one step are read from the device together, so a step costs one
    sync. With ``accumulate_grad_batches > 1`` the loss of each micro-batch is judged as it comes (one
    read per micro-batch), so a non-finite loss names its own micro-batch (report, ``batch.pt``, replay);
    the accumulated gradients are judged once, at the optimizer step, from the shared statistics. An
    optimizer step yields at most one finding: once a micro-batch is found poisoned, the rest of the step
    is not judged again. When every loss of the step was finite but its gradients are not, the report
    lists the step's micro-batches; ``check_micro_batches=True`` names the one whose backward made the
    first NaN/inf (it judges the gradients summed so far after every micro-batch: one extra pass over
    the gradients per micro-batch; non-finite values persist in a sum, so the first micro-batch after
    which they are non-finite is the one).

    On detection (alert ``nonfinite_loss``, ``nonfinite_gradient`` or ``nonfinite_parameter``, severity
    critical) every rank takes the same decision at the same point (one collective) and, with the
    default ``action="raise"``, raises :class:`~lightning_gradguard.NonFiniteError` before the optimizer
    step: the weights, and the buffers the bad step's forward wrote (BatchNorm's running statistics, put
    back from a copy kept at the start of every step), are those after the last good step. Beside the
    run's logs, in
    ``nan_report/step_<k>/``, it writes ``report.json`` (step, kind, non-finite parameters in model
    order with counts, loss, learning rates, the last total gradient norms, precision, origin), the
    offending batch (``batch.pt``) and ``last_good.ckpt``, a checkpoint Lightning can resume from. The
    origin comes from replaying the batch on copies of the good weights: forward hooks name the first
    module whose output went non-finite (or say that the batch itself was bad); when the forward pass is
    clean, the backward replay names the op that made the first NaN/inf gradient and the line that
    created it.

    Under 16-mixed with a GradScaler, non-finite gradients are the scaler's business: the step is
    skipped and counted (``skipped_steps``), not failed. ``loss_scale_collapse`` fires when the scale
    drops below ``loss_scale_floor`` or ``max_consecutive_skips`` steps in a row are skipped.

    Args:
        action: ``"raise"`` (default), ``"stop"``, ``"warn"`` or ``"skip"``. ``"skip"`` drops the
            poisoned update and goes on: every gradient of the optimizer is set to ``None``, which
            ``torch.optim`` optimizers treat as "no update" (Adam's step count and moments stay as
            they were), exactly like the GradScaler's own skip, and the buffers the step's forward wrote
            (BatchNorm's running statistics) go back to what they were at its start
            (:mod:`lightning_gradguard.core.buffers`); the LR scheduler still advances.
            ``"stop"`` drops the poisoned update the same way and sets ``trainer.should_stop``: the run
            ends with the weights of the last good step (Lightning ends it after the current batch and
            a validation run, if any; with ``accumulate_grad_batches > 1`` possibly before the
            accumulation window is complete, and then no update is made at all). Until ``min_epochs``
            / ``min_steps`` are met Lightning keeps training: every poisoned update meanwhile is
            dropped too. ``"warn"`` only reports: the poisoned update is applied. Under
            ``accumulate_grad_batches > 1``, ``"skip"`` and ``"stop"`` drop the update of the whole
            optimizer step that holds the poisoned micro-batch.
        check_loss: check the loss before backward.
        check_gradients: check the gradients before the optimizer step.
        check_parameters_every_n_steps: also check parameters after the update every N steps (0: never).
        report_dir: where reports go (default: ``<log_dir>/nan_report``).
        save_batch: write the offending batch.
        save_checkpoint: write the last-good checkpoint (a collective under DDP: every rank calls it).
        find_origin: replay the batch to find where the value was born (automatic optimization only).
        history_size: how many recent total gradient norms the report lists.
        loss_scale_floor: GradScaler scale below which the scale counts as collapsed.
        max_consecutive_skips: consecutive GradScaler skips that count as a collapse.
        check_micro_batches: under ``accumulate_grad_batches > 1``, also judge the gradients after every
            micro-batch, so a gradient finding names the micro-batch that poisoned them (one extra pass
            over the gradients per micro-batch; off by default).
        cooldown_steps: minimum optimizer steps between two findings of the same kind (default 1000,
            wherever their origin): within it a repeated finding is neither reported nor replayed and
            writes no files, only the action applies (``"raise"`` always reports).

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import NaNSentinel, NonFiniteError

        trainer = Trainer(callbacks=[NaNSentinel()])
        try:
            trainer.fit(model)
        except NonFiniteError as err:
            print(err)              # what, where, step, origin, hint
            print(err.report_dir)   # report.json, batch.pt, last_good.ckpt
    """

    error_type = NonFiniteError
    allowed_actions = ("warn", "stop", "raise", "skip")
    skip_cause = "nan_sentinel"

    #: the GradScaler's skipped steps, in all and in a row (saved as ``skipped_steps``,
    #: ``consecutive_skips``): the report of this run lists this run's steps only
    _skips: RunField[SkipCounters] = RunField(SkipCounters, key="", save=_skips_saved, load=_skips_loaded)
    #: the recent total gradient norms a report lists (on the device until a report reads them)
    norm_history: RunField[_nan.NormRing] = RunField(
        from_settings=lambda s: _nan.NormRing(s.history_size), key=None
    )

    def __init__(
        self,
        *,
        action: Literal["raise", "stop", "warn", "skip"] = "raise",
        check_loss: bool = True,
        check_gradients: bool = True,
        check_parameters_every_n_steps: int = 0,
        report_dir: str | None = None,
        save_batch: bool = True,
        save_checkpoint: bool = True,
        find_origin: bool = True,
        history_size: int = 50,
        loss_scale_floor: float = 1.0,
        max_consecutive_skips: int = 16,
        check_micro_batches: bool = False,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.check_loss = check_bool("check_loss", check_loss)
        self.check_gradients = check_bool("check_gradients", check_gradients)
        self.check_parameters_every_n_steps: int = check_int(
            "check_parameters_every_n_steps", check_parameters_every_n_steps, 0
        )
        self.report_dir: str | None = check_path("report_dir", report_dir)
        self.save_batch = check_bool("save_batch", save_batch)
        self.save_checkpoint = check_bool("save_checkpoint", save_checkpoint)
        self.find_origin = check_bool("find_origin", find_origin)
        self.history_size: int = check_int("history_size", history_size, 1)
        self.loss_scale_floor: float = check_float("loss_scale_floor", loss_scale_floor, 0.0, low_open=True)
        self.max_consecutive_skips: int = check_int("max_consecutive_skips", max_consecutive_skips, 1)
        self.check_micro_batches = check_bool("check_micro_batches", check_micro_batches)
        self.last_report_dir: str | None = None
        self._step = _nan.StepTrack()
        #: one process, automatic optimization, no GradScaler, no sharding: a step without accumulation
        #: is judged by one read of its loss and total gradient norm (see :meth:`on_train_start`)
        self._one_read = False
        self._scaler = False  # a GradScaler is active (its skipped steps leave the buffers as they were)

    @property
    def skipped_steps(self) -> int:
        """Steps the GradScaler skipped under 16-mixed (non-finite gradients), in this run."""
        return self._skips.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Steps the GradScaler skipped in a row, up to the last one."""
        return self._skips.consecutive_skips

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        # a fit never starts inside an optimizer step (one stopped mid-accumulation leaves this behind)
        self._step = _nan.StepTrack()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide once per fit whether a step can be judged by one read of its loss and gradient norm: the
        general path's guarantees need nothing more there (no rank to agree with, no scaler to ask, no
        shard to add up, no micro-batch to name)."""
        self._one_read = (
            trainer.world_size == 1
            and pl_module.automatic_optimization
            and self.check_loss
            and self.check_gradients
            and not self.check_micro_batches
            and active_scaler(trainer) is None
            and not is_sharded(trainer)
            and unsupported_reason(trainer) is None
        )
        self._scaler = active_scaler(trainer) is not None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step.batch, self._step.batch_idx = batch, batch_idx
        if (
            self.action != "warn" or self._scaler
        ):  # a step it or the GradScaler drops leaves them as they were
            keep_step_buffers(trainer, pl_module, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._one_read and trainer.accumulate_grad_batches == 1 and self._step.pending_loss is None:
            self._step.pending_loss = loss.detach()  # judged with the gradients, in one read
            return  # (a second backward in the step, as LBFGS's closure makes, takes the general path)
        step, loss = self._step, loss.detach()
        previous = step.backward(loss)
        if not (pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1):
            if self.check_loss:  # judged with the gradients, in on_before_optimizer_step
                step.flag_loss(loss)
            return
        # Accumulation: judge each micro-batch now, so the finding names it (and the replay and batch.pt
        # are its own), and at most once per optimizer step.
        first = step.open_micro()
        if step.poisoned is not None:  # this step has its finding; its update is dealt with at the step
            return
        earlier = None
        if self.check_micro_batches and self.check_gradients and not first and active_scaler(trainer) is None:
            # the gradients summed over the step's earlier micro-batches (local ones under DDP's no_sync)
            earlier = _nan.earlier_check(trainer, pl_module, loss.device)
        if self.check_loss or earlier is not None:
            checked = _nan.loss_check([loss]) if self.check_loss else None
            flags = _nan.read_flags(trainer, loss=checked, earlier=earlier)
            self._decide(trainer, None, flags, step.micro(), previous)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        stats = step_stats(trainer, pl_module, optimizer)
        total = stats.grad_total(2.0) if self.check_gradients and stats.unsupported is None else None
        if total is not None and not total.sharded:  # the statistics every gradguard callback shares
            self.norm_history.push(total.values, stats.step)
        pending = self._step.pending_loss
        one_loss = pending is not None and not self._step.losses
        if one_loss and total is not None and _nan.both_finite(pending, total.values):  # type: ignore[arg-type]
            self._step.close_healthy()  # the one-read path: a healthy step costs one stack and one read
            return
        closed = self._step.close()
        if closed.poisoned is not None:
            # Accumulation: a micro-batch of this step was found poisoned and reported already (on every
            # rank alike, so no rank waits in a collective here). No second finding; drop the update.
            if self.action in ("skip", "stop"):
                skip_update(trainer, optimizer, "nan_sentinel")
            return
        if total is None and not closed.losses:
            return
        current = closed.micro()
        if len(closed.step_batches) > 1 and not self.check_micro_batches:
            # every loss of the step was finite (judged as they came): which micro-batch's backward made
            # the gradients non-finite is not known, and the last one is not to be blamed for it
            current = MicroBatch(batch=None, batch_idx=None, loss=None, among=tuple(closed.step_batches))
        grads = None if total is None else _nan.grads_check(total.values, stats.grads)
        loss, scaler = _nan.loss_check(closed.losses), active_scaler(trainer)
        flags = _nan.read_flags(trainer, loss=loss, grads=grads, scaler=scaler, total=total)
        if flags.total is not None:  # sharded: the ranks' shares were summed with the flags
            self.norm_history.push(flags.total, stats.step)
        self._decide(trainer, optimizer, flags, current, None)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        current, stepped = self._step.end_batch()
        every = self.check_parameters_every_n_steps
        # parameters change only where an optimizer stepped: not after the other micro-batches of a step
        if not (every and stepped and every_nth(trainer.global_step, every)):
            return
        if _nan.params_nonfinite(trainer, pl_module):  # one collective, one host read
            micro = current or MicroBatch(batch=batch, batch_idx=batch_idx, loss=None)
            found = Detection(NONFINITE_PARAMETER, culprit=0, micro=micro, can_replay=False)
            self._fail(trainer, found, self._skips)

    # ------------------------------------------------------------------ the verdict
    def _decide(
        self, trainer: pl.Trainer, opt: Any, flags: Flags, current: MicroBatch, previous: MicroBatch | None
    ) -> None:
        """Act on the flags (reduced across ranks, read once): the same verdict on every rank.

        ``opt`` is ``None`` for a micro-batch judged under accumulation (``on_before_backward``), and
        ``previous`` the micro-batch before ``current``: see
        :func:`~lightning_gradguard.monitors.nan.rules.decide`, which takes the decision.
        """
        verdict = decide(
            flags,
            current=current,
            previous=previous,
            optimizer=opt,
            counters=self._skips,
            loss_scale_floor=self.loss_scale_floor,
            max_consecutive_skips=self.max_consecutive_skips,
        )
        if verdict.detection is None:
            if verdict.counters.skipped_steps > self._skips.skipped_steps:  # the GradScaler drops this step
                restore_step_buffers(trainer)
            self._skips = verdict.counters
            return
        if opt is None:  # under accumulation: the rest of this optimizer step is not judged
            self._step.poisoned = verdict.detection.micro
        self._fail(trainer, verdict.detection, verdict.counters)

    # ------------------------------------------------------------------ the failure path and the action
    def _fail(self, trainer: pl.Trainer, found: Detection, counters: SkipCounters) -> None:
        """Report what was ``found`` (in this rank's micro-batch), take the skip ``counters``, then act.

        Within the cooldown (a "warn"/"skip"/"stop" run that keeps meeting NaNs) no replay, no gather, no
        files: only the action. Every rank has the same cooldown, so all skip alike. ``action="raise"``
        always builds the report (the error carries it); its files too, unless within the cooldown.
        """
        if self.action == "raise" or (self.action != "warn" and found.optimizer is not None):
            # the bad step is dropped: what its forwards wrote goes, before last_good.ckpt (not before a
            # micro-batch's backward under accumulation, which reads BatchNorm's buffers: at the step)
            restore_step_buffers(trainer)
        due = self.would_report(found.rule.kind, int(trainer.global_step))
        filed = self._file(trainer, found, counters, due) if due or self.action == "raise" else None
        self._skips = counters  # last_good.ckpt is written: the counters may count this step now
        act = self._stop(trainer, found, filed)
        if (
            due and filed is not None
        ):  # its alert, in its rule's words; one per cooldown, wherever it was born
            self.run_rules(
                trainer, RULES, filed.report, step=filed.report.step, cooldown=lambda f: f.kind, then=act
            )
        else:
            act([])

    def _stop(
        self, trainer: pl.Trainer, found: Detection, filed: Filed | None
    ) -> Callable[[list[Alert]], None]:
        """The action on what was ``found``, once its alert is recorded (:meth:`run_rules`' last word)."""

        def act(_: list[Alert]) -> None:
            error = None
            if filed is not None and self.action == "raise":  # "raise" always has its report
                alerts = [a for a in self.alerts if a.kind == found.rule.kind][-1:]
                error = NonFiniteError(filed.message(), alerts, filed.report.to_dict(), filed.folder)
            # "stop" ends the run after this batch (see the class docstring) without the poisoned update; a
            # NaN found in the weights after a step (nonfinite_parameter) has no update left to drop
            poisoned = found.rule is not NONFINITE_PARAMETER
            optimizer = found.optimizer if poisoned else None  # accumulation, no optimizer: at the step
            self.apply_action(trainer, self.action, optimizer=optimizer, poisoned=poisoned, error=error)

        return act

    def _file(self, trainer: pl.Trainer, found: Detection, counters: SkipCounters, write: bool) -> Filed:
        """Build the report of what was ``found``; with ``write``, write its files (its alert is recorded
        after them, by :meth:`_fail`).

        The files come first: ``last_good.ckpt`` holds this callback as it was before the bad step, without
        this finding in the cooldown (a resumed run that meets the same NaN reports it in full) and with
        the skip counters before the step.
        """
        settings = ReportSettings(
            action=self.action,
            check_loss=self.check_loss,
            find_origin=self.find_origin,
            report_dir=self.report_dir,
            save_batch=self.save_batch,
            save_checkpoint=self.save_checkpoint,
            counters=counters,
        )
        history = self.norm_history.records()
        report = build_report(trainer, trainer.lightning_module, found, settings, history)
        if not write:
            return Filed(report=report, folder=None)
        filed = write_report(trainer, report, found.micro, settings)
        self.last_report_dir = filed.folder
        return filed
