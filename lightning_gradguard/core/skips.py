"""Updates a callback drops, and why: one record per Trainer, shared by the callbacks that drop or count them.

:func:`skip_update` is how NaNSentinel and LossSpikeGuard drop an update (every gradient to ``None``, as
:func:`~lightning_gradguard.core.trial.drop_update`, and the buffers the step's forward wrote put back)
and record the cause in the Trainer's shared
:class:`~lightning_gradguard.core.state.TrainerState` (a Python counter: no device work, no sync);
OptimizerMonitor reads the counts with :func:`skipped_updates`. The drop is also a fact of the step:
:attr:`~lightning_gradguard.core.stats.StepStats.dropped` says it to every monitor that measured the step
(GradientNormLogger, OptimizerMonitor, StallDetector judge no dropped update), and
:meth:`~lightning_gradguard.core.stats.StepStats.scaler_skipped` says when the GradScaler skipped one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_gradguard.core.buffers import restore_step_buffers
from lightning_gradguard.core.state import trainer_state
from lightning_gradguard.core.stats import mark_dropped
from lightning_gradguard.core.trial import drop_update

#: why an update was dropped: the GradScaler found inf/NaN, NaNSentinel's skip, LossSpikeGuard's skip/rollback
SKIP_CAUSES = ("grad_scaler", "nan_sentinel", "loss_spike")


def skip_update(trainer: pl.Trainer, optimizer: Any, cause: str) -> None:
    """Drop this step's update of ``optimizer`` (its state untouched), put back the buffers its forward
    wrote (BatchNorm's running statistics, when a callback keeps them: ``core.buffers``), count it
    under ``cause`` and make it a fact of the step (``StepStats.dropped``, read by the monitors that
    measured the step)."""
    drop_update(optimizer)
    restore_step_buffers(trainer)
    mark_dropped(trainer, optimizer, cause)
    counts = trainer_state(trainer).skipped_updates
    counts[cause] = counts.get(cause, 0) + 1


def skipped_updates(trainer: pl.Trainer) -> dict[str, int]:
    """Updates dropped so far on this Trainer by a callback, per cause (the GradScaler's not included)."""
    return dict(trainer_state(trainer).skipped_updates)
