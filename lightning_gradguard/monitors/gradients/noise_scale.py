"""The gradient noise scale of a run, measured from the two batch sizes it already has.

:class:`NoiseScaleTracker` is what ``GradientNormLogger(log_noise_scale=True)`` stands on. A tensor hook on
every trainable parameter sees each micro-batch's own gradient before it is added into ``.grad`` and,
under DDP, before the all-reduce (DDP reduces once per optimizer step, after the last micro-batch's
accumulation; Lightning runs the others under ``no_sync``). The hook queues that gradient's norm on the
device. At ``on_before_optimizer_step`` the squared norms are summed (the small batch: one rank's
micro-batch) and set against the step's accumulated, all-reduced, unscaled gradient (the big batch: the
whole step) in :func:`~lightning_gradguard.functional.noise_scale.noise_scale_terms`; the two terms go
into a device EMA. Nothing is read back on those steps. On a logging step the EMA rides in the logger's
one transfer, averaged across the ranks in its one collective (each rank keeps the EMA of its own
micro-batches: the average of the ranks' EMAs is the EMA of the step's mean, the estimate being linear).

Cost per optimizer step: one norm per parameter and micro-batch (a read of the gradients, as the
gradients are written), the step's total gradient norm (shared with the other monitors), ~10 small
kernels; on a logging step three floats more in the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.batch import batch_size_of
from lightning_gradguard.core.cadence import log_step, on_logging_step
from lightning_gradguard.core.runstate import RunField, Stateful
from lightning_gradguard.core.sharding import is_sharded, unsupported_reason
from lightning_gradguard.core.state import info_once, strict_mode, warn_once
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.noise_scale import (
    NoiseScaleEstimate,
    b_simple,
    effective_batch_sizes,
    noise_scale_terms,
)
from lightning_gradguard.monitors.gradients.tags import NOISE_SCALE

_KEY = ("noise_scale", "ema")
_NAME = "GradientNormLogger(log_noise_scale=True)"


def _trainable(trainer: pl.Trainer) -> list[Tensor]:
    """The trainable parameters of the (one) optimizer, each once."""
    params: dict[int, Tensor] = {}
    for group in trainer.optimizers[0].param_groups:
        params.update({id(p): p for p in group["params"] if p.requires_grad})
    return list(params.values())


def _ema_loaded(tracker: NoiseScaleTracker, saved: Tensor | None) -> NoiseScaleEMA:
    return NoiseScaleEMA(tracker.beta, None if saved is None else saved.detach().clone().float())


class NoiseScaleTracker(Stateful):
    """Hooks, device accumulation and the EMA behind the ``noise_scale/*`` tags (see the module docstring).

    Call :meth:`on_batch` from ``on_train_batch_start`` and :meth:`on_step` from
    ``on_before_optimizer_step`` on every rank; on the steps :meth:`on_step` marks as due, every rank
    calls :meth:`queue` and fetches its transfer (one collective), then :meth:`emit`. :meth:`detach`
    removes the hooks (``teardown``).

    Args:
        beta: the EMA's decay per optimizer step.
        on: ``False``: every method does nothing (the logger's noise scale is off).
    """

    #: the EMA (on the CPU in a checkpoint; under DDP this rank's, equal on every rank at each read)
    ema: RunField[NoiseScaleEMA] = RunField(
        from_settings=lambda n: NoiseScaleEMA(n.beta), save=lambda _, e: e.saved(), load=_ema_loaded
    )

    def __init__(self, beta: float, on: bool = True) -> None:
        self.on, self.beta = on, beta
        self.due: int | None = None  # the log step whose EMA is to be read
        self.batch_size = 0  # the samples of the latest measured step, over every rank
        self._enabled: bool | None = None if on else False  # None: decided at the first batch of a fit
        self._handles: list[RemovableHandle] = []
        self._hooked: list[Tensor] = []
        self._norms: list[Tensor] = []  # the norms the hooks saw in this window (all micro-batches)
        self._sizes: list[int] = []  # the sizes of this window's micro-batches that ran a backward
        self._pending: int | None = None  # the current micro-batch's size until its backward ran
        self._fired = False
        self._open = False
        self._error: Exception | None = None

    # ------------------------------------------------------------------ hooks
    def _hook(self, grad: Tensor) -> None:
        try:
            g = grad.coalesce().values() if grad.is_sparse else grad
            self._norms.append(torch.linalg.vector_norm(g, dtype=torch.float32))
            self._fired = True
        except Exception as err:  # never inside the user's backward: said at the step
            self._error = err

    def _attach(self, params: list[Tensor]) -> None:
        if len(params) == len(self._hooked) and all(
            a is b for a, b in zip(params, self._hooked, strict=True)
        ):
            return
        self.detach()
        self._handles = [p.register_hook(self._hook) for p in params]
        self._hooked = params

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooked, self._norms, self._open = [], [], [], False

    # ------------------------------------------------------------------ the run
    def start(self, fresh: bool) -> None:
        """A fit starts: decide again at its first batch; a fresh run starts an empty average."""
        self._enabled, self.due = (None if self.on else False), None
        if fresh:
            self.reset_run()

    def _supported(self, trainer: pl.Trainer, every: int) -> bool:
        why = None
        if every == 0:
            return False  # periodic logging is off: nothing to measure for
        if not trainer.lightning_module.automatic_optimization:
            why = "it needs automatic optimization (micro-batches Lightning accumulates)"
        elif is_sharded(trainer) or unsupported_reason(trainer) is not None:
            why = "it does not support sharded training (FSDP, DeepSpeed) yet"
        elif trainer.world_size == 1 and trainer.accumulate_grad_batches == 1:
            why = (
                "this run has one batch size only (one process, accumulate_grad_batches=1), and a second "
                "would need an extra backward pass. Use accumulate_grad_batches >= 2 or several processes"
            )
        if why is not None:
            info_once(trainer, "noise_scale:off", f"{_NAME}: the gradient noise scale is not logged: {why}.")
        return why is None

    def on_batch(self, trainer: pl.Trainer, batch: Any, every: int) -> None:
        """A micro-batch starts (``on_train_batch_start``): note its size; a new window starts afresh."""
        if self._enabled is None:
            self._enabled = self._supported(trainer, every)
        if not self._enabled:
            return
        if (
            not self._open
        ):  # the first micro-batch of an optimizer step: what the hooks saw before is not ours
            self._attach(_trainable(trainer))
            self._norms, self._sizes, self._pending, self._fired, self._open = [], [], None, False, True
        self._commit()
        self._pending = batch_size_of(batch)
        if self._pending is None:
            warn_once(
                trainer, "noise_scale:size", f"{_NAME}: no tensor in the batch gives its size; skipped."
            )
            self._enabled = False
            self.detach()

    def _commit(self) -> None:
        """Count the previous micro-batch when its backward reached the parameters."""
        if self._pending is not None and self._fired:
            self._sizes.append(self._pending)
        self._pending, self._fired = None, False

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, every: int) -> None:
        """The optimizer is about to step: one sample into the EMA, on the device."""
        if not self._enabled or not self._open:
            return
        self._open = False
        at = log_step(trainer)
        self.due = at if on_logging_step(at, every) else self.due  # before anything can fail: ranks agree
        self._commit()
        norms, self._norms = self._norms, []
        if self._error is not None:
            err, self._error = self._error, None
            if strict_mode():
                raise err
            warn_once(
                trainer, "noise_scale:hook", f"{_NAME}: a gradient hook failed ({err!r}); step skipped."
            )
            return
        world, k, m = trainer.world_size, trainer.accumulate_grad_batches, len(self._sizes)
        if not norms or not m or (m == 1 and world == 1):  # no backward, or one batch size only
            return
        small_batch, big_batch = effective_batch_sizes(self._sizes, world)
        self.batch_size = sum(self._sizes) * world
        # the hooks saw (loss / k)'s gradient of each micro-batch, still scaled by a GradScaler
        small = torch.stack(norms).square().sum() * (k * k / m)
        if (scaler := active_scaler(trainer)) is not None:
            small = small / scaler._scale.to(small.device).float().square()
        # .grad holds the sum of the m micro-batches' (loss / k) gradients, averaged over the ranks
        total = step_stats(trainer, pl_module, optimizer).grad_total(2.0).values.to(small.device)
        big = total.float().square() * (k / m) ** 2
        self.ema.update(*noise_scale_terms(small, big, small_batch, big_batch))

    # ------------------------------------------------------------------ reading
    def queue(self, transfer: HostTransfer) -> None:
        """Queue the EMA on a due step (every rank: averaged across the ranks in the fetch's collective)."""
        if self.due is not None:
            state = self.ema.state if self.ema.state is not None else torch.zeros(3)
            transfer.add(_KEY, state, reduce="mean")

    def emit(self, trainer: pl.Trainer, host: dict[Any, Tensor]) -> dict[str, float]:
        """Log the fetched EMA at the due step (rank zero writes) and return the scalars; every rank keeps
        the ranks' mean EMA from here on (the checkpoint of any rank then holds the run's)."""
        at, self.due = self.due, None
        if at is None or _KEY not in host:
            return {}
        if self.ema.state is not None:
            self.ema.state.copy_(host[_KEY])
        est = NoiseScaleEMA.read(host[_KEY])
        if est.weight <= 0:  # no sample yet
            return {}
        metrics = {NOISE_SCALE.tag("grad_sq"): est.grad_sq, NOISE_SCALE.tag("trace_sigma"): est.trace_sigma}
        metrics[NOISE_SCALE.tag("batch_size")] = float(self.batch_size)
        if est.b_simple is not None:  # undefined while the smoothed |G|^2 is not positive
            metrics[NOISE_SCALE.tag("b_simple")] = est.b_simple
        _emit.log_scalars(trainer, metrics, at)
        return metrics


@dataclass
class NoiseScaleEMA:
    """Exponential moving averages of the two terms, kept on the device; the update never syncs.

    ``state`` holds ``[sum w |G|^2, sum w tr(Sigma), sum w]`` (``w`` the EMA weights): dividing by the
    last entry is the bias correction (Adam's), so the first samples are not pulled towards 0. A sample
    with a non-finite term (a step the GradScaler skipped) leaves the state as it is, on the device.
    The state is linear in the samples: the mean of several processes' states is the state of the mean
    samples (a data-parallel run keeps one per rank and averages them when it reads).

    Args:
        beta: the decay per sample; the average spans about ``1 / (1 - beta)`` samples.
        state: a saved state (``None``: empty).
    """

    beta: float = 0.99
    state: Tensor | None = None

    def update(self, grad_sq: Tensor, trace_sigma: Tensor) -> None:
        """Add one sample (0-dim device tensors)."""
        sample = torch.stack(
            [grad_sq.float(), trace_sigma.float(), torch.ones_like(grad_sq, dtype=torch.float)]
        )
        old = self.state.to(sample.device) if self.state is not None else torch.zeros_like(sample)
        new = old * self.beta + sample * (1.0 - self.beta)
        self.state = torch.where(torch.isfinite(sample).all(), new, old)

    def saved(self) -> Tensor | None:
        """The state as a checkpoint holds it (on the CPU)."""
        return None if self.state is None else self.state.detach().cpu()

    @staticmethod
    def read(state: Tensor) -> NoiseScaleEstimate:
        """The estimate from a state brought to the host (three numbers)."""
        total_g, total_t, weight = (float(x) for x in state.reshape(-1)[:3])
        if weight <= 0:
            return NoiseScaleEstimate(float("nan"), float("nan"), None, 0.0)
        grad_sq, trace_sigma = total_g / weight, total_t / weight
        return NoiseScaleEstimate(grad_sq, trace_sigma, b_simple(grad_sq, trace_sigma), weight)
