"""What LossSpikeGuard gathers of one optimizer step, and the step's numbers read in one transfer.

:class:`StepInputs` follows the micro-batches of the step being run: their batch indices (and whether an
earlier run's ``spikes.json`` names one of them), their samples, whether the last is the epoch's last
batch, and the sum of their losses as Lightning hands them to ``on_before_backward``. At the optimizer
step :meth:`StepInputs.take` hands them over as a :class:`GatheredStep`. :func:`read_step_values` then
brings the step's loss and total gradient norm (the shared statistics pass) to the host as
:class:`StepValues`: one all-reduce (the mean over the ranks) and one device -> host transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.batch import batch_size_of
from lightning_gradguard.core.runstate import RunField, Stateful
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.tree import tensors_in


@dataclass(frozen=True, kw_only=True)
class GatheredStep:
    """What one optimizer step's micro-batches left, at the optimizer step.

    Attributes:
        loss: their mean loss (also over a last accumulation window cut short), unscaled (16-mixed);
            ``None`` when no loss went through ``on_before_backward``. Still on the device.
        batches: their batch indices.
        replay: whether an earlier run's ``spikes.json`` names one of them.
        short: whether the step is a partial last batch of the epoch with under half the usual samples
            (its numbers are noisier by sqrt(full / samples): it is not judged).
        inputs: the 2-norms of the floating inputs of its micro-batches (on the device) and their entry
            counts, or ``None`` when its batches hold no floating tensor (token ids).
    """

    loss: Tensor | None
    batches: list[int]
    replay: bool
    short: bool
    inputs: tuple[Tensor, list[int]] | None = None


class StepInputs(Stateful):
    """Gathers the micro-batches of the optimizer step being run (see :class:`GatheredStep`).

    ``full``, the most samples a step has had, outlives the steps (and the fits): a partial last batch is
    measured against it. It is in the checkpoint (its one declared field).
    """

    full: RunField[int] = RunField(int, per_run=False)

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the step being gathered (``full`` stays)."""
        self.batches: list[int] = []
        self.replay = self.last = False
        self.samples = self.micro = 0
        self.loss: Tensor | None = None
        self.inputs: list[tuple[Tensor, int]] = []

    def add_batch(
        self, trainer: pl.Trainer, batch: object, batch_idx: int, skip: set[tuple[int, int]]
    ) -> None:
        """A micro-batch starts; ``skip`` holds the ``(epoch, batch index)`` pairs to drop again."""
        self.batches.append(batch_idx)
        self.replay |= (int(trainer.current_epoch), batch_idx) in skip
        self.samples += batch_size_of(batch) or 0
        self.last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        norm = inputs_norm(batch)
        if norm is not None:
            self.inputs.append(norm)

    def add_loss(self, loss: Tensor) -> None:
        """A micro-batch's loss as Lightning gives it to ``backward`` (divided by
        ``accumulate_grad_batches``, times the GradScaler's scale under 16-mixed)."""
        value = loss.detach().float().reshape(())
        self.loss = value if self.loss is None else self.loss + value
        self.micro += 1

    def take(self, trainer: pl.Trainer, manual: bool) -> GatheredStep:
        """At the optimizer step: what its micro-batches left; the losses are cleared for the next one.

        Under manual optimization a batch's optimizers share its batch indices: they are cleared at the
        batch's end (:meth:`clear`), not here.
        """
        scale = getattr(active_scaler(trainer), "_scale", None)  # 16-mixed: backward got the loss x scale
        loss = None
        if self.loss is not None and self.micro:  # each micro-batch's loss came divided by `accumulate`
            mean = self.loss * (trainer.accumulate_grad_batches / self.micro)
            loss = mean if scale is None else mean / scale
        short = self.last and 0 < self.samples < self.full / 2
        self.full = max(self.full, self.samples)
        inputs = None
        if self.inputs:  # one norm per micro-batch: stacked only under accumulation
            norms = [n for n, _ in self.inputs]
            inputs = (norms[0] if len(norms) == 1 else torch.stack(norms), [k for _, k in self.inputs])
        gathered = GatheredStep(
            loss=loss, batches=[*self.batches], replay=self.replay, short=short, inputs=inputs
        )
        self.loss, self.micro, self.inputs = None, 0, []
        if not manual:
            self.clear()
        return gathered


