"""The overfit trial: train on one batch until the loss reaches a target, recording what the check needs.

:func:`train_on_batch` is the one training loop of :class:`~lightning_gradguard.OverfitBatchSanity`: the
user's optimizer on the first batch, and ``Adam(fallback_lr)`` again from the same weights when that
missed. Each step is :func:`~lightning_gradguard.core.trial.trial_loss` (``training_step`` under the
precision context, ``self.log`` swallowed, optionally re-seeded), a plain ``backward`` and the optimizer's
``step``: the LR scheduler is not stepped, gradient clipping and loss scaling are not applied. The stop
rule: a loss at or below the target after the first step, a non-finite loss, or ``max_steps`` steps.
On the way it records the loss curve, the gradient norms, which parameters got a (non-zero) gradient,
which modules ran and, for a classifier, whether the batch is memorised. :func:`randomness` tells
whether ``training_step`` draws random numbers, and where they act.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.trial import loss_of, quiet_logging, seed_all, training_step_of, trial_loss
from lightning_gradguard.monitors.preflight.modules import CalledModules, LeafOutputs

__all__ = ["FROZEN_SEED", "TrialCurve", "choose_optimizer", "randomness", "train_on_batch"]

#: the seed every step of the check is re-seeded with when ``training_step``'s randomness is frozen
FROZEN_SEED = 0x5EED

Stop = Literal["target", "diverged", "no_loss", "budget"]


@dataclass(kw_only=True)
class TrialCurve:
    """What one trial on the batch recorded.

    Attributes:
        losses: the loss at each evaluation (``steps + 1`` values).
        grad_norms: the total gradient 2-norm at each step (``grad_norms[k]`` is the gradient at
            ``losses[k]``).
        stopped: why the trial ended: ``"target"`` (a loss at or below the target after the first step),
            ``"diverged"`` (a non-finite loss), ``"no_loss"`` (``training_step`` returned none),
            ``"budget"`` (``max_steps`` steps taken).
        memorised: at the last evaluation after the first, every sample was classified right (argmax of
            the logits equals the label); only followed for a classifier.
        logits: the output followed at the first evaluation (the last leaf output with the batch's
            leading dimension), or ``None``.
        labels: the labels of the batch, for a classifier, else ``None``.
        got_grad: per parameter (host), whether it received a gradient at some step.
        nonzero_grad: per parameter (on the device), whether its gradient was non-zero at some step;
            ``None`` when no step had a gradient.
        called: the modules that ran in the first ``training_step``.
    """

    losses: list[float]
    grad_norms: list[float]
    stopped: Stop
    memorised: bool
    logits: Tensor | None
    labels: Tensor | None
    got_grad: Tensor
    nonzero_grad: Tensor | None
    called: set[str]

    @property
    def reached(self) -> bool:
        """The loss reached the target."""
        return self.stopped == "target"


def choose_optimizer(
    trainer: pl.Trainer, params: list[nn.Parameter], fallback_lr: float
) -> torch.optim.Optimizer:
    """The user's first optimizer, or ``Adam(fallback_lr)`` over ``params`` when there is none."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    real = [o for o in trainer.optimizers if not isinstance(o, _MockOptimizer)]
    if real:
        if len(real) > 1:
            warn_once(
                trainer,
                "overfit_batch_many_optimizers",
                "OverfitBatchSanity trains with the first optimizer only.",
            )
        return real[0]
    return torch.optim.Adam(params, lr=fallback_lr)


