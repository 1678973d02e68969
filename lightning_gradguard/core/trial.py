"""Training outside Lightning's loop: the trial steps of pre-flight checks, LR sweeps and replays.

Pre-flight checks, the LR range test and the NaN replay call ``training_step`` themselves. A trial step
is built from three pieces that behave like Lightning's own:

* :func:`trial_loss`: one call of ``training_step`` (its ``batch_idx`` argument as Lightning passes it,
  the precision context, optionally through the strategy so DDP all-reduces the gradients), with its
  ``self.log`` calls swallowed (a trial's losses are not the run's metrics) and, on request, seeded;
* :func:`trial_backward`: the backward of a loss, divided for accumulation and scaled by the GradScaler;
* :func:`trial_optimizer_step`: gradient clipping as the Trainer is configured, then the optimizer step
  through the GradScaler, reporting a step the scaler skipped.

The caller owns the loop (how many steps, what to record, when to stop) and restores everything
afterwards (:class:`~lightning_gradguard.core.snapshot.TrainingSnapshot`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn

from lightning_gradguard.core.stats import active_scaler

__all__ = [
    "configured_lr",
    "drop_update",
    "loss_of",
    "quiet_logging",
    "seed_all",
    "training_step_of",
    "trial_backward",
    "trial_loss",
    "trial_optimizer_step",
]


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


def trial_optimizer_step(trainer: pl.Trainer, optimizer: Any, clip: bool = True) -> bool:
    """Clip the gradients as the Trainer is configured, then step; ``True`` when the step was skipped.

    With a GradScaler the gradients are unscaled before clipping and the step goes through the scaler,
    which skips it (and lowers its scale) when it finds NaN/inf: that is reported as skipped.
    """
    clip_val = trainer.gradient_clip_val if clip else None
    algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm")
    scaler = active_scaler(trainer)
    if scaler is None:
        if clip_val:
            trainer.precision_plugin.clip_gradients(optimizer, clip_val, algorithm)
        optimizer.step()
        return False
    before = float(scaler.get_scale())
    if clip_val:
        scaler.unscale_(optimizer)
        trainer.precision_plugin.clip_gradients(optimizer, clip_val, algorithm)
    scaler.step(optimizer)
    scaler.update()
    return float(scaler.get_scale()) < before


def drop_update(optimizer: Any) -> None:
    """Set every gradient of ``optimizer`` to ``None``: ``torch.optim`` optimizers then skip the update.

    Adam's moments and step count, SGD's momentum buffers: all stay as they were, as when the GradScaler
    skips a step.
    """
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
