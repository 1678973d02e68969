"""The overfit trial: train on one batch until the loss reaches a target, recording what the check needs.

:func:`train_on_batch` is the one training loop of :class:`~lightning_gradguard.OverfitBatchSanity`: the
user's optimizer on the first batch, and ``Adam(fallback_lr)`` again from the same weights when that
missed; a :class:`TrialPlan` says how far it goes and what it records, a :class:`TrialCurve` is what it
recorded. Each step is :func:`~lightning_gradguard.core.trial.trial_loss` (``training_step`` under the
precision context, ``self.log`` swallowed, optionally re-seeded), a plain ``backward`` and the optimizer's
``step``: the LR scheduler is not stepped, gradient clipping and loss scaling are not applied. The stop
rule: a loss at or below the target after the first step, a non-finite loss, or ``max_steps`` steps.
On the way it records the loss curve, the gradient norms, which parameters got a (non-zero) gradient,
which modules ran and, for a classifier, whether the batch is memorised. :func:`choose_optimizer` picks
the user's optimizer; :func:`randomness` tells whether ``training_step`` draws random numbers, and where
they act.
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
from lightning_gradguard.core.trial import trial_loss
from lightning_gradguard.functional.stats import foreach_norms, total_norm
from lightning_gradguard.monitors.overfit.modules import CalledModules, LeafOutputs

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


@dataclass(frozen=True, kw_only=True)
class TrialPlan:
    """How one trial trains on the batch.

    Attributes:
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

    max_steps: int
    target_loss: Callable[[float], float]
    frozen: bool
    batch_size: int
    labels_of: Callable[[Tensor | None], Tensor | None] | None
    inspect: bool


def train_on_batch(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    plan: TrialPlan,
) -> TrialCurve:
    """Train on ``batch`` with ``optimizer`` until the loss is at or below ``plan.target_loss(initial)``.

    Args:
        trainer: the trainer (its precision plugin's train-step context is used).
        pl_module: the model, in train mode.
        batch: the batch, as ``training_step`` takes it.
        params: the trainable parameters (their gradients are recorded).
        optimizer: the optimizer that steps (``LBFGS`` gets a closure).
        plan: how many steps, to what target, and what to record.
    """
    record = _Record(len(params), plan)
    outputs = _Outputs(pl_module, plan.batch_size, plan.labels_of) if plan.labels_of is not None else None
    calls = CalledModules(pl_module) if plan.inspect else None
    stopped: Stop = "budget"
    try:
        for step in range(plan.max_steps + 1):
            optimizer.zero_grad(set_to_none=True)
            for p in params:
                p.grad = None
            # frozen: the same random draws in every step: one fixed batch, one fixed objective
            loss = trial_loss(trainer, pl_module, batch, seed=FROZEN_SEED if plan.frozen else None)
            if calls is not None:
                calls.remove()  # the modules of the first training_step only
            if outputs is not None:
                outputs.see(step)
            if loss is None:
                stopped = "no_loss"
                break
            stop = record.stop(float(loss.detach().float()), step)
            if stop is not None:
                stopped = stop
                break
            loss.backward()
            record.gradients(params)
            _step(trainer, optimizer, pl_module, batch, plan.frozen)
    finally:  # never leave a hook on the user's model, even when training_step fails
        if outputs is not None:
            outputs.remove()
        if calls is not None:
            calls.remove()
    return record.curve(stopped, outputs, calls.called if calls is not None else set())


class _Record:
    """The loss curve, the gradient norms and, when inspecting, the gradient flags of one trial."""

    def __init__(self, num_params: int, plan: TrialPlan) -> None:
        self.plan = plan
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.got_grad = torch.zeros(num_params, dtype=torch.bool)
        self.nonzero: Tensor | None = None

    def stop(self, value: float, step: int) -> Stop | None:
        """Record the loss of the evaluation at ``step``; why the trial ends there, or ``None``: a step."""
        self.losses.append(value)
        if not math.isfinite(value):
            return "diverged"
        if step > 0 and value <= self.plan.target_loss(self.losses[0]):
            return "target"
        return "budget" if step == self.plan.max_steps else None

    def gradients(self, params: list[nn.Parameter]) -> None:
        """Record the gradient norm after ``backward``, and (inspecting) which gradients there are."""
        grads = [p.grad for p in params]
        present = [g for g in grads if g is not None]
        # functional's norms, not torch.nn.utils.get_total_norm: that one first appears in torch 2.6
        self.grad_norms.append(float(total_norm(foreach_norms(present))) if present else 0.0)
        if not self.plan.inspect:
            return
        with torch.no_grad():  # flags stay on the device: one host read at the end, not one per tensor
            self.got_grad |= torch.tensor([g is not None for g in grads])
            if present:
                flags = torch.zeros(len(grads), dtype=torch.bool, device=present[0].device)
                for i, g in enumerate(grads):
                    if g is not None:
                        flags[i] = g.ne(0).any().to(flags.device)
                self.nonzero = flags if self.nonzero is None else self.nonzero | flags

    def curve(self, stopped: Stop, outputs: _Outputs | None, called: set[str]) -> TrialCurve:
        return TrialCurve(
            losses=self.losses,
            grad_norms=self.grad_norms,
            stopped=stopped,
            memorised=outputs is not None and outputs.memorised,
            logits=outputs.logits if outputs is not None else None,
            labels=outputs.labels if outputs is not None else None,
            got_grad=self.got_grad,
            nonzero_grad=self.nonzero,
            called=called,
        )


