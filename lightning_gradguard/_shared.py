"""Per-trainer state shared by every gradguard callback on it.

The heart is :class:`StepStats`: for one optimizer step it lists the trainable parameters the optimizer
is about to update and computes gradient and weight statistics lazily, on the device, each at most once.
The first callback that asks in ``on_before_optimizer_step`` pays for the pass; the others read the
cached tensors. Nothing here moves data to the host: callers do that, once, when they need numbers.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.functional.stats import foreach_norms, group_index, layer_names, reduce_norms

__all__ = [
    "StepStats",
    "TrainerState",
    "info_once",
    "log_step",
    "logging_interval",
    "loss_of",
    "on_logging_step",
    "quiet_logging",
    "reduce_any",
    "skipped_for_fast_dev_run",
    "step_stats",
    "strict_mode",
    "trainer_state",
]


@dataclass
class TrainerState:
    """What the callbacks of one trainer share."""

    stats: dict[tuple[int, int], StepStats] = field(default_factory=dict)
    layout_written: set[int] = field(default_factory=set)
    layout_pruned: bool = False
    logged_tags: set[str] = field(default_factory=set)
    alert_counts: dict[str, int] = field(default_factory=dict)
    said_no_logger: bool = False
    warned: set[str] = field(default_factory=set)
    param_cache: dict[int, tuple[list[Tensor], list[str], list[Tensor], list[bool]]] = field(
        default_factory=dict
    )


_STATES: weakref.WeakKeyDictionary[Any, TrainerState] = weakref.WeakKeyDictionary()


def trainer_state(trainer: pl.Trainer) -> TrainerState:
    state = _STATES.get(trainer)
    if state is None:
        state = _STATES[trainer] = TrainerState()
    return state


def log_step(trainer: pl.Trainer) -> int:
    """The x-axis Lightning's own logger connector uses for training metrics.

    It counts batches that stepped an optimizer: one per optimizer step in automatic optimization
    (so it equals ``global_step`` there) and one per batch in manual optimization (where
    ``global_step`` counts every ``opt.step()``). Using it keeps our charts aligned with the loss.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if value is not None else int(trainer.global_step)


def logging_interval(trainer: pl.Trainer, override: int | None = None) -> int:
    """How often a callback logs its periodic scalars, in logging steps; ``0`` means never.

    ``override`` (the callback's own ``log_every_n_steps``) wins when given; otherwise the Trainer's
    ``log_every_n_steps``, where Lightning reads ``0`` as "log nothing" and so do we: detection still runs,
    only the periodic scalars and histograms stop.
    """
    if override is not None:
        return int(override)
    return max(int(getattr(trainer, "log_every_n_steps", 50) or 0), 0)


def on_logging_step(at: int, every: int) -> bool:
    """Lightning's logging rule (``(step + 1) % every == 0``) plus the very first step; never for ``every=0``.

    Matching Lightning puts our points at the same x as the loss it logs from the same batch; the extra
    first point shows whether the run starts in a healthy range.
    """
    return every > 0 and (at == 0 or (at + 1) % every == 0)


def info_once(trainer: pl.Trainer, key: str, message: str) -> None:
    """One INFO line per trainer on the ``lightning_gradguard`` logger, from global rank zero."""
    state = trainer_state(trainer)
    if key in state.warned:
        return
    state.warned.add(key)
    if trainer.is_global_zero:
        import logging

        logging.getLogger("lightning_gradguard").info(message)


def skipped_for_fast_dev_run(trainer: pl.Trainer, name: str, what: str) -> bool:
    """True (after one INFO line) when ``fast_dev_run`` is on: a smoke test skips sweeps and trial runs.

    Lightning's own tuner does the same: ``fast_dev_run`` runs a batch or two to prove the code path,
    and a range test or a pre-flight trial of hundreds of steps would defeat it.
    """
    if not getattr(trainer, "fast_dev_run", False):
        return False
    info_once(trainer, f"fast_dev_run:{name}", f"{name}: skipping {what} since `fast_dev_run` is enabled.")
    return True


def reduce_any(trainer: pl.Trainer, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one collective; a no-op on one process)."""
    if trainer.world_size <= 1:
        return bool(flag)
    return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=False))


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
            names.append(name)
            params.append(p)
    for i, p in enumerate(in_opt):  # tensors the optimizer holds that the module does not own
        if id(p) in wanted and id(p) not in seen:
            seen.add(id(p))
            names.append(f"optimizer_param_{i}")
            params.append(p)
    state.param_cache[id(opt)] = (in_opt, names, params, trainable)
    return names, params


def _grad_scale(trainer: pl.Trainer, optimizer: Any) -> Tensor | None:
    """The GradScaler scale when the optimizer's gradients are still scaled (fused optimizers)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
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


#: set to 1 (our test suite does) to let a monitor's own exceptions through instead of warning once
STRICT_ENV = "GRADGUARD_STRICT"


def strict_mode() -> bool:
    """Whether a monitor's own exceptions are raised (``GRADGUARD_STRICT=1``) instead of warned about."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def warn_once(trainer: pl.Trainer, key: str, message: str) -> None:
    """A one-time warning per trainer (a model shape we do not understand never crashes a run)."""
    state = trainer_state(trainer)
    if key in state.warned:
        return
    state.warned.add(key)
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(message, category=UserWarning)


def gradguard_callbacks(trainer: pl.Trainer) -> Iterable[Any]:
    from lightning_gradguard.callbacks._base import GradGuardCallback

    return [cb for cb in trainer.callbacks if isinstance(cb, GradGuardCallback)]  # type: ignore[attr-defined]


@contextmanager
def quiet_logging(pl_module: nn.Module) -> Iterator[None]:
    """Run ``training_step`` without its ``self.log`` / ``self.log_dict`` calls reaching the loggers.

    For the trial steps of the pre-flight checks, the LR sweep and the NaN replay: their losses are
    not the run's metrics.
    """
    had = {k: k in pl_module.__dict__ for k in ("log", "log_dict")}
    saved = {k: pl_module.__dict__.get(k) for k in had}
    pl_module.__dict__["log"] = lambda *a, **k: None
    pl_module.__dict__["log_dict"] = lambda *a, **k: None
    try:
        yield
    finally:
        for k, present in had.items():
            if present:
                pl_module.__dict__[k] = saved[k]
            else:
                del pl_module.__dict__[k]


def loss_of(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned: the tensor itself or ``output["loss"]``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None
