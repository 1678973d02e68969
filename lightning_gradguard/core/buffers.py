"""The buffers a step's forward writes, kept from before the step: a dropped step leaves them as they were.

A forward in training mode writes BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked``
(and any buffer a module updates in place) before any monitor can judge the step. When NaNSentinel or
LossSpikeGuard then drop the step, its update is never made, but those statistics would keep the bad
batch: NaN in every eval-mode output after a NaN batch, a rewritten ``running_var`` after a corrupt one.

:class:`StepBuffers` (one per Trainer, shared by the callbacks that can drop a step) copies the buffers at
the start of each optimizer step, in one fused copy into tensors allocated once, and writes them back when
the step is dropped (:func:`restore_step_buffers`, called by
:func:`~lightning_gradguard.core.skips.skip_update` and before NaNSentinel writes ``last_good.ckpt``).
Only the buffers a forward writes are copied: at the start of the second step, the buffers that the first
step left unchanged are dropped from the list (a model without BatchNorm then copies nothing; under DDP,
which broadcasts the buffers on every forward, all of them stay).

It also says what the step's BatchNorm layers saw (:meth:`StepBuffers.batch_variance_ratio`): from the
running variance before and after the forward and the layer's momentum, the variance of the batch, against
the running variance the run has built up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.core.state import trainer_state


@dataclass(frozen=True)
class _NormLayer:
    """A BatchNorm layer in training mode: its name, its running variance's index among the kept buffers,
    its momentum."""

    name: str
    var: int
    momentum: float


def _keepable(buf: Tensor | None) -> bool:
    """A plain tensor whose values a forward can write (not a bool mask, not a meta or sharded tensor)."""
    return (
        isinstance(buf, Tensor)
        and type(buf) is Tensor
        and buf.dtype != torch.bool
        and not buf.is_complex()
        and buf.device.type != "meta"
    )


class StepBuffers:
    """The model's written buffers as they were at the start of the current optimizer step."""

    def __init__(self, module: nn.Module) -> None:
        named = [(name, buf) for name, buf in module.named_buffers() if _keepable(buf)]
        self.names = [name for name, _ in named]
        self.live: list[Tensor] = [buf for _, buf in named]
        self.saved: list[Tensor] = [buf.detach().clone() for buf in self.live]
        self._versions: list[int] | None = [buf._version for buf in self.live]
        self.key: tuple[int, int, int] | None = None
        self.norm_layers = self._norm_layers(module)
        self._momenta: Tensor | None = None
        self._restored = False  # the current step was dropped: it tells nothing of what a forward writes

    def _norm_layers(self, module: nn.Module) -> list[_NormLayer]:
        index = {id(buf): i for i, buf in enumerate(self.live)}
        layers = []
        for name, mod in module.named_modules():
            var, momentum = getattr(mod, "running_var", None), getattr(mod, "momentum", None)
            if isinstance(mod, nn.modules.batchnorm._NormBase) and id(var) in index and momentum:
                layers.append(_NormLayer(name, index[id(var)], float(momentum)))  # not the cumulative mean
        return layers

    def keep(self, key: tuple[int, int, int]) -> None:
        """Copy the buffers now, once per optimizer step ``key`` (a second caller of the step is free)."""
        if key == self.key:
            return
        if self._versions is not None and self.key is not None and not self._restored:
            self._narrow()
        self._restored = False
        if self.live:
            torch._foreach_copy_(self.saved, self.live)
        self.key = key

    def _narrow(self) -> None:
        """Keep only the buffers the first step (not dropped) wrote: their version counter moved or their
        value changed (BatchNorm's kernels write the running statistics without moving the counter).
        Once per fit: one comparison per buffer."""
        assert self._versions is not None
        written = [
            i
            for i, (buf, was) in enumerate(zip(self.live, self.saved, strict=True))
            if buf._version != self._versions[i] or not torch.equal(buf, was)
        ]
        moved = {old: new for new, old in enumerate(written)}
        self.names = [self.names[i] for i in written]
        self.live = [self.live[i] for i in written]
        self.saved = [self.saved[i] for i in written]
        self.norm_layers = [
            _NormLayer(n.name, moved[n.var], n.momentum) for n in self.norm_layers if n.var in moved
        ]
        self._versions, self._momenta = None, None

    def restore(self) -> bool:
        """Write the buffers of the step's start back (one fused copy); ``False`` if none were kept."""
        if self.key is None or not self.live:
            return False
        with torch.no_grad():
            torch._foreach_copy_(self.live, self.saved)
        self._restored = True
        return True

    def batch_variance_ratio(self) -> Tensor | None:
        """The largest ``|log10|`` of (the batch's variance / the running variance before it) over the
        BatchNorm layers of this step (each averaged over its channels); ``None`` without such a layer.

        The batch's variance comes back from the running update, ``new = (1 - m) old + m batch``, with the
        layer's momentum ``m`` (layers with the cumulative average, ``momentum=None``, are not read). On the
        device, in a few fused kernels whatever the number of layers.
        """
        if not self.norm_layers or self.key is None:
            return None
        old = [self.saved[n.var] for n in self.norm_layers]
        new = [self.live[n.var] for n in self.norm_layers]
        before = torch.stack(torch._foreach_norm(old, 1)).float()  # variances are >= 0: the sum
        after = torch.stack(torch._foreach_norm(new, 1)).float()
        if self._momenta is None or self._momenta.device != before.device:
            self._momenta = before.new_tensor([n.momentum for n in self.norm_layers])
        batch = (after - (1 - self._momenta) * before) / self._momenta
        tiny = torch.finfo(torch.float32).tiny
        return (batch.clamp_min(tiny) / before.clamp_min(tiny)).log10().abs().max()

    @property
    def warm_after(self) -> int:
        """Steps after which every read layer's running variance holds the run's data, not its initial 1
        (three time constants of the slowest momentum)."""
        return max((math.ceil(3 / n.momentum) for n in self.norm_layers), default=0)


def keep_step_buffers(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
    """At ``on_train_batch_start``: keep the buffers of the optimizer step that starts (one copy per step
    whatever the number of callers; the first micro-batch's under ``accumulate_grad_batches``).

    Automatic optimization only: under manual optimization one forward may serve several optimizers, and
    which of its buffer writes belong to a dropped update is not known.
    """
    if not pl_module.automatic_optimization:
        return
    state = trainer_state(trainer)
    kept = state.step_buffers
    if kept is None or kept.module_id != id(pl_module):
        kept = state.step_buffers = _Kept(id(pl_module), StepBuffers(pl_module))
    accumulate = max(int(trainer.accumulate_grad_batches), 1)
    kept.buffers.keep((int(trainer.current_epoch), int(trainer.global_step), batch_idx // accumulate))


def step_buffers(trainer: pl.Trainer) -> StepBuffers | None:
    """The buffers kept for the current step, if a callback keeps them."""
    kept = trainer_state(trainer).step_buffers
    return None if kept is None else kept.buffers


def restore_step_buffers(trainer: pl.Trainer) -> bool:
    """Put the buffers back as they were at the start of this optimizer step (a dropped step)."""
    kept = step_buffers(trainer)
    return kept is not None and kept.restore()


def forget_step_buffers(trainer: pl.Trainer) -> None:
    """At fit start: the buffer list is rebuilt from the model (a new fit may bring a new model)."""
    trainer_state(trainer).step_buffers = None


@dataclass
class _Kept:
    module_id: int
    buffers: StepBuffers
