"""The update an optimizer step applied: ``||delta w||`` per layer from a snapshot, and ``||delta w||/||w||``.

Pure tensor math, no Trainer: take :func:`weight_snapshot` before ``optimizer.step()``, call
:func:`update_norms` after it (both stay on the device), bring the norms to the host with the others and
divide with :func:`update_ratio`. About ``1e-3`` is the rule of thumb for a healthy layer (CS231n, Karpathy);
small models sit higher (2e-3 to 2e-2 on the digits models of ``docs/optimizer.md``).

A tensor with more than ``max_entries`` entries is not copied whole: the snapshot keeps an evenly strided
sample of it (a stride coprime with each of its dimensions, so the sample does not fall on a few columns of a
power-of-two-wide matrix or a few positions of a 3x3 kernel), and
its update norm is the sample's scaled by ``(numel / sampled) ** (1 / p)``. With ``SAMPLE_ENTRIES`` = 65 536
entries (256 KB per float32 tensor) the estimate's relative error is about ``1 / sqrt(2 * 65536)`` = 0.3 % for
dense updates (a 1024 x 600 layer sampled with stride 11: 0.1-0.4 % in the tests); a sparse one (a few rows or
columns, e.g. SGD on an embedding) is estimated from the fraction of it the sample meets, within ~25 % (one
column of a 2048 x 1024 matrix: 0.8-21 % over 8 seeds). A 124 M-parameter model's snapshot is ~15 MB instead
of 500 MB. (The infinity norm is not scaled: the sample's largest entry is at most the tensor's.) Every
monitor reads the update of a step from one such sample (``core.stats.UpdateSample``).

Example::

    before = weight_snapshot(params)
    optimizer.step()
    norms = update_norms(before, params, index, num_groups)   # index: group of each parameter
    ratio = update_ratio(float(norms.total), float(weight_total))
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradguard.functional.stats import foreach_norms, reduce_norms

#: ``t.requires_grad`` without a Python call per tensor
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

#: a parameter with more entries than this is sampled for its update norm (one size for every monitor)
SAMPLE_ENTRIES = 1 << 16


@dataclass(frozen=True)
class UpdateNorms:
    """The norms of one step's update, on the device: per group (``layers``) and in total (shape ``[1]``)."""

    layers: Tensor
    total: Tensor


@dataclass
class WeightSnapshot:
    """The values to diff against after the step: each parameter whole, or a strided sample of it.

    Attributes:
        values: copies: the whole tensor in its shape when ``strides[i] == 1``, else its flat strided
            sample (:func:`sampled`).
        strides: the stride of each sample.
        scales: ``numel / sampled`` of each parameter (1.0 when copied whole).
    """

    values: list[Tensor]
    strides: list[int]
    scales: list[float]


def _stride(shape: Sequence[int], max_entries: int | None) -> int:
    """The smallest stride that keeps at most ``max_entries`` of a tensor of ``shape`` and shares no factor
    with any of its dimensions: the flat indices ``0, k, 2k, ...`` then visit every position of every
    trailing block alike. A stride that shares one aliases with the layout: stride 3 on a 3x3 kernel keeps
    only its left column, which a 2x2 input under padding 1 never reaches (SwiftFormer's last downsampling
    at 32 px: a gradient of exact zeros on the sample of a layer that learns)."""
    numel = math.prod(shape)
    if max_entries is None or numel <= max_entries:
        return 1
    k = -(-numel // max_entries)
    while any(math.gcd(k, d) != 1 for d in shape if d > 1):
        k += 1
    return k


def sampled(tensors: Sequence[Tensor], strides: Sequence[int]) -> list[Tensor]:
    """Views of the entries a snapshot with these ``strides`` keeps (no copy): the same sample of another
    tensor of each parameter's shape (its gradient, an optimizer moment). A tensor kept whole (stride 1)
    is itself (no op), a sampled one a flat strided view; a tensor that requires grad is detached first."""
    if max(strides, default=1) == 1 and not any(map(_REQUIRES_GRAD, tensors)):
        return list(tensors)  # the usual case: every tensor whole, nothing to detach (no op)
    out = []
    for t, k in zip(tensors, strides, strict=True):
        t = t.detach() if t.requires_grad else t
        out.append(t if k == 1 else t.reshape(-1)[::k])
    return out


def weight_snapshot(params: Sequence[Tensor], max_entries: int | None = SAMPLE_ENTRIES) -> WeightSnapshot:
    """A copy of the parameters' values (one fused kernel), sampled above ``max_entries`` entries
    (``None``: every tensor whole)."""
    numels = [p.numel() for p in params]
    strides = [_stride(p.shape, max_entries) for p in params]
    values = list(torch._foreach_mul(sampled(params, strides), 1.0))
    scales = [n / max(1, v.numel()) for n, v in zip(numels, values, strict=True)]
    return WeightSnapshot(values, strides, scales)


def update_norms(
    snapshot: WeightSnapshot,
    params: Sequence[Tensor],
    index: Tensor,
    num_groups: int,
    norm_type: float = 2.0,
) -> UpdateNorms:
    """``||w_before - w_after||`` per group and in total; ``snapshot`` is overwritten with the difference.

    ``index[i]`` is the group of ``params[i]`` (a long tensor on the norms' device).
    """
    torch._foreach_sub_(snapshot.values, sampled(params, snapshot.strides))
    upd = foreach_norms(snapshot.values, norm_type)
    if math.isfinite(norm_type) and max(snapshot.scales, default=1.0) != 1.0:
        factors = torch.tensor([s ** (1.0 / norm_type) for s in snapshot.scales], dtype=upd.dtype)
        upd = upd * factors.to(upd.device)
    return UpdateNorms(
        layers=reduce_norms(upd, index, num_groups, norm_type),
        total=torch.linalg.vector_norm(upd, ord=norm_type).reshape(1),
    )


def update_ratio(update_norm: float, weight_norm: float) -> float:
    """``||delta w|| / ||w||``; a weight norm of 0 divides by ``1e-30`` instead (never a division error)."""
    return update_norm / max(weight_norm, 1e-30)


def foreach_dots(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """``<a_i, b_i>`` for every pair, as one float32 vector: one ``torch.dot`` per pair (one read of each
    tensor, nothing written; BLAS's accumulation, so a cosine is good to float32's rounding)."""
    if not a:
        return torch.zeros(0)
    return torch.stack(
        [torch.dot(x.reshape(-1).float(), y.reshape(-1).float()) for x, y in zip(a, b, strict=True)]
    )


def dtype_spacing(values: Tensor, dtype: torch.dtype) -> Tensor:
    """The gap between each ``|value|`` and the next ``dtype`` number away from zero, in float32:
    ``eps * 2**e`` for ``2**e <= |value| < 2**(e + 1)`` (bfloat16: 2**-7 at 1.0; values below ``tiny``
    count as ``tiny``). The resolution of ``dtype`` there: an update under half of it rounds away."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.detach().float().abs().clamp_min(info.tiny))
    return info.eps * torch.exp2((exponent - 1).float())
