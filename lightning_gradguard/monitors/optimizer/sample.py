"""Optimizer-state plumbing: the record of dropped updates, the GradScaler skip count, and one step's sample.

* :func:`skip_update` is how a callback drops an update (every gradient to ``None``, as
  :func:`~lightning_gradguard.core.trial.drop_update`) and records why, in the Trainer's shared
  :class:`~lightning_gradguard.core.state.TrainerState` (a Python counter: no device work, no sync).
* :class:`ScaleWatch` counts the steps the GradScaler skipped, on the device: the scale before the step
  against the scale after it (it only ever falls on an overflow); read with the logging step's transfer.
* :class:`OptimizerSample` is one measured step of one optimizer: before ``optimizer.step()`` it copies
  (a sample of) the weights and the gradient and notes each parameter's learning rate; after the step it
  queues the update's geometry and the optimizer's moments into the step's one
  :class:`~lightning_gradguard.core.transfer.HostTransfer`, and :meth:`OptimizerSample.read` turns the
  host values into per-layer numbers (:mod:`lightning_gradguard.functional.optimizer_state`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.state import trainer_state
from lightning_gradguard.core.stats import StepStats, active_scaler
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.layers import log_distance_scores
from lightning_gradguard.functional.optimizer_state import (
    OPTIMIZER_SAMPLE_ENTRIES,
    LayerGeometry,
    LayerMoments,
    layer_geometry,
    layer_moments,
    update_geometry,
)
from lightning_gradguard.functional.stats import foreach_norms
from lightning_gradguard.functional.updates import WeightSnapshot, sampled, weight_snapshot

__all__ = [
    "OptimizerReading",
    "OptimizerSample",
    "ScaleWatch",
    "reading_scalars",
]


class ScaleWatch:
    """Counts GradScaler skips on the device: one scale copy before the step, one compare after it.

    The scale only falls when the scaler found inf/NaN gradients (it then halves and skips the step); it
    grows, never falls, otherwise. A step another callback dropped is not counted again (a rollback may
    restore an older, lower scale). ``count`` stays on the device until a logging step reads it.
    """

    def __init__(self) -> None:
        self.count: Tensor | None = None
        self._before: Tensor | None = None
        self._others = 0

    def before_step(self, trainer: pl.Trainer) -> None:
        """Call in ``on_before_optimizer_step`` (settles the previous optimizer's step first)."""
        self.settle(trainer)
        scale = getattr(active_scaler(trainer), "_scale", None)
        if scale is None:
            return
        self._before = scale.detach().clone()
        self._others = sum(trainer_state(trainer).skipped_updates.values())

    def settle(self, trainer: pl.Trainer) -> None:
        """Call once the step ran: adds 1 on the device when the scale fell across it."""
        before, self._before = self._before, None
        scale = getattr(active_scaler(trainer), "_scale", None)
        if (
            before is None
            or scale is None
            or sum(trainer_state(trainer).skipped_updates.values()) > self._others
        ):
            return
        fell = (scale.detach() < before).float().reshape(1)
        self.count = fell if self.count is None else self.count + fell.to(self.count.device)


@dataclass(frozen=True)
class OptimizerReading:
    """One optimizer step on the host: the update's geometry, the moments, and what the optimizer keeps.

    ``keeps`` names the moment families found in the optimizer's state (``"exp_avg"``,
    ``"exp_avg_sq"``, ``"momentum_buffer"``); empty for an optimizer we do not read (LBFGS, Adagrad, ...).
    ``graded`` lists the layers that had a gradient this step.
    """

    step: int
    geometry: LayerGeometry
    moments: LayerMoments
    keeps: frozenset[str]
    graded: frozenset[str]


def reading_scalars(reading: OptimizerReading, layers: LayerSelection, suffix: str = "") -> dict[str, float]:
    """The tags of one reading: ``optimizer/<family>/total<suffix>`` and ``optimizer/<family>/<layer>``
    for the layers ``layers`` shows (with a cap: chosen on how far their update ratio lies from the
    others'), plus ``optimizer/<family>/across_layers/*`` with a cap. Undefined values are left out."""
    g, m = reading.geometry, reading.moments
    families = {
        "step_size": g.step_size,
        "update_cosine": g.cosine,
        "exp_avg_norm": m.exp_avg_norm,
        "exp_avg_sq_rms": m.exp_avg_sq_rms,
        "momentum_norm": m.momentum_norm,
    }
    totals = {"step_size": g.step_size_total, "update_cosine": g.cosine_total, **m.totals}
    out = {f"optimizer/{f}/total{suffix}": v for f, v in totals.items() if v is not None}
    shown: set[str] | None = None
    if layers.max_layers is not None:
        ratios = [g.update_ratio.get(n, 1.0) for n in g.step_size]
        shown = layers.show(list(g.step_size), log_distance_scores(ratios))
    for family, values in families.items():
        kept = layers.keep(values)
        out.update({f"optimizer/{family}/{k}": v for k, v in kept.items() if shown is None or k in shown})
        aggregates = layers.aggregates(f"optimizer/{family}", kept) if kept else {}
        out.update({f"{k}{suffix}": v for k, v in aggregates.items()})
    return out


def _host_number(value: Any) -> float | Tensor:
    """A Python float, or a device tensor to read with the transfer (never a sync here)."""
    if isinstance(value, Tensor):
        return float(value) if value.device.type == "cpu" else value.detach().float().reshape(1)
    return float(value)


class OptimizerSample:
    """One measured step of one optimizer, on the device until :meth:`queue` and :meth:`read`.

    Build it in ``on_before_optimizer_step`` (it copies a sample of the weights and of the gradient, and
    the learning rate each parameter will be stepped with: the scheduler changes it after the step),
    queue it after ``optimizer.step()``, read it from the host values. Not for sharded parameters.
    """

    def __init__(self, stats: StepStats, optimizer: Any) -> None:
        self.stats = stats
        self.opt = getattr(optimizer, "optimizer", optimizer)
        self.params = stats.params
        self.labels, self.index = stats.groups(stats.names, None, False)
        group_of = {id(p): g for g in self.opt.param_groups for p in g["params"]}
        self.groups = [group_of.get(id(p), {}) for p in self.params]
        self.lrs = [_host_number(g.get("lr", 0.0)) for g in self.groups]
        self.with_grad = [
            i for i, p in enumerate(self.params) if p.grad is not None and p.grad.layout == torch.strided
        ]
        self.weights: Any = weight_snapshot(stats.local_params(), OPTIMIZER_SAMPLE_ENTRIES)
        self.strides, self.scales = list(self.weights.strides), list(self.weights.scales)
        grads = [self.params[i].grad for i in self.with_grad]
        self.grads: Any = (
            weight_snapshot(grads, OPTIMIZER_SAMPLE_ENTRIES) if grads else WeightSnapshot([], [], [])  # type: ignore[arg-type]
        )
        self.keeps: frozenset[str] = frozenset()
        self._moment_index: dict[str, list[int]] = {}
        self._second: dict[int, tuple[float | Tensor, float, float]] = {}  # step, beta2, eps

    def queue(self, transfer: HostTransfer, key: Hashable) -> None:
        """Queue the step's geometry and the optimizer's moments under ``(key, name)``; after the step."""
        geometry = update_geometry(self.weights, self.params, self.grads, self.with_grad)
        self.weights = self.grads = None  # the copies are not needed any more
        transfer.add((key, "update_sq"), geometry.update_sq)
        transfer.add((key, "grad_sq"), geometry.grad_sq)
        transfer.add((key, "descent"), geometry.descent)
        transfer.add_norms((key, "weight"), self.stats.weight_norms(2.0))
        for i, lr in enumerate(self.lrs):
            if isinstance(lr, Tensor):
                transfer.add((key, f"lr:{i}"), lr)
        moments: dict[str, list[Tensor]] = {"exp_avg": [], "exp_avg_sq": [], "momentum_buffer": []}
        index: dict[str, list[int]] = {name: [] for name in moments}
        for i, p in enumerate(self.params):
            state, group = self.opt.state.get(p, {}), self.groups[i]
            for name in ("exp_avg", "momentum_buffer"):
                if isinstance(state.get(name), Tensor):
                    moments[name].append(state[name])
                    index[name].append(i)
            v = state.get("max_exp_avg_sq", state.get("exp_avg_sq"))
            if isinstance(v, Tensor) and "betas" in group and "step" in state:
                moments["exp_avg_sq"].append(v)
                index["exp_avg_sq"].append(i)
                step = _host_number(state["step"])
                if isinstance(step, Tensor):
                    transfer.add((key, f"step:{i}"), step)
                self._second[i] = (step, float(group["betas"][1]), float(group.get("eps", 0.0)))
        for name, tensors in moments.items():
            if tensors:  # on the weights' sample; exp_avg_sq is >= 0: its 1-norm is its sum
                order = 1.0 if name == "exp_avg_sq" else 2.0
                views = sampled(tensors, [self.strides[i] for i in index[name]])
                norms = foreach_norms(views, order)
                if any(self.scales[i] != 1.0 for i in index[name]):
                    factor = torch.tensor([self.scales[i] ** (1.0 / order) for i in index[name]])
                    norms = norms * factor.to(norms.device)
                transfer.add((key, name), norms)
        self.keeps = frozenset(name for name, tensors in moments.items() if tensors)
        self._moment_index = index

    def read(self, host: dict[Any, Tensor], key: Hashable) -> OptimizerReading:
        """The step's per-layer numbers from the transfer's host values."""
        v = {k[1]: t for k, t in host.items() if isinstance(k, tuple) and k[0] == key}
        lrs = [float(v[f"lr:{i}"][0]) if isinstance(lr, Tensor) else lr for i, lr in enumerate(self.lrs)]
        weight = v["weight"].tolist()
        grad_sq, descent = v["grad_sq"].tolist(), v["descent"].tolist()
        geometry = layer_geometry(
            self.labels,
            self.index,
            v["update_sq"].tolist(),
            [w * w for w in weight],
            lrs,
            {i: (g, d) for i, g, d in zip(self.with_grad, grad_sq, descent, strict=True)},
        )
        per: dict[str, dict[int, float]] = {}
        for name, idx in self._moment_index.items():
            values = v[name].tolist() if name in v else []
            per[name] = dict(zip(idx, values, strict=True))
        second = {}
        for i, (step, beta2, eps) in self._second.items():
            t = float(v[f"step:{i}"][0]) if isinstance(step, Tensor) else step
            second[i] = (per["exp_avg_sq"][i], self.params[i].numel(), 1.0 - beta2**t, eps)
        moments = layer_moments(
            self.labels,
            self.index,
            {i: x * x for i, x in per.get("exp_avg", {}).items()},
            {i: x * x for i, x in per.get("momentum_buffer", {}).items()},
            second,
        )
        graded = frozenset(self.labels[self.index[i]] for i in self.with_grad)
        return OptimizerReading(self.stats.step, geometry, moments, self.keeps, graded)
