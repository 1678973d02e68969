r"""
GradientCheck
=============

Pre-flight check of the backward pass: compares autograd's gradients with finite differences, in
float64 on a tiny slice of a batch, for the modules most likely to be wrong (those with a custom
``torch.autograd.Function`` or a backward hook). Usable as a callback (at the start of ``fit``) or as a
plain function on any module and batch.

This module holds both faces: :func:`gradient_check` (the arguments validated, the batch cut and
converted to float64, the caller's RNG states put back) and :class:`GradientCheck`, which runs it on the
first batch of ``fit``. The engine under both is
:mod:`~lightning_gradguard.monitors.gradcheck.engine`; the alerts are the findings of its rule
(:mod:`~lightning_gradguard.monitors.gradcheck.rules`), in the words of
:mod:`~lightning_gradguard.monitors.gradcheck.findings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradguard.alerts import Finding
from lightning_gradguard.core.batch import first_train_batch, slice_batch
from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.preflight import OTHER_RANKS, PreflightCheck
from lightning_gradguard.core.snapshot import RNGState, train_loader_generators
from lightning_gradguard.core.state import info_once
from lightning_gradguard.core.trial import loss_of, quiet_logging, seed_all, training_step_of
from lightning_gradguard.core.validate import check_float, check_int, check_str_list
from lightning_gradguard.monitors.gradcheck.engine import (
    GradientCheckResult,
    GradientCheckSettings,
    ModuleLossFn,
    gradcheck_module,
)
from lightning_gradguard.monitors.gradcheck.findings import passed_line
from lightning_gradguard.monitors.gradcheck.rules import GRADIENT_MISMATCH, RULES

LossFn = Callable[[nn.Module, Any], Tensor]


def _settings(max_samples: int | None, **given: Any) -> GradientCheckSettings:
    """The checked arguments of :func:`gradient_check` from ``samples_per_tensor`` on, as its engine's
    settings (each argument checked by name: ``TypeError`` / ``ValueError``)."""
    check_int("max_samples", max_samples, 1, allow_none=True)
    check_int("samples_per_tensor", given["samples_per_tensor"], 1)
    check_int("max_evaluations", given["max_evaluations"], 1)
    check_float("max_seconds", given["max_seconds"], 0.0, low_open=True, allow_none=True)
    check_float("tolerance", given["tolerance"], 0.0, low_open=True)
    check_float("min_order", given["min_order"], 0.0)
    check_float("eps", given["eps"], 0.0, 1.0, low_open=True)
    check_int("seed", given["seed"], 0)
    check_float("taylor_tolerance", given["taylor_tolerance"], 0.0, low_open=True)
    return GradientCheckSettings(**given, reseed=seed_all)


def gradient_check(
    module: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    modules: list[str] | None = None,
    max_samples: int | None = 4,
    samples_per_tensor: int = 6,
    max_evaluations: int = 2000,
    tolerance: float = 1e-3,
    min_order: float = 1.5,
    eps: float = 1e-6,
    seed: int = 0,
    taylor_tolerance: float = 1e-2,
    max_seconds: float | None = 10.0,
) -> GradientCheckResult:
    """Check autograd's gradients of ``module`` against finite differences, in float64.

    The module is deep-copied and the copy converted to float64; the original, its gradients and the
    caller's RNG states are untouched. The copy stays in train mode (BatchNorm normalises with the
    statistics of the fixed batch slice; its running statistics change on the copy only), its
    ``nn.Dropout`` modules are switched to eval, and torch, NumPy and ``random`` are re-seeded with
    ``seed`` before every loss evaluation: the finite differences see one deterministic function.

    How each tensor is checked (a Taylor test; finite differences on sampled coordinates, and along the
    Taylor direction to arbitrate a miss) and which (the modules with a custom ``autograd.Function`` or a
    backward hook, and every parameter upstream of them): the engine this function runs,
    :mod:`~lightning_gradguard.monitors.gradcheck.engine`. Other arguments: :class:`GradientCheck`.

    Args:
        module: the model (a ``LightningModule`` or any ``nn.Module``).
        batch: one batch, as ``training_step`` / ``loss_fn`` takes it.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``; default for a ``LightningModule``: its
            ``training_step(batch, 0)`` (``self.log`` calls are swallowed).
        max_samples: cut the batch to this many samples (``None``: keep it whole).

    Returns:
        A :class:`GradientCheckResult`.

    Example::

        from lightning_gradguard import gradient_check

        result = gradient_check(model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
        for p in result.failures:
            print(p.name, p.max_rel_error, p.taylor_order)
    """
    settings = _settings(
        max_samples,
        samples_per_tensor=samples_per_tensor,
        max_evaluations=max_evaluations,
        tolerance=tolerance,
        min_order=min_order,
        eps=eps,
        seed=seed,
        taylor_tolerance=taylor_tolerance,
        max_seconds=max_seconds,
    )
    return _run(module, batch, loss_fn, modules=modules, max_samples=max_samples, settings=settings)


def _run(
    module: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    *,
    modules: list[str] | None,
    max_samples: int | None,
    settings: GradientCheckSettings,
) -> GradientCheckResult:
    """:func:`gradient_check` once its numbers are valid: check what it is to run on, cut the batch and
    convert it to float64, run the engine on a float64 copy and time it, put the caller's RNG states back."""
    modules = check_str_list("modules", modules)
    if loss_fn is None and not isinstance(module, pl.LightningModule):
        raise ValueError(
            "`loss_fn` is required unless `module` is a LightningModule (then training_step is used)"
        )
    started = time.perf_counter()
    rng = RNGState()
    try:
        batch = slice_batch(batch, max_samples)
        batch = apply_to_collection(
            batch, Tensor, lambda t: t.detach().double() if t.is_floating_point() else t
        )
        result = gradcheck_module(
            module, _copy_loss(module, batch, loss_fn), modules=modules, settings=settings
        )
    finally:
        rng.restore()
    result.seconds = time.perf_counter() - started
    return result


def _copy_loss(module: nn.Module, batch: Any, loss_fn: LossFn | None) -> ModuleLossFn:
    """The loss of the float64 copy: ``loss_fn(copy, batch)``, or a ``LightningModule``'s
    ``training_step`` with its ``self.log`` calls swallowed. The copy gets the original's trainer back
    (a deep copy drops it)."""
    trainer = module.__dict__.get("_trainer")
    lightning = isinstance(module, pl.LightningModule)

    def loss(model: nn.Module) -> Tensor | None:
        if lightning:
            model.__dict__["_trainer"] = trainer
        if loss_fn is not None:
            return loss_of(loss_fn(model, batch))
        with quiet_logging(model):
            return loss_of(training_step_of(model, batch))

    return loss


class GradientCheck(PreflightCheck):
    r"""Pre-flight gradient check at the start of ``fit``: autograd against finite differences in float64.

    Runs :func:`gradient_check` in ``on_train_start`` of a fit that starts a new run (step 0; a fit that
    resumes or continues the Trainer's run skips it with one INFO line), after Lightning set up the model
    and the dataloaders, before the first real batch, on the first batch of a fresh pass over the train
    dataloader, cut to ``max_samples`` samples, through ``training_step``. The real model is never
    touched (the check works on a float64 deep copy) and the RNG states, including the dataloader
    sampler's, are restored, so the real run is the one it would have been without the check.

    A parameter fails when finite differences disagree with autograd (on a sampled coordinate, or along
    the Taylor direction after a Taylor miss); a Taylor miss alone, which ReLU kinks cause on correct
    gradients, is arbitrated and at worst *inconclusive* (see :func:`gradient_check`). Each failing
    parameter gives an alert ``gradient_mismatch`` (severity error) naming the parameter, the relative
    error, the two gradient values and the observed Taylor order. With ``action="raise"`` (default)
    every rank raises :class:`~lightning_gradguard.SanityCheckError` after the verdict was reduced
    across ranks; ``"warn"`` reports and trains on. A check that passed says so in one INFO line on
    the ``lightning_gradguard`` logger (global rank zero): how many tensors, the largest relative
    error, the time, and any inconclusive Taylor tests.

    Args:
        modules: qualified names of the modules to check (default: the modules with a custom
            ``autograd.Function`` or a backward hook, else all).
        max_samples: samples of the first batch used.
        samples_per_tensor: coordinates checked with finite differences per parameter tensor.
        max_evaluations: bound on the number of loss evaluations.
        tolerance: largest relative error accepted.
        min_order: smallest observed Taylor order accepted before finite differences arbitrate.
        eps: relative finite-difference step.
        seed: seed of the check's own randomness.
        taylor_tolerance: the largest Taylor remainder linear in ``h`` still blamed on kinks (see
            :class:`~lightning_gradguard.monitors.gradcheck.engine.GradientCheckSettings`).
        max_seconds: bound on the check's time: at most this over the time of one evaluation (timed on
            two warm ones, the faster) are spent (``None``: ``max_evaluations`` alone); the tensors
            checked are then spread over the model.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import GradientCheck

        check = GradientCheck()           # checks the layers with custom autograd Functions
        Trainer(callbacks=[check]).fit(model, datamodule=dm)
        print(check.result.targets, [(p.name, p.max_rel_error) for p in check.result.parameters])
    """

    state_key_args = ("modules",)
    sharded_reason = (
        "it checks a float64 deep copy of the model, and a rank holds only pieces of the sharded parameters "
        "(a sharded module cannot be copied whole)"
    )

    def __init__(
        self,
        *,
        action: Literal["raise", "warn", "stop"] = "raise",
        modules: list[str] | None = None,
        max_samples: int | None = 4,
        samples_per_tensor: int = 6,
        max_evaluations: int = 2000,
        tolerance: float = 1e-3,
        min_order: float = 1.5,
        eps: float = 1e-6,
        seed: int = 0,
        taylor_tolerance: float = 1e-2,
        max_seconds: float | None = 10.0,
    ) -> None:
        super().__init__(action=action)
        _settings(
            max_samples,
            samples_per_tensor=samples_per_tensor,
            max_evaluations=max_evaluations,
            tolerance=tolerance,
            min_order=min_order,
            eps=eps,
            seed=seed,
            taylor_tolerance=taylor_tolerance,
            max_seconds=max_seconds,
        )
        self.modules: list[str] | None = check_str_list("modules", modules)
        self.max_samples: int | None = None if max_samples is None else int(max_samples)
        self.samples_per_tensor = int(samples_per_tensor)
        self.max_evaluations = int(max_evaluations)
        self.tolerance = float(tolerance)
        self.min_order = float(min_order)
        self.eps = float(eps)
        self.seed = int(seed)
        self.taylor_tolerance = float(taylor_tolerance)
        self.max_seconds: float | None = None if max_seconds is None else float(max_seconds)
        self.result: GradientCheckResult | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.applies(trainer, pl_module):
            return
        rng = RNGState(train_loader_generators(trainer))  # the samplers' generators included
        if self.modules is not None:
            known = {part for n, _ in pl_module.named_modules() for part in (n, user_name(n))}
            unknown = [m for m in self.modules if m not in known and user_name(m) not in known]
            if unknown:
                raise ValueError(f"`modules` names modules that {type(pl_module).__name__} lacks: {unknown}")
        self.result = None
        try:
            batch, _ = first_train_batch(trainer)
            rng.restore()
            self.result = gradient_check(
                pl_module,
                batch,
                modules=self.modules,
                max_samples=self.max_samples,
                samples_per_tensor=self.samples_per_tensor,
                max_evaluations=self.max_evaluations,
                tolerance=self.tolerance,
                min_order=self.min_order,
                eps=self.eps,
                seed=self.seed,
                taylor_tolerance=self.taylor_tolerance,
                max_seconds=self.max_seconds,
            )
        except Exception as err:  # a model or loader we cannot drive: warn, never crash
            self.could_not_run(trainer, err)  # our own failure: raised under GRADGUARD_STRICT=1
        finally:
            rng.restore()
        self._conclude(trainer, self.result)  # on every rank, even a skipped one: the verdict is collective

    def _conclude(self, trainer: pl.Trainer, result: GradientCheckResult | None) -> None:
        ran = result is not None
        result = result if result is not None else GradientCheckResult(passed=True)
        if result.skipped:  # the budget's choice, not a finding about the run: one INFO line
            checked = len(result.parameters)
            info_once(
                trainer,
                "gradient_check_budget",
                f"GradientCheck: within max_evaluations={self.max_evaluations} and "
                f"max_seconds={self.max_seconds} {checked} of {checked + len(result.skipped)} parameter "
                f"tensors were checked, spread over the model; unchecked: {result.skipped[:8]}"
                f"{' ...' if len(result.skipped) > 8 else ''} (raise max_seconds to check them all).",
            )
        elsewhere = Finding(GRADIENT_MISMATCH, "The gradient check failed on another rank.", hint=OTHER_RANKS)
        self.run_rules(
            trainer,
            RULES,
            result,
            then=lambda alerts: self.conclude(
                trainer,
                alerts,
                failed_here=not result.passed,
                on_failure=None if not result.passed else elsewhere,
                passed_line=passed_line(result) if ran else None,
            ),
        )
