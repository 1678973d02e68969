"""An exact snapshot of everything a few trial training steps can change, and its restore.

Pre-flight checks (overfit one batch, an LR range test) train the real model for a few steps before the
real run starts. Afterwards the run must be the one it would have been without them, bit for bit. A
:class:`TrainingSnapshot` records, and :meth:`TrainingSnapshot.restore` writes back:

* every parameter's value, ``.grad`` and ``requires_grad`` (the module's, and any tensor an optimizer
  holds that the module does not own), every buffer's value (BatchNorm running
  statistics, ``num_batches_tracked``), every module's ``training`` flag;
* the state of every optimizer (moments, step counts, param groups and their learning rates) and LR
  scheduler;
* the RNG states: torch CPU, every initialised CUDA device, NumPy's global generator, Python's
  ``random``, and the ``generator`` of a dataloader's sampler when given;
* the trainer's progress counters (global step, batches that stepped, epoch and batch progress) and
  the GradScaler of its precision plugin (16-mixed), if any;
* torchmetrics states (duck-typed on the public ``metric_state`` and ``update_count``).

Values are copied into the *same* tensor objects (``copy_``), so optimizers, DDP hooks and anything else
that holds a reference to a parameter keep pointing at the live tensor.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn


class RNGState:
    """The global random states: torch CPU and CUDA, NumPy, Python ``random`` (and extra generators)."""

    def __init__(self, generators: Iterable[torch.Generator] = ()) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        self.python = random.getstate()
        try:
            import numpy as np

            self.numpy: Any = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
            self.numpy = None
        self.generators = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
        for g, state in self.generators:
            g.set_state(state)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader's sampler and batch sampler draw from, if any."""
    found: list[torch.Generator] = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        for holder in (obj, getattr(obj, "sampler", None)):
            g = getattr(holder, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                found.append(g)
    return found


def tensors_free_iterables(iterables: Any) -> list[Any]:
    """The individual dataloaders inside what ``CombinedLoader.iterables`` holds."""
    if isinstance(iterables, dict):
        return list(iterables.values())
    if isinstance(iterables, (list, tuple)):
        return list(iterables)
    return [iterables]


def train_loader_generators(trainer: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of the train dataloaders' samplers (a snapshot restores them)."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    gens: list[torch.Generator] = []
    if combined is not None:
        for loader in tensors_free_iterables(combined.iterables):
            gens.extend(loader_generators(loader))
    return gens


_PROGRESS_PATHS = (
    "fit_loop.epoch_progress",
    "fit_loop.epoch_loop.batch_progress",
    "fit_loop.epoch_loop.scheduler_progress",
    "fit_loop.epoch_loop.automatic_optimization.optim_progress",
    "fit_loop.epoch_loop.manual_optimization.optim_step_progress",
)


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class TrainingSnapshot:
    """Record a model's (and optionally a trainer's) trainable state now; put it back with :meth:`restore`.

    Args:
        module: the model; its parameters, buffers, ``training`` flags and torchmetrics states are kept.
        optimizers: optimizers whose ``state_dict`` is kept (default: the trainer's, when given).
        schedulers: LR schedulers whose ``state_dict`` is kept (default: the trainer's, when given).
        trainer: a Lightning ``Trainer``: its optimizers, schedulers, progress counters and the
            ``torch.Generator`` of its train dataloaders' samplers are kept (trial steps that draw
            batches must not change the run's batch order).
        generators: extra ``torch.Generator`` objects whose state is kept (e.g. from
            :func:`loader_generators`).
        keep_progress: with a ``trainer``, also keep its progress counters and its samplers' generators
            (``False``: the run's position in the data moves on after a restore, as for a rollback).
        store: where the copies are kept (``"cpu"``: spare the accelerator's memory; default: beside the
            originals, which is exact to the bit and fastest).
        keep_grads: also keep the ``.grad`` tensors (``False``: a restore leaves every ``.grad`` ``None``,
            as for a rollback point whose update is dropped anyway; half the copying of a weights-only
            snapshot).
        keep_metrics: also keep torchmetrics states (``False``: a restore leaves them as they are, as for a
            rollback point: the data moves on, so what the metrics accumulated since stays counted).

    Example::

        snap = TrainingSnapshot(pl_module, trainer=trainer)
        try:
            ...  # a few trial steps on the real model and optimizer
        finally:
            snap.restore()
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Sequence[Any] | None = None,
        trainer: Any = None,
        generators: Iterable[torch.Generator] = (),
        keep_progress: bool = True,
        store: str | torch.device | None = None,
        keep_grads: bool = True,
        keep_metrics: bool = True,
    ) -> None:
        self.module, self.trainer = module, trainer
        gens = list(generators)
        if trainer is not None and keep_progress:
            gens += [g for g in train_loader_generators(trainer) if all(g is not h for h in gens)]
        self.rng = RNGState(gens)
        if trainer is not None:
            optimizers = list(trainer.optimizers) if optimizers is None else optimizers
            if schedulers is None:
                schedulers = [cfg.scheduler for cfg in getattr(trainer, "lr_scheduler_configs", [])]

        def keep(t: Tensor) -> Tensor:
            return t.detach().clone() if store is None else t.detach().to(store, copy=True)

        self.params: list[tuple[Tensor, Tensor, Tensor | None, bool]] = [
            (p, keep(p), None if p.grad is None or not keep_grads else keep(p.grad), p.requires_grad)
            for p in _parameters(module, optimizers or [])
        ]
        self.buffers: list[tuple[nn.Module, str, Tensor | None]] = [
            (mod, name, None if buf is None else keep(buf))
            for mod in module.modules()
            for name, buf in mod._buffers.items()
        ]
        self.modes = [(m, m.training) for m in module.modules()]
        self.metrics = [(m, _metric_state(m)) for m in module.modules() if keep_metrics and _is_metric(m)]
        self.optimizers = [
            (
                o,
                copy.deepcopy(o.state_dict())
                if store is None
                else apply_to_collection(o.state_dict(), Tensor, keep),
            )
            for o in (optimizers or [])
        ]
        self.schedulers = [(s, copy.deepcopy(s.state_dict())) for s in (schedulers or [])]
        self._keep_loop(trainer, keep_progress)

    def _keep_loop(self, trainer: Any, keep_progress: bool) -> None:
        """The GradScaler's state and, with ``keep_progress``, the loops' progress counters."""
        self.progress: list[tuple[Any, dict[str, Any]]] = []
        self.batches_that_stepped: int | None = None
        self.scaler: Any = None
        self.scaler_state: dict[str, Any] | None = None
        if trainer is None:
            return
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            self.scaler, self.scaler_state = scaler, copy.deepcopy(scaler.state_dict())
        if not keep_progress:
            return
        for path in _PROGRESS_PATHS:
            obj = _resolve(trainer, path)
            if obj is not None and hasattr(obj, "state_dict"):
                self.progress.append((obj, copy.deepcopy(obj.state_dict())))
        self.batches_that_stepped = _resolve(trainer, "fit_loop.epoch_loop._batches_that_stepped")

    @torch.no_grad()
    def restore(self, mid_step: bool = False) -> None:
        """Write every recorded value back (idempotent: can be called more than once).

        ``mid_step``: inside an optimizer step whose ``unscale_`` is done and whose ``scaler.step()``
        follows (a rollback in ``on_before_optimizer_step``): the GradScaler keeps its bookkeeping of it.
        """
        scaler_pending = dict(getattr(self.scaler, "_per_optimizer_states", {})) if mid_step else {}
        self._restore_tensors()
        for m, training in self.modes:
            m.training = training
        for m, state in self.metrics:
            _set_metric_state(m, state)
        for owner, state in (*self.optimizers, *self.schedulers, *self.progress):
            owner.load_state_dict(copy.deepcopy(state))
        if self.scaler is not None and self.scaler_state is not None:
            self.scaler.load_state_dict(copy.deepcopy(self.scaler_state))
            self.scaler._per_optimizer_states.clear()  # no half-finished unscale_/step bookkeeping
            self.scaler._per_optimizer_states.update(scaler_pending)
        if self.batches_that_stepped is not None and self.trainer is not None:
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.batches_that_stepped
        self.rng.restore()

    def _restore_tensors(self) -> None:
        """Parameters (values, gradients, ``requires_grad``) and buffers, in place where the shape allows."""
        for p, value, grad, requires_grad in self.params:
            p.copy_(value)
            p.grad = None if grad is None else grad.to(device=p.device, copy=True)
            p.requires_grad_(requires_grad)
        for mod, name, buf in self.buffers:
            current: Tensor | None = mod._buffers.get(name)
            if buf is None or current is None or current.shape != buf.shape:
                device = current.device if current is not None else None
                mod._buffers[name] = None if buf is None else buf.to(device=device, copy=True)
            else:
                current.copy_(buf)


def _parameters(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[Tensor]:
    """The module's parameters and the tensors its optimizers hold, each once."""
    tensors: dict[int, Tensor] = {}
    for p in [*module.parameters(), *(q for o in optimizers for g in o.param_groups for q in g["params"])]:
        tensors.setdefault(id(p), p)
    return list(tensors.values())


def _is_metric(m: nn.Module) -> bool:
    """A torchmetrics ``Metric``, duck-typed on its public API (torchmetrics is not imported here)."""
    return isinstance(getattr(m, "metric_state", None), dict) and isinstance(
        getattr(m, "update_count", None), int
    )


def _metric_state(m: Any) -> dict[str, Any]:
    """The metric's states and update count (public properties) and its cached ``compute()`` result."""
    return {
        "states": copy.deepcopy(m.metric_state),
        "update_count": m.update_count,
        # no public reader: restored as it was, so a compute() after the restore is the cached one, as
        # before the trial (under DDP an emptied cache would make compute() sync again)
        "computed": copy.deepcopy(getattr(m, "_computed", None)),
    }


def _set_metric_state(m: Any, saved: dict[str, Any]) -> None:
    """Write the states back (each a public attribute of the metric); the update count and the cached
    ``compute()`` result have no public setter, so they are the two private fields written."""
    for name, value in saved["states"].items():
        setattr(m, name, copy.deepcopy(value))
    m._update_count = saved["update_count"]
    m._computed = copy.deepcopy(saved["computed"])


def rollback_point(module: nn.Module, trainer: Any, device: str = "cpu") -> TrainingSnapshot:
    """A snapshot to roll a run back to: weights, buffers, optimizers, schedulers, GradScaler and RNG.

    Not the run's position in the data (it moves on), not the gradients (the update of the step that
    rolls back is dropped), not torchmetrics states (what they counted since stays counted). ``device``:
    ``"cpu"`` spares the accelerator's memory, ``"same"`` keeps the copies beside the originals.
    """
    store = "cpu" if device == "cpu" else None
    return TrainingSnapshot(
        module, trainer=trainer, keep_progress=False, store=store, keep_grads=False, keep_metrics=False
    )
