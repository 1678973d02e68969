"""The overfit-one-batch check on one batch: the trial, the findings, the fallback, the verdict.

:func:`run_overfit_check` is what :class:`~lightning_gradguard.OverfitBatchSanity` runs on the first
batch (drawn, cut and restored afterwards by the callback), with the callback's arguments as an
:class:`OverfitSettings`. It trains on the batch with the user's optimizer
(:func:`~lightning_gradguard.monitors.overfit.trial.train_on_batch`), collects the findings of its
rules (:mod:`~lightning_gradguard.monitors.overfit.rules`, run from their declarations where the check
reaches their phase) and, when the target was missed, tries ``Adam(fallback_lr)`` from the same weights
to tell a slow LR from a broken pipeline. The verdict: the batch was learned (the target reached, the
batch memorised, the loss on a floor, or a slow learner as
:func:`~lightning_gradguard.monitors.overfit.rules.missed_target` judges it) and no finding is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.alerts import Finding, judge
from lightning_gradguard.core.batch import batch_size_of
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.trial import configured_lr
from lightning_gradguard.functional.overfit import at_floor
from lightning_gradguard.monitors.overfit.diagnosis import chance_loss, labels_of
from lightning_gradguard.monitors.overfit.findings import OverfitResult, ParameterRecord
from lightning_gradguard.monitors.overfit.modules import used_outside_training
from lightning_gradguard.monitors.overfit.rules import (
    OUTCOME_RULES,
    OVERFIT_FAILED,
    TRIAL_RULES,
    Outcome,
    Trial,
    failed_finding,
    parameter_findings,
)
from lightning_gradguard.monitors.overfit.trial import (
    TrialCurve,
    TrialPlan,
    choose_optimizer,
    probe_updates,
    randomness,
    train_on_batch,
)


@dataclass(frozen=True, kw_only=True)
class OverfitSettings:
    """What :class:`~lightning_gradguard.OverfitBatchSanity` was configured with (see its arguments)."""

    max_steps: int
    target: float
    target_mode: str
    num_classes: int | None
    check_initial_loss: bool
    initial_loss_tolerance: float
    check_batch_mixing: bool
    ignore_parameters: list[str]
    fallback_lr: float

    def target_loss(self, initial: float) -> float:
        """The loss to reach, from the initial loss."""
        return self.target * initial if self.target_mode == "relative" else self.target


@dataclass(frozen=True, kw_only=True)
class _Check:
    """One run of the check: what it trains on, and what it fixed before the first step.

    Attributes:
        names: the qualified names of the trainable parameters.
        params: the trainable parameters.
        start: their values before the first step (the fallback starts again from them).
        optimizer: the user's first optimizer, or ``Adam(fallback_lr)`` when there is none.
        randomness: what ``training_step``'s random draws change (see ``OverfitResult.randomness``).
        warm_up: a scheduler had scaled some group's LR below its configured one (see
            ``OverfitResult.warm_up``).
        plan: the trial with the user's optimizer.
    """

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    batch: Any
    settings: OverfitSettings
    names: list[str]
    params: list[nn.Parameter]
    start: list[Tensor]
    optimizer: torch.optim.Optimizer
    randomness: str
    warm_up: bool
    plan: TrialPlan


def run_overfit_check(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, settings: OverfitSettings
) -> OverfitResult:
    """Train on ``batch`` until the loss reaches the target, and say what was found on the way.

    The model, the optimizer and the RNG states are left changed: the caller restores them.
    """
    check = _prepare(trainer, pl_module, batch, settings)
    curve = train_on_batch(trainer, pl_module, batch, check.params, check.optimizer, check.plan)
    if curve.stopped == "no_loss":
        warn_once(
            trainer,
            "overfit_batch_no_loss",
            "OverfitBatchSanity: training_step returned no loss; the check was skipped.",
        )
    result = _result(check, curve)
    if not result.losses:
        result.passed = True  # nothing could be checked (warned above)
        return result
    c, labels = labels_of(batch, curve.logits, result.num_samples, settings.num_classes)
    if c is not None and labels is not None:
        result.num_classes = c
        result.chance_loss = chance_loss(labels, c)
    result.findings.extend(_findings(check, curve, result))
    learned = result.reached_target or result.memorised
    result.converged = not learned and at_floor(
        result.losses, result.grad_norms, result.chance_loss, result.num_classes
    )
    learned = learned or result.converged
    if not learned and any(o is check.optimizer for o in trainer.optimizers):
        # The user's optimizer missed the target. Is it the pipeline, or only the optimizer's LR (a
        # fine-tuning LR such as 2e-5, a warm-up the check does not run)? Try again from the same
        # weights with Adam(fallback_lr): if that memorises the batch, the model, the loss and the data
        # are fine, and the finding is a warning.
        result.fallback_reached = _fallback_trial(check, labels, result)
    # learned: did the loss blow up on the way (a too-high LR that landed on the target)? Not: why not?
    outcome = judge(OUTCOME_RULES, Outcome(result=result, learned=learned, fallback_lr=settings.fallback_lr))
    result.findings.extend(outcome)
    if not learned:  # the model learns after all (a slow LR or objective) unless overfit_failed is an error
        learned = not any(f.rule is OVERFIT_FAILED and f.severity == "error" for f in outcome)
    result.passed = verdict(result, learned)
    return result


#: what a non-finite loss adds to ``overfit_failed``'s words
_NONFINITE = (
    " The loss is not finite (NaN/inf), so no curve of it shows learning: the check fails whatever the "
    "LR or its schedule."
)
_NONFINITE_HINT = (
    "Find where the first forward overflows: unnormalised inputs (raw 16-bit audio, pixel values in "
    "0-255), float16 (its largest value is 65504: normalise, or train in bf16-mixed or 32-bit), a log or a "
    "division without eps. "
)


def verdict(result: OverfitResult, learned: bool) -> bool:
    """Whether the check passed, from its findings: the batch was ``learned``, no finding is an error, and
    the loss it judged is finite. A non-finite initial or final loss makes ``overfit_failed`` an error (a
    warning about a slow or warmed-up LR cannot stand on NaN), so the verdict never contradicts it."""
    if not (math.isfinite(result.initial_loss) and math.isfinite(result.final_loss)):
        failed: list[Finding] = [f for f in result.findings if f.rule is OVERFIT_FAILED]
        if not failed:
            failed = [failed_finding(result)]
            result.findings.append(failed[0])
        for f in failed:
            if f.severity != "error":
                error = replace(
                    f, severity="error", message=f.message + _NONFINITE, hint=_NONFINITE_HINT + f.hint
                )
                result.findings[result.findings.index(f)] = error
        return False
    return learned and not any(f.severity == "error" for f in result.findings)


def _prepare(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, settings: OverfitSettings
) -> _Check:
    """Fix the parameters, their starting values and the optimizer; find out what ``training_step``
    draws at random (before any hook is left on the model) and plan the trial."""
    named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = choose_optimizer(trainer, params, settings.fallback_lr)
    warm_up = any(_warming_up(group) for group in optimizer.param_groups)
    configured_lr(optimizer)
    start = [p.detach().clone() for p in params]
    n = batch_size_of(batch) or 0
    pl_module.train()
    drawn = randomness(trainer, pl_module, batch, n)
    pl_module.train()
    plan = TrialPlan(
        max_steps=settings.max_steps,
        target_loss=settings.target_loss,
        frozen=drawn == "inputs",
        batch_size=n,
        labels_of=(lambda out: labels_of(batch, out, n, settings.num_classes)[1]) if n else None,
        inspect=True,
    )
    return _Check(
        trainer=trainer,
        pl_module=pl_module,
        batch=batch,
        settings=settings,
        names=[name for name, _ in named],
        params=params,
        start=start,
        optimizer=optimizer,
        randomness=drawn,
        warm_up=warm_up,
        plan=plan,
    )


def _warming_up(group: dict[str, Any]) -> bool:
    """A scheduler has scaled this param group's LR below the one it was configured with."""
    base, lr = group.get("initial_lr"), group.get("lr")
    if not (isinstance(base, (int, float)) and isinstance(lr, (int, float))):
        return False  # no scheduler, or an LR held in a tensor
    return float(lr) < float(base)


