"""The overfit-one-batch check on one batch: the trial, the findings, the fallback, the verdict.

:func:`run_overfit_check` is what :class:`~lightning_gradguard.OverfitBatchSanity` runs on the first
batch (drawn, cut and restored afterwards by the callback): it trains on the batch with the user's
optimizer (:func:`~lightning_gradguard.monitors.preflight.overfit_trial.train_on_batch`), collects the findings
(:mod:`~lightning_gradguard.monitors.preflight.findings`, :mod:`~lightning_gradguard.monitors.preflight.diagnosis`), and
when the target was missed, tries ``Adam(fallback_lr)`` from the same weights to tell a slow LR from a
broken pipeline. The settings come from the callback as an :class:`OverfitSettings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.core.batch import batch_size_of
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.trial import configured_lr
from lightning_gradguard.functional.overfit import at_floor, still_learning
from lightning_gradguard.monitors.preflight.diagnosis import (
    chance_loss,
    failed_finding,
    initial_loss_finding,
    labels_of,
    not_shrinking,
)
from lightning_gradguard.monitors.preflight.findings import OverfitResult, batch_mixing, parameter_findings
from lightning_gradguard.monitors.preflight.overfit_trial import choose_optimizer, randomness, train_on_batch

__all__ = ["OverfitSettings", "run_overfit_check"]


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


def run_overfit_check(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, settings: OverfitSettings
) -> OverfitResult:
    """Train on ``batch`` until the loss reaches the target, and say what was found on the way.

    The model, the optimizer and the RNG states are left changed: the caller restores them.
    """
    named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    params = [p for _, p in named]
    optimizer = choose_optimizer(trainer, params, settings.fallback_lr)
    configured_lr(optimizer)
    start = [p.detach().clone() for p in params]
    n = batch_size_of(batch) or 0
    pl_module.train()
    drawn = randomness(trainer, pl_module, batch, n)  # before any hook is left on the model
    frozen = drawn == "inputs"
    pl_module.train()
    curve = train_on_batch(
        trainer,
        pl_module,
        batch,
        params,
        optimizer,
        max_steps=settings.max_steps,
        target_loss=settings.target_loss,
        frozen=frozen,
        batch_size=n,
        labels_of=(lambda out: labels_of(batch, out, n, settings.num_classes)[1]) if n else None,
        inspect=True,
    )
    if curve.stopped == "no_loss":
        warn_once(
            trainer,
            "overfit_batch_no_loss",
            "OverfitBatchSanity: training_step returned no loss; the check was skipped.",
        )
    losses, grad_norms, logits, reached = curve.losses, curve.grad_norms, curve.logits, curve.reached
    steps = max(len(losses) - 1, 0)
    initial = losses[0] if losses else math.nan
    final = losses[-1] if losses else math.nan
    # the target was missed, but at the last step every sample is classified correctly with a loss
    # below the initial one: memorised, above a loss floor (label smoothing)
    memorised = curve.memorised and not reached and final < initial
    result = OverfitResult(
        passed=False,
        reached_target=reached,
        memorised=memorised,
        steps=steps,
        initial_loss=initial,
        final_loss=final,
        target_loss=settings.target_loss(initial),
        losses=losses,
        grad_norms=grad_norms,
        seconds=0.0,
        num_samples=n,
        optimizer=type(optimizer).__name__,
        randomness=drawn,
    )
    if not losses:
        result.passed = True  # nothing could be checked (warned above)
        return result
    findings = result.findings
    if steps > 0:
        nonzero = curve.nonzero_grad
        nonzero_grad = nonzero.cpu() if nonzero is not None else torch.zeros(len(params), dtype=torch.bool)
        findings.extend(
            parameter_findings(
                optimizer,
                names,
                params,
                start,
                curve.got_grad,
                nonzero_grad,
                curve.called,
                settings.ignore_parameters,
            )
        )
    if settings.check_initial_loss and trainer.global_step == 0:  # a resumed model is not a fresh one
        findings.extend(
            initial_loss_finding(
                batch,
                logits,
                initial,
                n,
                num_classes=settings.num_classes,
                tolerance=settings.initial_loss_tolerance,
            )
        )
    c, labels = labels_of(batch, logits, n, settings.num_classes)
    if c is not None and labels is not None:
        result.num_classes = c
        result.chance_loss = chance_loss(labels, c)
    if reached or memorised:
        findings.extend(not_shrinking(grad_norms, initial, final))
    if settings.check_batch_mixing:
        findings.extend(batch_mixing(trainer, pl_module, batch))
    result.converged = not (reached or memorised) and at_floor(
        losses, grad_norms, result.chance_loss, result.num_classes
    )
    learned = reached or memorised or result.converged
    if not learned and any(o is optimizer for o in trainer.optimizers):
        # The user's optimizer missed the target. Is it the pipeline, or only the optimizer's LR (a
        # fine-tuning LR such as 2e-5, a warm-up the check does not run)? Try again from the same
        # weights with Adam(fallback_lr): if that memorises the batch, the model, the loss and the data
        # are fine, and the finding is a warning.
        learned = _fallback_trial(trainer, pl_module, batch, params, start, labels, frozen, result, settings)
        result.fallback_reached = learned
    if not (reached or memorised or result.converged):
        failed = failed_finding(result)
        if result.fallback_reached:
            failed.severity = "warning"
            failed.message += (
                f" Adam(lr={settings.fallback_lr:g}) from the same weights did memorise it: the model, loss "
                "and data can learn; your optimizer's LR is slow for memorising one batch."
            )
            failed.hint = (
                "Fine for a small fine-tuning LR or a run that relies on warm-up; otherwise raise the LR "
                "(an LR range test tells how far) or max_steps."
            )
        elif still_learning(losses, result.chance_loss, result.num_classes):
            learned = True
            failed.severity = "warning"
            failed.message += (
                " The loss was still falling steadily and had at least halved: the model learns from its "
                "inputs, more slowly than the check's budget."
            )
            failed.hint = (
                "Objectives such as a VAE's ELBO or a regression on unnormalised targets take longer "
                "to memorise a batch; raise max_steps (or the LR) to see the target reached."
            )
        findings.append(failed)
    result.passed = learned and not any(f.severity == "error" for f in findings)
    return result


def _fallback_trial(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    params: list[nn.Parameter],
    start: list[Tensor],
    labels: Tensor | None,
    frozen: bool,
    result: OverfitResult,
    settings: OverfitSettings,
) -> bool:
    """Train from ``start`` with ``Adam(fallback_lr)``: does it reach the target or memorise the batch?"""
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    n = result.num_samples
    curve = train_on_batch(
        trainer,
        pl_module,
        batch,
        params,
        torch.optim.Adam(params, lr=settings.fallback_lr),
        max_steps=settings.max_steps,
        target_loss=settings.target_loss,
        frozen=frozen,
        batch_size=n,
        labels_of=(lambda _: labels) if labels is not None and n else None,
        inspect=False,
    )
    if curve.stopped != "budget":  # reached the target, or diverged, or no loss
        return curve.reached
    initial, final = curve.losses[0], curve.losses[-1]
    return at_floor(curve.losses, curve.grad_norms, result.chance_loss, result.num_classes) or (
        curve.memorised and final < initial
    )
