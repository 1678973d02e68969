"""What StallDetector measures of a run, on the device, read in one transfer per check.

* :func:`lr_now` and :func:`lr_configured`: the LR in use (host numbers, free) and the highest LR the
  optimizers and their schedulers were configured to reach (``lr``, ``initial_lr``, ``max_lr``, a
  ``CyclicLR``'s ``max_lrs``);
* :func:`class_targets` and :func:`token_targets`: the class-index targets of a batch, or its token-level
  targets (a sequence model's ``(batch, T)`` next tokens), when it has them;
* :class:`StallProbe`: one check's measurements: the update/weight ratio of every layer (from the step's
  shared update sample, :meth:`~lightning_gradguard.core.stats.StepStats.take_update_sample`: the same
  numbers GradientNormLogger and OptimizerMonitor report; under sharding the ranks' pieces are combined
  in the check's transfer), the weight decay's part of that update and the rest of it (from the same
  sample and :func:`~lightning_gradguard.core.lr.decay_factors`), the ratio of the gradient the optimizer
  used to the raw one (on the first entries of each gradient, before and after clipping), the mean loss
  since the last check and its standard error, and the label or token counts, all in one
  :class:`~lightning_gradguard.core.transfer.HostTransfer` (losses, labels and tokens summed across ranks);
* :func:`has_low_precision` (decided once, at the start of training) and, for a model with 16-bit
  weights only, what became of their updates on the check's step
  (:class:`~lightning_gradguard.monitors.stall.check.Rounding`): the sampled entries with a non-zero
  gradient, those that did not change, the typical update and weight, from the same update sample (its
  gradients sampled too) and in the same transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.lr import decay_factors, group_lr
from lightning_gradguard.core.runstate import RunField, Stateful
from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.stats import foreach_norms
from lightning_gradguard.functional.updates import sampled, update_ratio
from lightning_gradguard.monitors.stall.check import LOW_PRECISION, Rounding

#: class indices at or above this are not counted (the label rules then see none of that batch)
MAX_CLASSES = 1024
#: token ids at or above this (or above ``num_classes`` when it is larger) are not counted
TOKEN_BINS = 1 << 16
#: the clip ratio is read on the first this many entries of each gradient, before and after clipping
CLIP_ENTRIES = 4096
_TARGET_KEYS = ("y", "target", "targets", "label", "labels")
#: the transfer's key of the outputs' class profile since the last check (``K x K`` sums, then ``K`` counts)
LEAN_KEY = "class_profile"
#: the typical update and weight of the rounding measure are medians of at most this many sampled entries
MEDIAN_ENTRIES = 1 << 16


def has_low_precision(module: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``module`` is 16-bit (bfloat16, float16): only then does a check
    measure what became of their updates (decided once, in ``on_train_start``)."""
    return any(p.requires_grad and p.dtype in LOW_PRECISION for p in module.parameters())


def lr_now(optimizers: Sequence[Any]) -> float:
    """The largest LR of any param group of ``optimizers`` (``trainer.optimizers``), now (read every
    step: plain loops, no Python call; a group without a numeric ``lr`` counts as 0)."""
    best = 0.0
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group.get("lr")  # every step, a plain read (lr=None, a relative step, is no number)
            if isinstance(lr, (int, float, Tensor)):
                best = max(best, float(lr))
    return best


def lr_configured(trainer: pl.Trainer) -> float:
    """The highest LR the optimizers are configured to reach now: a scheduled group's ``initial_lr`` /
    ``max_lr`` (the base its scheduler scales), a ``CyclicLR``'s ``max_lrs``, and the ``lr`` of a group
    no scheduler drives (a change there is deliberate: the user's, or a tuner's such as LRFinderPlus,
    which rescales the scheduler's bases as well)."""
    best = 0.0
    for opt in trainer.optimizers:
        for g in opt.param_groups:
            bases = [float(g[k]) for k in ("initial_lr", "max_lr") if isinstance(g.get(k), (int, float))]
            best = max(best, *bases) if bases else max(best, group_lr(g) or 0.0)
    for config in trainer.lr_scheduler_configs:
        for lr in getattr(config.scheduler, "max_lrs", None) or []:
            best = max(best, float(lr))
    return best


