"""Sharded parameters (FSDP1, FSDP2 / DTensor): each rank's pieces, and norms of the whole tensors.

Under sharded training a rank holds a piece of every parameter and of its gradient: FSDP1 exposes the
pieces as flat views (``use_orig_params=True``) or one ``_flat_param`` per FSDP unit, FSDP2 as
``DTensor`` parameters whose ``to_local()`` is the piece. A norm of the whole tensor is made of the
pieces: every rank computes its **share**, the sum of the p-th powers of its pieces (the largest
absolute entry for the infinity norm), and one collective adds the shares of every rank up (the maximum
for the infinity norm); the p-th root of the sum is the norm. A piece several ranks hold (a parameter
FSDP does not shard, HSDP's replica groups, a DTensor replicated over a mesh dimension) is divided by
the number of its copies first, so it counts once.

:func:`sharding_of` finds the layout of an optimizer's parameters once (cached with the parameter list);
:class:`PendingNorms` are norms on the device that may still need the other ranks' shares:
:class:`~lightning_gradguard.core.transfer.HostTransfer` reduces them in the transfer it already makes
(one collective for every pending tensor of a fetch) and finishes them. On one process and under DDP
(every rank holds the whole, already all-reduced gradient) nothing is pending: the values are the
norms, and no collective is added. :func:`unsupported_reason` names what we cannot measure (DeepSpeed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.state import trainer_state

FLAT_PARAM_MESSAGE = (
    "GradGuard: FSDP runs with `use_orig_params=False`, so the optimizer holds one `_flat_param` per FSDP "
    "unit: per-layer norms are per FSDP unit (named after the wrapped module), per-parameter norms and "
    "histograms are not the model's parameters. Totals are right. Pass `use_orig_params=True` (Lightning's "
    "FSDPStrategy default) for per-layer norms."
)


FSDP_CPU_CHECKPOINT = (
    "NaNSentinel writes no last_good.ckpt under FSDPStrategy on CPU: torch's sharded checkpointing crashed "
    "the process there. The weights stay those of the last good step (action 'stop' or 'skip')."
)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's piece of ``t``: ``DTensor.to_local()``, else ``t`` itself (FSDP1's pieces are plain)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        local: Tensor = to_local()
        return local
    return t


@dataclass(frozen=True)
class PendingNorms:
    """Norms on the device that may still need the other ranks' shares.

    ``sharded=False``: ``values`` are the norms themselves. ``sharded=True``: ``values`` are this rank's
    shares (sums of p-th powers, already divided by the number of copies; for the infinity norm the
    largest entry); summed over the ranks (max for the infinity norm) and rooted by :meth:`finish`, they
    are the norms of the whole tensors.
    """

    values: Tensor
    norm_type: float
    sharded: bool = False

    @property
    def reduce_op(self) -> str | None:
        """How the shares of the ranks combine: ``"sum"``, ``"max"``, or ``None`` (nothing to combine)."""
        if not self.sharded:
            return None
        return "max" if math.isinf(self.norm_type) else "sum"

    def finish(self, reduced: Tensor) -> Tensor:
        """The norms, from the shares summed (max) over every rank (any device)."""
        if not self.sharded or math.isinf(self.norm_type):
            return reduced
        return reduced.clamp_min(0).pow(1.0 / self.norm_type)

    def reshape(self, *shape: int) -> PendingNorms:
        return PendingNorms(self.values.reshape(*shape), self.norm_type, self.sharded)


@dataclass(frozen=True)
class Sharding:
    """How an optimizer's parameters are sharded across the ranks, in its parameter order.

    ``copies[i]`` is how many ranks hold each entry of parameter ``i`` (1 for a sharded piece, the world
    size for a replicated parameter); ``numels[i]`` its element count as a whole tensor.
    """

    kind: str  # "fsdp1" or "fsdp2"
    copies: list[float]
    numels: list[int]
    #: FSDP1 with use_orig_params=False: the optimizer holds flat parameters
    flat: bool = False


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def world_size() -> int:
    """Processes in the default process group (1 without one)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dtensor_copies(p: Any, world: int) -> float:
    """Ranks holding each entry of DTensor ``p``: mesh copies in the world times replicated dimensions."""
    mesh = p.device_mesh
    copies = world / max(int(mesh.size()), 1)
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            copies *= int(mesh.size(dim))
    return float(copies)


