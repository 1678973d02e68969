r"""
Learning-rate range test: the math
==================================

Pure functions (plain Python floats and NumPy, no Trainer) behind :class:`~lightning_gradguard.LRFinderPlus`,
usable from a hand-written PyTorch loop:

* :func:`sweep_lrs`: the learning rates of an exponential or linear sweep.
* :func:`ema_smooth`: exponential moving average with bias correction, counted from the first point.
* :func:`centered_smooth`: a zero-lag Gaussian smoother used for the suggestions: a one-sided EMA lags
  behind the curve and shifts every feature to larger LRs.
* :func:`suggest_steep`, :func:`suggest_valley`, :func:`suggest_minimum`, :func:`suggest_slide` and
  :func:`suggest_all`.

All suggestion functions take the learning rates and an (already smoothed) loss curve of the same
length and return a learning rate, or ``None`` when the curve does not support one. The sweep's online
stop rule, which keeps state, is the LR finder's own
(:class:`~lightning_gradguard.monitors.lr_finder.divergence.DivergenceMonitor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SUGGESTION_METHODS",
    "centered_smooth",
    "ema_smooth",
    "suggest_all",
    "suggest_minimum",
    "suggest_slide",
    "suggest_steep",
    "suggest_valley",
    "sweep_lrs",
]

SUGGESTION_METHODS: tuple[str, ...] = ("valley", "steep", "minimum", "slide")


def sweep_lrs(min_lr: float, max_lr: float, num: int, mode: str = "exponential") -> list[float]:
    """``num`` learning rates from ``min_lr`` to ``max_lr`` (both included), geometric or arithmetic."""
    if num < 1:
        return []
    if num == 1:
        return [float(min_lr)]
    if mode == "exponential":
        ratio = math.log(max_lr / min_lr)
        return [float(min_lr * math.exp(ratio * i / (num - 1))) for i in range(num)]
    if mode == "linear":
        return [float(min_lr + (max_lr - min_lr) * i / (num - 1)) for i in range(num)]
    raise ValueError(f"`mode` must be one of 'exponential', 'linear'; got {mode!r}")


def ema_smooth(values: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average: ``avg_t / (1 - beta**t)`` with ``t`` counted from 1.

    The first output equals the first input, whatever ``beta``; ``beta = 0`` returns the input.
    """
    out: list[float] = []
    avg = 0.0
    for t, v in enumerate(values, start=1):
        avg = beta * avg + (1.0 - beta) * float(v)
        out.append(avg / (1.0 - beta**t) if beta > 0 else avg)
    return out


def centered_smooth(values: Sequence[float], sigma: float | None = None) -> list[float]:
    """Zero-lag smoothing: a Gaussian-weighted mean over neighbouring points (``sigma`` in points).

    The kernel is symmetric, so a feature of the curve stays at the learning rate where it happened
    instead of being dragged to larger LRs as by a causal EMA; it is local (cut at 4 sigma) and
    renormalised at the ends, so the exploding tail of a diverging sweep does not leak far back into the
    descent. ``sigma`` defaults to 5 % of the number of points (at least 1).
    """
    y = np.asarray(values, dtype=np.float64)
    n = y.size
    if n == 0:
        return []
    sig = max(1.0, 0.05 * n) if sigma is None else float(sigma)
    if sig <= 0:
        return [float(v) for v in y]
    half = math.ceil(4 * sig)
    offsets = np.arange(-half, half + 1)
    kernel = np.exp(-0.5 * (offsets / sig) ** 2)
    num = np.convolve(y, kernel, mode="same") if n >= kernel.size else _direct(y, kernel, half)
    den = (
        np.convolve(np.ones(n), kernel, mode="same")
        if n >= kernel.size
        else _direct(np.ones(n), kernel, half)
    )
    return [float(v) for v in num / den]


def _direct(y: np.ndarray, kernel: np.ndarray, half: int) -> np.ndarray:
    """``np.convolve(..., mode="same")`` for a kernel longer than the signal (centred on the signal)."""
    n = y.size
    out = np.zeros(n)
    for i in range(n):
        for j in range(n):
            k = j - i + half
            if 0 <= k < kernel.size:
                out[i] += kernel[k] * y[j]
    return out