def _target_candidates(batch: Any) -> tuple[list[Any], int | None]:
    """Where targets may be (the last elements of a tuple or list first, or a dict's ``y`` / ``target(s)``
    / ``label(s)``), and the batch size (the first tensor's first dimension)."""
    if isinstance(batch, Mapping):
        candidates = [batch[k] for k in _TARGET_KEYS if k in batch]
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        candidates = list(batch[1:])[::-1]
    else:
        return [], None
    first = next(
        (t for t in (batch.values() if isinstance(batch, Mapping) else batch) if isinstance(t, Tensor)), None
    )
    return candidates, first.shape[0] if first is not None and first.dim() else None


def _integer(t: Any) -> bool:
    return (
        isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    )


def class_targets(batch: Any) -> Tensor | None:
    """The class-index targets of a batch: an integer vector as long as the batch (the last such element
    of a tuple or list, or a ``y`` / ``target(s)`` / ``label(s)`` entry of a dict; a ``(batch, 1)`` column
    counts as one); ``None`` otherwise."""
    candidates, n = _target_candidates(batch)
    for t in candidates:
        if _integer(t) and (n is None or t.shape[0] == n):
            if t.dim() == 1:
                return t
            if t.dim() == 2 and t.shape[1] == 1:
                return t.reshape(-1)
    return None


def token_targets(batch: Any) -> Tensor | None:
    """The token-level targets of a batch: an integer ``(batch, T)`` tensor with ``T > 1`` where
    :func:`class_targets` looks (a sequence model's next tokens, a Hugging Face ``labels`` entry), or the
    same flattened to a vector ``T > 1`` times as long as the batch. Negative entries (``ignore_index``,
    -100 by default) are positions without a target; the caller skips them."""
    candidates, n = _target_candidates(batch)
    for t in candidates:
        if not _integer(t):
            continue
        if t.dim() == 2 and t.shape[1] > 1 and (n is None or t.shape[0] == n):
            return t
        if t.dim() == 1 and n is not None and n > 0 and t.shape[0] > n and t.shape[0] % n == 0:
            return t
    return None


def _counts(targets: Tensor, bins: int) -> Tensor:
    """How often each id in ``[0, bins)`` occurs (float32, on the targets' device, without a host sync:
    ids outside the range go to one extra bin that is dropped)."""
    t = targets.reshape(-1).long()
    t = torch.where((t >= 0) & (t < bins), t, torch.full_like(t, bins))
    counts = torch.zeros(bins + 1, device=t.device, dtype=torch.float32)
    counts.index_add_(0, t, torch.ones_like(t, dtype=torch.float32))
    return counts[:bins]


@dataclass
class StallReading:
    """One check on the host: the loss and its standard error, update ratios and total, weight norms, the
    decay's and the rest's parts of the update, clip ratio, label counts and token counts."""

    loss: float | None = None
    loss_stderr: float | None = None
    update_ratios: dict[str, float] = field(default_factory=dict)
    update_total: float | None = None
    weight_norms: dict[str, float] = field(default_factory=dict)
    decay: dict[str, tuple[float, float]] = field(default_factory=dict)
    decay_groups: list[tuple[float, float]] = field(default_factory=list)
    clip_ratio: float | None = None
    labels: list[float] | None = None
    tokens: Tensor | None = None
    rounding: Rounding | None = None
    #: the outputs' class profile since the last check (``functional.health.class_profile``, summed)
    class_profile: tuple[Tensor, Tensor] | None = None
    scaler_skipped: bool = (
        False  # the GradScaler skipped the check's step (inf/NaN while its scale backs off)
    )


