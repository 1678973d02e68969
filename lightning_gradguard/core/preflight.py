"""What the pre-flight checks share: what they find, when a check runs, and how it ends.

A :class:`PreflightFinding` is one specific problem a check found: an
:class:`~lightning_gradguard.alerts.Finding` of one of the check's declared rules (its kind, severity,
message, hint, numbers) with the names concerned, the place of its alert. :class:`PreflightCheck` is the
base of :class:`~lightning_gradguard.OverfitBatchSanity` and :class:`~lightning_gradguard.GradientCheck`.
A check runs in ``on_train_start`` of a fit that starts a new run, where it applies
(:meth:`PreflightCheck.applies`: not under ``fast_dev_run``, not on a fit that resumes from a checkpoint
or continues the Trainer's run, automatic optimization only (:func:`manual_optimization_note` says so
once), not under a sharded strategy such as FSDP or DeepSpeed, where each check says why in
``sharded_reason``). It ends with :meth:`PreflightCheck.conclude`
on every rank, even one that could not run it: the verdict is reduced across ranks (one collective), so
when one rank fails every rank acts alike (the ranks that passed say "failed on another rank", with a
closing finding of their own) and none is left waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gradguard.alerts import Alert, Finding, SanityCheckError, Severity
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.collective import reduce_any
from lightning_gradguard.core.sharding import is_sharded
from lightning_gradguard.core.state import (
    info_once,
    raised_by_us,
    skipped_for_fast_dev_run,
    strict_mode,
    warn_once,
)

log = logging.getLogger("lightning_gradguard")

#: the hint of an alert that says the check failed on another rank
OTHER_RANKS = "See the alerts of the other ranks."


#: how many names an alert lists before it says how many more there are
MAX_LISTED = 8


@dataclass(frozen=True)
class PreflightFinding(Finding):
    """One specific problem a check found: a rule of the check that holds, and the parameters (or
    samples) concerned. Its ``kind``, ``severity``, ``message``, ``hint`` and ``data`` are those of every
    :class:`~lightning_gradguard.alerts.Finding`; ``severity`` ``"error"`` fails the check, ``"warning"``
    and ``"info"`` are reported only.

    Attributes:
        names: the parameters (or samples) concerned; the first :data:`MAX_LISTED` are the alert's place
            (``where``), unless the check states one.
    """

    names: list[str] = field(default_factory=list)

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        listed = ", ".join(self.names[:MAX_LISTED]) + (", ..." if len(self.names) > MAX_LISTED else "")
        if self.where is None and listed:
            object.__setattr__(self, "where", listed)


#: the one line that says what does not run under manual optimization, and what to run instead
MANUAL_OPTIMIZATION = (
    "OverfitBatchSanity, GradientCheck and LRFinderPlus need automatic optimization (training_step returning "
    "the loss): this module steps its optimizers itself, so they do not run; the training monitors do. "
    "Instead: lightning_gradguard.gradient_check(model, batch, loss_fn) checks its gradients, "
    "Trainer(overfit_batches=1) shows whether it can memorise one batch, and lr_find() on a version with "
    "automatic optimization suggests a learning rate."
)


def manual_optimization_note(trainer: pl.Trainer) -> None:
    """Say once per Trainer, as INFO, that the pre-flight checks and the range test skip manual optimization
    (a setup, not a fault: a GAN steps two optimizers by design) and what the user can run instead."""
    info_once(trainer, "manual_optimization", MANUAL_OPTIMIZATION)


class PreflightCheck(GradGuardCallback):
    """Base of the pre-flight checks: once per run where it applies, one verdict reduced across ranks.

    Args:
        action: ``"raise"`` (a failure raises :class:`~lightning_gradguard.SanityCheckError` on every
            rank), ``"warn"`` or ``"stop"``.
    """

    error_type = SanityCheckError
    allowed_actions = ("raise", "warn", "stop")
    #: why the check cannot run under a sharded strategy (FSDP, DeepSpeed): the middle of its warning
    sharded_reason = "a rank holds only pieces of the sharded parameters"

    def __init__(self, *, action: str = "raise") -> None:
        super().__init__(action=action, cooldown_steps=0)

    def applies(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether the check runs in this fit: not under ``fast_dev_run`` (a smoke test); only when the fit
        starts a new run (:meth:`fresh_run`: no ``ckpt_path``, the Trainer at step 0), not when it resumes
        from a checkpoint or continues the Trainer's run (a second ``fit()`` after raising ``max_epochs``),
        which says so in one INFO line; only under automatic optimization (else one INFO line for every
        check, :func:`manual_optimization_note`) and not under a sharded strategy (FSDP, DeepSpeed) (else a
        one-time warning naming the strategy; the run goes on)."""
        name = type(self).__name__
        if skipped_for_fast_dev_run(trainer, name, "the pre-flight check"):
            return False
        if not self.fresh_run(trainer):
            if trainer.is_global_zero:
                resumed = getattr(trainer, "ckpt_path", None) is not None
                log.info(
                    "%s: this fit %s at step %d; the check runs only when a run starts (step 0): skipped.",
                    name,
                    "resumes from a checkpoint" if resumed else "continues the Trainer's run",
                    trainer.global_step,
                )
            return False
        if not pl_module.automatic_optimization:
            manual_optimization_note(trainer)
            return False
        if is_sharded(trainer):  # before the model is touched: nothing to restore, no collective to match
            warn_once(trainer, f"{name}_sharded", self._sharded_message(type(trainer.strategy).__name__))
            return False
        return True

    def could_not_run(self, trainer: pl.Trainer, err: Exception) -> None:
        """Say once that the check was skipped because it raised ``err``. A model or loader the check
        cannot drive is the user's: one warning, and training goes on. A failure of our own code
        (:func:`~lightning_gradguard.core.state.raised_by_us`: an API the installed torch lacks, a wrong
        call) says so and, under ``GRADGUARD_STRICT=1``, is raised: never a quiet "skipped"."""
        name, error = type(self).__name__, f"{type(err).__name__}: {err}"
        if not raised_by_us(err):
            warn_once(trainer, f"{name}_error", f"{name} could not run the check ({error}); skipped.")
            return
        if strict_mode():
            raise err
        warn_once(
            trainer,
            f"{name}_internal",
            f"{name} failed inside lightning_gradguard ({error}); the check was skipped and training goes "
            "on. Please report this to lightning_gradguard with your torch and Lightning versions.",
        )

    def _sharded_message(self, strategy: str) -> str:
        """The one-time warning of the check skipped under a sharded strategy."""
        return (
            f"{type(self).__name__} does not run under {strategy}: {self.sharded_reason}. The check was "
            "skipped; training goes on untouched. Run it on the same model with one device or under DDP (a "
            "short fit with devices=1), or call lightning_gradguard.gradient_check(model, batch, loss_fn) "
            "on the unwrapped model."
        )

    def report_findings(self, trainer: pl.Trainer, findings: Sequence[Finding]) -> list[Alert]:
        """Report every finding (:meth:`report_finding`): its kind and severity, where: its names (the first
        few)."""
        alerts: list[Alert] = []
        for f in findings:
            alert = self.report_finding(trainer, f)
            if alert is not None:
                alerts.append(alert)
        return alerts

    def conclude(
        self,
        trainer: pl.Trainer,
        alerts: list[Alert],
        *,
        failed_here: bool,
        on_failure: Finding | None,
        passed_line: str | None,
        on_success: Finding | None = None,
    ) -> None:
        """End the check on every rank alike: reduce the verdict (one collective), report, then act.

        Args:
            trainer: the trainer.
            alerts: what this rank already reported (its findings).
            failed_here: whether the check failed on this rank (``False`` for a rank that could not run it).
            on_failure: the closing finding, reported as an error when the check failed on some rank
                (``None``: nothing more).
            passed_line: logged (INFO, global rank zero) when it passed on every rank: silence after
                success reads as "did it run?" (``None``: nothing, e.g. the check did not run here).
            on_success: the closing finding, reported when it passed on every rank with a reservation:
                at its own severity when that is info (a note, not a reservation), else as a warning.
        """
        if reduce_any(trainer, failed_here):
            if on_failure is not None:
                alert = self.report_finding(trainer, replace(on_failure, severity="error"))
                if alert is not None:
                    alerts.append(alert)
        else:
            if on_success is not None:
                severity: Severity = "info" if on_success.severity == "info" else "warning"
                self.report_finding(trainer, replace(on_success, severity=severity))
            if passed_line is not None and trainer.is_global_zero:
                log.info(passed_line)
        self.act(trainer, alerts)
