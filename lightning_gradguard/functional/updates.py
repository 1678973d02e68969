"""The update an optimizer step applied: ``||delta w||`` per layer from a snapshot, and ``||delta w||/||w||``.

Pure tensor math, no Trainer: take :func:`weight_snapshot` before ``optimizer.step()``, call
:func:`update_norms` after it (both stay on the device), bring the norms to the host with the others and
divide with :func:`update_ratio`. Healthy runs sit near ``1e-3`` (CS231n, Karpathy).

Example::

    before = weight_snapshot(params)
    optimizer.step()
    norms = update_norms(before, params, index, num_groups)   # index: group of each parameter
    ratio = update_ratio(float(norms.total), float(weight_total))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradguard.functional.stats import foreach_norms, reduce_norms

__all__ = ["UpdateNorms", "update_norms", "update_ratio", "weight_snapshot"]


@dataclass(frozen=True)
class UpdateNorms:
    """The norms of one step's update, on the device: per group (``layers``) and in total (shape ``[1]``)."""

    layers: Tensor
    total: Tensor


def weight_snapshot(params: Sequence[Tensor]) -> list[Tensor]:
    """A copy of the parameters' values (one fused kernel), to diff against after the step."""
    return list(torch._foreach_mul([p.detach() for p in params], 1.0))


def update_norms(
    snapshot: list[Tensor], params: Sequence[Tensor], index: Tensor, num_groups: int, norm_type: float = 2.0
) -> UpdateNorms:
    """``||w_before - w_after||`` per group and in total; ``snapshot`` is overwritten with the difference.

    ``index[i]`` is the group of ``params[i]`` (a long tensor on the norms' device).
    """
    torch._foreach_sub_(snapshot, [w.detach() for w in params])
    upd = foreach_norms(snapshot, norm_type)
    return UpdateNorms(
        layers=reduce_norms(upd, index, num_groups, norm_type),
        total=torch.linalg.vector_norm(upd, ord=norm_type).reshape(1),
    )


def update_ratio(update_norm: float, weight_norm: float) -> float:
    """``||delta w|| / ||w||``; a weight norm of 0 divides by ``1e-30`` instead (never a division error)."""
    return update_norm / max(weight_norm, 1e-30)