def _as_arrays(lrs: Sequence[float], losses: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.log10(np.asarray(lrs, dtype=np.float64))
    y = np.asarray(losses, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"`lrs` and `losses` must have the same length; got {x.size} and {y.size}")
    return x, y


def _edge(n: int) -> int:
    """Points ignored at each end of a curve for slope-based rules (smoothing edge effects)."""
    return min(max(1, n // 20), 5)


def _descent_slopes(lrs: Sequence[float], losses: Sequence[float]) -> tuple[int, np.ndarray] | None:
    """``(start, d loss / d log10 lr)`` over the stretch before the minimum, the first few points (the
    smoothing's edge) left out; ``None`` when the curve is too short for a slope."""
    x, y = _as_arrays(lrs, losses)
    n = y.size
    if n < 5 or np.ptp(x) == 0:
        return None
    stop = int(np.argmin(y)) + 1
    start = _edge(n)
    if stop - start < 2:
        return None
    return start, np.gradient(y, x)[start:stop]


def suggest_steep(lrs: Sequence[float], losses: Sequence[float]) -> float | None:
    """The LR where the curve falls fastest per decade (most negative d loss / d log10 lr).

    Only the stretch before the minimum counts, and a few points at the very start are ignored (smoothing
    edge effects). ``None`` when the curve never falls.
    """
    found = _descent_slopes(lrs, losses)
    if found is None:
        return None
    start, window = found
    i = int(np.argmin(window))
    if window[i] >= 0:
        return None
    return float(lrs[start + i])


def _longest_run(mask: np.ndarray) -> tuple[int, int] | None:
    """First and last index of the longest run of ``True`` in ``mask`` (the earliest on a tie)."""
    best: tuple[int, int] | None = None
    start: int | None = None
    for i, flag in enumerate([*mask.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            if best is None or i - 1 - start > best[1] - best[0]:
                best = (start, i - 1)
            start = None
    return best


def suggest_valley(lrs: Sequence[float], losses: Sequence[float], tolerance: float = 0.5) -> float | None:
    """The middle (in log-LR) of the longest stretch of significant descent before the curve's minimum.

    A point belongs to the descent when the curve falls there at least ``tolerance`` times as fast (per
    decade of LR) as at its steepest point. Counting every decreasing point instead would let a noisy
    flat start, or a plateau that sags gently for decades, pass for the descent and pull the suggestion
    far to the left; with the tolerance relative to the steepest fall, the stretch is the width of the
    descent itself (``tolerance = 0.5``: where it falls at least half as fast as at its fastest), whatever
    the scale or offset of the loss. ``None`` when the curve never falls.
    """
    descent = _descent_slopes(lrs, losses)
    if descent is None:
        return None
    start, slope = descent
    steepest = float(-slope.min())
    if steepest <= 0:
        return None
    found = _longest_run(slope <= -tolerance * steepest)
    if found is None:  # pragma: no cover - the steepest point itself always qualifies
        return None
    a, b = found
    x = np.log10(np.asarray(lrs, dtype=np.float64))  # the middle in log-LR
    return float(10.0 ** (0.5 * (x[start + a] + x[start + b])))


def suggest_minimum(lrs: Sequence[float], losses: Sequence[float], divisor: float = 10.0) -> float | None:
    """The LR of the lowest loss divided by ``divisor`` (the classic "one order of magnitude before")."""
    x, y = _as_arrays(lrs, losses)
    if y.size < 2:
        return None
    i = int(np.argmin(y))
    if i == 0:
        return None
    return float(10.0 ** x[i] / divisor)


def suggest_slide(
    lrs: Sequence[float], losses: Sequence[float], window: int | None = None, tolerance: float = 0.5
) -> float | None:
    """Slide a window leftwards from the end of the curve until its two ends descend alike.

    The slope (per decade, in units of the curve's range) is compared at the two ends of a window of
    ``window`` points (default: a seventh of the curve). Near the end of a diverging sweep the ends
    differ a lot; the window slides left, one point at a time, until the difference falls below
    ``tolerance`` (of the curve's steepest slope) with the left end on the descent, i.e. into the smooth
    descending stretch; the LR at its left end is the suggestion. ``None`` when the curve never falls
    or is too short.
    """
    x, y = _as_arrays(lrs, losses)
    n = y.size
    w = max(2, n // 7) if window is None else int(window)
    if n < w + 3 or np.ptp(x) == 0:
        return None
    span = float(np.ptp(y))
    if span == 0:
        return None
    slope = np.gradient(y, x) / span
    steepest = float(-slope.min())
    if steepest <= 0:
        return None
    right = n - 1
    left = right - w
    while left > 0 and (abs(slope[right] - slope[left]) > tolerance * steepest or slope[left] >= 0):
        right -= 1  # the ends still differ, or the window still sits in the rising tail
        left -= 1
    if slope[left] >= 0 and slope[min(left + 1, n - 1)] >= 0:
        # the flat start of the curve: move right to where it begins to fall
        falling = np.nonzero(slope[left:] < 0)[0]
        if falling.size == 0:
            return None
        left += int(falling[0])
    return float(10.0 ** x[left])


def suggest_all(lrs: Sequence[float], losses: Sequence[float]) -> dict[str, float | None]:
    """Every suggestion method on one (already smoothed) curve, keyed by method name."""
    return {
        "valley": suggest_valley(lrs, losses),
        "steep": suggest_steep(lrs, losses),
        "minimum": suggest_minimum(lrs, losses),
        "slide": suggest_slide(lrs, losses),
    }
