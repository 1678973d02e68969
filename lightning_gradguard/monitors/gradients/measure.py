"""What the gradient-norm log stands on: the Trainer's clipping, and the norms of one step read once.

:func:`~lightning_gradguard.core.lr.clip_setting` says how the Trainer clips gradients (and so which norm
decides whether a step is clipped); :class:`ClipRing` keeps the recent pre-clip norms on the device. A
:class:`NormSample` is taken in ``on_before_optimizer_step`` from the shared
:class:`~lightning_gradguard.core.stats.StepStats` (grouped gradient and weight norms, the step's shared
update sample, histograms): nothing is read back there. After ``optimizer.step()``
(``on_train_batch_end``) :meth:`NormSample.queue` queues everything, the update norms included, on a
:class:`~lightning_gradguard.core.transfer.HostTransfer`, which the caller fetches once for all its
samples; :meth:`NormSample.read` turns the host values into a :class:`NormReading`, and
:func:`select_reading` into the scalars of the layers shown.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.runstate import RunField, Stateful, nothing
from lightning_gradguard.core.sharding import PendingNorms, world_size
from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.clipping import push_norm
from lightning_gradguard.functional.layers import log_distance_scores
from lightning_gradguard.functional.stats import (
    device_histograms,
    nonfinite_counts,
)
from lightning_gradguard.functional.updates import update_ratio
from lightning_gradguard.monitors.gradients.tags import (
    GRAD_HISTOGRAM,
    GRAD_LOG10_HISTOGRAM,
    GRAD_NONFINITE,
    GRAD_NORM,
    UPDATE_RATIO,
    WEIGHT_HISTOGRAM,
    WEIGHT_NORM,
)
from lightning_gradguard.tags import Family

_HIST_PARTS = ("stats", "edges", "counts")  # a histogram's NaN/inf counts are the grad_nonfinite scalars


def parse_norm_type(norm_type: Any) -> float:
    """``norm_type`` as ``2.0`` or ``inf`` (from ``2``, ``"inf"``, ...); else an error naming it."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (str, int, float)):
        raise TypeError(f"`norm_type` must be 2 or 'inf'; got {norm_type!r} ({type(norm_type).__name__})")
    try:
        value = float(norm_type)
    except ValueError:
        value = float("nan")
    if value not in (2.0, math.inf):
        raise ValueError(f"`norm_type` must be 2 or 'inf'; got {norm_type!r}")
    return value


def _norms_loaded(ring: ClipRing, saved: Tensor | None) -> Tensor | None:
    return saved.clone() if saved is not None and saved.numel() == ring.size else None


class ClipRing(Stateful):
    """The pre-clip norms of the last ``size`` steps, on the device: a ring written every step, no sync.

    Under sharding a slot holds this rank's share of the step's norm (see
    :class:`~lightning_gradguard.core.sharding.PendingNorms`), combined across the ranks when the window
    is read (:meth:`queue`, in the reader's one transfer); the last window read is kept on the host for
    the checkpoint (the steps since then are left out of it). NaN marks an empty slot.

    Checkpointed: ``norms``, the window as whole norms on the CPU (under sharding, as last read; ``None``
    before any; a window of another size is not restored), and ``seen``, how many steps were written.
    """

    values: RunField[Tensor | None] = RunField(
        nothing, key="norms", save=lambda r, v: r.whole_norms(v), load=_norms_loaded
    )
    seen: RunField[int] = RunField(int)
    norm_type: RunField[float] = RunField(lambda: 2.0, key=None)
    shares: RunField[bool] = RunField(bool, key=None)
    #: under sharding: the whole norms of the last window read
    _read: RunField[Tensor | None] = RunField(nothing, key=None)

    def __init__(self, size: int) -> None:
        self.size = size
        self.reset_run()

    def whole_norms(self, values: Tensor | None) -> Tensor | None:
        """The window as the checkpoint holds it: whole norms on the CPU (``None`` before any)."""
        if self.shares:
            return None if self._read is None else self._read.clone()
        return None if values is None else values.detach().cpu()

    def push(self, total: PendingNorms) -> None:
        """Write one step's (pending) pre-clip norm."""
        if self.values is not None and total.sharded and not self.shares:  # restored whole norms
            whole = self.values.to(total.values.device)
            self.values = whole if math.isinf(total.norm_type) else whole.pow(total.norm_type) / world_size()
        elif self.values is not None:
            self.values = self.values.to(total.values.device)
        self.shares, self.norm_type = total.sharded, total.norm_type
        self.values = push_norm(self.values, self.seen, total.values, self.size)
        if self._read is not None:
            self._read[self.seen % self.size] = float("nan")
        self.seen += 1

    def queue(self, transfer: HostTransfer, key: Hashable) -> None:
        """Queue the window (the filled slots) on ``transfer``."""
        if self.values is not None and self.seen:
            window = self.values[: min(self.seen, self.size)]
            transfer.add_norms(key, PendingNorms(window, self.norm_type, self.shares))

    def read(self, window: Tensor) -> Tensor:
        """Note the window as read back (whole norms, on the host) and return it."""
        if self.shares:
            self._read = torch.full((self.size,), float("nan"))
            self._read[: window.numel()] = window
        return window


