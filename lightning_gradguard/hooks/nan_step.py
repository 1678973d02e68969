"""What NaNSentinel sees of an optimizer step: its micro-batches, the flags it judges them by, a finding.

:class:`StepTrack` follows the optimizer step being judged (the batch Lightning started, the micro-batch
whose backward ran last, under accumulation the step's micro-batches and the one found poisoned).
:func:`read_flags` is the packed verdict of a step or micro-batch: one flag slot per rank for the loss,
one per rank for the gradients summed over the step's earlier micro-batches, one for the step's
gradients, all-reduced in one collective and read, with the GradScaler's scale beside them (never
summed), in one device -> host transfer (:class:`~lightning_gradguard.core.transfer.HostTransfer`).
A verdict that finds something names it as a :class:`Finding`, what the failure path
(:mod:`~lightning_gradguard.hooks.nan_report`) reports. :func:`remember_norm` keeps the recent total
gradient norms on the device (a ring), :func:`recent_norms` reads them for a report.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.sharding import PendingNorms, local_tensor
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.stats import clean_name, foreach_norms

__all__ = [
    "NOT_REPLAYED",
    "Finding",
    "Flags",
    "MicroBatch",
    "NonFiniteTensor",
    "NormRecord",
    "NormRing",
    "StepTrack",
    "add_up_pieces",
    "grads_nonfinite",
    "named_grads",
    "params_nonfinite",
    "read_flags",
]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the sentinel saw it: what a report, ``batch.pt`` and the replay are made of."""

    batch: Any
    batch_idx: int | None
    loss: Tensor | None
    #: batch indices of an optimizer step's micro-batches when the finding cannot name one of them
    among: tuple[int, ...] = ()


@dataclass
class StepTrack:
    """Where the sentinel stands in the optimizer step being judged (a fresh one at every fit's start)."""

    #: the batch Lightning started last, and its index
    batch: Any = None
    batch_idx: int = 0
    #: without accumulation: the loss flags, judged with the gradients in on_before_optimizer_step
    loss_bad: Tensor | None = None
    # the micro-batch whose backward ran last; under accumulation the micro-batches judged in the
    # current optimizer step, and the one its finding named (the step then yields no other finding)
    current: MicroBatch | None = None
    in_step: int = 0
    poisoned: MicroBatch | None = None
    #: an optimizer step ran in the current batch
    stepped: bool = False
    #: batch indices of the current optimizer step's micro-batches
    step_batches: list[int] = field(default_factory=list)

    def micro(self) -> MicroBatch:
        """The micro-batch whose backward ran last, else the batch started last (without a loss)."""
        return self.current or MicroBatch(batch=self.batch, batch_idx=self.batch_idx, loss=None)

    def flag_loss(self, bad: Tensor) -> None:
        """Add a micro-batch's loss flag to the step's (without accumulation: judged with the gradients)."""
        self.loss_bad = bad if self.loss_bad is None else self.loss_bad | bad

    def backward(self, loss: Tensor) -> MicroBatch | None:
        """The micro-batch of the batch started last runs its backward with ``loss``: the one before it."""
        previous = self.current
        self.current = MicroBatch(batch=self.batch, batch_idx=self.batch_idx, loss=loss)
        return previous

    def open_micro(self) -> bool:
        """Count the current micro-batch in the optimizer step; ``True`` when it opens the step."""
        first = self.in_step == 0
        self.in_step += 1
        if first:
            self.step_batches = []
        self.step_batches.append(self.batch_idx)
        return first

    def close(self) -> StepTrack:
        """The optimizer step runs: what it held (loss flags, poisoned micro-batch, micro-batches)."""
        closed = copy.copy(self)
        self.loss_bad, self.poisoned, self.in_step, self.step_batches = None, None, 0, []
        self.stepped = True
        return closed

    def end_batch(self) -> tuple[MicroBatch, bool]:
        """The batch ends: its micro-batch, and whether an optimizer step ran in it."""
        micro, stepped = self.micro(), self.stepped
        if self.in_step == 0:  # no optimizer step is open: hold no micro-batch longer than needed
            self.current = None
        self.stepped = False
        return micro, stepped


@dataclass(frozen=True)
class Flags:
    """The flags of a step (or micro-batch) as every rank reads them, after one collective."""

    #: ranks whose loss is non-finite
    loss_ranks: list[int]
    #: ranks whose gradients summed over the step's earlier micro-batches are non-finite
    earlier_ranks: list[int]
    #: the step's gradients (all-reduced: the same on every rank) are non-finite
    grads_bad: bool
    #: the GradScaler's scale, when one was read
    scale: float | None
    #: under sharding: the step's total gradient norm, combined across the ranks in the same collective
    #: (on the device, for the norm history; ``None`` otherwise)
    total: Tensor | None = None


