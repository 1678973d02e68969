r"""The gradient noise scale: how large a batch is worth using, from two batch sizes a run already has.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018), Appendix A. The
mean gradient :math:`G_x` of ``x`` samples drawn from the data satisfies

.. math:: E\,|G_x|^2 = |G|^2 + \operatorname{tr}(\Sigma) / x,

with :math:`G` the true gradient and :math:`\Sigma` the per-example gradient covariance. Two sizes
``b < B`` give two equations and so unbiased estimates of both terms (:func:`noise_scale_terms`); their
ratio is the *simple noise scale* :math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2`
(:func:`b_simple`), the batch size around which doubling the batch stops halving the number of steps.
Each per-step estimate is very noisy (the estimate of :math:`|G|^2` is often negative), so, as in the
paper, the two terms are averaged separately over many steps (:class:`NoiseScaleEMA`, on the device)
and divided only when read.

Pure functions and a small dataclass, no Trainer: usable from a plain PyTorch loop that has micro-batch
gradients and their mean (accumulation), or per-rank gradients and their all-reduced mean (data
parallel). :func:`effective_batch_sizes` gives ``b`` and ``B`` when the micro-batches differ in size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

_T = TypeVar("_T", float, Tensor)


def noise_scale_terms(small_sq: _T, big_sq: _T, small_batch: float, big_batch: float) -> tuple[_T, _T]:
    r"""Unbiased estimates of :math:`|G|^2` and :math:`\operatorname{tr}(\Sigma)` from two batch sizes.

    Args:
        small_sq: :math:`|G_b|^2`, the squared norm of a mean gradient over ``small_batch`` samples (or the
            mean of several such squared norms: the estimates stay unbiased and get less noisy).
        big_sq: :math:`|G_B|^2`, the squared norm of the mean gradient over ``big_batch`` samples.
        small_batch, big_batch: ``b < B``.

    Returns:
        ``(grad_sq, trace_sigma)``: :math:`(B|G_B|^2 - b|G_b|^2)/(B - b)` and
        :math:`(|G_b|^2 - |G_B|^2)/(1/b - 1/B)`, floats or tensors like the inputs. Either may be negative
        on one step; only their averages over many steps mean something.
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small_batch < big_batch; got {small_batch} and {big_batch}")
    grad_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace_sigma = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sq, trace_sigma


def effective_batch_sizes(micro_batch_sizes: Sequence[int], ranks: int = 1) -> tuple[float, float]:
    r"""``(b, B)`` for the mean of the micro-batches' :math:`|g_i|^2` and for their equal-weighted mean.

    A step averages ``m`` micro-batch gradients :math:`g_i` (each the mean over its :math:`b_i` samples)
    on each of ``ranks`` processes, all with the same sizes (a ``DistributedSampler`` pads the ranks
    alike). Then :math:`E\,\mathrm{mean}_i |g_i|^2 = |G|^2 + \operatorname{tr}(\Sigma)/b` with
    :math:`1/b = \mathrm{mean}_i\, 1/b_i`, and the step's gradient :math:`G_B`, the plain mean of all
    :math:`m \cdot` ``ranks`` micro-batch gradients, has :math:`1/B = \sum_i (1/b_i) / (m^2 \cdot
    \text{ranks})`. With equal sizes: ``b`` is the micro-batch and ``B = m * ranks * b``.
    """
    if not micro_batch_sizes or ranks < 1 or min(micro_batch_sizes) < 1:
        raise ValueError(f"need micro-batch sizes >= 1 and ranks >= 1; got {micro_batch_sizes}, {ranks}")
    m = len(micro_batch_sizes)
    inverse = sum(1.0 / b for b in micro_batch_sizes)
    return m / inverse, m * m * ranks / inverse


def b_simple(grad_sq: float, trace_sigma: float) -> float | None:
    r""":math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2`; ``None`` unless both are positive and
    finite (a non-positive smoothed :math:`|G|^2` means the average has not settled yet)."""
    finite = all(abs(x) < float("inf") for x in (grad_sq, trace_sigma))
    return trace_sigma / grad_sq if finite and grad_sq > 0 and trace_sigma > 0 else None


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """The smoothed terms on the host, and their ratio.

    Attributes:
        grad_sq: the smoothed :math:`|G|^2` (bias-corrected exponential moving average).
        trace_sigma: the smoothed :math:`\\operatorname{tr}(\\Sigma)`.
        b_simple: their ratio, ``None`` when it is undefined (see :func:`b_simple`).
        weight: how full the average is, :math:`1 - \\beta^n` after ``n`` samples (0: no sample yet).
    """

    grad_sq: float
    trace_sigma: float
    b_simple: float | None
    weight: float
