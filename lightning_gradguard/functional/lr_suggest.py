r"""
Learning-rate range test: the math
==================================

Pure functions (plain Python floats and NumPy, no Trainer) behind :class:`~lightning_gradguard.LRFinderPlus`,
usable from a hand-written PyTorch loop:

* :func:`sweep_lrs`: the learning rates of an exponential or linear sweep.
* :func:`ema_smooth`: exponential moving average with bias correction, counted from the first point.
* :func:`centered_smooth`: a zero-lag Gaussian smoother used for the suggestions: a one-sided EMA lags
  behind the curve and shifts every feature to larger LRs.
* :func:`loss_noise` and :func:`descent_check`: does the curve's descent stand out of its own noise
  (a :class:`DescentCheck`)? Without that, no method suggests anything.
* :func:`suggest_steep`, :func:`suggest_valley`, :func:`suggest_minimum`, :func:`suggest_slide` and
  :func:`suggest_all`.

All suggestion functions take the learning rates and an (already smoothed) loss curve of the same
length and return a learning rate, or ``None`` when the curve does not support one. Each reads only the
smoothed curve's shape, so each finds "a descent" in a curve that is pure noise;
:func:`suggest_all` with the raw losses (``raw=``) first asks :func:`descent_check` and suggests
nothing for a curve whose fall does not stand out of its noise. The sweep's online
stop rule, which keeps state, is the LR finder's own
(:class:`~lightning_gradguard.monitors.lr_finder.divergence.DivergenceMonitor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SUGGESTION_METHODS: tuple[str, ...] = ("valley", "steep", "minimum", "slide", "peak")

#: a suggestion needs the smoothed curve's fall to be at least this many times the noise of that fall
#: (measured margins in docs/lr_finder.md: sweeps of models whose loss cannot fall reached at most 5.1
#: with 20 to 100 points, 7.8 with 12; real sweeps of small models learning at batch size 4 or more at
#: least 7.8)
DESCENT_NOISE_MULTIPLE = 6.0

#: the fewest raw losses the noise is read from (20 differences), even when the minimum comes earlier
NOISE_POINTS = 21

#: the noise is never taken below this fraction of the loss's size: a fall smaller than a few of these
#: is float rounding or a loss that barely depends on the weights (a bias-only model), not a descent; with
#: the smoother's gain and DESCENT_NOISE_MULTIPLE a suggestion needs a fall of at least 0.1 % of the loss
#: (averaged repeats of a sweep lower the noise, never this floor)
RELATIVE_NOISE_FLOOR = 5e-4

#: the diverging tail of a sweep starts at the first raw loss, after the curve's low, that is this many
#: noise units above the level the sweep started from plus as much again as the curve fell
DIVERGENCE_NOISE = 4.0


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
    kernel = _kernel(y.size, sigma)
    if kernel is None:
        return [float(v) for v in y]
    return [float(v) for v in _convolve(y, kernel) / _convolve(np.ones(y.size), kernel)]


def _kernel(n: int, sigma: float | None) -> np.ndarray | None:
    """The Gaussian kernel of :func:`centered_smooth` for ``n`` points; ``None``: no smoothing."""
    if n == 0:
        return None
    sig = max(1.0, 0.05 * n) if sigma is None else float(sigma)
    if sig <= 0:
        return None
    offsets = np.arange(-math.ceil(4 * sig), math.ceil(4 * sig) + 1)
    return np.asarray(np.exp(-0.5 * (offsets / sig) ** 2))


def _convolve(y: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """``np.convolve(y, kernel, mode="same")``, also for a kernel longer than the signal."""
    if y.size >= kernel.size:
        return np.asarray(np.convolve(y, kernel, mode="same"))
    return _direct(y, kernel, kernel.size // 2)


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


def loss_noise(losses: Sequence[float] | np.ndarray) -> float:
    """The batch-to-batch noise of a sweep's raw losses: the standard deviation of one loss around the trend.

    Read from the point-to-point differences, robustly: ``1.4826 * MAD(diff) / sqrt(2)`` (the MAD of
    the differences around their median, scaled so that independent Gaussian noise of standard deviation
    ``s`` gives ``s``). Differences take out the trend, the median its slope, and the MAD ignores the few
    big jumps of a diverging tail. Never below :data:`RELATIVE_NOISE_FLOOR` times the median ``|loss|``;
    ``0.0`` for fewer than two points.
    """
    y = np.asarray(losses, dtype=np.float64)
    if y.size < 2:
        return 0.0
    d = np.diff(y)
    mad = float(np.median(np.abs(d - np.median(d))))
    return max(1.4826 * mad / math.sqrt(2.0), RELATIVE_NOISE_FLOOR * float(np.median(np.abs(y))))


def smoothing_gain(n: int, sigma: float | None = None) -> np.ndarray:
    """How much of independent point noise :func:`centered_smooth` keeps at each of ``n`` points.

    A smoothed value is a weighted mean, so its noise is ``noise * sqrt(sum w**2) / sum w`` over the
    weights it used: about ``1 / sqrt(3.5 * sigma)`` inside the curve, more at the ends where the kernel
    is cut.
    """
    kernel = _kernel(n, sigma)
    if kernel is None:
        return np.ones(n)
    ones = np.ones(n)
    return np.asarray(np.sqrt(_convolve(ones, kernel**2)) / _convolve(ones, kernel))


@dataclass(frozen=True, kw_only=True)
class DescentCheck:
    """Whether a smoothed range-test curve falls by more than its own noise (see :func:`descent_check`).

    Attributes:
        fall: how far the smoothed curve falls, from ``start`` to its minimum at ``lowest``.
        start: index of the point the fall is measured from (the one where it stands out most).
        lowest: index of the smoothed curve's minimum.
        noise: the raw losses' noise (:func:`loss_noise`).
        fall_noise: the noise of that fall on the smoothed curve (``noise`` times the smoother's gain at
            both ends, added in quadrature).
        ratio: ``fall / fall_noise`` (``inf`` for a fall on a noiseless curve, ``0`` without a fall).
        required: the ratio a suggestion needs.
    """

    fall: float
    start: int
    lowest: int
    noise: float
    fall_noise: float
    ratio: float
    required: float

    @property
    def stands_out(self) -> bool:
        """``True`` when the fall is at least ``required`` times its noise."""
        return self.ratio >= self.required


def descent_check(
    losses: Sequence[float],
    curve: Sequence[float] | None = None,
    required: float = DESCENT_NOISE_MULTIPLE,
    sigma: float | None = None,
    noise_floor: float = 0.0,
) -> DescentCheck:
    """Does the smoothed curve's fall to its minimum stand out of the noise of the raw ``losses``?

    ``curve`` is :func:`centered_smooth` of ``losses`` (computed when not given, with ``sigma``). The
    noise is :func:`loss_noise` of the raw losses up to the curve's minimum ``m`` (at least the first
    :data:`NOISE_POINTS`): what comes after is the divergence, and with no stop rule it can be most of
    the curve. For every point ``i`` before ``m``, its fall ``curve[i] - curve[m]`` is compared with the
    noise that fall has on a curve of pure noise, ``noise * sqrt(g_i**2 + g_m**2)`` (``g``:
    :func:`smoothing_gain`); the point where the ratio is largest is kept. On pure noise the
    ratio stays below about 5 (99th percentile of Gaussian noise, 40 points or more; heavier tails and
    fewer points reach higher); a real descent gives tens. ``noise_floor``: the noise is never taken
    below it (the spread between averaged sweeps, see :func:`sweep_spread`).
    """
    y = np.asarray(losses, dtype=np.float64)
    c = np.asarray(centered_smooth(losses, sigma) if curve is None else curve, dtype=np.float64)
    if c.shape != y.shape:
        raise ValueError(f"`curve` and `losses` must have the same length; got {c.size} and {y.size}")
    if y.size < 2:
        return DescentCheck(
            fall=0.0, start=0, lowest=0, noise=loss_noise(y), fall_noise=0.0, ratio=0.0, required=required
        )
    m = int(np.argmin(c))
    # the noise before the divergence: a long diverging tail (no stop rule) is no noise of the descent
    noise = max(loss_noise(y[: max(m + 1, min(y.size, NOISE_POINTS))]), noise_floor)
    gain = smoothing_gain(y.size, sigma)
    spread = noise * np.sqrt(gain[: m + 1] ** 2 + gain[m] ** 2)
    fall = c[: m + 1] - c[m]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(fall > 0, fall / spread, 0.0)
    i = int(np.argmax(ratios))
    return DescentCheck(
        fall=float(fall[i]),
        start=i,
        lowest=m,
        noise=noise,
        fall_noise=float(spread[i]),
        ratio=float(ratios[i]),
        required=required,
    )


def running_median(values: Sequence[float] | np.ndarray, half: int) -> np.ndarray:
    """The median of each point's window of ``2 * half + 1`` neighbours (cut at the ends).

    Unlike a mean, a median is not dragged by the few huge losses of a diverging tail: the curve's low
    point stays where the descent put it.
    """
    y = np.asarray(values, dtype=np.float64)
    h = max(0, int(half))
    return np.array([np.median(y[max(0, i - h) : i + h + 1]) for i in range(y.size)])


def divergence_start(losses: Sequence[float]) -> int:
    """The index where a sweep's diverging tail begins (``len(losses)`` when it has none).

    The tail starts at the first raw loss after the curve's low point (read on a running median, which
    the blow-up does not move) that has climbed back above the level the sweep started from (the median
    of its first tenth) by as much as the curve fell, plus :data:`DIVERGENCE_NOISE` times the losses'
    noise before the low. Everything from there on is the divergence, not the descent: smoothing it
    together with the descent drags the curve's low up and to the left, and its jumps inflate the noise.
    """
    y = np.asarray(losses, dtype=np.float64)
    n = y.size
    if n < 5:
        return n
    start = float(np.median(y[: max(3, n // 10)]))
    robust = running_median(y, max(1, n // 40))
    low = int(np.argmin(robust))
    noise = loss_noise(y[: max(low + 1, min(n, NOISE_POINTS))])
    limit = start + max(start - float(robust[low]), 0.0) + DIVERGENCE_NOISE * noise
    above = np.nonzero(y[low + 1 :] > limit)[0]
    return n if above.size == 0 else low + 1 + int(above[0])


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


def suggest_peak(lrs: Sequence[float], losses: Sequence[float]) -> float | None:
    """The LR of the curve's lowest point: the peak for a run that warms up to it and then decays.

    A range test raises the LR on a model that has hardly trained; the point where its loss stops falling
    is about the largest LR that model takes. A warm-up reaches the peak only after the model has
    trained at smaller LRs, and a decay brings it down again, which is why one-cycle and warm-up-then-decay
    schedules run at about that LR (Smith 2018), a decade above the descent's steepest point that suits a
    constant LR. ``None`` when the curve's lowest point is its first.
    """
    return suggest_minimum(lrs, losses, divisor=1.0)


def suggest_all(
    lrs: Sequence[float],
    losses: Sequence[float],
    raw: Sequence[float] | None = None,
    required: float = DESCENT_NOISE_MULTIPLE,
) -> dict[str, float | None]:
    """Every suggestion method on one (already smoothed) curve, keyed by method name.

    With ``raw`` (the raw losses ``losses`` was smoothed from) every method gives ``None`` unless the
    curve's fall stands out of its noise as the finder judges it (:func:`read_curve`, with ``required``):
    each method alone finds a "descent" in any wiggle of a curve that cannot fall.
    """
    if raw is not None and not read_curve(lrs, raw, required).descent.stands_out:
        return dict.fromkeys(SUGGESTION_METHODS)
    return {
        "valley": suggest_valley(lrs, losses),
        "steep": suggest_steep(lrs, losses),
        "minimum": suggest_minimum(lrs, losses),
        "slide": suggest_slide(lrs, losses),
        "peak": suggest_peak(lrs, losses),
    }


@dataclass(frozen=True)
class CurveReading:
    """A sweep read as the finder reads it (see :func:`read_curve`).

    Attributes:
        cut: index where the diverging tail begins (:func:`divergence_start`; ``len(losses)``: none).
        curve: the zero-lag smoothed curve of every point, the one the suggestions are read from.
        head: the zero-lag smoothed curve of the points before the tail, the one the descent is judged on
            (``descent.start`` and ``descent.lowest`` index it).
        descent: the descent check on the points before the tail.
        suggestions: every method's suggestion, all ``None`` unless the descent stands out.
    """

    cut: int
    curve: list[float]
    head: list[float]
    descent: DescentCheck
    suggestions: dict[str, float | None]


def sweep_spread(sweeps: Sequence[Sequence[float]]) -> float:
    """The noise of the mean of several sweeps at the same LRs, read from how far they differ point by point.

    Each sweep's step-to-step differences, their variance between the sweeps at each point pooled over
    the points, halved, over the number of sweeps: a mean of squares, so heavy tails count in full (the
    step-to-step MAD of :func:`loss_noise` ignores them: a batch-of-one cross-entropy, skewed by its rare
    confident mistakes, once passed for a descent at 7.4 times its MAD noise), while neither the common
    trend nor a slow drift of one sweep's trajectory from another's enters it. ``0.0`` for fewer than two
    sweeps or points.
    """
    y = np.asarray(sweeps, dtype=np.float64)
    if y.ndim != 2 or y.shape[0] < 2 or y.shape[1] < 2:
        return 0.0
    between = np.var(np.diff(y, axis=1), axis=0, ddof=1)
    return float(math.sqrt(float(np.mean(between)) / 2.0 / y.shape[0]))


def read_curve(
    lrs: Sequence[float],
    losses: Sequence[float],
    required: float = DESCENT_NOISE_MULTIPLE,
    sweeps: Sequence[Sequence[float]] = (),
) -> CurveReading:
    """Judge the descent without the diverging tail; read the suggestions off the whole smoothed curve.

    Whether the curve falls (its noise, its smoothed fall) is judged on the points before the tail
    (:func:`divergence_start`): smoothed together with a blow-up, the low is dragged up and to the left
    and the noise grows, and a real descent can look like noise. The suggestions read the whole curve,
    as before: there the tail lifts the last points of the descent, which keeps ``steep`` and ``peak``
    off the edge of the blow-up (read on the descent alone, the steepest point moved onto that edge and
    a batch-4 Adam MLP's suggestion doubled, 1.18 -> 1.59 times the best loss in benchmarks/lr_hard.py).

    ``losses`` can be the mean of several ``sweeps`` (their losses at the same ``lrs``): then the noise is
    at least their spread (:func:`sweep_spread`, on the points up to the curve's low, as the noise).
    """
    if len(lrs) != len(losses):
        raise ValueError(f"`lrs` and `losses` must have the same length; got {len(lrs)} and {len(losses)}")
    cut = divergence_start(losses)
    head = centered_smooth(losses[:cut])
    # the spread where the noise is read: up to the curve's low (at least NOISE_POINTS points); nearer the
    # blow-up each sweep's trajectory goes its own way, which is no noise of the descent
    upto = max(int(np.argmin(head)) + 1 if head else 0, min(cut, NOISE_POINTS))
    spread = sweep_spread([list(s[:upto]) for s in sweeps])
    check = descent_check(losses[:cut], head, required, noise_floor=spread)
    curve = centered_smooth(losses)
    suggestions: dict[str, float | None] = dict.fromkeys(SUGGESTION_METHODS)
    if check.stands_out:
        suggestions = suggest_all(lrs, curve)
    return CurveReading(cut, curve, head, check, suggestions)
