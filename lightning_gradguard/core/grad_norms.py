"""What the gradient-norm log stands on: the Trainer's clipping, and the norms of one step read once.

:func:`clip_setting` says how the Trainer clips gradients (and so which norm decides whether a step is
clipped). A :class:`NormSample` is taken in ``on_before_optimizer_step`` from the shared
:class:`~lightning_gradguard.core.stats.StepStats` (grouped gradient and weight norms, a snapshot of the
weights, histograms): nothing is read back there. After ``optimizer.step()`` (``on_train_batch_end``)
:meth:`NormSample.queue` finishes the update norms and queues everything on a
:class:`~lightning_gradguard.core.transfer.HostTransfer`, which the caller fetches once for all its
samples; :meth:`NormSample.read` turns the host values into a :class:`NormReading`.
:func:`read_layer_norms` is the short way for a check that needs only the per-layer 2-norms on the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor

from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.clipping import clipping_norm_type
from lightning_gradguard.functional.stats import device_histograms, group_index, layer_names, nonfinite_counts
from lightning_gradguard.functional.updates import update_norms, update_ratio, weight_snapshot

__all__ = [
    "ClipSetting",
    "HistogramRows",
    "LayerNorms",
    "NormReading",
    "NormSample",
    "NormSpec",
    "clip_setting",
    "parse_norm_type",
    "read_layer_norms",
]

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


@dataclass(frozen=True)
class ClipSetting:
    """How the Trainer clips gradients: ``gradient_clip_val`` and the norm that decides clipping."""

    value: float
    norm_type: float


def clip_setting(trainer: pl.Trainer) -> ClipSetting | None:
    """The Trainer's gradient clipping, or ``None`` when it does not clip.

    Lightning clips only in automatic optimization, and only for a ``gradient_clip_val`` above 0. Clipping
    by norm rescales the gradient when its total 2-norm exceeds the value; clipping by value changes it
    when some entry's magnitude does, which is when the infinity norm exceeds the value.
    """
    val = trainer.gradient_clip_val
    if val is None or float(val) <= 0 or not trainer.lightning_module.automatic_optimization:
        return None
    algorithm = GradClipAlgorithmType(getattr(trainer, "gradient_clip_algorithm", None) or "norm")
    return ClipSetting(value=float(val), norm_type=clipping_norm_type(algorithm.value))


@dataclass(frozen=True)
class NormSpec:
    """What to measure: the norm, the grouping (``group_depth``, ``per_parameter``), weights, the update."""

    norm_type: float = 2.0
    group_depth: int | None = None
    per_parameter: bool = False
    weights: bool = True
    update: bool = True
    histogram_bins: int | None = None  # None: no histograms


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
        out = {f"grad_norm/total{suffix}": self.grad_total, **_tagged("grad_norm", self.grad_layers)}
        if self.weight_total is not None:
            out[f"weight_norm/total{suffix}"] = self.weight_total
            out.update(_tagged("weight_norm", self.weight_layers))
        if self.update_ratio_total is not None:
            out[f"update_ratio/total{suffix}"] = self.update_ratio_total
            out.update(_tagged("update_ratio", self.update_ratios))
        out[f"grad_nonfinite/total{suffix}"] = self.nonfinite_total
        out.update(_tagged("grad_nonfinite", self.nonfinite_layers))
        return out


def _tagged(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{name}": x for name, x in values.items()}


class NormSample:
    """The norms of one optimizer step, on the device until :meth:`queue` and :meth:`read`."""

    def __init__(self, stats: StepStats, spec: NormSpec) -> None:
        self.stats, self.spec = stats, spec
        nt, depth, per_param = spec.norm_type, spec.group_depth, spec.per_parameter
        self.device: dict[str, Tensor] = {}
        self.grad_labels, self.device["grad_layers"] = stats.grad_groups(nt, depth, per_param)
        self.device["grad_params"] = stats.grad_norms(nt)
        self.device["grad_total"] = stats.grad_total(nt).reshape(1)
        self.weight_labels: list[str] = []
        self.weight_index: Tensor | None = None
        if spec.weights or spec.update:
            self.weight_labels, layer_w = stats.weight_groups(nt, depth, per_param)
            self.device["weight_layers"] = layer_w
            self.device["weight_total"] = torch.linalg.vector_norm(stats.weight_norms(nt), ord=nt).reshape(1)
            _, index = stats.groups(stats.names, depth, per_param)
            self.weight_index = torch.tensor(index, dtype=torch.long, device=layer_w.device)
        self.snapshot = weight_snapshot(stats.params) if spec.update and stats.params else None
        self.histograms = self._histograms() if spec.histogram_bins is not None else {}

    def _histograms(self) -> dict[str, Any]:
        stats, bins = self.stats, self.spec.histogram_bins or 0
        grads = stats.grads
        if stats.grad_scale is not None:  # still-scaled (fused optimizer): show unscaled values
            inv = 1.0 / stats.grad_scale.float()
            grads = [g.float() * inv.to(g.device) for g in grads]
        return {
            "grad": (stats.grad_names, device_histograms(grads, bins)),
            "grad_log10": (stats.grad_names, device_histograms(grads, bins, log10=True)),
            "weight": (stats.names, device_histograms([p.detach() for p in stats.params], bins)),
        }

    def queue(self, transfer: HostTransfer, key: Hashable) -> None:
        """Queue every value under ``(key, name)``; call after ``optimizer.step()`` applied the update."""
        for name, t in self.device.items():
            transfer.add((key, name), t)
        if self.snapshot is not None and self.weight_index is not None:
            upd = update_norms(
                self.snapshot,
                self.stats.params,
                self.weight_index,
                len(self.weight_labels),
                self.spec.norm_type,
            )
            transfer.add((key, "update_layers"), upd.layers)
            transfer.add((key, "update_total"), upd.total)
            self.snapshot = None
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
        """NaN/inf gradient entries per layer: none unless some norm came out non-finite; only then count."""
        bad = [i for i, x in enumerate(grad_params.tolist()) if not math.isfinite(x)]
        if not bad:
            return {}
        counts = nonfinite_counts([self.stats.grads[i] for i in bad]).cpu().tolist()
        labels, index = self.stats.groups(
            self.stats.grad_names, self.spec.group_depth, self.spec.per_parameter
        )
        per_layer: dict[str, float] = {}
        for i, c in zip(bad, counts, strict=True):
            per_layer[labels[index[i]]] = per_layer.get(labels[index[i]], 0.0) + float(c)
        return per_layer


@dataclass(frozen=True)
class LayerNorms:
    """Per-layer gradient 2-norms of one step on the host (model order), their total and element counts.

    ``device`` is where the gradients live (a follow-up collective needs a tensor there).
    """

    labels: list[str]
    values: list[float]
    total: float
    numels: list[int]
    device: torch.device


@functools.lru_cache(maxsize=16)
def _layer_numels(names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Elements per layer (cached while the parameters with a gradient are the same)."""
    labels, index = group_index(layer_names(names))
    numels = [0] * len(labels)
    for i, n in zip(index, sizes, strict=True):
        numels[i] += n
    return tuple(numels)


def read_layer_norms(stats: StepStats) -> LayerNorms | None:
    """The step's per-layer gradient 2-norms and total on the host, in one transfer; ``None`` without any.

    The norms are the shared ones of :class:`~lightning_gradguard.core.stats.StepStats` (no second pass).
    """
    labels, norms = stats.grad_groups(2.0)
    if not labels:
        return None
    transfer = HostTransfer()
    transfer.add("norms", norms)
    transfer.add("total", stats.grad_total(2.0))
    host = transfer.fetch()  # the one device -> host transfer of this check
    return LayerNorms(
        labels=labels,
        values=host["norms"].tolist(),
        total=float(host["total"]),
        numels=list(_layer_numels(tuple(stats.grad_names), tuple(g.numel() for g in stats.grads))),
        device=norms.device,
    )
