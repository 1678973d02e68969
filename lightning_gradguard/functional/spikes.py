"""Spikes: how far one step's loss or gradient norm lies above the recent steps, robustly.

A spike is judged against the recent window of *accepted* values (a spike is kept out of the window, so
it never raises the baseline it is measured against). The score is a robust z-score: the distance from
the window's median in units of its median absolute deviation (MAD, scaled by 1.4826 so that it matches
the standard deviation of a normal distribution), in log space when every value is positive (losses and
norms are multiplicative: a loss that doubles is a jump of ln 2 wherever it starts) and in linear space
otherwise (a loss that can be negative, such as a negative log-likelihood). The median and the MAD are
not moved by the outliers they are meant to find, unlike a mean and a standard deviation.

A step is a spike when its score reaches the threshold *and* the value is at least ``min_ratio`` times
the window's median (linear space: the median plus ``min_ratio - 1`` times its magnitude): in a very
quiet window (MAD near 0) a tiny rise can have a large z-score, and a spike must also be large in
absolute terms.

Before any window is warm, a run can only be compared with its own start. :func:`start_level` is that
start: the median of the first losses, with a scale that stays meaningful when the loss is near zero or
negative (differences, not ratios: a rise is measured in units of the start's magnitude, or of the first
losses' spread when that is larger). :meth:`StartLevel.factor` says how many "starts" a loss lies at:
1 at the start, 6 for a positive loss six times its start.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the MAD of a normal distribution is 0.6745 sigma: 1.4826 * MAD estimates sigma
MAD_TO_SIGMA = 1.4826
#: the smallest spread a window is given (log space: about 1 %), so a constant window still has a scale
_MIN_SCALE = 0.01


@dataclass(frozen=True, kw_only=True)
class SpikeScore:
    """One value against the recent window.

    Attributes:
        value: the value judged.
        level: the window's median (the typical recent value).
        zscore: robust z-score of ``value`` (NaN without a usable window or for a non-finite value).
        ratio: ``value / level`` (NaN when the level is not positive).
        log_space: whether the score was taken on ``log(value)`` (every value positive).
    """

    value: float
    level: float
    zscore: float
    ratio: float
    log_space: bool


def spike_score(value: float, window: Sequence[float]) -> SpikeScore:
    """The robust z-score of ``value`` against ``window`` (the recent accepted values)."""
    # builtins over the window (filter, min, map, one list comprehension): a judged step costs a handful of
    # Python calls whatever the window's length
    finite = list(filter(math.isfinite, window))
    if not finite or not math.isfinite(value):
        return SpikeScore(value=value, level=math.nan, zscore=math.nan, ratio=math.nan, log_space=False)
    log_space = value > 0 and min(finite) > 0
    xs = list(map(math.log, finite)) if log_space else finite
    x = math.log(value) if log_space else value
    center = statistics.median(xs)
    mad = statistics.median([abs(v - center) for v in xs])
    floor = _MIN_SCALE if log_space else _MIN_SCALE * max(abs(center), 1e-12)
    scale = max(MAD_TO_SIGMA * mad, floor)
    level = math.exp(center) if log_space else center
    ratio = value / level if level > 0 else math.nan
    return SpikeScore(value=value, level=level, zscore=(x - center) / scale, ratio=ratio, log_space=log_space)


def is_spike(score: SpikeScore, threshold: float, min_ratio: float) -> bool:
    """Whether ``score`` reaches ``threshold`` and the value is at least ``min_ratio`` times the level."""
    if not math.isfinite(score.zscore) or score.zscore < threshold:
        return False
    if score.log_space:
        return score.ratio >= min_ratio
    return score.value >= score.level + (min_ratio - 1.0) * abs(score.level)


@dataclass(frozen=True, kw_only=True)
class StartLevel:
    """Where a run's loss started, to judge a later loss against.

    Attributes:
        level: the median of the first losses.
        scale: the unit a rise is measured in: ``|level|``, or the middle one of the first losses' distances
            from their median when that is larger (a loss that starts near zero, or crosses it, gets the
            spread of its first steps). ``0`` only when every first loss is exactly ``0``.
    """

    level: float
    scale: float

    def factor(self, value: float) -> float:
        """``1 + (value - level) / scale``: for a positive start, ``value / level`` (NaN without a scale)."""
        return 1.0 + (value - self.level) / self.scale if self.scale > 0 else math.nan

    def threshold(self, factor: float) -> float:
        """The loss at which :meth:`factor` reaches ``factor`` (``inf`` without a scale)."""
        return self.level + (factor - 1.0) * self.scale if self.scale > 0 else math.inf


def start_level(first: Sequence[float]) -> StartLevel:
    """The :class:`StartLevel` of a run whose first (finite) losses are ``first`` (at least one)."""
    if not first or not all(map(math.isfinite, first)):
        raise ValueError(f"`first` must hold finite losses, got {list(first)!r}")
    level = statistics.median(first)
    spread = statistics.median([abs(v - level) for v in first])
    return StartLevel(level=level, scale=max(abs(level), spread))