def train_on_batch(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    max_steps: int,
    target_loss: Callable[[float], float],
    frozen: bool,
    batch_size: int,
    labels_of: Callable[[Tensor | None], Tensor | None] | None,
    inspect: bool,
) -> TrialCurve:
    """Train on ``batch`` with ``optimizer`` until the loss is at or below ``target_loss(initial)``.

    Args:
        trainer: the trainer (its precision plugin's train-step context is used).
        pl_module: the model, in train mode.
        batch: the batch, as ``training_step`` takes it.
        params: the trainable parameters (their gradients are recorded).
        optimizer: the optimizer that steps (``LBFGS`` gets a closure).
        max_steps: the most optimizer steps.
        target_loss: the target, from the initial loss.
        frozen: re-seed every generator with :data:`FROZEN_SEED` before each ``training_step``: one fixed
            batch and objective when ``training_step`` draws random numbers that act on the inputs.
        batch_size: the batch's leading dimension (outputs with it are followed).
        labels_of: from the first evaluation's output, the labels to follow memorisation with (``None``:
            not a classifier we understand); ``None``: outputs are not followed at all.
        inspect: record which parameters get a (non-zero) gradient and which modules run in the first
            ``training_step`` (the user's optimizer; the fallback needs the curve only).
    """
    got_grad = torch.zeros(len(params), dtype=torch.bool)
    nonzero_flags: Tensor | None = None
    losses: list[float] = []
    grad_norms: list[float] = []
    leaf = LeafOutputs(pl_module, batch_size) if labels_of is not None else None
    calls = CalledModules(pl_module) if inspect else None
    logits: Tensor | None = None
    labels: Tensor | None = None
    memorised = False
    stopped: Stop = "budget"
    try:
        for step in range(max_steps + 1):
            optimizer.zero_grad(set_to_none=True)
            for p in params:
                p.grad = None
            # frozen: the same random draws in every step: one fixed batch, one fixed objective
            loss = trial_loss(trainer, pl_module, batch, seed=FROZEN_SEED if frozen else None)
            if calls is not None:
                calls.remove()
            if leaf is not None and labels_of is not None:
                out = None if leaf.last is None else leaf.last.detach()
                leaf.last = None
                if step == 0:
                    logits = out
                    labels = labels_of(logits)
                    if labels is None or logits is None or logits.dim() != 2:
                        leaf.remove()  # not a classifier we understand: no accuracy to follow
                        leaf = None
                elif (
                    labels is not None
                    and out is not None
                    and logits is not None
                    and out.shape == logits.shape
                ):
                    memorised = bool((out.argmax(dim=1) == labels).all())
            if loss is None:
                stopped = "no_loss"
                break
            value = float(loss.detach().float())
            losses.append(value)
            if not math.isfinite(value):
                stopped = "diverged"
                break
            if step > 0 and value <= target_loss(losses[0]):
                stopped = "target"
                break
            if step == max_steps:
                break
            loss.backward()
            grads = [p.grad for p in params]
            present = [g for g in grads if g is not None]
            grad_norms.append(float(torch.nn.utils.get_total_norm(present)) if present else 0.0)
            if inspect:  # flags stay on the device: one host read at the end, not one per tensor
                got_grad, nonzero_flags = _note_grads(grads, present, got_grad, nonzero_flags)
            if isinstance(optimizer, torch.optim.LBFGS):

                def closure() -> Tensor:
                    optimizer.zero_grad()
                    if frozen:
                        seed_all(FROZEN_SEED)
                    with quiet_logging(pl_module):
                        out = loss_of(training_step_of(pl_module, batch))
                    assert out is not None
                    out.backward()
                    return out

                optimizer.step(closure)
            else:
                optimizer.step()
    finally:  # never leave a hook on the user's model, even when training_step fails
        if leaf is not None:
            leaf.remove()
        if calls is not None:
            calls.remove()
    return TrialCurve(
        losses=losses,
        grad_norms=grad_norms,
        stopped=stopped,
        memorised=memorised,
        logits=logits,
        labels=labels,
        got_grad=got_grad,
        nonzero_grad=nonzero_flags,
        called=calls.called if calls is not None else set(),
    )


def _note_grads(
    grads: list[Tensor | None], present: list[Tensor], got_grad: Tensor, nonzero: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Add this step's gradients to the flags: received one (host), non-zero (on the device)."""
    with torch.no_grad():
        got_grad |= torch.tensor([g is not None for g in grads])
        if present:
            flags = torch.zeros(len(grads), dtype=torch.bool, device=present[0].device)
            for i, g in enumerate(grads):
                if g is not None:
                    flags[i] = g.ne(0).any().to(flags.device)
            nonzero = flags if nonzero is None else nonzero | flags
    return got_grad, nonzero


def randomness(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, n: int) -> str:
    """Does ``training_step`` draw random numbers, and where do they act?

    Calls it twice on the batch under two different seeds. ``"none"``: the same loss. ``"inputs"``:
    the model's output changed (noise added to the inputs, a diffusion timestep, mixup, augmentation
    in ``training_step``, dropout). ``"targets"``: the same output but another loss (labels drawn or
    shuffled at random, sampled negatives).
    """
    seen: list[tuple[float, Tensor | None]] = []
    for seed in (1, 2):
        leaf = LeafOutputs(pl_module, n) if n else None
        try:
            loss = trial_loss(trainer, pl_module, batch, seed=seed)
        finally:
            if leaf is not None:
                leaf.remove()
        if loss is None:
            return "none"
        out = None if leaf is None or leaf.last is None else leaf.last.detach()
        seen.append((float(loss.detach().float()), out))
    (a, out_a), (b, out_b) = seen
    if a == b or (math.isnan(a) and math.isnan(b)):
        return "none"
    if out_a is not None and out_b is not None and torch.equal(out_a, out_b):
        return "targets"
    return "inputs"
