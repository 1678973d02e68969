"""Activation counts of one step, summed across ranks and brought to the host: one check, one transfer.

Per-layer activation counts (:class:`~lightning_gradguard.monitors.dead_units.rules.UnitCounts`) are summed
over the ranks before anyone judges them, so every rank reaches the same verdict. Which layers a rank saw
depends on its data (a branch taken on one rank only), and an all-reduce of vectors with different layouts
would mix layers or hang: :func:`sum_counts` first compares a signature of the layout across ranks (one
small collective) and skips the step on every rank when they differ, then packs the counts through one
:class:`~lightning_gradguard.core.transfer.HostTransfer` (one all-reduce, one device -> host copy).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch

from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.monitors.dead_units.rules import UnitCounts

_SAMPLES = ("samples",)  # the transfer key of the values-per-unit numbers (layer keys are strings)
_LOSS = ("loss",)  # the transfer key of the step's loss


@dataclass(frozen=True)
class SummedCounts:
    """The step's counts on the host, summed over the ranks (``agreed=False``: the ranks' layers differed)."""

    agreed: bool
    records: dict[str, UnitCounts] = field(default_factory=dict)
    loss: float | None = None  # the step's mean loss over the ranks, when it was read


def sum_counts(
    trainer: pl.Trainer, records: dict[str, UnitCounts], loss: torch.Tensor | None = None
) -> SummedCounts:
    """``records`` summed over every rank, on the host (call it on every rank at the same point), with the
    step's ``loss`` (its mean over the ranks; every rank passes one or none alike)."""
    device = next(iter(records.values())).counts.device if records else trainer.strategy.root_device
    if trainer.world_size > 1:
        sig = zlib.crc32(
            "|".join(f"{k}:{r.saturation}:{r.counts.numel()}" for k, r in records.items()).encode()
        )
        check = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
        check = trainer.strategy.reduce(check, reduce_op="max")
        if int(check[0]) != -int(check[1]):
            return SummedCounts(agreed=False)
        if not records:  # no rank saw an activation on this step
            return SummedCounts(agreed=True)
    transfer = HostTransfer()
    for key, record in records.items():
        transfer.add(key, record.counts)
    transfer.add(_SAMPLES, torch.tensor([float(r.samples) for r in records.values()], device=device))
    if loss is not None:
        transfer.add(_LOSS, loss.to(device), reduce="mean")
    host = transfer.fetch(trainer, reduce_op="sum")  # the one device -> host transfer of this step
    samples = host.pop(_SAMPLES).tolist()
    mean_loss = float(host.pop(_LOSS)) if loss is not None else None
    return SummedCounts(
        agreed=True,
        loss=mean_loss,
        records={
            key: UnitCounts(saturation=r.saturation, counts=host[key], samples=n)
            for (key, r), n in zip(records.items(), samples, strict=True)
        },
    )