def read_flags(
    trainer: pl.Trainer,
    *,
    loss_bad: Tensor | None,
    grad_bad: Tensor | None,
    earlier_bad: Tensor | None = None,
    scaler: Any = None,
    total: PendingNorms | None = None,
) -> Flags:
    """Reduce the flags across ranks and read them, with ``scaler``'s scale, in one host transfer.

    ``total`` (a 2-norm, when its shares are sharded) is summed in the same collective, and returned.
    """
    world, rank = trainer.world_size, trainer.global_rank
    device = next(t for t in (loss_bad, earlier_bad, grad_bad) if t is not None).device
    # one slot per rank for the loss, one per rank for the earlier micro-batches' gradients (local
    # under DDP's no_sync), one for the step's gradients (a rank's flag: summed, any rank's counts),
    # and under sharding one for this rank's share of the total gradient norm
    shared = total is not None and total.sharded and world > 1
    flags = torch.zeros(2 * world + 1 + int(shared), device=device)
    for slot, flag in ((rank, loss_bad), (world + rank, earlier_bad), (2 * world, grad_bad)):
        if flag is not None:
            flags[slot] = flag.float()
    if shared and total is not None:
        flags[-1] = total.values.to(device).float()
    if world > 1:  # the one collective; the scale is read beside the flags, never summed across ranks
        flags = trainer.strategy.reduce(flags, reduce_op="sum")
    transfer = HostTransfer()
    transfer.add("flags", flags)
    if scaler is not None:
        transfer.add("scale", scaler._scale.reshape(1).to(device))
    host = transfer.fetch()  # the one device -> host read of this step (or micro-batch)
    bad = host["flags"].tolist()
    return Flags(
        loss_ranks=[r for r in range(world) if bad[r] > 0],
        earlier_ranks=[r for r in range(world) if bad[world + r] > 0],
        grads_bad=bad[2 * world] > 0,
        scale=float(host["scale"]) if "scale" in host else None,
        total=total.finish(flags[-1]) if shared and total is not None else None,
    )


@dataclass(frozen=True)
class NonFiniteTensor:
    """A gradient (or parameter) holding NaN/inf: its name, how many entries, out of how many."""

    name: str
    nonfinite: int
    numel: int


#: the origin a report gives under sharding (the replay would need every rank's collectives in step)
NOT_REPLAYED = {
    "phase": "unknown",
    "description": "not replayed: the parameters are sharded (FSDP), and a replay on one rank would wait "
    "on the others' collectives",
}


def add_up_pieces(ranks: list[list[NonFiniteTensor]], pl_module: pl.LightningModule) -> list[NonFiniteTensor]:
    """Under sharding, every rank's non-finite pieces of each tensor as one (entries added up), in the
    model's parameter order."""
    whole: dict[str, NonFiniteTensor] = {}
    for t in (t for pieces in ranks for t in pieces):
        seen = whole.get(t.name)
        whole[t.name] = (
            t if seen is None else NonFiniteTensor(t.name, seen.nonfinite + t.nonfinite, seen.numel)
        )
    order = {clean_name(name): i for i, (name, _) in enumerate(pl_module.named_parameters())}
    return sorted(whole.values(), key=lambda t: order.get(t.name, len(order)))


@dataclass(frozen=True)
class Finding:
    """What a verdict found: the alert kind, the culprit rank, the micro-batch, and the step's optimizer.

    ``culprit`` ``None``: the gradients are all-reduced, the report is of the first rank whose replay finds
    an origin. ``optimizer`` is ``None`` for a micro-batch judged under accumulation.
    """

    kind: str
    culprit: int | None
    micro: MicroBatch
    optimizer: Any = None
    can_replay: bool = True
    #: the GradScaler's scale, for a finding under 16-mixed
    scale: float | None = None


def params_nonfinite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether any rank's parameters hold NaN/inf (one collective, one host read)."""
    params = [local_tensor(p.detach()) for p in pl_module.parameters()]
    transfer = HostTransfer()
    transfer.add("bad", ~torch.isfinite(foreach_norms(params)).all() if params else torch.zeros(()))
    return float(transfer.fetch(trainer, reduce_op="sum")["bad"]) > 0


def grads_nonfinite(trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device) -> Tensor:
    """0-dim bool on the device: the gradients the optimizers hold now are non-finite.

    A flag on every rank, even one without gradients, so that every rank joins the collective.
    """
    grads = [g for _, g in named_grads(trainer, pl_module)]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=device)
    return ~torch.isfinite(foreach_norms(grads)).all()


def named_grads(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
    """The gradients the optimizers hold now, by parameter name in model order (trainable ones only)."""
    wanted = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    return [
        (clean_name(name), local_tensor(p.grad))
        for name, p in pl_module.named_parameters()
        if id(p) in wanted and p.requires_grad and p.grad is not None
    ]


@dataclass(frozen=True)
class NormRecord:
    """One recent total gradient norm, at the step it was measured."""

    step: int
    total_grad_norm: float


class NormRing:
    """The last ``size`` total gradient norms, kept on the device (no sync), with their steps.

    Written every optimizer step; read only for a report (one host read then). The slot of a norm is its
    position in the order of writes, so the ring keeps the latest ``size`` norms in order however long the
    run is.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: Tensor | None = None
        self.steps: list[int] = []
        self.written = 0

    def push(self, total: Tensor, step: int) -> None:
        """Keep ``total`` (a 0-dim device tensor) measured at ``step``."""
        if self.values is None or self.values.device != total.device:
            self.values = torch.full((self.size,), float("nan"), device=total.device)
            self.steps, self.written = [], 0
        self.values[self.written % self.size] = total.float()
        self.written += 1
        self.steps.append(step)
        del self.steps[: -self.size]

    def records(self) -> list[NormRecord]:
        """The kept norms, oldest first."""
        if self.values is None or not self.steps:
            return []
        values = self.values.tolist()
        oldest = self.written - len(self.steps)
        return [
            NormRecord(step=s, total_grad_norm=values[(oldest + i) % self.size])
            for i, s in enumerate(self.steps)
        ]
