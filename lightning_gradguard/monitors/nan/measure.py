"""What NaNSentinel sees of an optimizer step: its micro-batches, the flags it reads, a report's facts.

:class:`StepTrack` follows the optimizer step being judged (the batch Lightning started, the micro-batch
whose backward ran last, under accumulation the step's micro-batches and the one found poisoned).
:func:`read_flags` is the packed verdict of a step or micro-batch: one flag slot per rank for the loss,
one per rank for the gradients summed over the step's earlier micro-batches, one for the step's
gradients, all-reduced in one collective and read, with the GradScaler's scale beside them (never
summed), in one device -> host transfer (:class:`~lightning_gradguard.core.transfer.HostTransfer`).
The verdict the :class:`Flags` imply is :func:`~lightning_gradguard.monitors.nan.rules.decide`, with the
:class:`SkipCounters`. What the flags are made of: the :class:`Check` of the losses, of the step's
gradients and of the earlier micro-batches' gradients (:func:`loss_check`, :func:`grads_check`,
:func:`earlier_check`), and :func:`params_nonfinite`, the parameter check after an update.
:class:`NormRing` keeps the recent total gradient norms on the device for a report; :func:`named_grads`
and :func:`add_up_pieces` give a report its non-finite tensors; :class:`NaNReport` is the report's facts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.alerts import Rule
from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.sharding import PendingNorms, local_tensor
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.stats import foreach_norms, nonfinite_counts


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
    #: without accumulation: the step's losses, judged with the gradients in on_before_optimizer_step
    losses: list[Tensor] = field(default_factory=list)
    # the micro-batch whose backward ran last; under accumulation the micro-batches judged in the
    # current optimizer step, and the one its finding named (the step then yields no other finding)
    current: MicroBatch | None = None
    in_step: int = 0
    poisoned: MicroBatch | None = None
    #: an optimizer step ran in the current batch
    stepped: bool = False
    #: batch indices of the current optimizer step's micro-batches
    step_batches: list[int] = field(default_factory=list)
    #: the one-read path's loss (one process, no accumulation): judged with the gradients at the step and
    #: tracked (:meth:`backward`, :meth:`flag_loss`) only when the step must be looked at closer
    pending_loss: Tensor | None = None

    def micro(self) -> MicroBatch:
        """The micro-batch whose backward ran last, else the batch started last (without a loss)."""
        return self.current or MicroBatch(batch=self.batch, batch_idx=self.batch_idx, loss=None)

    def flag_loss(self, loss: Tensor) -> None:
        """Keep a loss of the step (without accumulation: judged with the gradients)."""
        self.losses.append(loss)

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
        if self.pending_loss is not None:  # the one-read path's loss, tracked now that it is looked at
            self.backward(self.pending_loss)
            self.flag_loss(self.pending_loss)
            self.pending_loss = None
        closed = StepTrack(
            batch=self.batch,
            batch_idx=self.batch_idx,
            losses=self.losses,
            current=self.current,
            in_step=self.in_step,
            poisoned=self.poisoned,
            stepped=True,
            step_batches=self.step_batches,
        )
        self.losses, self.poisoned, self.in_step, self.step_batches = [], None, 0, []
        self.stepped = True
        return closed

    def close_healthy(self) -> None:
        """The optimizer step of the one-read path runs with a finite loss and finite gradients."""
        self.pending_loss, self.stepped = None, True

    def end_batch(self) -> tuple[MicroBatch | None, bool]:
        """The batch ends: its micro-batch (``None``: the batch started last, see :meth:`micro`), and
        whether an optimizer step ran in it."""
        current, stepped = self.current, self.stepped
        if self.in_step == 0:  # no optimizer step is open: hold no micro-batch longer than needed
            self.current = None
        self.stepped = False
        return current, stepped


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


@dataclass(frozen=True)
class Check:
    """Something a verdict judges, as a value and, for a suspicious value, the exact test.

    ``value`` is NaN or inf when a NaN or inf is in what it sums up (a loss, a total norm): its finiteness
    is read on the host, with no kernel run for it. A sum of large finite values can overflow too, so a
    non-finite ``value`` is confirmed by ``exact()`` (0-dim bool on the device: a NaN/inf entry is there),
    which runs only then.
    """

    value: Tensor
    exact: Callable[[], Tensor]


def both_finite(loss: Tensor, total: Tensor) -> bool:
    """Whether a step's loss (summed) and its 0-dim total gradient norm are both finite: one stack, one
    read, no kernel for the test itself (a sum holding NaN/inf is NaN/inf). A non-finite answer is only a
    suspicion (a sum of large finite values can overflow): the exact tests of :func:`read_flags` decide."""
    value = loss if loss.dim() == 0 else loss.sum()
    if value.dtype != total.dtype:
        value = value.to(total.dtype)
    loss_value, total_value = torch.stack([value, total]).tolist()
    return math.isfinite(loss_value) and math.isfinite(total_value)


def loss_check(losses: list[Tensor]) -> Check | None:
    """The step's (or micro-batch's) losses as one :class:`Check`; ``None`` without a loss."""
    if not losses:
        return None
    parts = [x if x.dim() == 0 else x.sum() for x in losses]
    value = parts[0] if len(parts) == 1 else torch.stack([p.float() for p in parts]).sum()
    return Check(value, lambda: torch.stack([~torch.isfinite(x).all() for x in losses]).any())


def grads_check(value: Tensor, grads: list[Tensor]) -> Check:
    """Gradients as a :class:`Check`: ``value`` their total norm (or a rank's share of it)."""
    return Check(value, lambda: nonfinite_counts(grads).sum() > 0)


def read_flags(
    trainer: pl.Trainer,
    *,
    loss: Check | None = None,
    grads: Check | None = None,
    earlier: Check | None = None,
    scaler: Any = None,
    total: PendingNorms | None = None,
) -> Flags:
    """Reduce the verdict across ranks and read it, with ``scaler``'s scale, in one host transfer.

    ``loss``, ``grads`` (the step's gradients) and ``earlier`` (the gradients of the step's earlier
    micro-batches) travel as values: a healthy step costs one stack (one collective under DDP) and one
    read. Only when a value comes out NaN/inf are the exact tests run and read a second time (every rank
    sees the same reduced values, so every rank does). ``total`` (a 2-norm, when its shares are sharded)
    is summed in the first collective, and returned.
    """
    quick = _read(
        trainer, [c.value if c is not None else None for c in (loss, earlier, grads)], scaler, total
    )
    if not (quick.loss_ranks or quick.earlier_ranks or quick.grads_bad):
        return quick
    # the exact tests as values too: NaN where something is non-finite, else 0
    exact = [
        torch.where(c.exact(), float("nan"), 0.0) if c is not None else None for c in (loss, earlier, grads)
    ]
    return replace(_read(trainer, exact, scaler, None), total=quick.total)


def _read(trainer: pl.Trainer, values: list[Tensor | None], scaler: Any, total: PendingNorms | None) -> Flags:
    """One read of the loss, earlier and gradient values (bad: not finite), with the scale."""
    world, rank = trainer.world_size, trainer.global_rank
    loss, earlier, grads = values
    if world == 1:  # no collective: what is there, stacked (one kernel) and read (the one sync)
        slots = [(k, t) for k, t in zip(("loss", "earlier", "grads"), values, strict=True) if t is not None]
        parts = [t if t.dtype == torch.float32 else t.float() for _, t in slots]
        if scaler is not None:
            parts.append(scaler._scale.reshape(()).to(parts[0].device).float())
        read = torch.stack(parts).tolist()
        host = {k: [v] for (k, _), v in zip(slots, read, strict=False)}
        return _flags(host, read[-1] if scaler is not None else None, None)
    # one slot per rank for the loss, one per rank for the earlier micro-batches' gradients (local
    # under DDP's no_sync), one for the step's gradients (summed: any rank's NaN counts), and under
    # sharding one for this rank's share of the total gradient norm
    shared = total is not None and total.sharded
    device = next(t for t in values if t is not None).device
    flags = torch.zeros(2 * world + 1 + int(shared), device=device)
    for slot, value in ((rank, loss), (world + rank, earlier), (2 * world, grads)):
        if value is not None:
            flags[slot] = value.float()
    if shared and total is not None:
        flags[-1] = total.values.to(device).float()
    flags = trainer.strategy.reduce(flags, reduce_op="sum")  # the one collective
    transfer = HostTransfer()  # the scale is read beside the flags, never summed across ranks
    transfer.add("flags", flags)
    if scaler is not None:
        transfer.add("scale", scaler._scale.reshape(1).to(device))
    fetched = transfer.fetch()  # the one device -> host read of this step (or micro-batch)
    bad = fetched["flags"].tolist()
    host = {
        "loss": bad[:world] if loss is not None else [],
        "earlier": bad[world : 2 * world] if earlier is not None else [],
        "grads": [bad[2 * world]] if grads is not None else [],
    }
    scale = float(fetched["scale"]) if "scale" in fetched else None
    return _flags(host, scale, total.finish(flags[-1]) if shared and total is not None else None)


def _flags(host: dict[str, list[float]], scale: float | None, total: Tensor | None) -> Flags:
    return Flags(
        loss_ranks=[r for r, v in enumerate(host.get("loss", [])) if not math.isfinite(v)],
        earlier_ranks=[r for r, v in enumerate(host.get("earlier", [])) if not math.isfinite(v)],
        grads_bad=any(not math.isfinite(v) for v in host.get("grads", [])),
        scale=scale,
        total=total,
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
    order = {user_name(name): i for i, (name, _) in enumerate(pl_module.named_parameters())}
    return sorted(whole.values(), key=lambda t: order.get(t.name, len(order)))


@dataclass(frozen=True)
class SkipCounters:
    """The steps a GradScaler skipped (non-finite gradients under 16-mixed): in all, and in a row."""

    skipped_steps: int = 0
    consecutive_skips: int = 0

    def after(self, skipped: bool) -> SkipCounters:
        """The counters after a step the scaler skipped (``skipped``) or took."""
        return SkipCounters(
            skipped_steps=self.skipped_steps + int(skipped),
            consecutive_skips=self.consecutive_skips + 1 if skipped else 0,
        )


def params_nonfinite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether any rank's parameters hold NaN/inf (one collective and one host read; a second pair only
    when a norm comes out non-finite, to tell a NaN from a norm that overflowed)."""
    params = [local_tensor(p.detach()) for p in pl_module.parameters()]
    transfer = HostTransfer()
    transfer.add("bad", ~torch.isfinite(foreach_norms(params)).all() if params else torch.zeros(()))
    if float(transfer.fetch(trainer, reduce_op="sum")["bad"]) == 0:
        return False
    transfer.add("bad", nonfinite_counts(params).sum() if params else torch.zeros(()))
    return float(transfer.fetch(trainer, reduce_op="sum")["bad"]) > 0


def earlier_check(trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device) -> Check:
    """The gradients the optimizers hold now, as a :class:`Check` (their total norm).

    A value on every rank, even one without gradients, so that every rank joins the collective.
    """
    grads = [g for _, g in named_grads(trainer, pl_module)]
    if not grads:
        return Check(torch.zeros((), device=device), lambda: torch.zeros((), dtype=torch.bool, device=device))
    return grads_check(torch.linalg.vector_norm(foreach_norms(grads)), grads)


def named_grads(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
    """The gradients the optimizers hold now, by parameter name in model order (trainable ones only)."""
    wanted = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    return [
        (user_name(name), local_tensor(p.grad))
        for name, p in pl_module.named_parameters()
        if id(p) in wanted and p.requires_grad and p.grad is not None
    ]


@dataclass(frozen=True)
class NormRecord:
    """One recent total gradient norm, at the step it was measured."""

    step: int
    total_grad_norm: float


class NormRing:
    """The last ``size`` total gradient norms, kept on the device (no sync, no kernel), with their steps.

    Written every optimizer step: the 0-dim norm tensors themselves are kept (a list, no copy into a
    buffer); read only for a report (one stack and one host read then).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.kept: list[Tensor] = []
        self.steps: list[int] = []

    def push(self, total: Tensor, step: int) -> None:
        """Keep ``total`` (a 0-dim device tensor, not written to afterwards) measured at ``step``."""
        self.kept.append(total)
        self.steps.append(step)
        if len(self.steps) > self.size:
            del self.kept[0], self.steps[0]

    def records(self) -> list[NormRecord]:
        """The kept norms, oldest first."""
        if not self.kept:
            return []
        device = self.kept[-1].device
        values = torch.stack([t.to(device).float().reshape(()) for t in self.kept]).tolist()
        return [NormRecord(step=s, total_grad_norm=v) for s, v in zip(self.steps, values, strict=True)]


@dataclass(frozen=True)
class ScalerState:
    """The GradScaler at a finding under 16-mixed: its scale and the steps it skipped."""

    scale: float
    skipped_steps: int
    consecutive: int


@dataclass
class NaNReport:
    """The forensic report of a finding (the facts; its alert's words are its rule's check, in
    :mod:`~lightning_gradguard.monitors.nan.rules`); :meth:`to_dict` gives it as ``report.json`` and
    ``NonFiniteError.report``."""

    rule: Rule[Any]
    step: int
    epoch: int
    batch_idx: int | None
    micro_batches: list[int]
    losses_checked: bool
    rank: int
    world_size: int
    precision: str
    loss: float | None
    learning_rates: list[list[float]]
    nonfinite_parameters: list[NonFiniteTensor]
    origin: dict[str, Any] | None
    recent_total_grad_norms: list[NormRecord]
    grad_scaler: ScalerState | None
    weights: str
    #: the files written (``report``, ``batch``, ``checkpoint``); set by
    #: :func:`~lightning_gradguard.monitors.nan.report.write_report`
    files: dict[str, str] | None = None

    @property
    def kind(self) -> str:
        """The alert kind of the finding (its rule's)."""
        return self.rule.kind

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        del fields["rule"]
        out = {"kind": self.rule.kind, **fields}
        if out["files"] is None:
            del out["files"]
        return out