class _StepSample:
    """The check step's update, from the step's shared update sample (the same per-layer ratios every
    monitor reports), and the clip ratio on the first ``CLIP_ENTRIES`` entries of each gradient.

    The clip ratio compares a small contiguous slice of each gradient before and after clipping: clipping
    by norm scales every entry alike, so any part of the gradient gives its ratio (by value, a close one).
    It is not measured under sharding (a rank's slice is its own piece) nor in manual optimization.

    With a weight decay (:func:`decay_factors`), the update ``w_before - w_after`` of the sampled entries
    is split into the decay's part ``lr * weight_decay * w_before`` and the rest (the gradient's part),
    both scaled up from the sample like the update norm: read on the same copies, after the step.

    With ``rounding`` (a model with 16-bit weights), the gradients are sampled at the same entries and the
    16-bit parameters' entries with a non-zero gradient are counted, with those that did not change
    (:meth:`_queue_rounding`). Parameters in a param group with LR 0 are left out (nothing moves them).
    """

    def __init__(
        self, stats: StepStats, automatic: bool, optimizer: Any = None, rounding: bool = False
    ) -> None:
        self.stats = stats
        stats.watch_scaler()  # whether the GradScaler skips this step (nothing without a scaler)
        stats.take_update_sample(with_grads=rounding)
        self.rounding = rounding
        self.still = _lr_zero(optimizer) if rounding else frozenset()
        self.dtype, self.parameters = torch.bfloat16, 0  # of the 16-bit weights measured (set when queued)
        self.graded = [p for p in stats.params if p.grad is not None]
        raw = [p.grad for p in self.graded]
        measure_clip = automatic and raw and stats.sharding is None
        self.raw = foreach_norms(_heads(raw)).norm().reshape(1) if measure_clip else None  # type: ignore[arg-type]
        self.decay = decay_factors(optimizer, stats.params) if optimizer is not None else None

    def queue(self, transfer: HostTransfer) -> None:
        skipped = self.stats.scaler_skipped()
        if skipped is not None:
            transfer.add("scaler_skipped", skipped)
        transfer.add_norms("update_layers", self.stats.update_groups(2.0)[1])
        transfer.add_norms("weight_layers", self.stats.weight_groups(2.0)[1])
        transfer.add_norms("update_total", self.stats.update_total(2.0).reshape(1))
        used = [p.grad for p in self.graded if p.grad is not None]
        if self.raw is not None and len(used) == len(self.graded):  # .grad: what the optimizer used
            transfer.add("clip", torch.cat([self.raw, foreach_norms(_heads(used)).norm().reshape(1)]))
        if self.decay is not None:
            self._queue_decay(transfer, self.decay.factors)
        if self.rounding:
            self._queue_rounding(transfer)

    def _queue_decay(self, transfer: HostTransfer, factors: list[float]) -> None:
        """The decay's part and the rest of the update, per layer (grouped like the update norms)."""
        stats, sample = self.stats, self.stats.update_sample
        if sample is None:
            return
        diff = sample.diff()  # w_before - w_after on the sampled entries
        before = torch._foreach_add(sampled(sample.params, sample.strides), diff)
        decay = torch._foreach_mul(before, factors)
        rest = torch._foreach_sub(diff, decay)
        scale = torch.tensor([math.sqrt(s) for s in sample.scales])  # the sample's scale-up, as the update's
        labels, index = stats.groups(stats.names, None, False)
        for key, parts in (("decay_layers", decay), ("rest_layers", rest)):
            norms = foreach_norms(parts, 2.0)
            pending = stats.pending(norms * scale.to(norms.device, norms.dtype), 2.0)
            transfer.add_norms(key, stats.grouped(pending, index, len(labels)))

    def _queue_rounding(self, transfer: HostTransfer) -> None:
        """The 16-bit parameters' sampled entries with a non-zero gradient, those of them whose value did
        not change, both scaled up to whole tensors, and the medians of ``|delta w|`` (entries that
        changed), of ``|w|`` (entries with a gradient) and of ``|w|`` (entries that did not change)."""
        sample = self.stats.update_sample
        if sample is None:
            return
        diff, grads = sample.diff(), sample.grads
        picked = [
            (i, g)
            for i, g in zip(sample.with_grad, grads, strict=True)
            if diff[i].dtype in LOW_PRECISION and id(self.stats.params[i]) not in self.still
        ]
        if not picked:
            return
        numels: dict[torch.dtype, int] = {}
        for i, _ in picked:
            numels[diff[i].dtype] = numels.get(diff[i].dtype, 0) + self.stats.params[i].numel()
        self.dtype = max(numels, key=lambda d: numels[d])
        self.parameters = len(picked)
        g = torch.cat([x.reshape(-1) for _, x in picked])
        d = torch.cat([diff[i].reshape(-1) for i, _ in picked])
        after = sampled([sample.params[i] for i, _ in picked], [sample.strides[i] for i, _ in picked])
        w = torch.cat([v.reshape(-1) for v in after])
        sizes = torch.tensor([diff[i].numel() for i, _ in picked], device=g.device)
        scales = torch.tensor([sample.scales[i] for i, _ in picked], device=g.device, dtype=torch.float32)
        scale = torch.repeat_interleave(scales, sizes, output_size=g.numel())  # no sync for the size
        graded = g != 0
        lost = graded & (d == 0)
        counts = torch.stack([(scale * graded).sum(), (scale * lost).sum()])
        step = max(1, -(-g.numel() // MEDIAN_ENTRIES))  # the medians on a strided part of a large sample
        nan = torch.tensor(math.nan, device=g.device)
        medians = [
            torch.where(mask[::step], x[::step].float().abs(), nan).nanmedian()
            for mask, x in ((graded & ~lost, d), (graded, w), (lost, w))
        ]
        transfer.add("rounding", torch.cat([counts, torch.stack(medians)]))

    def read(self, host: dict[Any, Tensor], reading: StallReading) -> None:
        reading.scaler_skipped = "scaler_skipped" in host and float(host["scaler_skipped"][0]) > 0
        labels = self.stats.update_groups(2.0)[0]
        weights = host["weight_layers"].tolist()
        pairs = zip(labels, host["update_layers"].tolist(), weights, strict=True)
        reading.update_ratios = {label: update_ratio(u, w) for label, u, w in pairs}
        reading.weight_norms = dict(zip(labels, weights, strict=True))
        reading.update_total = float(host["update_total"][0])
        if "clip" in host:
            raw, used = (float(x) for x in host["clip"])
            reading.clip_ratio = used / raw if raw > 0 and math.isfinite(raw) else None
        if "decay_layers" in host and self.decay is not None:
            parts = zip(labels, host["decay_layers"].tolist(), host["rest_layers"].tolist(), strict=True)
            reading.decay = {label: (d, r) for label, d, r in parts}
            reading.decay_groups = list(self.decay.groups)
        if "rounding" in host:
            graded, lost, update, weight, lost_weight = host["rounding"].tolist()
            reading.rounding = Rounding(
                dtype=self.dtype,
                parameters=self.parameters,
                graded=graded,
                lost=lost,
                update=update,
                weight=weight,
                lost_weight=lost_weight,
            )


def _lr_zero(optimizer: Any) -> frozenset[int]:
    """The ids of the parameters in a param group of ``optimizer`` with LR 0 (a check step's loop over
    the groups, for a model with 16-bit weights only)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return frozenset(id(p) for g in getattr(opt, "param_groups", []) if group_lr(g) == 0 for p in g["params"])


def _heads(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().reshape(-1)[:CLIP_ENTRIES] for t in tensors]


def _read_targets(host: dict[Any, Tensor], reading: StallReading) -> None:
    """The label and token counts, and the outputs' class profile, from the check's transfer."""
    if "labels" in host:
        counts = host["labels"].tolist()
        last = max((i for i, c in enumerate(counts) if c > 0), default=-1)
        reading.labels = counts[: last + 1] if last >= 0 else None
    if "tokens" in host:
        reading.tokens = host["tokens"]
    if LEAN_KEY in host:
        flat = host[LEAN_KEY]
        k = math.isqrt(flat.numel())  # k * k + k entries: k is the integer root, less a fraction
        seen = flat[k * k :]
        if seen.numel() == k and float(seen.sum()) > 0:
            reading.class_profile = (flat[: k * k].reshape(k, k), seen)


def _losses_saved(probe: StallProbe, losses: list[Tensor | float]) -> list[float]:
    return [float(v) for v in losses]  # a checkpoint is a sync point: the pending losses as numbers


def _losses(probe: StallProbe, saved: Any) -> list[Tensor | float]:
    return [float(v) for v in saved]


class StallProbe(Stateful):
    """The device side of one check: started in ``on_before_optimizer_step``, read at the batch's end. The
    losses since the last check and the center of their squares are run state: a checkpoint taken between
    two checks keeps them, so the first check after a resume reads the steps it would have read."""

    #: the training losses since the last check (detached, one per micro-batch; numbers after a resume)
    losses: RunField[list[Tensor | float]] = RunField(list, save=_losses_saved, load=_losses)
    #: the previous check's mean loss (the same on every rank): the squares are taken about it
    center: RunField[float] = RunField(float)

    def __init__(self) -> None:
        self.sample: _StepSample | None = None
        self.labels: Tensor | None = None
        self.tokens: Tensor | None = None

    def add_loss(self, loss: Tensor) -> None:
        """Keep one micro-batch's loss (on the device; no sync): the check sums them."""
        self.losses.append(loss.detach())

    def note_labels(self, batch: Any, vocab: int | None = None) -> None:
        """Count the class-index targets of ``batch``, or else its token targets, on the device (no sync).

        Token ids are counted up to ``max(TOKEN_BINS, vocab)``; negative ones (``ignore_index``) are not."""
        targets = class_targets(batch)
        if targets is not None:
            counts = _counts(targets, MAX_CLASSES)
            self.labels = counts if self.labels is None else self.labels + counts
            return
        tokens = token_targets(batch)
        if tokens is not None:
            counts = _counts(tokens, max(TOKEN_BINS, vocab or 0))
            self.tokens = counts if self.tokens is None else self.tokens + counts

    def start(self, stats: StepStats, automatic: bool, optimizer: Any = None, rounding: bool = False) -> None:
        """The check's step is about to update: take (or share) the step's update sample, the raw
        gradient's norm for the clip ratio, and the weight decay each parameter gets this step; with
        ``rounding`` (16-bit weights) the sample's gradients too."""
        if stats.unsupported is None and stats.params:
            self.sample = _StepSample(stats, automatic, optimizer, rounding)

    def read(
        self,
        trainer: pl.Trainer,
        device: torch.device,
        also: Callable[[HostTransfer, bool, torch.device], None] | None = None,
    ) -> StallReading:
        """After the update: everything in one transfer (one collective under DDP).

        The gradient the optimizer used is still in ``.grad`` here under automatic optimization (Lightning
        zeroes it before the next backward); under manual optimization the user may have zeroed it after
        ``step()``, so the clip ratio is not measured there."""
        transfer = HostTransfer()
        sample, self.sample = self.sample, None
        if sample is not None:
            sample.queue(transfer)
        world = trainer.world_size > 1
        if self.losses:
            x = torch.stack([torch.as_tensor(v, device=device).reshape(()).float() for v in self.losses])
            sums = torch.stack([x.sum(), (x - self.center).square().sum(), x.new_tensor(float(len(x)))])
            transfer.add("loss", sums, reduce="sum" if world else None)
        for key, queued in (("labels", self.labels), ("tokens", self.tokens)):
            if queued is not None:
                transfer.add(key, queued, reduce="sum" if world else None)
        if also is not None:  # the outputs' class profile (monitors.stall.evidence), under LEAN_KEY
            also(transfer, world, device)
        host = transfer.fetch(trainer, device=device) if len(transfer) or world else {}
        self.losses, self.labels, self.tokens = [], None, None
        reading = StallReading()
        if sample is not None:
            sample.read(host, reading)
        if "loss" in host and float(host["loss"][2]) > 0:
            self._read_loss([float(v) for v in host["loss"]], reading)
        _read_targets(host, reading)
        return reading

    def _read_loss(self, sums: list[float], reading: StallReading) -> None:
        """The mean loss and its standard error, from the sum, the sum of squares about ``center`` and the
        count (squares about a value near the mean: no cancellation)."""
        total, squares, n = sums
        mean = total / n
        reading.loss = mean
        if n > 1:
            variance = max(squares - n * (mean - self.center) ** 2, 0.0) / (n - 1)
            reading.loss_stderr = math.sqrt(variance / n)
        if math.isfinite(mean):
            self.center = mean