def _fsdp1_layout(trainer: pl.Trainer, world: int) -> dict[int, tuple[float, int]] | None:
    """FSDP1's flat parameters: ``id(param) -> (copies, numel as a whole)``; ``None`` without FSDP1."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    root = getattr(trainer.strategy, "model", None)
    if not isinstance(root, torch.nn.Module):
        return None
    units = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]
    if not units:
        return None
    layout: dict[int, tuple[float, int]] = {}
    for unit in units:
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if handle is None or flat is None:
            continue
        group = getattr(handle, "process_group", None)
        shard = int(group.size()) if group is not None and handle.uses_sharded_strategy else 1
        copies = float(world / max(shard, 1))
        numels = list(getattr(flat, "_numels", ()))
        originals = getattr(flat, "_params", None)
        if originals is not None:  # use_orig_params=True: the model's own parameters, as flat views
            for p, n in zip(originals, numels, strict=False):
                layout[id(p)] = (copies, int(n))
        layout[id(flat)] = (copies, int(sum(numels)) if numels else flat.numel())
    return layout


def sharding_of(trainer: pl.Trainer, params: list[Tensor]) -> Sharding | None:
    """The sharding of ``params`` (an optimizer's trainable parameters); ``None`` when none is sharded."""
    world = world_size()
    if world <= 1 or not params:
        return None
    if any(_is_dtensor(p) for p in params):
        copies = [_dtensor_copies(p, world) if _is_dtensor(p) else float(world) for p in params]
        return Sharding(kind="fsdp2", copies=copies, numels=[int(p.numel()) for p in params])
    layout = _fsdp1_layout(trainer, world)
    if layout is None:
        return None
    found = [layout.get(id(p)) for p in params]
    if all(f is None or f[0] >= world for f in found):
        return None  # FSDP1 with NO_SHARD everywhere: every rank holds everything (like DDP)
    return Sharding(
        kind="fsdp1",
        copies=[float(world) if f is None else f[0] for f in found],
        numels=[int(p.numel()) if f is None else f[1] for p, f in zip(params, found, strict=True)],
        flat=any(getattr(p, "_is_flat_param", False) for p in params),
    )


def _strategy_names(trainer: pl.Trainer) -> set[str]:
    return {cls.__name__ for cls in type(trainer.strategy).__mro__}


def is_sharded(trainer: pl.Trainer) -> bool:
    """Whether the run shards its parameters (FSDP1, FSDP2 / DTensor, DeepSpeed): then every rank must
    take part in measuring norms (cached per Trainer; ask from a training hook, after the model is set up)."""
    state = trainer_state(trainer)
    if state.sharded is None:
        module = trainer.lightning_module
        state.sharded = world_size() > 1 and bool(
            _strategy_names(trainer) & {"FSDPStrategy", "DeepSpeedStrategy"}
            or (module is not None and any(_is_dtensor(p) for p in module.parameters()))
        )
    return state.sharded


def fsdp_checkpoint_on_cpu(trainer: pl.Trainer) -> bool:
    """Lightning's FSDPStrategy (FSDP1) on CPU, where torch's sharded ``save_checkpoint`` crashed."""
    return "FSDPStrategy" in _strategy_names(trainer) and trainer.strategy.root_device.type == "cpu"


def unsupported_reason(trainer: pl.Trainer) -> str | None:
    """Why gradient statistics cannot be measured in this run (DeepSpeed), else ``None``."""
    if "DeepSpeedStrategy" in _strategy_names(trainer):
        return (
            "DeepSpeed keeps gradients (ZeRO 1/2) and parameters (ZeRO 3) in its own partitioned buffers, "
            "out of the optimizer's view: gradient and weight norms measured there would be per-partition "
            "or empty, so GradGuard's gradient monitors are off under DeepSpeed (NaNSentinel still checks "
            "the loss). Use FSDP (FSDPStrategy or ModelParallelStrategy with fully_shard) to monitor "
            "sharded training."
        )
    return None
