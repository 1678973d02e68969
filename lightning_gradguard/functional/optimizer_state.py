r"""What an optimizer step did and what the optimizer keeps: step size, direction, moments, and two rules.

Pure math on host numbers, no Trainer: :func:`layer_geometry` and :func:`layer_moments` turn the
per-parameter sums a monitor measured on the step's update sample (``core.stats.UpdateSample``: per
parameter, the squared update norm, the squared gradient norm and the inner product of the update with
the negative gradient) into per-layer numbers, and :func:`epsilon_dominated` / :func:`ratio_outliers`
judge them.

Definitions (``Δw = w_after - w_before``, ``g`` the gradient the step used, ``lr_i`` the learning rate of
the param group of parameter ``i``):

* step size of a layer: :math:`\sqrt{\sum_i \|\Delta w_i\|^2 / lr_i^2}`, the norm of the update with each
  parameter's part divided by its own group's ``lr`` (a layer split over groups is measured per part).
  Plain SGD gives ``||g||``; Adam about ``sqrt(numel)`` (its per-entry step is about ``lr``).
* cosine: :math:`\langle \Delta w, -g\rangle / (\|\Delta w\|\,\|g\|)` over the layer's entries: 1 for plain
  SGD, lower where momentum, Adam's per-entry scaling or weight decay turn the step away from the gradient.
* ``exp_avg`` norm: the 2-norm of Adam's first moment as the optimizer holds it (not bias-corrected).
* RMS of :math:`\sqrt{\hat v}`: :math:`\sqrt{\operatorname{mean}(v) / (1 - \beta_2^t)}` over the layer's
  entries, the typical size of Adam's denominator before ``eps`` is added (``max_exp_avg_sq`` under
  AMSGrad, which is what divides there).

Sampling: a tensor above ``functional.updates.SAMPLE_ENTRIES`` (65 536) entries is measured on an
odd-strided sample of its entries, the same entries for the weights, the gradient and the optimizer's
moments; its sums are scaled by ``numel / sampled``. Below that size everything is exact.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LayerGeometry",
    "LayerMoments",
    "epsilon_dominated",
    "layer_geometry",
    "layer_moments",
    "ratio_outliers",
]


@dataclass(frozen=True)
class LayerGeometry:
    """Per-layer (and total) step size, cosine and update/weight ratio on the host.

    A layer without a gradient this step has no cosine; one without an update (a skipped step) has no
    cosine either; a layer of weight norm 0 has no ratio. Totals are ``None`` where undefined.
    """

    step_size: dict[str, float]
    cosine: dict[str, float]
    update_ratio: dict[str, float]
    step_size_total: float | None
    cosine_total: float | None
    update_ratio_total: float | None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def layer_geometry(
    labels: Sequence[str],
    index: Sequence[int],
    update_sq: Sequence[float],
    weight_sq: Sequence[float],
    lrs: Sequence[float],
    grads: dict[int, tuple[float, float]],
) -> LayerGeometry:
    """Combine per-parameter sums into layers (``index[i]``: the layer of parameter ``i``).

    ``grads`` maps a parameter to its ``(||g||^2, <Δw, -g>)``; a parameter of ``lr == 0`` adds nothing to
    the step size (its update is 0 in every ``torch.optim`` optimizer).
    """
    n = len(labels)
    upd, wsq, scaled, gsq, dot, has_grad = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [False] * n
    for i, j in enumerate(index):
        upd[j] += update_sq[i]
        wsq[j] += weight_sq[i]
        if lrs[i] > 0:
            scaled[j] += update_sq[i] / lrs[i] ** 2
        if i in grads:
            gsq[j] += grads[i][0]
            dot[j] += grads[i][1]
            has_grad[j] = True

    def cosine(u: float, g: float, d: float) -> float | None:
        return _finite(d / math.sqrt(u * g)) if u > 0 and g > 0 else None

    def ratio(u: float, w: float) -> float | None:
        return _finite(math.sqrt(u / w)) if w > 0 else None

    cos = {
        labels[j]: c for j in range(n) if has_grad[j] and (c := cosine(upd[j], gsq[j], dot[j])) is not None
    }
    return LayerGeometry(
        step_size={labels[j]: s for j in range(n) if (s := _finite(math.sqrt(scaled[j]))) is not None},
        cosine=cos,
        update_ratio={labels[j]: r for j in range(n) if (r := ratio(upd[j], wsq[j])) is not None},
        step_size_total=_finite(math.sqrt(sum(scaled))),
        cosine_total=cosine(sum(upd), sum(gsq), sum(dot)) if any(has_grad) else None,
        update_ratio_total=ratio(sum(upd), sum(wsq)),
    )


@dataclass(frozen=True)
class LayerMoments:
    """What the optimizer keeps, per layer and in total (host values; empty where it keeps none).

    Attributes:
        exp_avg_norm: 2-norm of Adam's ``exp_avg``.
        exp_avg_sq_rms: RMS of ``sqrt(v_hat)`` (bias-corrected second moment).
        momentum_norm: 2-norm of SGD's ``momentum_buffer``.
        eps: the ``eps`` of the param group holding most of the layer's entries (Adam family).
    """

    exp_avg_norm: dict[str, float]
    exp_avg_sq_rms: dict[str, float]
    momentum_norm: dict[str, float]
    eps: dict[str, float]
    totals: dict[str, float]


def _norms(
    labels: Sequence[str], index: Sequence[int], sq: dict[int, float]
) -> tuple[dict[str, float], float]:
    acc: dict[str, float] = {}
    for i, value in sq.items():
        acc[labels[index[i]]] = acc.get(labels[index[i]], 0.0) + value
    return {k: math.sqrt(v) for k, v in acc.items()}, math.sqrt(sum(acc.values()))


def layer_moments(
    labels: Sequence[str],
    index: Sequence[int],
    exp_avg_sq_norm: dict[int, float],
    momentum_sq_norm: dict[int, float],
    second: dict[int, tuple[float, int, float, float]],
) -> LayerMoments:
    """Per-layer moments from per-parameter numbers (keys: parameter positions).

    ``exp_avg_sq_norm[i]`` is ``||exp_avg_i||^2``, ``momentum_sq_norm[i]`` ``||momentum_buffer_i||^2``;
    ``second[i]`` is ``(sum(v_i), numel_i, 1 - beta2 ** step_i, eps_i)``. A parameter whose bias
    correction is 0 (no step taken yet) is left out.
    """
    exp_avg, exp_avg_total = _norms(labels, index, exp_avg_sq_norm)
    momentum, momentum_total = _norms(labels, index, momentum_sq_norm)
    v_sum: dict[str, float] = {}
    count: dict[str, int] = {}
    eps_weight: dict[str, dict[float, int]] = {}
    for i, (total, numel, correction, eps) in second.items():
        if correction <= 0 or numel <= 0:
            continue
        layer = labels[index[i]]
        v_sum[layer] = v_sum.get(layer, 0.0) + total / correction
        count[layer] = count.get(layer, 0) + numel
        eps_weight.setdefault(layer, {})
        eps_weight[layer][eps] = eps_weight[layer].get(eps, 0) + numel
    rms = {k: math.sqrt(v / count[k]) for k, v in v_sum.items()}
    totals: dict[str, float] = {}
    if exp_avg_sq_norm:
        totals["exp_avg_norm"] = exp_avg_total
    if rms:
        totals["exp_avg_sq_rms"] = math.sqrt(sum(v_sum.values()) / sum(count.values()))
    if momentum_sq_norm:
        totals["momentum_norm"] = momentum_total
    return LayerMoments(
        exp_avg_norm=exp_avg,
        exp_avg_sq_rms=rms,
        momentum_norm=momentum,
        eps={k: max(w, key=lambda e, w=w: w[e]) for k, w in eps_weight.items()},  # type: ignore[misc]
        totals=totals,
    )


def epsilon_dominated(rms: float, eps: float, ratio: float = 1.0) -> bool:
    """Whether ``eps`` dominates Adam's denominator ``sqrt(v_hat) + eps`` for a layer's typical entry:
    the RMS of ``sqrt(v_hat)`` is below ``ratio * eps`` (and not exactly 0: a layer that never had a
    gradient is not this finding)."""
    return 0.0 < rms < ratio * eps


def ratio_outliers(ratios: dict[str, float], factor: float) -> tuple[float, dict[str, float]]:
    """The median update/weight ratio over the layers and the layers more than ``factor`` times away from
    it, each with ``ratio / median`` (0 for a layer that did not move).

    Needs three layers or more and a median above 0 (a skipped step moves nothing): else no outlier.
    """
    values = [v for v in ratios.values() if math.isfinite(v) and v >= 0]
    if len(values) < 3:
        return 0.0, {}
    median = statistics.median(values)
    if median <= 0:
        return median, {}
    out = {k: v / median for k, v in ratios.items() if math.isfinite(v) and v >= 0}
    return median, {k: r for k, r in out.items() if r > factor or r < 1.0 / factor}