@dataclass(frozen=True)
class NormSpec:
    """What to measure: the norm, the grouping (``group_depth``, ``per_parameter``), weights, the update."""

    norm_type: float = 2.0
    group_depth: int | None = None
    per_parameter: bool = False
    weights: bool = True
    update: bool = True
    histogram_bins: int | None = None  # None: no histograms
    histogram_layers: frozenset[str] | None = None  # None: every layer gets histograms


@dataclass(frozen=True)
class HistogramRows:
    """Host histograms of one kind (``grad``, ``grad_log10``, ``weight``): row ``j`` is ``names[j]``."""

    kind: str
    names: list[str]
    stats: Tensor
    edges: Tensor
    counts: Tensor


@dataclass(frozen=True)
class NormReading:
    """The host values of a :class:`NormSample`; per-layer values keyed by layer, in model order.

    ``weight_*`` are ``None`` / empty when weight norms were not asked for, ``update_*`` when the update
    was not. ``nonfinite_layers`` lists only the layers with a NaN/inf gradient norm.
    """

    grad_total: float
    grad_layers: dict[str, float]
    nonfinite_total: float
    nonfinite_layers: dict[str, float]
    weight_total: float | None = None
    weight_layers: dict[str, float] = field(default_factory=dict)
    update_ratio_total: float | None = None
    update_ratios: dict[str, float] = field(default_factory=dict)
    histograms: list[HistogramRows] = field(default_factory=list)

    def scalars(self, suffix: str = "") -> dict[str, float]:
        """The reading as logger scalars, like Lightning's ``grad_norm`` utility names its own.

        ``grad_norm/total<suffix>`` and ``grad_norm/<layer>``; the same for ``weight_norm`` and
        ``update_ratio`` when measured; ``grad_nonfinite/total<suffix>`` and ``grad_nonfinite/<layer>``.
        """
        out = {GRAD_NORM.tag(f"total{suffix}"): self.grad_total, **_tagged(GRAD_NORM, self.grad_layers)}
        if self.weight_total is not None:
            out[WEIGHT_NORM.tag(f"total{suffix}")] = self.weight_total
            out.update(_tagged(WEIGHT_NORM, self.weight_layers))
        if self.update_ratio_total is not None:
            out[UPDATE_RATIO.tag(f"total{suffix}")] = self.update_ratio_total
            out.update(_tagged(UPDATE_RATIO, self.update_ratios))
        out[GRAD_NONFINITE.tag(f"total{suffix}")] = self.nonfinite_total
        out.update(_tagged(GRAD_NONFINITE, self.nonfinite_layers))
        return out


