"""Training outside Lightning's loop: the trial steps of pre-flight checks, LR sweeps and replays.

Pre-flight checks, the LR range test and the NaN replay call ``training_step`` themselves. A trial step
is built from pieces that behave like Lightning's own:

* :func:`trial_loss`: one call of ``training_step`` (its ``batch_idx`` argument as Lightning passes it,
  the precision context, optionally through the strategy so DDP all-reduces the gradients), with its
  ``self.log`` calls swallowed (a trial's losses are not the run's metrics) and, on request, seeded;
* :func:`trial_backward`: the backward of a loss, divided for accumulation and scaled by the GradScaler;
* :class:`TrialClosure`: what Lightning's automatic optimization hands ``optimizer.step``: zero the
  gradients, then ``training_step`` and backward over the step's micro-batches, returning their loss. It
  draws the micro-batches on its first call and evaluates the same ones again on every later call;
* :func:`trial_optimizer_step`: one optimizer step driven by such a closure, as Lightning's precision
  plugins drive it: the closure goes to ``optimizer.step`` (so ``LBFGS`` and any optimizer that needs a
  closure re-evaluate the loss), with gradient clipping as the Trainer is configured after each
  evaluation; under a GradScaler the closure runs first and the step goes through the scaler, reporting a
  step it skipped.

The caller owns the loop (how many steps, what to record, when to stop) and restores everything
afterwards (:class:`~lightning_gradguard.core.snapshot.TrainingSnapshot`).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn

from lightning_gradguard.core.stats import active_scaler


@contextmanager
def quiet_logging(pl_module: nn.Module) -> Iterator[None]:
    """Run ``training_step`` without its ``self.log`` / ``self.log_dict`` calls reaching the loggers.

    For the trial steps of the pre-flight checks, the LR sweep and the NaN replay: their losses are
    not the run's metrics.
    """
    had = {k: k in pl_module.__dict__ for k in ("log", "log_dict")}
    saved = {k: pl_module.__dict__.get(k) for k in had}
    pl_module.__dict__["log"] = lambda *a, **k: None
    pl_module.__dict__["log_dict"] = lambda *a, **k: None
    try:
        yield
    finally:
        for k, present in had.items():
            if present:
                pl_module.__dict__[k] = saved[k]
            else:
                del pl_module.__dict__[k]


def loss_of(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned: the tensor itself or ``output["loss"]``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def training_step_of(pl_module: nn.Module, batch: Any, batch_idx: int = 0) -> Any:
    """Call ``training_step`` as Lightning does: with ``batch_idx`` only when its signature takes one."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    step = pl_module.training_step
    if is_param_in_hook_signature(step, "batch_idx", min_args=2):  # type: ignore[arg-type]
        return step(batch, batch_idx)  # type: ignore[operator]
    return step(batch)  # type: ignore[operator]


def configured_lr(optimizer: torch.optim.Optimizer) -> None:
    """Set every param group's ``lr`` to the one it was configured with, before a scheduler scaled it.

    A PyTorch LR scheduler records each group's configured LR as ``initial_lr`` when it is built and then
    multiplies it by its factor: a warm-up starts at ``0`` or ``1e-3 x`` the configured LR. A few trial
    steps at that LR learn nothing (and ``lr=0`` would read as a parameter the optimizer ignores), so the
    trial steps use ``initial_lr`` (for ``OneCycleLR``: ``max_lr / div_factor``, its own starting LR).
    The caller restores the optimizer's state afterwards.
    """
    for group in optimizer.param_groups:
        base = group.get("initial_lr")
        if isinstance(base, (int, float)) and not isinstance(group.get("lr"), Tensor) and base > 0:
            group["lr"] = float(base)


def seed_all(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), NumPy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def trial_loss(
    trainer: pl.Trainer,
    pl_module: nn.Module,
    batch: Any,
    batch_idx: int = 0,
    *,
    through_strategy: bool = False,
    seed: int | None = None,
) -> Tensor | None:
    """The loss of one ``training_step`` call, as Lightning makes it, kept out of the run's metrics.

    ``through_strategy=True`` calls it through the strategy (the precision context and, under DDP, the
    wrapped model, so the backward all-reduces the gradients as in the run: an LR sweep). Otherwise it is
    called directly under the precision plugin's train-step context: a local trial on this rank alone (a
    pre-flight check, a replay). ``seed`` re-seeds every generator first (the same random draws in every
    trial step). ``None`` when ``training_step`` returned no loss.
    """
    if seed is not None:
        seed_all(seed)
    with torch.enable_grad(), quiet_logging(pl_module):
        if through_strategy:
            out = trainer.strategy.training_step(batch, batch_idx)
        else:
            with trainer.precision_plugin.train_step_context():
                out = training_step_of(pl_module, batch, batch_idx)
    return loss_of(out)


def trial_backward(trainer: pl.Trainer, loss: Tensor, divide: int = 1) -> None:
    """Backward of ``loss / divide`` (accumulation), scaled by the GradScaler when one is active."""
    scaled = loss / divide if divide != 1 else loss
    scaler = active_scaler(trainer)
    if scaler is not None:
        scaled = scaler.scale(scaled)
    scaled.backward()


class NoTrialLoss(RuntimeError):
    """``training_step`` returned no loss inside a :class:`TrialClosure`: there is nothing to step on."""