@dataclass(frozen=True, kw_only=True)
class StepValues:
    """The step's numbers on the host, the mean over the ranks.

    Attributes:
        values: by name: ``"loss"`` (when it was read), ``"grad_norm"`` (the total gradient norm before
            clipping, when it was read) and ``"batch_variance"`` (how many times a BatchNorm layer's batch
            variance is over, or under, its running variance, when it was read).
        short: whether any rank's step was a short last batch (then no rank judges it).
    """

    values: dict[str, float]
    short: bool

    @property
    def finite(self) -> bool:
        """Whether every value is finite (NaN/inf: the GradScaler's skip or NaNSentinel's finding)."""
        return all(math.isfinite(v) for v in self.values.values())


def read_step_values(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    optimizer: Any,
    *,
    loss: Tensor | None,
    grad_norm: bool,
    short: bool,
    batch_variance: Tensor | None = None,
    inputs: tuple[Tensor, list[int]] | None = None,
) -> StepValues:
    """The step's ``loss`` (``None``: not read) and, when ``grad_norm`` or without a loss, its total
    gradient norm, with the ``short`` flag: one transfer, the step's one collective.

    ``batch_variance`` (``core.buffers.StepBuffers.batch_variance_ratio``: the largest ``|log10|`` of a
    BatchNorm batch variance over its running variance) comes back as ``"batch_variance"``, the factor
    itself (``10 ** value``), the largest over the ranks. ``inputs`` (the 2-norms of the step's floating
    inputs and their entry counts) comes back as ``"inputs"``: the largest mean square of a micro-batch's
    floating inputs, over the micro-batches and the ranks.

    Under DeepSpeed the statistics pass measures nothing: with a loss, the loss alone is read. Every path
    reads at least one tensor, which places the flag on the step's device.
    """
    transfer = HostTransfer()
    if grad_norm or loss is None:  # the shared statistics pass
        stats = step_stats(trainer, pl_module, optimizer)
        if stats.unsupported is None or loss is None:
            total = stats.grad_total(2.0)
            transfer.add_norms("grad_norm", total)  # sharded: summed in the fetch
            anchor = total.values
    if loss is not None:
        transfer.add("loss", loss)
        anchor = loss
    transfer.add("short", anchor.new_full((1,), float(short)))  # any rank's: every rank passes alike
    if batch_variance is not None:
        transfer.add("batch_variance", batch_variance.reshape(1).to(anchor.device), reduce="max")
    if inputs is not None:
        transfer.add("inputs", inputs[0].reshape(-1).to(anchor.device), reduce="max")
    host = transfer.fetch(trainer, reduce_op="mean")
    values = {k: float(v) for k, v in host.items() if k not in ("short", "inputs")}
    if inputs is not None:
        values["inputs"] = max(
            n * n / max(k, 1) for n, k in zip(host["inputs"].tolist(), inputs[1], strict=True)
        )
    if "batch_variance" in values:
        values["batch_variance"] = 10 ** values["batch_variance"]
    return StepValues(values=values, short=float(host["short"]) > 0)


def inputs_norm(batch: Any) -> tuple[Tensor, int] | None:
    """The 2-norm of every entry of the floating tensors in ``batch`` (images, audio, features; not token
    ids or labels), on the device, and their entry count; ``None`` without any. One kernel for one tensor."""
    floats = [t for t in tensors_in(batch) if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    norm = (
        torch.linalg.vector_norm(floats[0])
        if len(floats) == 1
        else torch.linalg.vector_norm(torch.stack(torch._foreach_norm(floats)))
    )
    return norm.float(), sum(t.numel() for t in floats)