class _Outputs:
    """Follows a classifier's output through a trial: the logits and labels at the first evaluation, and
    whether the last evaluation classified every sample right (argmax of the logits equals the label)."""

    def __init__(
        self,
        pl_module: pl.LightningModule,
        batch_size: int,
        labels_of: Callable[[Tensor | None], Tensor | None],
    ) -> None:
        self.leaf: LeafOutputs | None = LeafOutputs(pl_module, batch_size)
        self.labels_of = labels_of
        self.logits: Tensor | None = None
        self.labels: Tensor | None = None
        self.memorised = False

    def see(self, step: int) -> None:
        """Take the output of the evaluation at ``step``."""
        if self.leaf is None:
            return
        out = None if self.leaf.last is None else self.leaf.last.detach()
        self.leaf.last = None
        if step == 0:
            self.logits = out
            self.labels = self.labels_of(out)
            if self.labels is None or out is None or out.dim() != 2:
                self.remove()  # not a classifier we understand: no accuracy to follow
            return
        if out is None or self.labels is None or self.logits is None or out.shape != self.logits.shape:
            return
        self.memorised = bool((out.argmax(dim=1) == self.labels).all())

    def remove(self) -> None:
        if self.leaf is not None:
            self.leaf.remove()
            self.leaf = None


def _step(
    trainer: pl.Trainer,
    optimizer: torch.optim.Optimizer,
    pl_module: pl.LightningModule,
    batch: Any,
    frozen: bool,
) -> None:
    """One optimizer step; ``LBFGS`` re-evaluates the loss through a closure, each evaluation a
    :func:`trial_loss` like the trial's own (the precision context, re-seeded alike)."""
    if not isinstance(optimizer, torch.optim.LBFGS):
        optimizer.step()
        return

    def closure() -> Tensor:
        optimizer.zero_grad()
        out = trial_loss(trainer, pl_module, batch, seed=FROZEN_SEED if frozen else None)
        assert out is not None
        out.backward()
        return out

    optimizer.step(closure)


def probe_updates(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    targets: list[nn.Parameter],
    frozen: bool,
) -> list[Tensor | None]:
    """The update one ``optimizer.step()`` makes to each of ``targets``, seen where no rounding hides it.

    One more ``training_step`` (re-seeded like the trial's when ``frozen``) and a backward to ``targets``
    alone; each target is set to zero, where its dtype holds any update to its full precision, and the
    optimizer steps with no gradient on its other parameters (it skips them): what a target holds
    afterwards is its update. The targets get their values back without a gradient; the optimizer's state
    has moved on by one step (the caller restores it). ``None`` for a target without a gradient, and for
    every target under ``LBFGS`` (its step evaluates the loss of all parameters again).
    """
    none: list[Tensor | None] = [None] * len(targets)
    if not targets or isinstance(optimizer, torch.optim.LBFGS):
        return none
    optimizer.zero_grad(set_to_none=True)
    loss = trial_loss(trainer, pl_module, batch, seed=FROZEN_SEED if frozen else None)
    if loss is None or not loss.requires_grad:
        return none
    grads = torch.autograd.grad(loss, targets, allow_unused=True)
    values = [t.detach().clone() for t in targets]
    try:
        with torch.no_grad():
            for t, g in zip(targets, grads, strict=True):
                t.grad = g
                t.zero_()
        optimizer.step()
        return [None if g is None else t.detach().clone() for t, g in zip(targets, grads, strict=True)]
    finally:
        with torch.no_grad():
            for t, v in zip(targets, values, strict=True):
                t.copy_(v)
                t.grad = None


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
