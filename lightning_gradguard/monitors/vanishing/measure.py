"""The per-layer gradient norms a VanishingExplodingDetector check reads, in one transfer.

:func:`read_layer_norms` brings the step's per-layer 2-norms and their total to the host from the shared
:class:`~lightning_gradguard.core.stats.StepStats` (no second pass over the gradients);
:func:`watched_norms` keeps the layers the detector's ``include`` / ``exclude`` watch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer


@dataclass(frozen=True)
class LayerNorms:
    """Per-layer gradient 2-norms of one step on the host (model order), their total and element counts.

    ``device`` is where the gradients live (a follow-up collective needs a tensor there).
    """

    labels: list[str]
    values: list[float]
    total: float
    numels: list[int]
    device: torch.device
    loss: float | None = None


def read_layer_norms(stats: StepStats, loss: torch.Tensor | None = None) -> LayerNorms | None:
    """The step's per-layer gradient 2-norms and total on the host, with the step's ``loss`` when given, in
    one transfer; ``None`` without any gradient.

    The norms are the shared ones of :class:`~lightning_gradguard.core.stats.StepStats` (no second pass);
    under sharding the transfer combines the ranks' shares (every rank must call this alike).
    """
    labels, norms = stats.grad_groups(2.0)
    if not labels:
        return None
    transfer = HostTransfer()
    transfer.add_norms("norms", norms)
    transfer.add_norms("total", stats.grad_total(2.0))
    if loss is not None:
        transfer.add("loss", loss.to(norms.values.device))
    host = transfer.fetch()  # the one device -> host transfer of this check
    return LayerNorms(
        labels=labels,
        values=host["norms"].tolist(),
        total=float(host["total"]),
        numels=stats.grad_layer_numels(),
        device=norms.values.device,
        loss=float(host["loss"]) if "loss" in host else None,
    )


def watched_norms(norms: LayerNorms, selection: LayerSelection) -> LayerNorms | None:
    """``norms`` of the watched layers only (the total still covers every layer); ``None`` if none is."""
    keep = [i for i, n in enumerate(norms.labels) if selection.watches(n)]
    if not keep:
        return None
    return replace(
        norms,
        labels=[norms.labels[i] for i in keep],
        values=[norms.values[i] for i in keep],
        numels=[norms.numels[i] for i in keep],
    )
