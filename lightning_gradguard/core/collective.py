"""Decisions taken together: every rank reaches the same verdict at the same point (one collective).

A raise on one rank alone hangs or kills the others under DDP; these helpers reduce a verdict first, so
that every rank acts alike. They are no-ops on one process.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


def reduce_any(trainer: pl.Trainer, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one collective; a no-op on one process)."""
    if trainer.world_size <= 1:
        return bool(flag)
    return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=False))


def gather(trainer: pl.Trainer, local: Any) -> list[Any]:
    """Every rank's ``local`` (any picklable object), on every rank, in rank order (one all-gather)."""
    if trainer.world_size <= 1 or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return [local]
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, local)
    return out
