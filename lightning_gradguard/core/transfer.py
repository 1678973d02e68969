"""The one device -> host transfer of a step: pack many small device tensors, read them back at once.

A callback that needs host numbers on a step (norms to log, flags to decide on, activity counts) adds its
device tensors to a :class:`HostTransfer` under a key, then calls :meth:`HostTransfer.fetch` once: one
``torch.cat`` on the device, one ``.cpu()`` (the only sync), and the tensors come back, each in its
shape, under its key. Under DDP, :meth:`HostTransfer.fetch` can all-reduce the packed vector first, so a
whole verdict costs one collective and one sync.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

__all__ = ["HostTransfer"]


class HostTransfer:
    """Collects device tensors under keys; :meth:`fetch` brings them all to the host in one transfer.

    Example::

        transfer = HostTransfer()
        transfer.add("norms", layer_norms)        # any shape, any float dtype, on the device
        transfer.add("total", total_norm)
        host = transfer.fetch()                   # one cat, one .cpu(); float32 tensors on the CPU
        host["norms"].tolist(), float(host["total"])
    """

    def __init__(self) -> None:
        self._parts: list[Tensor] = []
        self._layout: list[tuple[Hashable, int, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, key: Hashable) -> bool:
        return any(k == key for k, _, _ in self._layout)

    def add(self, key: Hashable, tensor: Tensor) -> None:
        """Queue ``tensor`` (detached, flattened, as float32) under ``key``."""
        self._layout.append((key, tensor.numel(), tuple(tensor.shape)))
        self._parts.append(tensor.detach().reshape(-1).float())

    def fetch(
        self, trainer: pl.Trainer | None = None, reduce_op: str | None = None, device: Any = None
    ) -> dict[Any, Tensor]:
        """Everything queued, on the host, by key (in its original shape), after one transfer.

        With ``reduce_op`` (``"sum"``, ``"max"``, ...) and a ``trainer`` on more than one process, the
        packed vector is all-reduced first (one collective, the same on every rank). ``device`` places an
        empty transfer (on a rank with nothing to add, the collective still needs a tensor).
        """
        packed = torch.cat(self._parts) if self._parts else torch.zeros(0, device=device)
        if reduce_op is not None and trainer is not None and trainer.world_size > 1:
            packed = trainer.strategy.reduce(packed, reduce_op=reduce_op)
        host = packed.cpu()  # the one device -> host transfer
        out: dict[Any, Tensor] = {}
        offset = 0
        for key, numel, shape in self._layout:
            out[key] = host[offset : offset + numel].reshape(shape)
            offset += numel
        self._parts, self._layout = [], []
        return out
