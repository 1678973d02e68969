"""The learning-rate schedule a run will train with, read by stepping its schedulers ahead of time.

The finder fits its suggestion to the schedule: a run that warms up to a peak and decays needs that
peak, not the constant LR a plain range test suggests. The schedule is read, not guessed from the
scheduler's class: the run's own schedulers (``LambdaLR`` from ``transformers``' helpers, ``OneCycleLR``,
``SequentialLR`` of ``LinearLR`` and ``CosineAnnealingLR``, any other) are stepped ahead on copies
(:class:`~lightning_gradguard.core.lr.ScheduleCopy`, StallDetector's reader too: the run's schedulers and
optimizer are not touched) and group 0's LR is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_gradguard.core.lr import ScheduleCopy

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


def _factors(trainer: pl.Trainer, optimizer: Any, configured: float) -> Iterator[float]:
    """Group 0's LR over ``configured`` now and after each step of every scheduler of ``optimizer``, read on
    copies (:class:`~lightning_gradguard.core.lr.ScheduleCopy`: the run's schedulers are not touched),
    until one refuses to step (``OneCycleLR`` past its end); nothing for ``ReduceLROnPlateau``."""
    schedule = ScheduleCopy(trainer, optimizer)
    if not schedule.configs or not schedule.readable or configured <= 0:
        return
    yield schedule.lrs()[0] / configured
    while schedule.step():
        yield schedule.lrs()[0] / configured


def read_schedule(trainer: pl.Trainer, optimizer: Any, configured: float) -> Schedule | None:
    """Read the schedule of ``optimizer`` ahead: group 0's LR at each scheduler step (``None``: no
    schedule read).

    ``configured`` is group 0's configured LR (the factors are relative to it). Read until the peak is
    known (the LR has fallen to half of it, or no higher LR came for a while), at most
    :data:`MAX_SCHEDULE_STEPS` steps, whatever the run's length (``lr_find``'s throwaway Trainer runs one
    epoch; the schedule is the module's). ``ReduceLROnPlateau`` (it needs a metric) is no schedule.
    """
    configs = [
        c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is optimizer
    ]
    interval = "step" if any(c.interval == "step" for c in configs) else "epoch"
    factors: list[float] = []
    top, at = 0.0, 0  # the highest factor so far, and its step
    for factor in _factors(trainer, optimizer, configured):
        factors.append(factor)
        if factor > top or len(factors) == 1:
            top, at = factor, len(factors) - 1
        # the peak is known once the LR has fallen to half of it, or no higher LR came for as many
        # steps as it took to reach it (at least FLAT_STEPS)
        done = (at > 0 and factor < 0.5 * top) or len(factors) - 1 - at >= max(FLAT_STEPS, at)
        if done or len(factors) > MAX_SCHEDULE_STEPS:
            break
    return _shape(factors, interval) if factors else None


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
    :data:`FLAT_STEPS`), and ends where :func:`settled_end` puts the run's end. One that never stops
    changing (an inverse square root, an exponential decay), or reaches zero only by underflow
    (:func:`decayed_away`), is cut where :func:`guessed_end` puts the run's end. Read on copies of the
    schedulers (:func:`_factors`).
    """
    limit = min(horizon, MAX_SCHEDULE_STEPS) if horizon else MAX_SCHEDULE_STEPS
    factors: list[float] = []
    changed = 0  # the last step whose factor differs from the one before
    for factor in _factors(trainer, optimizer, configured):
        factors.append(factor)
        if len(factors) > 1 and factors[-1] != factors[-2]:
            changed = len(factors) - 1
        if not horizon and len(factors) - 1 - changed >= max(FLAT_STEPS, changed) and len(factors) > 1:
            keep = settled_end(factors, changed)
            factors = (factors + [factors[-1]] * keep)[:keep]
            break
        if len(factors) >= limit:
            break
    if not factors or not all(math.isfinite(f) and f >= 0 for f in factors) or max(factors) <= 0:
        return [1.0]
    if not horizon and (len(factors) >= limit or decayed_away(factors)):  # where the run ends is a guess
        return factors[: guessed_end(factors)]
    return factors


