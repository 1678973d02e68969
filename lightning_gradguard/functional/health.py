"""The math behind the health detectors: norm baselines, spikes, growth, gradient flow, unit activity.

Pure functions on tensors (or plain float sequences), no Trainer. The gradient helpers work on a
handful of per-layer norms already brought to the host; the activity helpers reduce a (possibly huge)
activation to one small vector per layer on its own device, so a caller can gather every layer's
vector and read them all in one transfer.

Conventions:

* norms are non-negative; a norm of exactly 0 means "no gradient signal" (the layer was not used or is
  frozen behind a dead path) and is never treated as "vanishing" by the helpers here;
* a *unit* of an activation is a feature of a ``Linear`` output (the last dimension) or a channel of a
  ``ConvNd`` output (dimension 1); every other dimension (batch, time, space) counts as a sample.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

#: Pre-activation values beyond which the activation's float32 derivative is numerically gone:
#: ``tanh`` for ``|x| > 9.5``, ``sigmoid`` below ``-23`` or above ``17``.
SATURATION_BOUNDS: dict[str, tuple[float, float]] = {"tanh": (-9.5, 9.5), "sigmoid": (-23.0, 17.0)}


def _floats(values: Sequence[float] | Tensor) -> list[float]:
    """``values`` as Python floats (a tensor read once; a list of host numbers taken as it is)."""
    if isinstance(values, Tensor):
        return list(map(float, values.detach().reshape(-1).tolist()))
    return list(map(float, values))


def _log10s(x: list[float]) -> list[float]:
    """``log10`` of each value as torch computes it: 0 gives ``-inf``, a negative or NaN value NaN."""
    return [math.log10(v) if v > 0.0 else -math.inf if v == 0.0 else math.nan for v in x]


def _lower_median(x: list[float]) -> float:
    """The lower median (``torch.median``'s: the smaller middle value of an even count)."""
    return sorted(x)[(len(x) - 1) // 2]


def log10_norms(norms: Sequence[float] | Tensor) -> Tensor:
    """``log10`` of the norms; zeros become ``-inf`` and non-finite norms stay non-finite."""
    return torch.tensor(_log10s(_floats(norms)), dtype=torch.float64)


def robust_baseline(values: Sequence[float] | Tensor, method: str = "median", beta: float = 0.9) -> float:
    """A typical value of a series that one outlier cannot drag: its median or its bias-corrected EMA.

    Non-finite entries are ignored. Meant for log-norms: the median of ``log10`` norms is the log of
    the median norm, and a geometric EMA is far less sensitive to a single spike than an arithmetic one.
    Host math (a handful of numbers per check).

    Returns:
        The baseline, or NaN when no finite value was given.
    """
    if method not in ("median", "ema"):
        raise ValueError(f"`method` must be 'median' or 'ema'; got {method!r}")
    x = [v for v in _floats(values) if math.isfinite(v)]
    if not x:
        return math.nan
    if method == "median":
        return _lower_median(x)  # the lower median for an even count: a conservative baseline
    return ema(x, beta)


def ema(values: Sequence[float] | Tensor, beta: float = 0.9) -> float:
    """Exponential moving average with bias correction (``beta`` close to 1 = long memory)."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"`beta` must be in [0, 1); got {beta!r}")
    x = _floats(values)
    n = len(x)
    if n == 0:
        return math.nan
    weighted = math.fsum([(1.0 - beta) * beta ** (n - 1 - i) * v for i, v in enumerate(x)])
    return weighted / (1.0 - beta**n)


def spike_ratio(value: float, history: Sequence[float] | Tensor, recent: int | None = None) -> float:
    """How many times larger ``value`` is than the run's typical norm (NaN without a usable history).

    The typical norm is the median of ``history``; with ``recent``, the larger of that median and the
    median of the last ``recent`` entries. The long median is robust to outliers but lags a level that
    is still moving: a norm that is rising by design (a GAN's generator while its discriminator learns,
    a warm-up) sits far above the median of its own past without any jump. The short median follows
    the current level, so a value is a spike only when it jumps above both. On a steady level the two
    medians agree and the ratio is the plain one. A ratio of 10 means "ten times the typical norm".
    The history should not include ``value``.
    """
    if recent is not None and recent < 1:
        raise ValueError(f"`recent` must be a positive int or None; got {recent!r}")
    logs = _log10s(_floats(history))
    base = robust_baseline(logs)
    if recent is not None and math.isfinite(base):
        base = max(base, robust_baseline(logs[-recent:]))
    if not math.isfinite(base) or not value > 0:
        return math.nan
    return 10.0 ** (math.log10(value) - base)


def growth_factor(history: Sequence[float] | Tensor, min_rising: float = 0.7) -> float:
    """The multiplicative change across a series of norms, if it is a sustained rise; else 1.0.

    The change is read off a least-squares line through ``log10(norm)`` (so one outlier moves it
    little), ``10 ** (slope * (n - 1))``. A series counts as a sustained rise when at least
    ``min_rising`` of its consecutive steps go up. Non-finite or zero entries make it 1.0 (no verdict).
    """
    y = _log10s(_floats(history))
    n = len(y)
    if n < 3 or not all(map(math.isfinite, y)):
        return 1.0
    if sum([b > a for a, b in itertools.pairwise(y)]) / (n - 1) < min_rising:
        return 1.0
    t = [i - (n - 1) / 2.0 for i in range(n)]
    y_mean = math.fsum(y) / n
    covariance = math.fsum([ti * (yi - y_mean) for ti, yi in zip(t, y, strict=True)])
    slope = covariance / math.fsum([ti * ti for ti in t])
    return 10.0 ** (slope * (n - 1))


def depth_ratio(norms_in_depth_order: Sequence[float] | Tensor) -> tuple[float, int, int]:
    """First-layer over last-layer gradient norm, skipping layers without a gradient (norm 0).

    Args:
        norms_in_depth_order: per-layer norms, the input side first (forward order).

    Returns:
        ``(ratio, first, last)``: the ratio and the positions used; ``(nan, -1, -1)`` when fewer than
        two layers carry a gradient.
    """
    x = _floats(norms_in_depth_order)
    live = [i for i, v in enumerate(x) if math.isfinite(v) and v > 0]
    if len(live) < 2:
        return math.nan, -1, -1
    first, last = live[0], live[-1]
    return x[first] / x[last], first, last


#: the share of the checked entries from which layers whose gradient is too small for the optimizer to
#: move them are a fault of the model: below it they are a sliver small by design (a state-space layer's
#: ``A_log`` and ``dt_bias``, a router's gate, a linear attention's forget gate, a bottleneck's LayerNorm:
#: 0.03-3.8 % of the shrunk models of the sweep of every transformers architecture) that learns slowly
#: while the model learns. One notion for every rule that reads a tiny gradient under an adaptive optimizer.
SLIVER_SHARE = 0.05


def sizeable_share(part: float, whole: float, share: float = SLIVER_SHARE) -> bool:
    """Whether ``part`` entries (of layers a rule found) are ``share`` of ``whole`` (the entries it checked)
    or more; ``False`` for no part at all. Counts, not norms: a sliver of a model is judged by its size."""
    return part > 0 and part >= share * whole


def flow_values(norms: Sequence[float] | Tensor) -> list[float]:
    """``log10(norm / largest norm)`` per layer as host numbers (see :func:`gradient_flow`)."""
    x = _floats(norms)
    top = max([v for v in x if math.isfinite(v) and v > 0], default=None)
    if top is None:
        return [math.nan] * len(x)
    return _log10s([v / top for v in x])


def gradient_flow(norms: Sequence[float] | Tensor) -> Tensor:
    """``log10(norm / largest norm)`` per layer: 0 for the strongest layer, -3 for one 1000x weaker.

    Layers with a zero norm get ``-inf``; if no layer has a finite positive norm, every entry is NaN.
    """
    return torch.tensor(flow_values(norms), dtype=torch.float64)


def unit_dim(ndim: int, channel_first: bool) -> int:
    """The dimension that indexes units of an activation with ``ndim`` dimensions.

    ``Linear``-style outputs ``(..., features)`` use the last dimension; ``ConvNd``-style outputs
    ``(batch, channels, *spatial)`` use dimension 1 (``channel_first``). A 1-D tensor is one sample.
    """
    if ndim <= 1:
        return 0
    return 1 if channel_first else ndim - 1


def _other_dims(x: Tensor, dim: int) -> tuple[int, ...]:
    return tuple(d for d in range(x.dim()) if d != dim)


def activity_counts(activation: Tensor, dim: int) -> tuple[Tensor, int]:
    """Per unit, how many of its values are non-zero (active), and how many values each unit has.

    For a ReLU output "non-zero" is "positive". One reduction kernel; the counts stay on the device.

    Returns:
        ``(counts[units] int64, samples_per_unit)``.
    """
    x = activation.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    if x.dim() == 1:
        return (x != 0).long(), 1
    dims = _other_dims(x, dim)
    n = x.numel() // max(x.shape[dim], 1)
    return torch.count_nonzero(x, dim=dims), n


def saturation_counts(pre_activation: Tensor, kind: str, dim: int) -> tuple[Tensor, int]:
    """Per unit, how many inputs of a ``sigmoid``/``tanh`` lie in its saturated zone.

    The zones are :data:`SATURATION_BOUNDS`. Returns ``(counts[units] int64, samples_per_unit)``.
    """
    if kind not in SATURATION_BOUNDS:
        raise ValueError(f"`kind` must be one of {tuple(SATURATION_BOUNDS)}; got {kind!r}")
    lo, hi = SATURATION_BOUNDS[kind]
    x = pre_activation.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    outside = (x < lo) | (x > hi)
    if x.dim() == 1:
        return outside.long(), 1
    dims = _other_dims(x, dim)
    n = x.numel() // max(x.shape[dim], 1)
    return outside.sum(dim=dims), n


def dead_units(active_counts: Sequence[Tensor] | Tensor) -> Tensor:
    """Units that were never active in any of the given batches (bool per unit).

    Args:
        active_counts: one per-unit count vector per batch (as from :func:`activity_counts`), or a
            stacked ``[batches, units]`` tensor. A unit is dead in the window when its count is zero in
            every batch: it output 0 for every sample the window saw.
    """
    if isinstance(active_counts, Tensor):
        stacked = active_counts.reshape(-1, active_counts.shape[-1]) if active_counts.dim() else active_counts
    else:
        if len(active_counts) == 0:
            raise ValueError("`active_counts` must hold at least one batch")
        stacked = torch.stack([torch.as_tensor(c) for c in active_counts])
    return ~(stacked != 0).any(dim=0)


def class_profile(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """What each class's examples get from the model, summed: ``(S, N)`` with ``S[k, j]`` the sum over the
    batch's examples of class ``k`` of their score for class ``j`` and ``N[k]`` their count (float32, on the
    device; no host sync). Divided, ``S / N`` is the class-mean profile that :func:`label_lean` tests.

    The scores are the logits centred over the batch (what every input gets alike goes: the class
    frequencies a model at chance has learned), then each row over the classes (the shift a softmax
    ignores: log-probabilities read as their logits), then scaled to a root mean square of 1 (every batch
    weighs the same, whatever the logits' size; outputs that barely depend on the input, 1e-4 of the
    logits' size or less, keep their size: rounding is not a profile). Targets outside ``[0, K)`` (an
    ``ignore_index``) count for nothing.

    Args:
        logits: ``(batch, K)`` scores of ``K`` classes.
        targets: ``(batch,)`` class indices.
    """
    raw = logits.detach().float()
    z = raw - raw.mean(0, keepdim=True)
    z = z - z.mean(1, keepdim=True)
    # outputs the same for every input differ by rounding only: a floor keeps that residue near 0
    floor = 1e-4 * raw.square().mean().sqrt() + torch.finfo(torch.float32).tiny
    z = z / torch.maximum(z.square().mean().sqrt(), floor)
    k = z.shape[1]
    y = targets.detach().reshape(-1).long()
    valid = ((y >= 0) & (y < k)).float()
    rows = y.clamp(0, k - 1)
    sums = z.new_zeros(k, k).index_add_(0, rows, z * valid[:, None])
    return sums, z.new_zeros(k).index_add_(0, rows, valid)


def label_lean(sums: Tensor, counts: Tensor, draws: int = 2000) -> tuple[float, float]:
    """How far a model's outputs lean toward the labels, and whether that is more than chance: ``(lean,
    p)`` from a :func:`class_profile` (summed over any number of batches; host tensors).

    ``lean`` is the mean over the classes seen of their examples' own-class score (the diagonal of the
    class-mean profile ``M = S / N``). ``p`` is the share of the relabelings of those classes (every
    permutation for up to 7 classes, else ``draws`` random ones and the labels as given) whose diagonal
    sum reaches the labels' own: a model that has not learned the labels cannot tell its classes' names
    apart, so its labels' diagonal is one draw among the relabelings' (however much class structure a
    random initialization, or training on wrong labels, gave its outputs); a model that learned them
    puts the labels' diagonal first. ``(nan, 1.0)`` with fewer than 4 classes seen: among the 2 or 6
    relabelings of 2 or 3 classes no diagonal is ever rare.
    """
    seen = torch.nonzero(counts > 0).reshape(-1)
    k = int(seen.numel())
    if k < 4:
        return math.nan, 1.0
    m = sums.double()[seen][:, seen] / counts.double()[seen][:, None]
    own = float(m.diagonal().sum())
    if k <= 7:
        perms = torch.tensor(list(itertools.permutations(range(k))))
        extra = 0
    else:
        g = torch.Generator().manual_seed(0)
        perms = torch.stack([torch.randperm(k, generator=g) for _ in range(draws)])
        extra = 1  # the labels' own diagonal counts as one draw
    totals = m.gather(1, perms.T).sum(0)
    reached = int((totals >= own - 1e-9 * max(abs(own), 1.0)).sum())
    return own / k, (reached + extra) / (perms.shape[0] + extra)
