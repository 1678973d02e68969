"""How far the run has come: the step's loss, against the run's first and best.

A rule about a model's internals (gradients that shrink, attention that sharpens, units that stop firing)
names a fault only if the run is not learning: a model that has fitted its data has small gradients, a
copy task's cross-attention is one-hot once it has learned to copy. :class:`LossProgress` is what such a
rule reads: the loss Lightning hands to ``backward`` summed on the device over the step's micro-batches
(:meth:`LossProgress.add`), taken as the step's mean loss into the monitor's own transfer
(:meth:`LossProgress.take`), and once on the host (:meth:`LossProgress.note`): the median of the last
three such losses against the run's first.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_gradguard.core.runstate import RunField, Stateful, nothing
from lightning_gradguard.core.stats import active_scaler

#: the loss at this fraction of its start or below: the model has fitted its data
FITTED = 0.1
#: the loss at this fraction of its start or below: the run learns (one that learned, then diverged back
#: above it, does not)
LEARNED = 0.5
#: the losses whose median is "where the run is now": one batch's loss is noisy (a healthy RegNet's single
#: batches spread 0.04-0.40 around 0.1)
RECENT = 3


def _first(_: Any, saved: Any) -> float | None:
    return None if saved is None else float(saved)


def _recent(_: Any, saved: Any) -> deque[float]:
    return deque((float(v) for v in saved), maxlen=RECENT)


class LossProgress(Stateful):
    """The step's mean loss (on the device) and the run's first and recent losses (host numbers)."""

    first: RunField[float | None] = RunField(nothing, load=_first)
    recent: RunField[deque[float]] = RunField(lambda: deque(maxlen=RECENT), load=_recent)
    _sum: RunField[Tensor | None] = RunField(nothing, key=None)
    _micro: RunField[int] = RunField(int, key=None)

    def __init__(self) -> None:
        self.reset_run()

    def add(self, loss: Tensor) -> None:
        """``on_before_backward``: one more micro-batch's loss (a scalar add on the device)."""
        value = loss.detach().float().reshape(())
        self._sum = value if self._sum is None else self._sum + value
        self._micro += 1

    def clear(self) -> None:
        """Forget the step's losses (a step that is not read)."""
        self._sum, self._micro = None, 0

    def take(self, trainer: pl.Trainer) -> Tensor | None:
        """The step's mean loss, still on the device, and the step forgotten; ``None`` without a loss.

        Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and, under 16-mixed,
        multiplies it by the GradScaler's scale before ``backward``: both are undone.
        """
        total, micro = self._sum, self._micro
        self.clear()
        if total is None or not micro:
            return None
        scale = getattr(active_scaler(trainer), "_scale", None)
        mean = total * (trainer.accumulate_grad_batches / micro)
        return (mean if scale is None else mean / scale).reshape(1)

    def note(self, value: float | None) -> None:
        """The step's loss on the host: the first finite one is the run's start."""
        if value is None or not math.isfinite(value):
            return
        if self.first is None:
            self.first = value
        self.recent.append(value)

    @property
    def level(self) -> float | None:
        """Where the loss is now: the median of the last :data:`RECENT` noted losses."""
        return statistics.median(self.recent) if self.recent else None

    def fitted(self) -> bool:
        """The loss is at :data:`FITTED` of the first or below (both positive)."""
        return self._below(FITTED)

    def learning(self) -> bool:
        """The loss is at :data:`LEARNED` of the first or below: the run has learned much of what it can,
        and has not diverged back."""
        return self._below(LEARNED)

    def _below(self, fraction: float) -> bool:
        first, level = self.first, self.level
        return first is not None and level is not None and 0 < level <= fraction * first
