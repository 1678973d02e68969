"""What StallDetector measures of a run, on the device, read in one transfer per check.

* :func:`lr_now` and :func:`lr_configured`: the LR in use (host numbers, free) and the highest LR the
  optimizers and their schedulers were configured to reach (``lr``, ``initial_lr``, ``max_lr``, a
  ``CyclicLR``'s ``max_lrs``);
* :func:`class_targets`: the class-index targets of a batch, when it has them;
* :class:`StallProbe`: one check's measurements: the update/weight ratio of every layer (from the step's
  shared update sample, :meth:`~lightning_gradguard.core.stats.StepStats.take_update_sample`: the same
  numbers GradientNormLogger and OptimizerMonitor report; under sharding the ranks' pieces are combined
  in the check's transfer), the ratio of the gradient the optimizer used to the raw one (on the first
  entries of each gradient, before and after clipping), the mean loss since the last check and the
  label counts, all in one :class:`~lightning_gradguard.core.transfer.HostTransfer` (losses and labels
  summed across ranks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.stats import foreach_norms
from lightning_gradguard.functional.updates import update_ratio

__all__ = ["MAX_CLASSES", "StallProbe", "StallReading", "class_targets", "lr_configured", "lr_now"]

#: class indices at or above this are not counted (the label rules then see none of that batch)
MAX_CLASSES = 1024
#: the clip ratio is read on the first this many entries of each gradient, before and after clipping
CLIP_ENTRIES = 4096
_TARGET_KEYS = ("y", "target", "targets", "label", "labels")


def lr_now(optimizers: Sequence[Any]) -> float:
    """The largest LR of any param group of ``optimizers`` (``trainer.optimizers``), now (read every
    step: plain loops, no Python call; a group without a numeric ``lr`` counts as 0)."""
    best = 0.0
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group.get("lr")
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
            best = max(best, *bases) if bases else max(best, float(g["lr"]))
    for config in trainer.lr_scheduler_configs:
        for lr in getattr(config.scheduler, "max_lrs", None) or []:
            best = max(best, float(lr))
    return best


def class_targets(batch: Any) -> Tensor | None:
    """The class-index targets of a batch: an integer vector as long as the batch (the last such element
    of a tuple or list, or a ``y`` / ``target(s)`` / ``label(s)`` entry of a dict); ``None`` otherwise."""
    if isinstance(batch, Mapping):
        candidates = [batch[k] for k in _TARGET_KEYS if k in batch]
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        candidates = list(batch[1:])[::-1]
    else:
        return None
    first = next(
        (t for t in (batch.values() if isinstance(batch, Mapping) else batch) if isinstance(t, Tensor)), None
    )
    n = first.shape[0] if first is not None and first.dim() else None
    for t in candidates:
        integer = isinstance(t, Tensor) and not t.is_floating_point() and t.dtype != torch.bool
        if integer and t.dim() == 1 and (n is None or t.shape[0] == n):
            return t
    return None


@dataclass
class StallReading:
    """One check on the host: the loss, update ratios and total, clip ratio and label counts."""

    loss: float | None = None
    update_ratios: dict[str, float] = field(default_factory=dict)
    update_total: float | None = None
    clip_ratio: float | None = None
    labels: list[float] | None = None


class _StepSample:
    """The check step's update, from the step's shared update sample (the same per-layer ratios every
    monitor reports), and the clip ratio on the first ``CLIP_ENTRIES`` entries of each gradient.

    The clip ratio compares a small contiguous slice of each gradient before and after clipping: clipping
    by norm scales every entry alike, so any part of the gradient gives its ratio (by value, a close one).
    It is not measured under sharding (a rank's slice is its own piece) nor in manual optimization.
    """

    def __init__(self, stats: StepStats, automatic: bool) -> None:
        self.stats = stats
        stats.take_update_sample()
        self.graded = [p for p in stats.params if p.grad is not None]
        raw = [p.grad for p in self.graded]
        measure_clip = automatic and raw and stats.sharding is None
        self.raw = foreach_norms(_heads(raw)).norm().reshape(1) if measure_clip else None  # type: ignore[arg-type]

    def queue(self, transfer: HostTransfer) -> None:
        transfer.add_norms("update_layers", self.stats.update_groups(2.0)[1])
        transfer.add_norms("weight_layers", self.stats.weight_groups(2.0)[1])
        transfer.add_norms("update_total", self.stats.update_total(2.0).reshape(1))
        used = [p.grad for p in self.graded if p.grad is not None]
        if self.raw is not None and len(used) == len(self.graded):  # .grad: what the optimizer used
            transfer.add("clip", torch.cat([self.raw, foreach_norms(_heads(used)).norm().reshape(1)]))

    def read(self, host: dict[Any, Tensor], reading: StallReading) -> None:
        labels = self.stats.update_groups(2.0)[0]
        pairs = zip(labels, host["update_layers"].tolist(), host["weight_layers"].tolist(), strict=True)
        reading.update_ratios = {label: update_ratio(u, w) for label, u, w in pairs}
        reading.update_total = float(host["update_total"][0])
        if "clip" in host:
            raw, used = (float(x) for x in host["clip"])
            reading.clip_ratio = used / raw if raw > 0 and math.isfinite(raw) else None


def _heads(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().reshape(-1)[:CLIP_ENTRIES] for t in tensors]


class StallProbe:
    """The device side of one check: started in ``on_before_optimizer_step``, read at the batch's end."""

    def __init__(self) -> None:
        #: the training losses since the last check (detached, one per micro-batch): summed at the check
        self.losses: list[Tensor] = []
        self.sample: _StepSample | None = None
        self.labels: Tensor | None = None

    def add_loss(self, loss: Tensor) -> None:
        """Keep one micro-batch's loss (on the device; no sync): the check sums them."""
        self.losses.append(loss.detach())

    def note_labels(self, batch: Any) -> None:
        """Count the class-index targets of ``batch`` (when it has them), on the device."""
        targets = class_targets(batch)
        if targets is not None:
            t = targets[(targets >= 0) & (targets < MAX_CLASSES)]
            counts = torch.bincount(t, minlength=MAX_CLASSES).float()
            self.labels = counts if self.labels is None else self.labels + counts

    def start(self, stats: StepStats, automatic: bool) -> None:
        """The check's step is about to update: take (or share) the step's update sample, and the raw
        gradient's norm for the clip ratio."""
        if stats.unsupported is None and stats.params:
            self.sample = _StepSample(stats, automatic)

    def read(self, trainer: pl.Trainer, device: torch.device) -> StallReading:
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
            total = torch.stack([x.reshape(()).float() for x in self.losses]).sum()
            transfer.add(
                "loss",
                torch.stack([total, total.new_tensor(float(len(self.losses)))]),
                reduce="sum" if world else None,
            )
        if self.labels is not None:
            transfer.add("labels", self.labels, reduce="sum" if world else None)
        host = transfer.fetch(trainer, device=device) if len(transfer) or world else {}
        self.losses, self.labels = [], None
        reading = StallReading()
        if sample is not None:
            sample.read(host, reading)
        if "loss" in host and float(host["loss"][1]) > 0:
            reading.loss = float(host["loss"][0]) / float(host["loss"][1])
        if "labels" in host:
            counts = host["labels"].tolist()
            last = max((i for i, c in enumerate(counts) if c > 0), default=-1)
            reading.labels = counts[: last + 1] if last >= 0 else None
        return reading