def _tagged(family: Family, values: dict[str, float]) -> dict[str, float]:
    head = f"{family.name}/"  # ``family.tag(name)``, without a Python call per layer
    return {head + name: x for name, x in values.items()}


class NormSample:
    """The norms of one optimizer step, on the device until :meth:`queue` and :meth:`read`.

    Under sharding every rank takes a sample, queues it and reads it (the fetch combines the ranks'
    shares in its one collective); histograms are of this rank's pieces (rank 0 writes them).
    """

    def __init__(self, stats: StepStats, spec: NormSpec) -> None:
        self.stats, self.spec = stats, spec
        nt, depth, per_param = spec.norm_type, spec.group_depth, spec.per_parameter
        self.device: dict[str, PendingNorms] = {}
        self.grad_labels, self.device["grad_layers"] = stats.grad_groups(nt, depth, per_param)
        self.device["grad_params"] = stats.grad_norms(nt)
        self.device["grad_total"] = stats.grad_total(nt).reshape(1)
        self.weight_labels: list[str] = []
        if spec.weights or spec.update:
            self.weight_labels, self.device["weight_layers"] = stats.weight_groups(nt, depth, per_param)
            self.device["weight_total"] = stats.weight_total(nt).reshape(1)
        # the step's one update sample, shared with every other monitor that measures the update
        self.updated = spec.update and stats.take_update_sample() is not None
        self.histograms = self._histograms() if spec.histogram_bins is not None else {}

    def _histograms(self) -> dict[str, Any]:
        stats, bins = self.stats, self.spec.histogram_bins or 0
        grads = stats.grads
        if stats.grad_scale is not None:  # still-scaled (fused optimizer): show unscaled values
            inv = 1.0 / stats.grad_scale.float()
            grads = [g.float() * inv.to(g.device) for g in grads]
        grad_names, weight_names, weights = stats.grad_names, stats.names, stats.local_params()
        if (layers := self.spec.histogram_layers) is not None:  # the layers shown (include/exclude, cap)
            g, w = self._in_layers(grad_names, layers), self._in_layers(weight_names, layers)
            grad_names, grads = [grad_names[i] for i in g], [grads[i] for i in g]
            weight_names, weights = [weight_names[i] for i in w], [weights[i] for i in w]
        out: dict[str, Any] = {}
        if grads:
            out[GRAD_HISTOGRAM.name] = (grad_names, device_histograms(grads, bins))
            out[GRAD_LOG10_HISTOGRAM.name] = (grad_names, device_histograms(grads, bins, log10=True))
        if weights:
            out[WEIGHT_HISTOGRAM.name] = (weight_names, device_histograms(weights, bins))
        return out

    def _in_layers(self, names: list[str], layers: frozenset[str]) -> list[int]:
        labels, index = self.stats.groups(names, self.spec.group_depth, self.spec.per_parameter)
        return [i for i, j in enumerate(index) if labels[j] in layers]

    def queue(self, transfer: HostTransfer, key: Hashable) -> None:
        """Queue every value under ``(key, name)``; call after ``optimizer.step()`` applied the update."""
        for name, t in self.device.items():
            transfer.add_norms((key, name), t)
        if self.updated:
            nt, depth, per_param = self.spec.norm_type, self.spec.group_depth, self.spec.per_parameter
            transfer.add_norms((key, "update_layers"), self.stats.update_groups(nt, depth, per_param)[1])
            transfer.add_norms((key, "update_total"), self.stats.update_total(nt).reshape(1))
            self.updated = False
        for kind, (_, spec) in self.histograms.items():
            for part in _HIST_PARTS:
                transfer.add((key, f"hist:{kind}:{part}"), getattr(spec, part))

    def read(self, host: dict[Any, Tensor], key: Hashable) -> NormReading:
        """The host values queued under ``key`` (a second transfer only when a gradient norm is NaN/inf)."""
        v = {k[1]: t for k, t in host.items() if isinstance(k, tuple) and k[0] == key}
        nonfinite = self._nonfinite(v["grad_params"])
        weighed, updated = "weight_layers" in v, "update_layers" in v
        w_total = float(v["weight_total"][0]) if weighed else None
        w_layers = v["weight_layers"].tolist() if weighed else []
        u_layers = v["update_layers"].tolist() if updated else []
        return NormReading(
            grad_total=float(v["grad_total"][0]),
            grad_layers=dict(zip(self.grad_labels, v["grad_layers"].tolist(), strict=True)),
            nonfinite_total=float(sum(nonfinite.values())),
            nonfinite_layers=nonfinite,
            weight_total=w_total if self.spec.weights else None,
            weight_layers=dict(zip(self.weight_labels, w_layers, strict=True)) if self.spec.weights else {},
            update_ratio_total=update_ratio(float(v["update_total"][0]), w_total or 0.0) if updated else None,
            update_ratios={
                name: update_ratio(u, w)
                for name, u, w in zip(self.weight_labels, u_layers, w_layers, strict=True)
            }
            if updated
            else {},
            histograms=[
                HistogramRows(
                    kind=kind,
                    names=names,
                    stats=v[f"hist:{kind}:stats"],
                    edges=v[f"hist:{kind}:edges"],
                    counts=v[f"hist:{kind}:counts"],
                )
                for kind, (names, _) in self.histograms.items()
            ],
        )

    def _nonfinite(self, grad_params: Tensor) -> dict[str, float]:
        """NaN/inf gradient entries per layer: none unless some norm came out non-finite; only then count
        (summed over the ranks' pieces under sharding: every rank reads the same norms and counts alike)."""
        bad = [i for i, x in enumerate(grad_params.tolist()) if not math.isfinite(x)]
        if not bad:
            return {}
        transfer = HostTransfer()
        counts = nonfinite_counts([self.stats.grads[i] for i in bad]).float()
        transfer.add("counts", counts, reduce="sum" if self.stats.sharding is not None else None)
        labels, index = self.stats.groups(
            self.stats.grad_names, self.spec.group_depth, self.spec.per_parameter
        )
        per_layer: dict[str, float] = {}
        for i, c in zip(bad, transfer.fetch()["counts"].tolist(), strict=True):
            per_layer[labels[index[i]]] = per_layer.get(labels[index[i]], 0.0) + float(c)
        return per_layer


