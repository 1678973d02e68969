"""The statistics of one optimizer step, computed once on the device and shared by every callback.

:class:`StepStats` lists the trainable parameters the optimizer is about to update and computes gradient
and weight statistics lazily, on the device, each at most once. The first callback that asks in
``on_before_optimizer_step`` pays for the pass; the others read the cached tensors. Nothing here moves
data to the host: callers do that, once, through :mod:`lightning_gradguard.core.transfer`.

Norms come as :class:`~lightning_gradguard.core.sharding.PendingNorms`: the norms themselves on one
process and under DDP; under FSDP1 / FSDP2 this rank's shares of the whole tensors' norms, computed on
its pieces, which the caller's one transfer combines across the ranks
(:meth:`~lightning_gradguard.core.transfer.HostTransfer.add_norms`). Every rank must then ask alike.

The update of the step is measured once too: the first monitor that wants it asks
:meth:`StepStats.take_update_sample` before ``optimizer.step()`` (one :class:`UpdateSample`: a strided
sample of every weight, and on request of its gradient at the same entries); after the step every monitor
reads the same per-parameter update norms (:meth:`StepStats.update_norms`, grouped like the weights by
:meth:`StepStats.update_groups`), so GradientNormLogger, OptimizerMonitor and StallDetector report the same
``||delta w|| / ||w||`` for the same layer on the same step. The weights the ratio divides by are the exact
norms before the step.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.sharding import (
    FLAT_PARAM_MESSAGE,
    PendingNorms,
    Sharding,
    local_tensor,
    sharding_of,
    unsupported_reason,
)
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.functional.stats import (
    clean_name,
    foreach_norms,
    group_index,
    group_shares,
    layer_names,
    norm_shares,
    reduce_norms,
    total_share,
)
from lightning_gradguard.functional.updates import (
    SAMPLE_ENTRIES,
    WeightSnapshot,
    foreach_dots,
    sampled,
    weight_snapshot,
)


@dataclass
class _Caches:
    """What the statistics keep per Trainer: the current step's statistics and the parameter lists."""

    #: (global_step, id(optimizer)) -> the step's statistics
    steps: dict[tuple[int, int], StepStats] = field(default_factory=dict)
    #: id(optimizer) -> (its parameters, their names, the trainable ones, their requires_grad flags)
    params: dict[int, tuple[list[Tensor], list[str], list[Tensor], list[bool]]] = field(default_factory=dict)
    #: id(optimizer) -> its trainable parameter list and their sharding (``core.sharding``)
    sharding: dict[int, tuple[list[Tensor], Sharding | None]] = field(default_factory=dict)
    #: why nothing can be measured in this run (DeepSpeed), once known; ``False`` until then
    unsupported: str | bool | None = False
    #: the Trainer's enabled GradScaler (``None``: none), once known; ``False`` until then
    scaler: Any = False
    #: (global_step, id(optimizer)) -> why a callback dropped that step's update (``core.skips``)
    dropped: dict[tuple[int, int], str] = field(default_factory=dict)


#: what the per-step lists read off each parameter group and parameter (C calls: no Python call per item)
_PARAMS = operator.itemgetter("params")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")

#: id(trainer) -> its caches (a plain dict, read without a Python call; an entry goes with its Trainer)
_CACHES: dict[int, _Caches] = {}


def _caches(trainer: pl.Trainer) -> _Caches:
    caches = _CACHES.get(id(trainer))
    if caches is None:
        caches = _CACHES[id(trainer)] = _Caches()
        weakref.finalize(trainer, _CACHES.pop, id(trainer), None)
    return caches


def step_cache(trainer: pl.Trainer) -> dict[tuple[int, int], StepStats]:
    """The Trainer's cache of step statistics (the same dict for the Trainer's life: a callback may keep
    it and clear it without looking it up)."""
    return _caches(trainer).steps


def global_step(trainer: pl.Trainer) -> int:
    """``trainer.global_step``, read from Lightning's progress counters directly (the property costs three
    Python calls, and this runs every step); the property itself if the loop looks otherwise."""
    try:
        loop = trainer.fit_loop.epoch_loop
        automatic: int = loop.automatic_optimization.optim_progress.optimizer.step.total.completed
        manual: int = loop.manual_optimization.optim_step_progress.total.completed
    except AttributeError:
        return int(trainer.global_step)
    return automatic + manual  # one of them stays 0: a module optimizes automatically or manually


