"""One measured optimizer step, and the GradScaler's skips: what OptimizerMonitor reads.

* :class:`ScaleWatch` counts the steps the GradScaler skipped, on the device: the scale before the step
  against the scale after it (it only ever falls on an overflow); read with the logging step's transfer.
* :class:`OptimizerSample` is one measured step of one optimizer: before ``optimizer.step()`` it takes
  the step's shared update sample with the gradient at its entries
  (:meth:`~lightning_gradguard.core.stats.StepStats.take_update_sample`) and notes each parameter's
  learning rate; after the step it
  queues the update's geometry and the optimizer's moments into the step's one
  :class:`~lightning_gradguard.core.transfer.HostTransfer`, and :meth:`OptimizerSample.read` turns the
  host values into per-layer numbers (:mod:`lightning_gradguard.functional.optimizer_state`); its
  update/weight ratios are the shared per-layer norms every monitor reads. For the Adam family (Adam,
  AdamW, NAdam, RAdam) it also reads each layer's largest per-entry step in units of lr, with the
  setting that bounds it (:class:`AdamStep`).
* :func:`reading_scalars`: a reading as ``optimizer/*`` tags.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.lr import decoupled_decay_groups
from lightning_gradguard.core.stats import StepStats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.layers import log_distance_scores
from lightning_gradguard.functional.optimizer_state import (
    LayerGeometry,
    LayerMoments,
    adam_step_bound,
    entry_steps,
    layer_geometry,
    layer_moments,
)
from lightning_gradguard.functional.stats import foreach_norms
from lightning_gradguard.functional.updates import sampled, update_ratio
from lightning_gradguard.monitors.optimizer.tags import OPTIMIZER


class ScaleWatch:
    """Counts GradScaler skips on the device, from the fact of each step
    (:meth:`~lightning_gradguard.core.stats.StepStats.scaler_skipped`: its scale fell across the step; a
    step another callback dropped is that callback's, not counted again). ``count`` stays on the device
    until a logging step reads it.
    """

    def __init__(self) -> None:
        self.count: Tensor | None = None
        self._stats: StepStats | None = None

    def before_step(self, stats: StepStats) -> None:
        """Call in ``on_before_optimizer_step`` (settles the previous optimizer's step first)."""
        self.settle()
        stats.watch_scaler()
        self._stats = stats

    def settle(self) -> None:
        """Call once the step ran: adds 1 on the device when the GradScaler skipped it."""
        stats, self._stats = self._stats, None
        fell = stats.scaler_skipped() if stats is not None else None
        if fell is not None:
            self.count = fell if self.count is None else self.count + fell.to(self.count.device)


#: the optimizers whose step is Adam's ``lr * m_hat / (sqrt(v_hat) + eps)``, and the bound that applies
_ADAM_KINDS = (
    (torch.optim.NAdam, "nadam"),
    (torch.optim.RAdam, "radam"),
    (torch.optim.Adam, "adam"),
    (torch.optim.AdamW, "adam"),
)


def _adam_kind(opt: Any) -> str | None:
    """``"adam"`` / ``"nadam"`` / ``"radam"`` for torch's Adam family (fused and foreach forms alike);
    ``None`` for any other optimizer (LAMB's trust ratio, Adafactor, ... scale their steps otherwise)."""
    return next((kind for cls, kind in _ADAM_KINDS if isinstance(opt, cls)), None)


@dataclass(frozen=True)
class AdamStep:
    r"""A layer's largest per-entry Adam step and the setting of the parameter it was found in.

    ``step`` is :math:`\max |\Delta w| / lr` (in units of the lr it was stepped with), ``bound`` the most
    Adam can take with these betas at this step count
    (:func:`~lightning_gradguard.functional.optimizer_state.adam_step_bound`; ``inf``: none).
    """

    step: float
    bound: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    steps_taken: float
    optimizer: str


@dataclass(frozen=True)
class OptimizerReading:
    """One optimizer step on the host: the update's geometry, the moments, and what the optimizer keeps.

    ``keeps`` names the moment families found in the optimizer's state (``"exp_avg"``,
    ``"exp_avg_sq"``, ``"momentum_buffer"``); empty for an optimizer we do not read (LBFGS, Adagrad, ...).
    ``graded`` lists the layers that had a non-zero gradient this step. ``adam_steps``: the Adam family only.
    ``numels``: the entries of each layer (a rule weighs the layers it found against those it checked).
    """

    step: int
    geometry: LayerGeometry
    moments: LayerMoments
    keeps: frozenset[str]
    graded: frozenset[str]
    adam_steps: dict[str, AdamStep] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)


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
    out = {OPTIMIZER.tag(f, f"total{suffix}"): v for f, v in totals.items() if v is not None}
    shown: set[str] | None = None
    if layers.max_layers is not None:
        ratios = [g.update_ratio.get(n, 1.0) for n in g.step_size]
        shown = layers.show(list(g.step_size), log_distance_scores(ratios))
    for family, values in families.items():
        kept = layers.keep(values)
        out.update({OPTIMIZER.tag(family, k): v for k, v in kept.items() if shown is None or k in shown})
        aggregates = layers.aggregates(OPTIMIZER.tag(family), kept) if kept else {}
        out.update({f"{k}{suffix}": v for k, v in aggregates.items()})
    return out


def _host_number(value: Any) -> float | Tensor:
    """A Python float, or a device tensor to read with the transfer (never a sync here); NaN for no number
    (Adafactor's relative step keeps ``lr=None``: the rules that read the LR skip a NaN)."""
    if isinstance(value, Tensor):
        return float(value) if value.device.type == "cpu" else value.detach().float().reshape(1)
    return float(value) if isinstance(value, (int, float)) else math.nan


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
        self.lrs = [_host_number(g.get("lr", 0.0)) for g in self.groups]  # None: the optimizer's own step
        # the step's one update sample (shared with the other monitors), with the gradient at its entries
        sample = stats.take_update_sample(with_grads=True)
        assert sample is not None  # the monitor measures only a step with parameters
        self.sample = sample
        self.keeps: frozenset[str] = frozenset()
        self.kind = _adam_kind(self.opt)
        self._moment_index: dict[str, list[int]] = {}
        self._second: dict[int, tuple[float | Tensor, float, float]] = {}  # step, beta2, eps
        # decoupled weight decay (AdamW's) moves an entry by lr * weight_decay * |w| on top of Adam's step:
        # the largest |w| of each such parameter on the sample, before the step (a device tensor)
        decay = (
            {id(g): float(g["weight_decay"]) for g in decoupled_decay_groups(self.opt)} if self.kind else {}
        )
        self._decay = {i: decay[id(g)] for i, g in enumerate(self.groups) if id(g) in decay}
        self._weight_max: Tensor | None = None
        if self._decay:
            params, strides = zip(*((self.params[i], sample.strides[i]) for i in self._decay), strict=True)
            self._weight_max = foreach_norms(sampled(list(params), list(strides)), math.inf)

    def queue(self, transfer: HostTransfer, key: Hashable) -> None:
        """Queue the step's geometry and the optimizer's moments under ``(key, name)``; after the step."""
        grad_sq, descent = self.sample.grad_geometry()
        transfer.add((key, "update_sq"), self.sample.norms(2.0).square())
        transfer.add((key, "grad_sq"), grad_sq)
        transfer.add((key, "descent"), descent)
        transfer.add_norms((key, "weight"), self.stats.weight_norms(2.0))
        # the update/weight ratio every monitor reports: the shared per-layer norms, not a sum of our own
        transfer.add_norms((key, "update_layers"), self.stats.update_groups(2.0)[1])
        transfer.add_norms((key, "weight_layers"), self.stats.weight_groups(2.0)[1])
        transfer.add_norms((key, "update_total"), self.stats.update_total(2.0).reshape(1))
        transfer.add_norms((key, "weight_total"), self.stats.weight_total(2.0).reshape(1))
        for i, lr in enumerate(self.lrs):
            if isinstance(lr, Tensor):
                transfer.add((key, f"lr:{i}"), lr)
        if self.kind is not None:  # each parameter's largest |delta w| on the sample (not scaled up)
            transfer.add((key, "update_max"), self.sample.norms(math.inf))
        if self._weight_max is not None:
            transfer.add((key, "weight_max"), self._weight_max)
        moments = self._moments(transfer, key)
        for name, tensors in moments.items():
            if tensors:
                transfer.add((key, name), self._moment_norms(name, tensors))
        self.keeps = frozenset(name for name, tensors in moments.items() if tensors)

    def _moments(self, transfer: HostTransfer, key: Hashable) -> dict[str, list[Tensor]]:
        """The moments the optimizer keeps, per family, noting which parameter each belongs to (and, for
        Adam's second moment, its step, ``beta2`` and ``eps``: the step queued when it is a tensor)."""
        moments: dict[str, list[Tensor]] = {"exp_avg": [], "exp_avg_sq": [], "momentum_buffer": []}
        self._moment_index = {name: [] for name in moments}
        for i, p in enumerate(self.params):
            state, group = self.opt.state.get(p, {}), self.groups[i]
            for name in ("exp_avg", "momentum_buffer"):
                if isinstance(state.get(name), Tensor):
                    moments[name].append(state[name])
                    self._moment_index[name].append(i)
            v = state.get("max_exp_avg_sq", state.get("exp_avg_sq"))  # what divides under AMSGrad
            if isinstance(v, Tensor) and "betas" in group and "step" in state:
                moments["exp_avg_sq"].append(v)
                self._moment_index["exp_avg_sq"].append(i)
                step = _host_number(state["step"])
                if isinstance(step, Tensor):
                    transfer.add((key, f"step:{i}"), step)
                self._second[i] = (step, float(group["betas"][1]), float(group.get("eps", 0.0)))
        return moments

    def _moment_norms(self, name: str, tensors: list[Tensor]) -> Tensor:
        """Norms of one moment family on the update sample's entries, scaled up where sampled
        (``exp_avg_sq`` is >= 0: its 1-norm is its sum)."""
        index, order = self._moment_index[name], 1.0 if name == "exp_avg_sq" else 2.0
        norms = foreach_norms(sampled(tensors, [self.sample.strides[i] for i in index]), order)
        if any(self.sample.scales[i] != 1.0 for i in index):
            factor = torch.tensor([self.sample.scales[i] ** (1.0 / order) for i in index])
            norms = norms * factor.to(norms.device)
        return norms

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
            {i: (g, d) for i, g, d in zip(self.sample.with_grad, grad_sq, descent, strict=True)},
        )
        geometry = replace(geometry, **_shared_ratios(self.labels, v))
        # Adam's step count per parameter (queued when the optimizer keeps it as a tensor)
        steps = {
            i: float(v[f"step:{i}"][0]) if isinstance(t, Tensor) else t
            for i, (t, _, _) in self._second.items()
        }
        # a layer whose (sampled) gradient is exactly zero learns nothing this step: a query and key that see
        # one token (MobileViT's last stage at 32 px), a layer scale after a dead branch; its update is the
        # weight decay's alone, no LR's doing, so the layer comparisons leave it out
        graded = frozenset(
            self.labels[self.index[i]] for i, g in zip(self.sample.with_grad, grad_sq, strict=True) if g > 0
        )
        adam = {}
        if "update_max" in v:
            update_max = v["update_max"].tolist()
            if "weight_max" in v:  # Adam's own part of the step: at least the move less the decay's largest
                for (i, decay), w in zip(self._decay.items(), v["weight_max"].tolist(), strict=True):
                    update_max[i] = max(0.0, update_max[i] - lrs[i] * decay * w)
            adam = self._adam_steps(update_max, lrs, steps)
        numels: dict[str, int] = {}
        for p, j in zip(self.params, self.index, strict=True):  # sizes only: no device read
            numels[self.labels[j]] = numels.get(self.labels[j], 0) + p.numel()
        return OptimizerReading(
            self.stats.step, geometry, self._read_moments(v, steps), self.keeps, graded, adam, numels
        )

    def _read_moments(self, v: dict[str, Tensor], steps: dict[int, float]) -> LayerMoments:
        per: dict[str, dict[int, float]] = {}
        for name, idx in self._moment_index.items():
            values = v[name].tolist() if name in v else []
            per[name] = dict(zip(idx, values, strict=True))
        second = {
            i: (per["exp_avg_sq"][i], self.params[i].numel(), 1.0 - beta2 ** steps[i], eps)
            for i, (_, beta2, eps) in self._second.items()
        }
        return layer_moments(
            self.labels,
            self.index,
            {i: x * x for i, x in per.get("exp_avg", {}).items()},
            {i: x * x for i, x in per.get("momentum_buffer", {}).items()},
            second,
        )

    def _adam_steps(
        self, update_max: list[float], lrs: list[float], steps: dict[int, float]
    ) -> dict[str, AdamStep]:
        """Each layer's largest per-entry step, and the setting of the parameter it was found in (the
        parameters with Adam state; RAdam's only once its variance is rectified)."""
        bounds: dict[int, float] = {}
        for i, t in steps.items():
            g = self.groups[i]
            decay = float(g.get("momentum_decay", 0.004))
            bound = adam_step_bound(float(g["betas"][0]), self._second[i][1], t, self.kind or "adam", decay)
            if bound is not None:
                bounds[i] = bound
        out = {}
        for layer, e in entry_steps(self.labels, self.index, update_max, lrs, bounds).items():
            _, beta2, eps = self._second[e.param]
            out[layer] = AdamStep(
                step=e.step,
                bound=e.bound,
                lr=lrs[e.param],
                beta1=float(self.groups[e.param]["betas"][0]),
                beta2=beta2,
                eps=eps,
                steps_taken=steps[e.param],
                optimizer=type(self.opt).__name__,
            )
        return out


def _shared_ratios(labels: list[str], v: dict[str, Tensor]) -> dict[str, Any]:
    """The update/weight ratios from the step's shared per-layer norms (the numbers every monitor reads)."""
    pairs = zip(labels, v["update_layers"].tolist(), v["weight_layers"].tolist(), strict=True)
    total_w = float(v["weight_total"][0])
    return {
        "update_ratio": {name: update_ratio(u, w) for name, u, w in pairs if w > 0},
        "update_ratio_total": update_ratio(float(v["update_total"][0]), total_w) if total_w > 0 else None,
    }