def select_reading(reading: NormReading, selection: LayerSelection, suffix: str = "") -> dict[str, float]:
    """The scalars of a GradientNormLogger reading, for the layers ``selection`` shows, and its aggregates.

    Totals always cover every parameter of the optimizer. With a cap the layers are chosen on how far
    their gradient norm and update ratio lie from the other layers' (:func:`log_distance_scores`) and
    the same layers are shown in every family.
    """
    if not selection.filters and selection.max_layers is None:
        return reading.scalars(suffix)
    grads = selection.keep(reading.grad_layers)
    scores = log_distance_scores(list(grads.values()))
    if reading.update_ratios:
        ratios = log_distance_scores([reading.update_ratios.get(n, 1.0) for n in grads])
        scores = [max(a, b) for a, b in zip(scores, ratios, strict=True)]
    shown = selection.show(list(grads), scores)
    capped = selection.max_layers is not None
    weights, ratios_kept = selection.keep(reading.weight_layers), selection.keep(reading.update_ratios)
    out = replace(
        reading,
        grad_layers={n: v for n, v in grads.items() if n in shown},
        weight_layers={n: v for n, v in weights.items() if not capped or n in shown},
        update_ratios={n: v for n, v in ratios_kept.items() if not capped or n in shown},
        nonfinite_layers=selection.keep(reading.nonfinite_layers),
    ).scalars(suffix)
    for family, values in (
        (GRAD_NORM.name, grads),
        (WEIGHT_NORM.name, weights),
        (UPDATE_RATIO.name, ratios_kept),
    ):
        out.update({f"{k}{suffix}": v for k, v in selection.aggregates(family, values).items()})
    return out
