"""The learning-rate schedule a run will train with, read by stepping its schedulers ahead of time.

The finder fits its suggestion to the schedule: a run that warms up to a peak and decays needs that
peak, not the constant LR a plain range test suggests. The schedule is read, not guessed from the
scheduler's class: the run's own schedulers (``LambdaLR`` from ``transformers``' helpers, ``OneCycleLR``,
``SequentialLR`` of ``LinearLR`` and ``CosineAnnealingLR``, any other) are stepped as the training loop
would step them and group 0's LR is recorded. The caller restores them afterwards (the range test's
snapshot keeps every scheduler's ``state_dict`` and the optimizer's LRs).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

#: the most scheduler steps read ahead (a warm-up longer than this is read as far as it goes)
MAX_SCHEDULE_STEPS = 100_000

#: steps read past the highest LR so far without a new one before the peak is taken as found
FLAT_STEPS = 1000

#: a schedule warms up when its LR starts at or below this fraction of its peak and rises to it later
WARMUP_START = 0.5


@dataclass(frozen=True)
class Schedule:
    """What the run's schedule does to group 0's LR, relative to the LR it is configured with.

    Attributes:
        peak: the largest factor the schedule reaches (1.0 for a warm-up to the configured LR).
        start: the factor at the first step.
        warmup_steps: scheduler steps until the peak (0: the LR starts at its peak).
        interval: ``"step"`` or ``"epoch"`` (what one scheduler step is).
        decays: whether the LR falls again after its peak within the steps read.
    """

    peak: float
    start: float
    warmup_steps: int
    interval: str
    decays: bool

    @property
    def warms_up(self) -> bool:
        return self.warmup_steps > 0 and self.start <= WARMUP_START * self.peak

    def describe(self) -> str:
        unit = "step" if self.interval == "step" else "epoch"
        rise = f"a warm-up over {self.warmup_steps} {unit}{'s' if self.warmup_steps != 1 else ''}"
        return rise + (" then a decay" if self.decays else "")


def read_schedule(trainer: pl.Trainer, optimizer: Any, configured: float) -> Schedule | None:
    """Step the schedulers of ``optimizer`` ahead and record group 0's LR (``None``: no schedule read).

    ``configured`` is group 0's configured LR (the factors are relative to it). Read until the peak is
    known (the LR has fallen to half of it, or no higher LR came for a while), at most
    :data:`MAX_SCHEDULE_STEPS` steps, whatever the run's length (``lr_find``'s throwaway Trainer runs one
    epoch; the schedule is the module's). The schedulers are left stepped: the caller restores them.
    ``ReduceLROnPlateau`` (it needs a metric) is no schedule.
    """
    configs = [
        c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is optimizer
    ]
    if not configs or configured <= 0 or any(c.reduce_on_plateau for c in configs):
        return None
    interval = "step" if any(c.interval == "step" for c in configs) else "epoch"
    factors = [float(optimizer.param_groups[0]["lr"]) / configured]
    top, at = factors[0], 0  # the highest factor so far, and its step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        while len(factors) <= MAX_SCHEDULE_STEPS:
            try:
                for c in configs:
                    c.scheduler.step()  # type: ignore[call-arg]  # ReduceLROnPlateau is left out above
            except Exception:  # stepped past its end (OneCycleLR) or cannot step ahead: what was read
                break
            factors.append(float(optimizer.param_groups[0]["lr"]) / configured)
            if factors[-1] > top:
                top, at = factors[-1], len(factors) - 1
            # the peak is known once the LR has fallen to half of it, or no higher LR came for as many
            # steps as it took to reach it (at least FLAT_STEPS)
            if (at > 0 and factors[-1] < 0.5 * top) or len(factors) - 1 - at >= max(FLAT_STEPS, at):
                break
    return _shape(factors, interval)


def _shape(factors: list[float], interval: str) -> Schedule | None:
    top = max(factors)
    if not all(math.isfinite(f) for f in factors) or top <= 0:
        return None
    at = factors.index(top)
    return Schedule(
        peak=top,
        start=factors[0],
        warmup_steps=at,
        interval=interval,
        decays=min(factors[at:]) < 0.9 * top,
    )


def schedule_factors(
    trainer: pl.Trainer, optimizer: Any, configured: float, horizon: int | None
) -> list[float]:
    """Group 0's LR factor (relative to ``configured``) at every scheduler step of the run's schedule.

    ``[1.0]`` without a schedule (or with ``ReduceLROnPlateau``, which needs a metric). ``horizon``: the
    run's length in scheduler steps when known (a fit inside its Trainer), read that far or to the
    schedule's end (``OneCycleLR`` refuses to step past it). Unknown (``lr_find``'s throwaway Trainer), the
    schedule is read until it has not changed for as long as it took to get there (at least
    :data:`FLAT_STEPS`): a schedule that ends at zero ends there; one that stays at a level (a warm-up to a
    constant LR) keeps that level for nine times its changing part (a warm-up a tenth of the run). The
    schedulers are left stepped: the caller restores them.
    """
    configs = [
        c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is optimizer
    ]
    if not configs or configured <= 0 or any(c.reduce_on_plateau for c in configs):
        return [1.0]
    limit = min(horizon, MAX_SCHEDULE_STEPS) if horizon else MAX_SCHEDULE_STEPS
    factors = [float(optimizer.param_groups[0]["lr"]) / configured]
    changed = 0  # the last step whose factor differs from the one before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        while len(factors) < limit:
            try:
                for c in configs:
                    c.scheduler.step()  # type: ignore[call-arg]  # ReduceLROnPlateau is left out above
            except Exception:  # stepped past its end (OneCycleLR): what was read
                break
            factors.append(float(optimizer.param_groups[0]["lr"]) / configured)
            if factors[-1] != factors[-2]:
                changed = len(factors) - 1
            if not horizon and len(factors) - 1 - changed >= max(FLAT_STEPS, changed):
                keep = changed + 1 if factors[-1] == 0 else 10 * (changed + 1)
                factors = (factors + [factors[-1]] * keep)[:keep]
                break
    if not all(math.isfinite(f) and f >= 0 for f in factors) or max(factors) <= 0:
        return [1.0]
    return factors


def compressed(factors: list[float], steps: int) -> list[float]:
    """The schedule ``factors`` squeezed (or stretched) to ``steps`` steps: the factor at the same share of
    the schedule as each step's share of the trial, first to last, so a trial warms up, peaks and anneals
    as the run does."""
    if steps <= 1:
        return factors[:steps]
    last = len(factors) - 1
    return [factors[round(i * last / (steps - 1))] for i in range(steps)]