def _result(check: _Check, curve: TrialCurve) -> OverfitResult:
    """The result of the user's trial, before the findings and the verdict."""
    losses = curve.losses
    initial = losses[0] if losses else math.nan
    final = losses[-1] if losses else math.nan
    return OverfitResult(
        passed=False,
        reached_target=curve.reached,
        # the target was missed, but at the last step every sample is classified correctly with a loss
        # below the initial one: memorised, above a loss floor (label smoothing)
        memorised=curve.memorised and not curve.reached and final < initial,
        steps=max(len(losses) - 1, 0),
        initial_loss=initial,
        final_loss=final,
        target_loss=check.settings.target_loss(initial),
        losses=losses,
        grad_norms=curve.grad_norms,
        seconds=0.0,
        num_samples=check.plan.batch_size,
        optimizer=type(check.optimizer).__name__,
        randomness=check.randomness,
        warm_up=check.warm_up,
    )


def _findings(check: _Check, curve: TrialCurve, result: OverfitResult) -> list[Finding]:
    """What the user's trial showed besides the loss reaching the target, in the order it is reported: the
    parameter rules, then the rules on the trial
    (:data:`~lightning_gradguard.monitors.overfit.rules.TRIAL_RULES`)."""
    settings, findings = check.settings, []
    if result.steps > 0:
        nonzero = curve.nonzero_grad
        record = ParameterRecord(
            names=check.names,
            params=check.params,
            start=check.start,
            got_grad=curve.got_grad.tolist(),
            nonzero_grad=nonzero.cpu().tolist() if nonzero is not None else [False] * len(check.params),
            called=curve.called,
            probe=lambda targets: probe_updates(
                check.trainer, check.pl_module, check.batch, check.optimizer, targets, check.plan.frozen
            ),
            elsewhere=lambda: used_outside_training(check.pl_module),
        )
        findings.extend(parameter_findings(check.optimizer, record, settings.ignore_parameters))
    trial = Trial(
        result=result,
        batch=check.batch,
        logits=curve.logits,
        trainer=check.trainer,
        pl_module=check.pl_module,
        check_initial_loss=settings.check_initial_loss,
        num_classes=settings.num_classes,
        tolerance=settings.initial_loss_tolerance,
        check_batch_mixing=settings.check_batch_mixing,
    )
    return findings + judge(TRIAL_RULES, trial)


def _fallback_trial(check: _Check, labels: Tensor | None, result: OverfitResult) -> bool:
    """Train from the starting weights with ``Adam(fallback_lr)``: does it reach the target or memorise
    the batch (the classifier's ``labels``, ``None`` for another model)?"""
    with torch.no_grad():
        for p, s in zip(check.params, check.start, strict=True):
            p.copy_(s)
    n = result.num_samples
    plan = replace(
        check.plan, labels_of=(lambda _: labels) if labels is not None and n else None, inspect=False
    )
    adam = torch.optim.Adam(check.params, lr=check.settings.fallback_lr)
    curve = train_on_batch(check.trainer, check.pl_module, check.batch, check.params, adam, plan)
    if curve.stopped != "budget":  # reached the target, or diverged, or no loss
        return curve.reached
    initial, final = curve.losses[0], curve.losses[-1]
    return at_floor(curve.losses, curve.grad_norms, result.chance_loss, result.num_classes) or (
        curve.memorised and final < initial
    )
