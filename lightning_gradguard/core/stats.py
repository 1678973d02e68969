"""The statistics of one optimizer step, computed once on the device and shared by every callback.

:class:`StepStats` lists the trainable parameters the optimizer is about to update and computes gradient
and weight statistics lazily, on the device, each at most once. The first callback that asks in
``on_before_optimizer_step`` pays for the pass; the others read the cached tensors. Nothing here moves
data to the host: callers do that, once, through :mod:`lightning_gradguard.core.transfer`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.core.state import TrainerState, trainer_state
from lightning_gradguard.functional.stats import (
    clean_name,
    foreach_norms,
    group_index,
    layer_names,
    reduce_norms,
)

__all__ = ["StepStats", "active_scaler", "step_stats"]


def _trainable(
    pl_module: pl.LightningModule, optimizer: Any, state: TrainerState
) -> tuple[list[str], list[Tensor]]:
    """Names and tensors of the trainable parameters ``optimizer`` updates, in model order (cached)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # unwrap LightningOptimizer
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    trainable = [p.requires_grad for p in in_opt]  # unfreezing a layer later changes what is measured
    cached = state.param_cache.get(id(opt))
    if (
        cached is not None
        and len(cached[0]) == len(in_opt)
        and all(a is b for a, b in zip(cached[0], in_opt, strict=True))
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
    state.param_cache[id(opt)] = (in_opt, names, params, trainable)
    return names, params


def active_scaler(trainer: pl.Trainer) -> Any:
    """The GradScaler of the Trainer's precision plugin when it is enabled (16-mixed), else ``None``."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _grad_scale(trainer: pl.Trainer, optimizer: Any) -> Tensor | None:
    """The GradScaler scale when the optimizer's gradients are still scaled (fused optimizers)."""
    scaler = active_scaler(trainer)
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


class StepStats:
    """Lazily computed, cached statistics of one optimizer step (all device tensors).

    Gradient statistics cover the trainable parameters of ``optimizer`` that have a gradient; weight
    statistics cover all its trainable parameters. Gradients are read as the optimizer will see them:
    accumulated, all-reduced, unscaled (a still-scaled gradient is divided by the GradScaler scale).
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        state = trainer_state(trainer)
        self.step = int(trainer.global_step)
        self.names, self.params = _trainable(pl_module, optimizer, state)
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        self.grad_names = [self.names[i] for i in with_grad]
        self.grads: list[Tensor] = [self.params[i].grad for i in with_grad]  # type: ignore[misc]
        self.grad_scale = _grad_scale(trainer, optimizer)
        self._cache: dict[tuple[Any, ...], Any] = {}

    def _memo(self, key: tuple[Any, ...], fn: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def groups(self, names: tuple[str, ...] | list[str], depth: int | None, per_parameter: bool) -> Any:
        labels = list(names) if per_parameter else layer_names(names, depth)
        return group_index(labels)

    def grad_norms(self, norm_type: float = 2.0) -> Tensor:
        """Per-parameter gradient norms (parameters with a gradient, model order)."""

        def compute() -> Tensor:
            norms = foreach_norms(self.grads, norm_type)
            if self.grad_scale is not None and norms.numel():
                norms = norms / self.grad_scale.to(norms.device).float()
            return norms

        return self._memo(("grad", float(norm_type)), compute)

    def grad_total(self, norm_type: float = 2.0) -> Tensor:
        """Total gradient norm over every parameter of this optimizer (0-dim)."""
        norms = self.grad_norms(norm_type)
        return self._memo(
            ("grad_total", float(norm_type)),
            lambda: (
                torch.linalg.vector_norm(norms, ord=norm_type)
                if norms.numel()
                else torch.zeros((), device=norms.device)
            ),
        )

    def grad_groups(
        self, norm_type: float = 2.0, depth: int | None = None, per_parameter: bool = False
    ) -> tuple[list[str], Tensor]:
        """Gradient norms per layer (or per parameter) and the layer names."""

        def compute() -> tuple[list[str], Tensor]:
            labels, index = self.groups(self.grad_names, depth, per_parameter)
            norms = self.grad_norms(norm_type)
            idx = torch.tensor(index, dtype=torch.long, device=norms.device)
            return labels, reduce_norms(norms, idx, len(labels), norm_type)

        return self._memo(("grad_groups", float(norm_type), depth, per_parameter), compute)

    def weight_norms(self, norm_type: float = 2.0) -> Tensor:
        """Per-parameter weight norms (every trainable parameter of the optimizer)."""
        return self._memo(
            ("weight", float(norm_type)),
            lambda: foreach_norms([p.detach() for p in self.params], norm_type),
        )

    def weight_groups(
        self, norm_type: float = 2.0, depth: int | None = None, per_parameter: bool = False
    ) -> tuple[list[str], Tensor]:
        def compute() -> tuple[list[str], Tensor]:
            labels, index = self.groups(self.names, depth, per_parameter)
            norms = self.weight_norms(norm_type)
            idx = torch.tensor(index, dtype=torch.long, device=norms.device)
            return labels, reduce_norms(norms, idx, len(labels), norm_type)

        return self._memo(("weight_groups", float(norm_type), depth, per_parameter), compute)

    def grads_finite(self) -> Tensor:
        """0-dim bool: every gradient element is finite (derived from the cached norms: no extra pass)."""
        norm_type = next((k[1] for k in self._cache if k[0] == "grad"), 2.0)
        return torch.isfinite(self.grad_norms(norm_type)).all()


def step_stats(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> StepStats:
    """The shared :class:`StepStats` of the current optimizer step (created on first request)."""
    state = trainer_state(trainer)
    opt = getattr(optimizer, "optimizer", optimizer)
    key = (int(trainer.global_step), id(opt))
    stats = state.stats.get(key)
    if stats is None:
        for old in [k for k in state.stats if k[0] != key[0]]:
            del state.stats[old]
        stats = state.stats[key] = StepStats(trainer, pl_module, optimizer)
    return stats
