"""What one check of a stalled-learning detector measured, the thresholds its rules use, and a finding.

Plain data and helpers on host numbers, no Trainer: :class:`StallCheck` is one check's measurements,
:class:`Rounding` what it measured of the low-precision weights' updates, :class:`StallThresholds` the
thresholds the rules of :mod:`lightning_gradguard.monitors.stall.rules` read; :func:`label_entropy` is
the loss of a classifier that learned only the class frequencies, :func:`token_entropy` that of a
sequence model that learned only the token frequencies, :func:`loss_trend` how much a loss fell over a few
checks against its noise, :func:`batch_purity` how much of a batch its one or two largest classes hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradguard.monitors.stall.ahead import Ahead

#: the weight dtypes whose updates the rounding rule measures (16-bit floats: bfloat16 keeps 8 significant
#: bits, float16 11)
LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class StallThresholds:
    """The thresholds of the rules (see :mod:`lightning_gradguard.monitors.stall.rules`).

    Attributes:
        patience: consecutive checks a condition must hold.
        warmup_steps: no ``chance_level`` / ``loss_plateau`` verdict before this step.
        collapse_factor: an update ratio this many times below its highest level has collapsed; an LR
            this many times below its highest has fallen.
        collapse_layers: the share of the layers that must have collapsed.
        collapse_share: a collapse must have lasted this share of the steps so far.
        final_phase: the last share of the planned run, where a schedule may decay the LR to ~0.
        early_phase: an LR that fell ``collapse_factor`` times within this first share of the planned run
            fell early (a schedule in the wrong unit gets there within a few percent of the run).
        clip_factor: a used gradient this many times smaller than the raw one is clipped to nothing.
        chance_margin: the loss is at chance when it is at least ``1 - chance_margin`` times the chance
            level (and at most ``chance_ceiling`` times it, or ``1 + chance_margin`` times ``ln V`` for token
            targets over a vocabulary of ``V``: the loss of a uniform guess).
        chance_ceiling: see ``chance_margin``; also, the chance rule is armed only when the first check's
            loss is within this factor of the chance level (a classifier's first loss is about ln C) or under
            the band's top.
        trend_floor: over the last ``patience`` check intervals, a loss that fell this share of its level...
        trend_sigmas: ...and this many standard errors of the fall is still falling (not at chance).
        chance_checks: consecutive checks whose window is at chance before ``chance_level``.
        plateau_checks: checks without a new best smoothed loss before ``loss_plateau``.
        plateau_factor: ``loss_plateau`` when the smoothed loss is this many times its best...
        improvement: ...or a new best is this relative improvement.
        lr_jump_factor: an LR this many times the configured maximum is a jump.
        warmup_lr_fraction: a warm-up that never ends keeps the LR under this share of the configured.
        warmup_lr_steps: with the planned run unknown, the warm-up is judged at this step.
        warmup_min_steps: the earliest step the warm-up is extrapolated from.
        warmup_ratio: ``warmup_missing`` when, on the dense start's checks, a transformer trained by an
            adaptive optimizer at (at least half) its configured LR from step 0 rewrites this share of its
            weights a step (the total update/weight ratio): healthy runs with a warm-up measured 0.013 at
            most in their first 5 steps, a post-LN BERT at a constant 7e-3 0.05-0.10.
        sorted_purity: a batch is (almost) one class when its largest class holds this share of it (its
            two largest, for a batch on a class boundary).
        sorted_minority: ...and that class is at most this share of the labels seen so far.
        decay_fall: a weight norm this many times below its highest has been shrunk away...
        decay_dominance: ...when the weight decay's part of the update was this many times the rest of it
            (1: larger than everything the gradient did, along the weights and across them).
        rounding_share: ``update_below_precision`` when more than this share of the low-precision weight
            entries that had a non-zero gradient did not change (their update was rounded away), on
            ``patience`` checks in a row, while the loss is above half its first value.
        decay_rate: read ahead, a decoupled weight decay that removes this share of every weight a step
            (``lr * weight_decay`` at the schedule's highest LR) on most of the model shrinks the weights
            away (a half-life of 69 steps at 1e-2; usual recipes sit at 1e-5 to 1e-3).
        dropout_ceiling: a dropout rate at or above this keeps a tenth of its inputs or less: a keep
            probability given as the drop rate (usual rates are 0 to 0.5): a warning.
        dropout_note: from this rate on (a fifth kept), an INFO line: still a keep probability most
            likely, yet a classifier head learns behind it (``transformers``' MobileNetV2 default).
        learning_p: a classifier whose outputs, over the loss window, lean toward the labels more than
            all but this share of the relabelings of its classes would is learning, whatever its loss
            says (:mod:`~lightning_gradguard.monitors.stall.evidence`): the chance rules hold their verdict.
    """

    patience: int = 3
    warmup_steps: int = 40
    collapse_factor: float = 100.0
    collapse_layers: float = 0.5
    collapse_share: float = 0.1
    final_phase: float = 0.1
    early_phase: float = 0.25
    clip_factor: float = 100.0
    chance_margin: float = 0.03
    chance_ceiling: float = 1.5
    trend_floor: float = 0.005
    trend_sigmas: float = 2.0
    chance_checks: int = 2
    plateau_checks: int = 30
    plateau_factor: float = 2.0
    improvement: float = 0.01
    lr_jump_factor: float = 10.0
    warmup_lr_fraction: float = 0.05
    warmup_lr_steps: int = 100
    warmup_min_steps: int = 19
    warmup_ratio: float = 0.03
    sorted_purity: float = 0.9
    sorted_minority: float = 0.5
    decay_fall: float = 10.0
    decay_dominance: float = 1.0
    rounding_share: float = 0.5
    decay_rate: float = 1e-2
    dropout_ceiling: float = 0.9
    dropout_note: float = 0.8
    learning_p: float = 0.05


@dataclass(frozen=True)
class Rounding:
    """The updates of a check's step on its 16-bit weights (:data:`LOW_PRECISION`), from the step's
    update sample; entry counts are scaled up from the sample to whole tensors.

    Attributes:
        dtype: the dtype of most of those weights (by entries).
        parameters: how many such parameters had a gradient (LR not 0).
        graded: their entries with a non-zero gradient.
        lost: those of them whose value did not change: the update was rounded away.
        update: the median ``|delta w|`` of the entries with a gradient that did change.
        weight: the median ``|w|`` of the entries with a gradient.
        lost_weight: the median ``|w|`` of the entries that did not change (NaN: none).
    """

    dtype: torch.dtype
    parameters: int
    graded: float
    lost: float
    update: float
    weight: float
    lost_weight: float

    @property
    def share(self) -> float:
        """The share of the entries with a gradient whose update was rounded away (0 without any)."""
        return self.lost / self.graded if self.graded > 0 else 0.0


@dataclass(frozen=True)
class StallCheck:
    """What one check measured. ``None`` / empty: not measured (that rule skips the check).

    ``lr``: the LR the checked step used (the largest over the param groups); ``lr_max``: the largest
    LR any step used so far; ``lr_configured``: the largest LR the optimizer was configured to reach.
    ``loss``: the mean training loss since the previous check. ``update_ratios``: ``||delta w|| / ||w||``
    per layer for this check's step; ``update_total``: ``||delta w||`` over every parameter.
    ``clip_ratio``: the norm of the gradient the optimizer used over its norm before clipping.
    ``labels``: class counts of the check's batch; ``tokens``: token counts of its token-level targets (a
    host tensor indexed by token id). ``planned_steps``: the run's planned optimizer steps (``None``:
    unknown). ``loss_stderr``: the standard error of ``loss`` (``None`` with fewer than two losses).
    ``weight_norms``: ``||w||`` per layer before the step; ``decay``: per layer, the norm of the weight
    decay's part of the update (``lr * weight_decay * ||w||``) and of the rest of it, for the layers an
    optimizer with decoupled decay updates; ``decay_groups``: ``(lr, weight_decay)`` of each param group
    that decays. ``rounding``: the updates of the 16-bit weights (only when the model has some).
    ``adaptive``: the optimizer divides each step by the gradient's running size (Adam and its family,
    ``core.lr.adaptive_eps``): the gradient's scale, and so a clip's, does not set its update.
    ``attention``: the model has attention layers (a transformer). ``ahead``: what the settings said
    at the start of training (the schedule read ahead, the weight decay's rate, the dropout rates), on
    every check of a fresh run (``None`` after a resume: nothing is read ahead then).
    """

    step: int
    lr: float
    lr_max: float
    lr_configured: float
    loss: float | None = None
    update_ratios: Mapping[str, float] = field(default_factory=dict)
    update_total: float | None = None
    clip_ratio: float | None = None
    labels: Sequence[float] | None = None
    planned_steps: int | None = None
    loss_stderr: float | None = None
    tokens: Tensor | None = None
    weight_norms: Mapping[str, float] = field(default_factory=dict)
    decay: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    decay_groups: Sequence[tuple[float, float]] = ()
    rounding: Rounding | None = None
    adaptive: bool = False
    orthogonalized: bool = False  # most of the update is orthogonalized (Muon): its size is the design
    attention: bool = False
    #: the outputs' class profile over the steps since the previous check (sums, counts: host tensors;
    #: :mod:`~lightning_gradguard.monitors.stall.evidence`); ``None``: not measured
    class_profile: tuple[Tensor, Tensor] | None = None
    ahead: Ahead | None = None  # what the settings said at the start of a fresh run

    @property
    def update_ratio_total(self) -> float | None:
        """``||delta w|| / ||w||`` over every measured layer, the decoupled weight decay's part of the
        update left out (the layers in ``decay`` count the rest of their update): what the gradient's
        steps do; ``None`` when not measured."""
        weights = math.sqrt(sum(w * w for w in self.weight_norms.values()))
        if self.update_total is None or weights <= 0:
            return None
        if not self.decay:
            return self.update_total / weights
        moved = sum(
            (self.decay[k][1] if k in self.decay else self.update_ratios.get(k, 0.0) * w) ** 2
            for k, w in self.weight_norms.items()
        )
        return math.sqrt(moved) / weights


def label_entropy(counts: Sequence[float]) -> float:
    """The entropy (nats) of a class distribution given by counts: the loss of a classifier that learned
    nothing but the class frequencies (``log C`` for balanced classes). NaN without any count."""
    total = sum(counts)
    if total <= 0:
        return math.nan
    return -sum(c / total * math.log(c / total) for c in counts if c > 0)


def token_entropy(counts: Tensor) -> float:
    """The entropy (nats) of the token frequencies given by ``counts`` (a tensor indexed by token id): the
    loss of a sequence model that learned nothing but how often each token occurs. Miller-Madow corrected
    (``+ (K - 1) / 2N`` for ``K`` tokens seen in ``N``): with a vocabulary as large as the sample the
    plain estimate is low by about that much. NaN without any count."""
    c = counts.double()
    c = c[c > 0]
    total = float(c.sum()) if c.numel() else 0.0
    if total <= 0:
        return math.nan
    p = c / total
    return float(-(p * p.log()).sum()) + (c.numel() - 1) / (2 * total)


@dataclass(frozen=True)
class LossTrend:
    """A loss over a few checks: its mean ``level``, how much the least-squares line through it fell from
    the first check to the last (``fall``, negative for a rise), and the standard error of that fall."""

    level: float
    fall: float
    noise: float


def loss_trend(points: Sequence[tuple[int, float, float | None]]) -> LossTrend | None:
    """The trend of ``(step, mean loss, its standard error)`` points (at least two, distinct steps).

    The noise is the standard error of the fitted fall: from the points' own standard errors when every
    point has one (the losses within each check), else from the line's residuals (three points or more;
    0 with two)."""
    if len(points) < 2:
        return None
    xs = [float(p[0]) for p in points]
    ys = [p[1] for p in points]
    n, xm, ym = len(points), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - xm) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys, strict=True)) / sxx
    span = xs[-1] - xs[0]
    errors = [p[2] for p in points]
    if all(e is not None and math.isfinite(e) for e in errors):  # var(slope) = sum (x - xm)^2 e^2 / sxx^2
        var_slope = sum((x - xm) ** 2 * e * e for x, e in zip(xs, errors, strict=True) if e is not None)
        var_slope /= sxx * sxx
    elif n > 2:
        residual = sum((y - ym - slope * (x - xm)) ** 2 for x, y in zip(xs, ys, strict=True)) / (n - 2)
        var_slope = residual / sxx
    else:
        var_slope = 0.0
    return LossTrend(level=ym, fall=-slope * span, noise=math.sqrt(var_slope) * span)


def batch_purity(counts: Sequence[float]) -> tuple[float, float]:
    """The shares of a batch held by its largest class and by its two largest classes."""
    total = sum(counts)
    if total <= 0:
        return 0.0, 0.0
    top = sorted(counts, reverse=True)[:2]
    return top[0] / total, sum(top) / total


def spread(history: Sequence[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    """About ``n`` entries of ``history``, from the first to the last."""
    if len(history) <= n:
        return list(history)
    picks = sorted({round(i * (len(history) - 1) / (n - 1)) for i in range(n)})
    return [history[i] for i in picks]