def settled_end(factors: list[float], changed: int) -> int:
    """How many of ``factors`` a run of unknown length takes, for a schedule that stopped changing at step
    ``changed`` (its last factor holds from there on): one that ends at zero ends there; one that holds its
    peak (a warm-up to a constant LR) holds it for nine times its changing part (a warm-up a tenth of the
    run); one that decayed and holds a lower level (a step decay: ``MultiStepLR``) holds it as long as it
    held the level before (milestones at 50 and 75 % of a run, or 30 and 60 of 90 epochs: exactly the run).

    Read as ten times the decay, a step decay of LR / 10 at 90, 180 and 270 of 300 steps was squeezed into a
    63-step trial as 2 steps at the candidate's LR and 59 at a thousandth of it: the trials of a digits MLP
    learned nearly nothing, and the search chose the LR that escapes the loss's plateau soonest, three
    times the best (2.25 times its loss)."""
    top, level = max(factors), factors[-1]
    if level == 0:
        return changed + 1
    if level >= 0.9 * top or changed < 1:
        return 10 * (changed + 1)
    start = changed - 1  # the first step of the level held before the last one
    while start > 0 and factors[start - 1] == factors[changed - 1]:
        start -= 1
    return changed + (changed - start)


#: a factor below this share of the schedule's peak is no LR to train with (a designed decay to zero, linear
#: or cosine, spends the last 0.1 to 2 % of its steps there; a geometric one nearly all of them) ...
NEGLIGIBLE = 1e-3

#: ... and a schedule that reaches zero after this share of its steps below it got there by underflow
UNDERFLOW_SHARE = 0.9


def decayed_away(factors: list[float]) -> bool:
    """Whether a schedule that ends at zero got there only by decaying geometrically: an exponential decay,
    or a step decay per epoch (``StepLR(step_size=1, gamma=0.7)`` on 22 batches an epoch, the PyTorch MNIST
    example's), has no end of its own and reaches zero where its factor underflows, thousands of steps after
    it stopped mattering. Read as the run's end, that squeezed a trial's whole decay into its first step:
    the MNIST example under Adadelta learned nothing in trials of 54 to 432 steps at any LR (its best
    300-step run reaches 3 % of the chance loss). Such a schedule ends where :func:`guessed_end` puts it.
    A decay to zero by design (linear, cosine, polynomial) spends at most a few percent of its steps below
    :data:`NEGLIGIBLE` of its peak; a geometric one, nearly all (:data:`UNDERFLOW_SHARE`)."""
    if not factors or factors[-1] != 0:
        return False
    floor = NEGLIGIBLE * max(factors)
    return sum(f < floor for f in factors) >= UNDERFLOW_SHARE * len(factors)


def guessed_end(factors: list[float]) -> int:
    """How many of ``factors`` a run of unknown length takes, for a schedule that never settles: ten times
    its warm-up (a warm-up a tenth of the run, as for a warm-up to a constant LR); without a warm-up, up to
    where it first falls to a tenth of its peak (an exponential decay by ten over the run); else all.

    Read to its 100,000-step limit instead, an inverse square root decay after a 30-step warm-up, squeezed
    into a 27-step trial, spent all but the trial's first step at 2-9 % of its peak: the trials ran far
    below the LRs they stood for. A held-out transformer tagger's search at ``search_steps=1100`` then
    picked LRs whose runs end at chance (22 times the best loss; 1.5 read this way)."""
    top = max(factors)
    at = factors.index(top)
    if at > 0 and factors[0] <= WARMUP_START * top:
        return min(len(factors), 10 * (at + 1))
    fallen = next((i for i, f in enumerate(factors) if f <= 0.1 * top), None)
    return len(factors) if fallen is None else fallen + 1


def compressed(factors: list[float], steps: int) -> list[float]:
    """The schedule ``factors`` squeezed (or stretched) to ``steps`` steps: the factor at the same share of
    the schedule as each step's share of the trial, first to last, so a trial warms up, peaks and anneals
    as the run does."""
    if steps <= 1:
        return factors[:steps]
    last = len(factors) - 1
    return [factors[round(i * last / (steps - 1))] for i in range(steps)]