class TrialClosure:
    """The closure of one trial step, as Lightning's automatic optimization builds it.

    Each call zeroes the optimizer's gradients (``set_to_none``), runs :func:`trial_loss` and
    :func:`trial_backward` (the loss divided by ``micro_batches``) on each of the step's micro-batches,
    and returns their mean loss, detached. The first call takes the micro-batches from ``draw`` (one call
    per micro-batch, interleaved with their ``training_step`` calls, as the training loop interleaves
    them); later calls (``LBFGS`` evaluates the loss several times per step) reuse the same ones. Raises
    :class:`NoTrialLoss` when ``training_step`` returns no loss; whatever ``draw`` raises propagates.

    Args:
        trainer: the trainer (precision plugin, strategy, GradScaler).
        pl_module: the model whose ``training_step`` runs.
        optimizer: the optimizer whose gradients are zeroed.
        draw: returns the next micro-batch, prepared as ``training_step`` takes it, and its ``batch_idx``.
        micro_batches: how many micro-batches make the step (``accumulate_grad_batches``).
        through_strategy: passed to :func:`trial_loss`.
        seed: passed to :func:`trial_loss` (every call re-seeded alike).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: nn.Module,
        optimizer: Any,
        draw: Callable[[], tuple[Any, int]],
        micro_batches: int = 1,
        *,
        through_strategy: bool = False,
        seed: int | None = None,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"`micro_batches` must be at least 1, got {micro_batches!r}")
        self.trainer, self.pl_module, self.optimizer = trainer, pl_module, optimizer
        self.draw = draw
        self.micro_batches = micro_batches
        self.through_strategy = through_strategy
        self.seed = seed
        self.batches: list[tuple[Any, int]] = []
        self.calls = 0

    def __call__(self) -> Tensor:
        self.calls += 1
        self.optimizer.zero_grad(set_to_none=True)
        total: Tensor | None = None
        for i in range(self.micro_batches):
            if i == len(self.batches):
                self.batches.append(self.draw())
            batch, batch_idx = self.batches[i]
            loss = trial_loss(
                self.trainer,
                self.pl_module,
                batch,
                batch_idx,
                through_strategy=self.through_strategy,
                seed=self.seed,
            )
            if loss is None:
                raise NoTrialLoss("training_step returned no loss")
            value = loss.detach().float()
            total = value if total is None else total + value
            trial_backward(self.trainer, loss, self.micro_batches)
        assert total is not None  # micro_batches >= 1
        return total / self.micro_batches


@dataclass(frozen=True)
class TrialStep:
    """One trial step: ``loss``, the closure's first value (the loss at the parameters the step started
    from); ``skipped``, the GradScaler skipped the update; ``evaluations``, how often the closure ran
    (``LBFGS``: up to its ``max_eval``; every other optimizer: 1)."""

    loss: Tensor
    skipped: bool
    evaluations: int


def trial_optimizer_step(
    trainer: pl.Trainer, optimizer: Any, closure: Callable[[], Tensor], clip: bool = True
) -> TrialStep:
    """One optimizer step on ``closure`` (a :class:`TrialClosure` or any callable with its contract).

    As Lightning's precision plugins do it: without a GradScaler the closure goes to
    ``optimizer.step(closure=...)`` and the gradients are clipped (as the Trainer is configured, unless
    ``clip=False``) after each evaluation, before the update; ``torch.optim`` optimizers evaluate it once,
    first thing, so the step is the one ``closure(); clip; optimizer.step()`` makes, bit for bit, and
    ``LBFGS`` evaluates it as often as it needs. An optimizer whose ``step`` takes no closure gets
    ``closure()`` and then ``step()``. With a GradScaler the closure runs once, the gradients are unscaled
    before clipping, and the step goes through the scaler, which skips it (and lowers its scale) when it
    finds NaN/inf: ``TrialStep.skipped``. An optimizer that needs a closure cannot step through a
    GradScaler (Lightning: "AMP and the LBFGS optimizer are not compatible"): ``ValueError``.
    """
    clip_val = trainer.gradient_clip_val if clip else None
    algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm")
    scaler = active_scaler(trainer)
    if scaler is not None:
        if needs_closure(optimizer):
            raise ValueError(
                f"`optimizer` ({type(optimizer).__name__}) needs a closure in its step, which a GradScaler "
                "cannot pass: 16-mixed precision and this optimizer are not compatible"
            )
        loss = closure()
        before = float(scaler.get_scale())
        if clip_val:
            scaler.unscale_(optimizer)
            trainer.precision_plugin.clip_gradients(optimizer, clip_val, algorithm)
        scaler.step(optimizer)
        scaler.update()
        return TrialStep(loss, float(scaler.get_scale()) < before, 1)
    losses: list[Tensor] = []

    def evaluate() -> Tensor:
        loss = closure()
        losses.append(loss)
        if clip_val:
            trainer.precision_plugin.clip_gradients(optimizer, clip_val, algorithm)
        return loss

    if takes_closure(optimizer):
        optimizer.step(closure=evaluate)
        if not losses:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(closure=...) never called its closure: the loss and the "
                "gradients of the step were not computed"
            )
    else:
        evaluate()
        optimizer.step()
    return TrialStep(losses[0], False, len(losses))


def _step_parameters(optimizer: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(optimizer.step).parameters)
    except (TypeError, ValueError):  # a builtin or C-implemented step: no signature to read
        return {}


def takes_closure(optimizer: Any) -> bool:
    """``optimizer.step`` accepts a ``closure`` keyword (every ``torch.optim`` optimizer does)."""
    params = _step_parameters(optimizer)
    return "closure" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def needs_closure(optimizer: Any) -> bool:
    """``optimizer.step`` cannot run without a closure (``LBFGS``: ``step(closure)``, no default)."""
    param = _step_parameters(optimizer).get("closure")
    if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return False
    return param.default is inspect.Parameter.empty


def drop_update(optimizer: Any) -> None:
    """Set every gradient of ``optimizer`` to ``None``: ``torch.optim`` optimizers then skip the update.

    Adam's moments and step count, SGD's momentum buffers: all stay as they were, as when the GradScaler
    skips a step.
    """
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
