"""The one device -> host transfer of a step: pack many small device tensors, read them back at once.

A callback that needs host numbers on a step (norms to log, flags to decide on, activity counts) adds its
device tensors to a :class:`HostTransfer` under a key, then calls :meth:`HostTransfer.fetch` once: one
``torch.cat`` on the device, one ``.cpu()`` (the only sync), and the tensors come back, each in its
shape, under its key. Under DDP, :meth:`HostTransfer.fetch` can all-reduce the packed vector first, so a
whole verdict costs one collective and one sync. Norms of sharded parameters
(:class:`~lightning_gradguard.core.sharding.PendingNorms`, added with :meth:`HostTransfer.add_norms`) are
combined across the ranks in that same collective, then finished: one collective per fetch, whatever
it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.sharding import PendingNorms, world_size

_SUMS = frozenset({"sum", "mean"})


def _flat(tensor: Tensor) -> Tensor:
    """``tensor`` detached, 1-D, float32, for the pack: no op for what is so already (norms usually are)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    return tensor if tensor.dtype == torch.float32 else tensor.float()


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
        # key, numel, shape, how the ranks' values combine (None: by the fetch's reduce_op), finish
        self._layout: list[
            tuple[Hashable, int, tuple[int, ...], str | None, Callable[[Tensor], Tensor] | None]
        ] = []
        #: whether some tensor queued has its own way to combine across the ranks
        self._own_ops = False

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, key: Hashable) -> bool:
        return any(entry[0] == key for entry in self._layout)

    def add(self, key: Hashable, tensor: Tensor, reduce: str | None = None) -> None:
        """Queue ``tensor`` (detached, flattened, as float32) under ``key``.

        ``reduce`` (``"sum"``, ``"mean"``, ``"max"``) combines this tensor across every rank in the fetch's
        collective whatever the fetch's ``reduce_op`` (every rank must then fetch alike).
        """
        self._layout.append((key, tensor.numel(), tuple(tensor.shape), reduce, None))
        self._own_ops = self._own_ops or reduce is not None
        self._parts.append(_flat(tensor))

    def add_norms(self, key: Hashable, norms: PendingNorms) -> None:
        """Queue norms that may still need the other ranks' shares: the fetch combines and finishes them.

        Without sharding they are the norms already: queued as they are, never reduced (under DDP the
        gradients are all-reduced, so every rank holds the norms).
        """
        values = norms.values
        if norms.sharded:
            self._layout.append((key, values.numel(), tuple(values.shape), norms.reduce_op, norms.finish))
            self._own_ops = True
        else:  # the norms themselves: nothing to combine, nothing to finish
            self._layout.append((key, values.numel(), tuple(values.shape), None, None))
        self._parts.append(_flat(values))

    def fetch(
        self, trainer: pl.Trainer | None = None, reduce_op: str | None = None, device: Any = None
    ) -> dict[Any, Tensor]:
        """Everything queued, on the host, by key (in its original shape), after one transfer.

        With ``reduce_op`` (``"sum"``, ``"max"``, ...) and a ``trainer`` on more than one process, the
        packed vector is all-reduced first (one collective, the same on every rank). Tensors queued with
        their own way to combine (sharded norms) are combined in that same collective. ``device`` places an
        empty transfer (on a rank with nothing to add, the collective still needs a tensor).
        """
        packed = torch.cat(self._parts) if self._parts else torch.zeros(0, device=device)
        if self._own_ops and world_size() > 1:
            fallback = reduce_op if trainer is not None and trainer.world_size > 1 else None
            packed = self._combine(packed, [entry[3] or fallback for entry in self._layout])
        elif reduce_op is not None and trainer is not None and trainer.world_size > 1:
            packed = trainer.strategy.reduce(packed, reduce_op=reduce_op)
        host = packed.cpu()  # the one device -> host transfer
        out: dict[Any, Tensor] = {}
        pieces = host.split_with_sizes([entry[1] for entry in self._layout]) if self._layout else ()  # one op
        for (key, numel, shape, _, finish), value in zip(self._layout, pieces, strict=True):
            if shape != (numel,):
                value = value.reshape(shape)
            out[key] = finish(value) if finish is not None else value
        self._parts, self._layout, self._own_ops = [], [], False
        return out

    def _combine(self, packed: Tensor, ops: list[str | None]) -> Tensor:
        """Combine the segments that have an op across the ranks, in one collective; the rest stay local.

        Sums and means: one all-reduce. Any max among them: one all-gather, each segment reduced after it
        (a NaN survives a max that way: ``amax`` propagates it, a reduce-max need not).
        """
        dist, world = torch.distributed, world_size()
        segments, offset = [], 0
        for (_, numel, _, _, _), op in zip(self._layout, ops, strict=True):
            segments.append((offset, numel, op))
            offset += numel
        picked = [(o, n, op) for o, n, op in segments if op is not None and n]
        if not picked:
            return packed
        sub = torch.cat([packed[o : o + n] for o, n, _ in picked])
        out = packed.clone()
        if all(op in _SUMS for _, _, op in picked):
            dist.all_reduce(sub, op=dist.ReduceOp.SUM)  # the one collective of this fetch
            rows = None
        else:
            gathered = [torch.empty_like(sub) for _ in range(world)]
            dist.all_gather(gathered, sub)  # the one collective of this fetch
            rows = torch.stack(gathered)
        at = 0
        for o, n, op in picked:
            if rows is None:
                value = sub[at : at + n]
            else:
                block = rows[:, at : at + n]
                value = block.amax(0) if op == "max" else block.amin(0) if op == "min" else block.sum(0)
            out[o : o + n] = value / world if op == "mean" else value
            at += n
        return out
