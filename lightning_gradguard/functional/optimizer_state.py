r"""What an optimizer step did and what the optimizer keeps: step size, direction, moments; the rules' math.

Pure math on host numbers, no Trainer: :func:`layer_geometry` and :func:`layer_moments` turn the
per-parameter sums a monitor measured on the step's update sample (``core.stats.UpdateSample``: per
parameter, the squared update norm, the squared gradient norm and the inner product of the update with
the negative gradient) into per-layer numbers, and :func:`epsilon_dominated` / :func:`ratio_outliers`
judge them. :func:`entry_steps` finds a layer's largest per-entry step in units of its lr, and
:func:`adam_step_bound` says how large Adam's can be at all.

Definitions (``Δw = w_after - w_before``, ``g`` the gradient the step used, ``lr_i`` the learning rate of
the param group of parameter ``i``):

* step size of a layer: :math:`\sqrt{\sum_i \|\Delta w_i\|^2 / lr_i^2}`, the norm of the update with each
  parameter's part divided by its own group's ``lr`` (a layer split over groups is measured per part).
  Plain SGD gives ``||g||``; Adam about ``sqrt(numel)`` (its per-entry step is about ``lr``).
* cosine: :math:`\langle \Delta w, -g\rangle / (\|\Delta w\|\,\|g\|)` over the layer's entries: 1 for plain
  SGD, lower where momentum, Adam's per-entry scaling or weight decay turn the step away from the gradient.
* ``exp_avg`` norm: the 2-norm of Adam's first moment as the optimizer holds it (not bias-corrected).
* largest per-entry step of a layer: :math:`\max_i \|\Delta w_i\|_\infty / lr_i`. Adam's per-entry step
  :math:`lr\,|\hat m| / (\sqrt{\hat v} + \epsilon)` is at most :func:`adam_step_bound` times ``lr``.
* RMS of :math:`\sqrt{\hat v}`: :math:`\sqrt{\operatorname{mean}(v) / (1 - \beta_2^t)}` over the layer's
  entries, the typical size of Adam's denominator before ``eps`` is added (``max_exp_avg_sq`` under
  AMSGrad, which is what divides there).

Sampling: a tensor above ``functional.updates.SAMPLE_ENTRIES`` (65 536) entries is measured on a strided
sample of its entries (a stride coprime with its dimensions), the same entries for the weights, the
gradient and the optimizer's moments; its sums are scaled by ``numel / sampled``. Below that size
everything is exact.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


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
        entries: the entries ``exp_avg_sq_rms`` averages over, per layer: those the Adam family holds (a
            layer split between optimizers, Muon's matrix beside AdamW's bias, counts its bias only).
    """

    exp_avg_norm: dict[str, float]
    exp_avg_sq_rms: dict[str, float]
    momentum_norm: dict[str, float]
    eps: dict[str, float]
    totals: dict[str, float]
    entries: dict[str, int] = field(default_factory=dict)


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
        entries=count,
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


# ---------------------------------------------------------------------------------------------- Adam's step
def adam_step_bound(
    beta1: float, beta2: float, step: float, kind: str = "adam", momentum_decay: float = 0.004
) -> float | None:
    r"""The largest per-entry step, in units of ``lr``, that Adam can take at ``step`` for ANY gradients.

    Adam's step of an entry is :math:`lr\,\hat m_t / (\sqrt{\hat v_t} + \epsilon)`, with both moments
    linear in the past gradients :math:`g_{t-k}` (weights :math:`c_k` in :math:`\hat m`, :math:`w_k` in
    :math:`\hat v`). By Cauchy-Schwarz :math:`|\sum_k c_k g_{t-k}| \le \sqrt{\sum_k c_k^2/w_k}\,
    \sqrt{\sum_k w_k g_{t-k}^2}`, so the step is at most :math:`\sqrt{\sum_k c_k^2 / w_k}` (``eps`` only
    lowers it), reached by a large gradient followed by quiet ones. With :math:`q = \beta_1^2/\beta_2 < 1`
    the sum converges: about 7.3 for the default betas (0.9, 0.999), 1.0 for (0.9, 0.9), the bound of
    Kingma & Ba, *Adam* (2015), Sec. 2.1. With :math:`\beta_2 \le \beta_1^2` it grows like
    :math:`q^{t/2}`: ``inf`` (``v`` forgets a large gradient faster than ``m`` does).

    ``kind``: ``"adam"`` (Adam, AdamW, also AMSGrad: its larger ``v`` only lowers the step), ``"nadam"``
    (NAdam's extra current-gradient term and its momentum schedule ``momentum_decay``; about 13.7 after
    1000 steps at the default betas) or ``"radam"`` (``None`` while RAdam's variance is not rectified:
    its step is then ``lr * m_hat``, in gradient units, not bounded in units of ``lr``).
    """
    t = max(1, int(step))
    q = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    if kind == "radam":
        rho_inf = 2.0 / (1.0 - beta2) - 1.0 if beta2 < 1 else math.inf
        if rho_inf - 2.0 * t * beta2**t / (1.0 - beta2**t) <= 5.0:
            return None
    if q >= 1.0:
        return math.inf
    a, b = 0.0, 1.0 / (1.0 - beta1**t)  # m_hat = b * m (Adam); NAdam adds a * g_t
    if kind == "nadam":

        def mu(i: int) -> float:
            return beta1 * (1.0 - 0.5 * 0.96 ** (i * momentum_decay))

        product = math.prod(mu(i) for i in range(1, min(t, 400) + 1))  # below 1e-100 long before 400
        a = (1.0 - mu(t)) / (1.0 - product)
        b = mu(t + 1) / (1.0 - product * mu(t + 1))
    later = q * (1.0 - q ** (t - 1)) / (1.0 - q)  # sum of q^k over k = 1 .. t-1
    first = a + b * (1.0 - beta1)
    total = (first * first + (b * (1.0 - beta1)) ** 2 * later) * (1.0 - beta2**t) / (1.0 - beta2)
    return math.sqrt(total)


def adam_step_threshold(bound: float, factor: float) -> float:
    """The per-entry step (in units of ``lr``) above which an Adam step is far too large: ``factor``, or
    Adam's own ``bound`` where that is larger and finite (a step within it is one Adam can take)."""
    return factor if math.isinf(bound) else max(factor, bound)


@dataclass(frozen=True)
class EntryStep:
    r"""A layer's largest per-entry step in units of its lr, and what bounds it.

    Attributes:
        step: :math:`\max |\Delta w| / lr` over the layer's entries (of the parameters judged).
        bound: :func:`adam_step_bound` of the parameter it was found in (``inf``: none).
        param: the position of that parameter.
    """

    step: float
    bound: float
    param: int


def entry_steps(
    labels: Sequence[str],
    index: Sequence[int],
    update_max: Sequence[float],
    lrs: Sequence[float],
    bounds: dict[int, float],
) -> dict[str, EntryStep]:
    """Per layer, the largest ``update_max[i] / lrs[i]`` over the parameters in ``bounds`` (those judged,
    with their Adam bound); a parameter of ``lr <= 0`` or a non-finite update (NaNSentinel's) is left out."""
    out: dict[str, EntryStep] = {}
    for i, bound in bounds.items():
        if lrs[i] <= 0 or not math.isfinite(update_max[i]):
            continue
        step, layer = update_max[i] / lrs[i], labels[index[i]]
        if layer not in out or step > out[layer].step:
            out[layer] = EntryStep(step=step, bound=bound, param=i)
    return out
