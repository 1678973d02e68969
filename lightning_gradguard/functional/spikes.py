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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ESCALATION",
    "MAD_TO_SIGMA",
    "SpikeScore",
    "escalated_action",
    "explain_spike",
    "is_spike",
    "snapshot_due",
    "spike_score",
]

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
    finite = [v for v in window if math.isfinite(v)]
    if not finite or not math.isfinite(value):
        return SpikeScore(value=value, level=math.nan, zscore=math.nan, ratio=math.nan, log_space=False)
    log_space = value > 0 and all(v > 0 for v in finite)
    xs = [math.log(v) for v in finite] if log_space else finite
    x = math.log(value) if log_space else value
    center = statistics.median(xs)
    mad = statistics.median(abs(v - center) for v in xs)
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


#: what a run of spikes escalates through, mildest first ("warn" never escalates)
ESCALATION = ("skip", "rollback", "raise")


def escalated_action(action: str, streak: int, patience: int, can_roll_back: bool) -> str:
    """What the ``streak``-th consecutive spike gets when the configured action is ``action``.

    Every ``patience`` consecutive spikes move one rung up ``skip -> rollback -> raise`` (``rollback`` is
    passed over when no snapshot can be restored), so a real divergence is not skipped forever: with
    ``patience=3`` and ``action="skip"`` spikes 1-3 are skipped, 4-6 rolled back, the 7th raises.
    """
    if action == "warn":
        return "warn"
    ladder = [a for a in ESCALATION if can_roll_back or a != "rollback"]
    start = ladder.index(action) if action in ladder else ladder.index("skip")
    return ladder[min(start + (max(streak, 1) - 1) // patience, len(ladder) - 1)]


def snapshot_due(
    judged: int, warmup: int, every: int, streak: int, calm: int, probation: bool, have: bool = True
) -> bool:
    """Whether a rollback point is taken after the ``judged``-th judged step (a calm one).

    At the end of the warm-up, then every ``every`` judged steps while no spike streak runs; at once when
    there is none (``have=False``: a resumed run, whose snapshot was not in the checkpoint). After a
    rollback (``probation``) the old point is kept until the run has had ``every`` healthy steps in a
    row (``calm``): the rollback held, and the streak of spikes behind it ends with the new point.
    """
    if not every or not judged:
        return False
    if probation:
        return calm >= every
    return not streak and (judged == warmup or judged % every == 0 or (not have and judged >= warmup))


SPIKE_HINTS = {
    "warn": "The update was applied. If spikes recur, use action='skip' or 'rollback'.",
    "skip": "The update of this step was dropped (optimizer state untouched); training goes on.",
    "rollback": "Weights, optimizer, scheduler and RNG went back to the last snapshot; the data moves on.",
    "raise": "Spikes kept coming past every recovery: lower the learning rate, clip gradients "
    "(gradient_clip_val), check the data around the recorded batches, or restart from an earlier checkpoint.",
}


def explain_spike(
    step: int, action: str, values: dict[str, float], scores: dict[str, SpikeScore], streak: int
) -> tuple[str, str]:
    """The alert's message (what was seen, with the numbers) and hint (what was done, what to try)."""
    parts = [
        f"{k.replace('_', ' ')} {values[k]:.4g} is {s.ratio:.3g}x the recent median {s.level:.4g} "
        f"(robust z-score {s.zscore:.1f})"
        for k, s in scores.items()
    ]
    run = f"; {streak} spikes in a row" if streak > 1 else ""
    return f"Spike at step {step}: " + "; ".join(parts) + f"{run}. Action: {action}.", SPIKE_HINTS[action]