def _trainable(
    pl_module: pl.LightningModule, optimizer: Any, state: _Caches
) -> tuple[list[str], list[Tensor]]:
    """Names and tensors of the trainable parameters ``optimizer`` updates, in model order (cached)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # unwrap LightningOptimizer
    in_opt = list(itertools.chain.from_iterable(map(_PARAMS, opt.param_groups)))  # no Python call per group
    trainable = list(map(_REQUIRES_GRAD, in_opt))  # unfreezing a layer later changes what is measured
    cached = state.params.get(id(opt))
    if (  # the same tensors, each still (not) trainable: compared in C, no Python call per parameter
        cached is not None
        and len(cached[0]) == len(in_opt)
        and all(map(operator.is_, cached[0], in_opt))
        and cached[3] == trainable
    ):
        return cached[1], cached[2]
    wanted = {id(p) for p in in_opt if p.requires_grad}
    names: list[str] = []
    params: list[Tensor] = []
    seen: set[int] = set()
    for name, p in pl_module.named_parameters():
        if id(p) in wanted and id(p) not in seen:
            seen.add(id(p))
            names.append(clean_name(name))
            params.append(p)
    for i, p in enumerate(in_opt):  # tensors the optimizer holds that the module does not own
        if id(p) in wanted and id(p) not in seen:
            seen.add(id(p))
            names.append(f"optimizer_param_{i}")
            params.append(p)
    state.params[id(opt)] = (in_opt, names, params, trainable)
    return names, params


def _sharding(trainer: pl.Trainer, state: _Caches, opt: Any, params: list[Tensor]) -> Sharding | None:
    """The sharding of ``params`` (cached while the optimizer's trainable parameters are the same list)."""
    cached = state.sharding.get(id(opt))
    if cached is not None and cached[0] is params:
        return cached[1]
    sharding = sharding_of(trainer, params)
    state.sharding[id(opt)] = (params, sharding)
    if sharding is not None and sharding.flat:
        warn_once(trainer, "sharding:flat_param", FLAT_PARAM_MESSAGE)
    return sharding


def active_scaler(trainer: pl.Trainer) -> Any:
    """The GradScaler of the Trainer's precision plugin when it is enabled (16-mixed), else ``None``
    (looked up once per Trainer: its precision plugin does not change)."""
    caches = _CACHES.get(id(trainer)) or _caches(trainer)
    if caches.scaler is False:
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        caches.scaler = scaler if scaler is not None and scaler.is_enabled() else None
    return caches.scaler


def _grad_scale(scaler: Any, optimizer: Any) -> Tensor | None:
    """The GradScaler scale when the optimizer's gradients are still scaled (fused optimizers)."""
    if scaler is None:
        return None
    opt = getattr(optimizer, "optimizer", optimizer)
    try:
        from torch.amp.grad_scaler import OptState

        stage = scaler._per_optimizer_states[id(opt)]["stage"]
        if stage is OptState.UNSCALED:
            return None
        scale: Tensor | None = scaler._scale
        return scale
    except (AttributeError, KeyError, ImportError):
        return None


class UpdateSample:
    """The update one optimizer step applies, sampled once for every monitor that asks.

    Made before ``optimizer.step()`` from this rank's weights (its pieces under sharding): a copy of every
    parameter, or of a strided sample of ``SAMPLE_ENTRIES`` of its entries when it is larger
    (:func:`~lightning_gradguard.functional.updates.weight_snapshot`); :meth:`sample_grads` adds the
    gradient at the same entries. Read after the step: :meth:`norms` (``||delta w||`` per parameter, scaled
    up from the sample) and :meth:`grad_geometry`. The copies are dropped with the step's statistics.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self._before: WeightSnapshot | None = weight_snapshot(params, SAMPLE_ENTRIES)
        self.strides, self.scales = list(self._before.strides), list(self._before.scales)
        #: the parameters whose gradient was sampled (strided, dense gradients), and the samples
        self.with_grad: list[int] = []
        self._grads: list[Tensor] | None = None
        self._diff: list[Tensor] | None = None
        self._norms: dict[float, Tensor] = {}

    def sample_grads(self, grads: list[Tensor | None]) -> None:
        """Copy the gradient of each parameter (``grads[i]`` or ``None``) at the weights' sampled entries.

        Call before the step; a second call does nothing."""
        if self._grads is not None:
            return
        self.with_grad = [i for i, g in enumerate(grads) if g is not None and g.layout == torch.strided]
        picked = [grads[i] for i in self.with_grad]
        views = sampled(picked, [self.strides[i] for i in self.with_grad])  # type: ignore[arg-type]
        self._grads = list(torch._foreach_mul(views, 1.0)) if views else []

    @property
    def grads(self) -> list[Tensor]:
        """The sampled gradients, one per parameter of :attr:`with_grad` (empty before
        :meth:`sample_grads`)."""
        return self._grads or []

    def diff(self) -> list[Tensor]:
        """``w_before - w_after`` on the sampled entries (computed once, after the step)."""
        if self._diff is None:
            before, self._before = self._before, None
            assert before is not None
            torch._foreach_sub_(before.values, sampled(self.params, self.strides))
            self._diff = before.values
        return self._diff

    def norms(self, norm_type: float = 2.0) -> Tensor:
        """``||delta w||`` of every parameter (a float32 vector on the device), scaled up from the sample
        (``(numel / sampled) ** (1 / p)``; the infinity norm is not scaled)."""
        if norm_type not in self._norms:
            diff = self.diff()
            norms = foreach_norms(diff, norm_type) if diff else torch.zeros(0)
            if math.isfinite(norm_type) and max(self.scales, default=1.0) != 1.0:
                factors = torch.tensor([s ** (1.0 / norm_type) for s in self.scales], dtype=norms.dtype)
                norms = norms * factors.to(norms.device)
            self._norms[norm_type] = norms
        return self._norms[norm_type]

    def grad_geometry(self) -> tuple[Tensor, Tensor]:
        """``(||g_i||^2, <delta w_i, -g_i>)`` of the parameters in :attr:`with_grad`, scaled up from the
        sample (float32 vectors on the device); empty without :meth:`sample_grads`."""
        diff, grads = self.diff(), self._grads or []
        if not grads:
            empty = torch.zeros(0, device=diff[0].device if diff else None)
            return empty, empty
        device = grads[0].device
        scales = torch.tensor([self.scales[i] for i in self.with_grad], dtype=torch.float32).to(device)
        grad_sq = foreach_norms(grads, 2.0).square() * scales
        descent = foreach_dots([diff[i] for i in self.with_grad], grads) * scales  # diff holds -delta w
        return grad_sq, descent


class StepStats:
    """Lazily computed, cached statistics of one optimizer step (all device tensors).

    Gradient statistics cover the trainable parameters of ``optimizer`` that have a gradient; weight
    statistics cover all its trainable parameters. Gradients are read as the optimizer will see them:
    accumulated, all-reduced, unscaled (a still-scaled gradient is divided by the GradScaler scale).

    Under sharding (``sharding`` set) ``grads`` and :meth:`local_params` are this rank's pieces, every
    trainable parameter counts as having a gradient (a rank whose piece is empty has none: its share is
    0, and every rank packs the same layout), and the norms are shares (see the module docstring).
    Under DeepSpeed (``unsupported`` set) nothing is measured: no parameters, no gradients.
    """

    def __init__(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: int | None = None
    ) -> None:
        state = _caches(trainer)
        self.step = global_step(trainer) if step is None else step
        if state.unsupported is False:
            state.unsupported = unsupported_reason(trainer)
        self.unsupported: str | None = state.unsupported  # type: ignore[assignment]
        if self.unsupported is not None:
            warn_once(trainer, "sharding:unsupported", self.unsupported)
            self.names: list[str] = []
            self.params: list[Tensor] = []
        else:
            self.names, self.params = _trainable(pl_module, optimizer, state)
        opt = getattr(optimizer, "optimizer", optimizer)
        self.sharding = _sharding(trainer, state, opt, self.params) if self.params else None
        self.grads: list[Tensor]
        if self.sharding is None:
            grads = list(map(_GRAD, self.params))
            if not any(map(operator.is_, grads, itertools.repeat(None))):  # the usual case: all have one
                self.grad_names, self.grads = list(self.names), grads
            else:
                with_grad = [i for i, g in enumerate(grads) if g is not None]
                self.grad_names = [self.names[i] for i in with_grad]
                self.grads = [grads[i] for i in with_grad]
        else:
            self.grad_names = list(self.names)
            self.grads = [
                local_tensor(p.grad) if p.grad is not None else local_tensor(p.detach()).new_zeros(0)
                for p in self.params
            ]
        self.scaler = active_scaler(trainer)
        self.grad_scale = None if self.scaler is None else _grad_scale(self.scaler, optimizer)
        #: why a callback dropped this step's update (a cause of ``core.skips.SKIP_CAUSES``), else ``None``
        self.dropped: str | None = state.dropped.get((self.step, id(opt))) if state.dropped else None
        self._cache: dict[tuple[Any, ...], Any] = {}

    def _memo(self, key: tuple[Any, ...], fn: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def groups(self, names: tuple[str, ...] | list[str], depth: int | None, per_parameter: bool) -> Any:
        """Labels and group of each of ``names`` (a subset of the optimizer's trainable parameters, such as
        those with a gradient this step): a parameter gets the same layer here as in the full list."""
        labels, index = _groups(tuple(names), depth, per_parameter, tuple(self.names))
        return list(labels), list(index)

    def grad_layer_numels(self, depth: int | None = None, per_parameter: bool = False) -> list[int]:
        """Elements of each layer of :meth:`grad_groups` (whole tensors, not this rank's pieces), in the
        order of its labels."""
        return list(
            _numels(
                tuple(self.grad_names), tuple(self.grad_numels()), depth, per_parameter, tuple(self.names)
            )
        )

    def local_params(self) -> list[Tensor]:
        """The trainable parameters' values as this rank holds them (its pieces under sharding), detached
        (made once per step: the weight norms, the update sample and the histograms share the list)."""
        local: list[Tensor] | None = self._cache.get(("local_params",))
        if local is None:
            if self.sharding is None:  # ``.data``: the values without autograd history, no op per tensor
                local = [p.data for p in self.params]
            else:
                local = [local_tensor(p.detach()) for p in self.params]
            self._cache[("local_params",)] = local
        return local

    def grad_numels(self) -> list[int]:
        """Elements of each gradient as a whole tensor (not of this rank's piece)."""
        if self.sharding is not None:
            return list(self.sharding.numels)
        return [g.numel() for g in self.grads]

    # ------------------------------------------------------------------ pending norms
    def pending(self, norms: Tensor, norm_type: float) -> PendingNorms:
        """Per-parameter norms of this rank's tensors (model order, one per parameter under sharding) as
        :class:`PendingNorms`: the norms, or under sharding this rank's shares of the whole ones."""
        if self.sharding is None:
            return PendingNorms(norms, norm_type)
        copies = self._memo(
            ("copies", norms.device), lambda: torch.tensor(self.sharding.copies, device=norms.device)
        )
        return PendingNorms(norm_shares(norms, copies, norm_type), norm_type, sharded=True)

    @staticmethod
    def grouped(per: PendingNorms, index: list[int], num_groups: int) -> PendingNorms:
        """Per-parameter pending norms combined per group (``index[i]``: the group of parameter ``i``)."""
        idx = _index_tensor(tuple(index), per.values.device)
        if not per.sharded:
            return PendingNorms(reduce_norms(per.values, idx, num_groups, per.norm_type), per.norm_type)
        return PendingNorms(group_shares(per.values, idx, num_groups, per.norm_type), per.norm_type, True)

    @staticmethod
    def total(per: PendingNorms) -> PendingNorms:
        """Per-parameter pending norms combined into one (0-dim)."""
        if per.sharded:
            return PendingNorms(total_share(per.values, per.norm_type), per.norm_type, True)
        values = per.values
        if not values.numel():
            return PendingNorms(torch.zeros((), device=values.device), per.norm_type)
        return PendingNorms(torch.linalg.vector_norm(values, ord=per.norm_type), per.norm_type)

    # ------------------------------------------------------------------ gradients
    # The gradient norms are read by some monitor on every step: cached by hand, without the closures of
    # ``_memo`` (a few Python calls less per step).
    def local_grad_norms(self, norm_type: float = 2.0) -> Tensor:
        """Norms of this rank's gradients (of its pieces under sharding), unscaled; a NaN/inf gradient
        entry gives a NaN/inf norm."""
        norms: Tensor | None = self._cache.get(("grad", norm_type))
        if norms is None:
            norms = foreach_norms(self.grads, norm_type)
            if self.grad_scale is not None and norms.numel():
                norms = norms / self.grad_scale.to(norms.device).float()
            self._cache[("grad", norm_type)] = norms
        return norms

    def grad_norms(self, norm_type: float = 2.0) -> PendingNorms:
        """Per-parameter gradient norms (parameters with a gradient, model order)."""
        pending: PendingNorms | None = self._cache.get(("grad_pending", norm_type))
        if pending is None:
            norms = self.local_grad_norms(norm_type)
            pending = self._cache[("grad_pending", norm_type)] = (
                PendingNorms(norms, norm_type) if self.sharding is None else self.pending(norms, norm_type)
            )
        return pending

    def grad_total(self, norm_type: float = 2.0) -> PendingNorms:
        """Total gradient norm over every parameter of this optimizer (0-dim)."""
        total: PendingNorms | None = self._cache.get(("grad_total", norm_type))
        if total is None:
            total = self._cache[("grad_total", norm_type)] = self.total(self.grad_norms(norm_type))
        return total

    def grad_groups(
        self, norm_type: float = 2.0, depth: int | None = None, per_parameter: bool = False
    ) -> tuple[list[str], PendingNorms]:
        """Gradient norms per layer (or per parameter) and the layer names."""

        def compute() -> tuple[list[str], PendingNorms]:
            labels, index = self.groups(self.grad_names, depth, per_parameter)
            return labels, self.grouped(self.grad_norms(norm_type), index, len(labels))

        return self._memo(("grad_groups", float(norm_type), depth, per_parameter), compute)

    # ------------------------------------------------------------------ weights
    def weight_norms(self, norm_type: float = 2.0) -> PendingNorms:
        """Per-parameter weight norms (every trainable parameter of the optimizer)."""
        return self._memo(
            ("weight", float(norm_type)),
            lambda: self.pending(foreach_norms(self.local_params(), norm_type), norm_type),
        )

    def weight_total(self, norm_type: float = 2.0) -> PendingNorms:
        """Total weight norm over every trainable parameter of this optimizer (0-dim)."""
        return self._memo(
            ("weight_total", float(norm_type)), lambda: self.total(self.weight_norms(norm_type))
        )

    def weight_groups(
        self, norm_type: float = 2.0, depth: int | None = None, per_parameter: bool = False
    ) -> tuple[list[str], PendingNorms]:
        def compute() -> tuple[list[str], PendingNorms]:
            labels, index = self.groups(self.names, depth, per_parameter)
            return labels, self.grouped(self.weight_norms(norm_type), index, len(labels))

        return self._memo(("weight_groups", float(norm_type), depth, per_parameter), compute)

    # ------------------------------------------------------------------ whether the update was applied
    def watch_scaler(self) -> None:
        """Keep the GradScaler's scale before the step (a device copy), so that :meth:`scaler_skipped` can
        tell after it whether the scaler skipped the step. Nothing without a scaler; a second call
        does nothing."""
        scale = getattr(self.scaler, "_scale", None)
        if scale is not None and ("scale_before",) not in self._cache:
            self._cache[("scale_before",)] = scale.detach().clone()

    def scaler_skipped(self) -> Tensor | None:
        """After the step: ``1.0`` (a 1-element device tensor) when the GradScaler skipped it (found
        inf/NaN: its scale fell across the step; it never falls otherwise), else ``0.0``. ``None`` without
        :meth:`watch_scaler` before the step, or when a callback dropped the step (:attr:`dropped`: the
        drop is the callback's, and a rollback may restore an older, lower scale)."""
        before: Tensor | None = self._cache.get(("scale_before",))
        scale = getattr(self.scaler, "_scale", None)
        if before is None or scale is None or self.dropped is not None:
            return None
        return (scale.detach() < before).float().reshape(1)

    # ------------------------------------------------------------------ the update
    def take_update_sample(self, with_grads: bool = False) -> UpdateSample | None:
        """The step's :class:`UpdateSample`, taken now (before ``optimizer.step()``) by the first caller;
        ``with_grads`` also samples the gradients (not under sharding). The weights' 2-norms are computed
        now too, so the ratio divides by the weights before the update. ``None`` without parameters."""
        if not self.params:
            return None
        sample: UpdateSample = self._memo(("update_sample",), lambda: UpdateSample(self.local_params()))
        self.weight_norms(2.0)
        if with_grads and self.sharding is None:
            sample.sample_grads([p.grad for p in self.params])
        return sample

    @property
    def update_sample(self) -> UpdateSample | None:
        """The update sample taken this step, if some monitor took one."""
        sample: UpdateSample | None = self._cache.get(("update_sample",))
        return sample

    def update_norms(self, norm_type: float = 2.0) -> PendingNorms:
        """Per-parameter ``||delta w||`` (model order), after the step; requires :meth:`take_update_sample`
        before it."""
        sample = self.update_sample
        assert sample is not None, "take_update_sample() must run before optimizer.step()"
        return self._memo(
            ("update", float(norm_type)), lambda: self.pending(sample.norms(norm_type), norm_type)
        )

    def update_total(self, norm_type: float = 2.0) -> PendingNorms:
        """``||delta w||`` over every trainable parameter of this optimizer (0-dim), after the step."""
        return self._memo(
            ("update_total", float(norm_type)), lambda: self.total(self.update_norms(norm_type))
        )

    def update_groups(
        self, norm_type: float = 2.0, depth: int | None = None, per_parameter: bool = False
    ) -> tuple[list[str], PendingNorms]:
        """``||delta w||`` per layer (grouped like :meth:`weight_groups`) and the layer names; after the
        step."""

        def compute() -> tuple[list[str], PendingNorms]:
            labels, index = self.groups(self.names, depth, per_parameter)
            return labels, self.grouped(self.update_norms(norm_type), index, len(labels))

        return self._memo(("update_groups", float(norm_type), depth, per_parameter), compute)


@functools.lru_cache(maxsize=32)
def _groups(
    names: tuple[str, ...], depth: int | None, per_parameter: bool, among: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Labels and group of each name (made once per list of names, not once per step); ``among``: every
    parameter's name, which decides the containers (:func:`layer_names`)."""
    labels, index = group_index(list(names) if per_parameter else layer_names(names, depth, among or None))
    return tuple(labels), tuple(index)


@functools.lru_cache(maxsize=16)
def _numels(
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    depth: int | None,
    per_parameter: bool,
    among: tuple[str, ...],
) -> tuple[int, ...]:
    """Elements per group of :func:`_groups` (made once per list of parameters, not once per step)."""
    labels, index = _groups(names, depth, per_parameter, among)
    numels = [0] * len(labels)
    for i, n in zip(index, sizes, strict=True):
        numels[i] += n
    return tuple(numels)


@functools.lru_cache(maxsize=32)
def _index_tensor(index: tuple[int, ...], device: torch.device) -> Tensor:
    """``index`` as a device tensor, made once per grouping (not once per step); never written to."""
    return torch.tensor(index, dtype=torch.long, device=device)


def step_stats(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> StepStats:
    """The shared :class:`StepStats` of the current optimizer step (created on first request)."""
    caches = _caches(trainer)
    steps = caches.steps
    step = global_step(trainer)
    key = (step, id(getattr(optimizer, "optimizer", optimizer)))
    stats = steps.get(key)
    if stats is None:
        if steps and next(iter(steps))[0] != step:  # the entries are all of one step: an older one's go
            steps.clear()
        if caches.dropped:
            for old in [k for k in caches.dropped if k[0] != step]:
                del caches.dropped[old]
        stats = steps[key] = StepStats(trainer, pl_module, optimizer, step)
    return stats


def mark_dropped(trainer: pl.Trainer, optimizer: Any, cause: str) -> None:
    """Record that a callback dropped the current step's update of ``optimizer`` (``core.skips``): the
    step's :class:`StepStats`, made already or later in the step, says so in :attr:`StepStats.dropped`,
    and every monitor that measured the step reads it there."""
    caches = _caches(trainer)
    key = (global_step(trainer), id(getattr(optimizer, "optimizer", optimizer)))
    caches.dropped[key] = cause
    stats = caches.steps.get(key)
    if stats is not None:
        stats.dropped = cause
