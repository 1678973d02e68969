r"""
OverfitBatchSanity
==================

Before the real run spends hours, prove in seconds that the model can learn: train on the first batch
until its loss collapses, check on the way that every parameter gets a gradient and moves, that the
initial loss is the one a fresh classifier should have, and put everything back exactly as it was.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradguard.alerts import Alert, SanityCheckError, Severity
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.batch import (
    batch_size_of,
    first_train_batch,
    redraw_first_samples,
    slice_batch,
    tensors_in,
)
from lightning_gradguard.core.collective import reduce_any
from lightning_gradguard.core.snapshot import TrainingSnapshot
from lightning_gradguard.core.state import skipped_for_fast_dev_run, warn_once
from lightning_gradguard.core.trial import configured_lr, loss_of, quiet_logging, seed_all, training_step_of
from lightning_gradguard.core.validate import check_bool, check_choice, check_float, check_int, check_str_list

__all__ = ["Finding", "OverfitBatchSanity", "OverfitResult", "SanityCheckError"]

log = logging.getLogger("lightning_gradguard")

_MAX_LISTED = 8


# --------------------------------------------------------------------------------------------- helpers
# Shared with callbacks/gradient_check.py.


def preflight_applies(
    check: GradGuardCallback, trainer: pl.Trainer, pl_module: pl.LightningModule, checked_before: bool
) -> bool:
    """Whether a pre-flight check runs in this fit: not under ``fast_dev_run`` (a smoke test), not on a
    resume of a run it already checked, and only under automatic optimization (else a one-time warning;
    the run goes on)."""
    name = type(check).__name__
    if skipped_for_fast_dev_run(trainer, name, "the pre-flight check"):
        return False
    if not check.fresh_run(trainer) and checked_before:
        if trainer.is_global_zero:
            log.info("%s: fit resumes from a checkpoint; the check is not repeated", name)
        return False
    if not pl_module.automatic_optimization:
        warn_once(
            trainer,
            f"{name}_manual",
            f"{name} needs automatic optimization (training_step returning the loss); the check was skipped. "
            "Under manual optimization, call lightning_gradguard.gradient_check(model, batch, loss_fn) "
            "yourself.",
        )
        return False
    return True


class LeafOutputs:
    """Forward hooks on every leaf module that keep the last output with a given leading dimension."""

    def __init__(self, module: nn.Module, batch_size: int) -> None:
        self.batch_size = batch_size
        self.last: Tensor | None = None
        self.name: str | None = None
        self.handles = [
            m.register_forward_hook(self._hook(name))
            for name, m in module.named_modules()
            if not any(True for _ in m.children())
        ]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.dim() >= 1 and output.shape[0] == self.batch_size:
                self.last, self.name = output, name

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_FROZEN_SEED = 0x5EED


def at_floor(
    losses: list[float], grad_norms: list[float], chance_loss: float | None, num_classes: int | None
) -> bool:
    """Did training converge to a loss floor above the target, after learning from the inputs?

    True when the gradient norm fell to 5 % of its first value or less (a minimum of the fixed objective,
    e.g. mixup's soft targets or label smoothing, whose entropy the loss cannot go below), the loss fell
    to half its initial value or less, and, for a classifier, clearly below the entropy of the batch's
    label frequencies (a model that ignores its inputs converges there too).
    """
    if len(grad_norms) < 5 or not losses:
        return False
    initial, final = losses[0], losses[-1]
    if not (math.isfinite(final) and initial > 0 and final <= 0.5 * initial):
        return False
    if not (grad_norms[0] > 0 and grad_norms[-1] <= 0.05 * grad_norms[0]):
        return False
    return chance_loss is None or num_classes is None or final < chance_loss - 0.15 * math.log(num_classes)


def oscillates(losses: list[float]) -> bool:
    """Late in the run (second half) the loss rose 50 % above the best value before it."""
    return len(losses) > 4 and any(
        losses[k] > 1.5 * min(losses[:k]) for k in range(len(losses) // 2, len(losses))
    )


def still_learning(losses: list[float], chance_loss: float | None, num_classes: int | None) -> bool:
    """The target was missed, but the model demonstrably learns from its inputs, only slowly.

    The loss is finite, at most half its initial value, did not oscillate, and, for a classifier, is
    clearly below the entropy of the batch's label frequencies (what a model ignoring its inputs reaches).
    """
    if len(losses) < 5:
        return False
    initial, final = losses[0], losses[-1]
    if not (math.isfinite(final) and initial > 0 and final <= 0.5 * initial) or oscillates(losses):
        return False
    return chance_loss is None or num_classes is None or final < chance_loss - 0.15 * math.log(num_classes)


class CalledModules:
    """Forward pre-hooks on every sub-module that note which ones ran (``called``: their names)."""

    def __init__(self, module: nn.Module) -> None:
        self.called: set[str] = set()
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in module.named_modules()]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.called.add(name)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# --------------------------------------------------------------------------------------------- results


@dataclass
class Finding:
    """One specific problem the check found.

    Attributes:
        kind: alert kind (``unused_parameter``, ``parameter_not_updated``, ``initial_loss_mismatch``,
            ``batch_mixing``, ``labels_unstable``, ``gradient_not_shrinking``, ``overfit_failed``).
        severity: ``"error"`` fails the check; ``"warning"`` is reported only.
        names: the parameters (or samples) concerned.
        message: what was seen, with the numbers.
        hint: what to do about it.
        data: the numbers behind the message.
    """

    kind: str
    severity: Severity
    names: list[str]
    message: str
    hint: str
    data: dict[str, float] = field(default_factory=dict)


@dataclass
class OverfitResult:
    """What :class:`OverfitBatchSanity` saw.

    Attributes:
        passed: the loss reached the target (or the batch was memorised) and no error finding was made.
        reached_target: the loss reached the target.
        memorised: the target was not reached in ``max_steps``, but at the last step a classifier
            classified every sample of the batch correctly (argmax of the logits equals the label) with
            a loss below the initial one: the check passes then too, since a loss with a floor (label
            smoothing) may never reach a relative target.
        steps: optimizer steps taken (the check stops at the first loss at or below the target).
        initial_loss: loss before the first step.
        final_loss: the last loss measured.
        target_loss: the loss the check had to reach.
        losses: the loss curve, one value per evaluation (``steps + 1`` values).
        grad_norms: the total gradient 2-norm at each step (``grad_norms[k]`` is the gradient at
            ``losses[k]``).
        seconds: wall time of the whole check, restore included.
        num_samples: samples in the batch trained on.
        optimizer: the optimizer class used (the user's, or the fallback ``Adam``).
        converged: the target was missed, but the loss converged to a floor (see :func:`at_floor`): the
            gradient norm fell to 5 % of its first value, the loss to half its initial value and below
            chance level. Soft targets (mixup, distillation) and label smoothing have such floors; the
            check passes.
        randomness: what random draws inside ``training_step`` change, found by calling it under two
            seeds: ``"none"``; ``"inputs"`` (the model's output: input noise, a diffusion timestep,
            mixup, augmentation, dropout), then every step of the check is re-seeded with one fixed seed
            so the batch and the objective stay the same; ``"targets"`` (the same output, another loss:
            labels drawn at random), then nothing is frozen (random labels cannot be memorised).
        findings: every specific problem found.
        fallback_reached: when the user's optimizer missed the target, whether ``Adam(fallback_lr)``,
            started again from the same weights, reached it or memorised the batch (then the check passes
            with a warning: the pipeline learns, the LR is slow); ``None`` when not tried.
        num_classes: for a classifier, the number of classes (given or inferred), else ``None``.
        chance_loss: for a classifier, the entropy of the batch's label frequencies: the loss of a model
            that ignores its inputs and predicts how often each label occurs.
    """

    passed: bool
    reached_target: bool
    memorised: bool
    steps: int
    initial_loss: float
    final_loss: float
    target_loss: float
    losses: list[float]
    grad_norms: list[float]
    seconds: float
    num_samples: int
    optimizer: str
    findings: list[Finding] = field(default_factory=list)
    randomness: str = "none"
    converged: bool = False
    fallback_reached: bool | None = None
    num_classes: int | None = None
    chance_loss: float | None = None


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


_HINTS = {
    "unused_parameter": (
        "These parameters are not in the graph that produced the loss: look for a `.detach()`, "
        "`torch.no_grad()`, `.item()`/`.numpy()` or `.data` on the way from them to the loss, a layer that "
        "forward() never calls, or a branch that is never taken. If they are unused on purpose, freeze "
        "them (requires_grad=False) or list them in `ignore_parameters`."
    ),
    "parameter_not_updated": (
        "The optimizer never changes these parameters: add them to configure_optimizers() (e.g. "
        "`self.parameters()` instead of one sub-module's), and check each param group's learning rate."
    ),
    "batch_mixing": (
        "A reshape/view/permute mixes the batch dimension (e.g. `x.view(features, batch)` where "
        "`x.view(batch, features)` was meant, or a transpose before a flatten), or an op reduces over "
        "dim 0. Every sample's output must depend only on that sample's input."
    ),
    "labels_unstable": (
        "Labels must be tied to their inputs: look for a dataset that draws or shuffles labels separately "
        "from the inputs (an index into the label array that is not the sample's index, a shuffle applied "
        "to one array only, a random label transform). A model cannot learn labels that change under it."
    ),
    "gradient_not_shrinking": (
        "While the batch was learned, the gradient norm did not shrink: the loss may have a floor the "
        "model cannot reach (label noise within the batch, a regularisation term), or the LR is so high "
        "that the optimizer bounces around the minimum."
    ),
}


def _passed_line(result: OverfitResult) -> str:
    """The one line that says the check ran and passed, with the numbers behind the verdict."""
    if result.reached_target:
        how = f"reached the target {result.target_loss:.4g}"
    elif result.memorised:
        how = "memorised the batch (every sample classified right)"
    elif result.converged:
        how = "converged to a loss floor above the target"
    else:
        how = "missed the target but kept learning"
    return (
        f"OverfitBatchSanity: passed - loss {result.initial_loss:.4g} -> {result.final_loss:.4g} in "
        f"{result.steps} steps on {result.num_samples} samples with {result.optimizer} ({how}; "
        f"{result.seconds:.1f} s)."
    )


def _label_stability(first: Any, second: Any) -> list[Finding]:
    """Compare two draws of the same samples: identical inputs with different labels is a pipeline bug.

    Only judged when every floating tensor came back identical (no random augmentation): then any
    per-sample difference in a one-dimensional integer tensor means the labels are not tied to their
    inputs.
    """
    a, b = list(tensors_in(first)), list(tensors_in(second))
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b, strict=True)):
        return []
    floats = [(x, y) for x, y in zip(a, b, strict=True) if x.is_floating_point()]
    # labels are one integer per sample: [N, k] integers are often drawn at random on purpose (sampled
    # negatives, random masks), a per-sample label is not
    ints = [(x, y) for x, y in zip(a, b, strict=True) if not x.is_floating_point() and x.dim() == 1]
    if not floats or not ints or not all(torch.equal(x, y) for x, y in floats):
        return []
    for x, y in ints:
        differ = (x != y).reshape(x.shape[0], -1).any(dim=1)
        count = int(differ.sum())
        if count:
            n = int(x.shape[0])
            return [
                Finding(
                    "labels_unstable",
                    "error",
                    [],
                    f"Fetching the first batch's samples twice gave identical inputs but different labels "
                    f"for {count} of {n} samples.",
                    _HINTS["labels_unstable"],
                    {"samples_changed": float(count), "samples": float(n)},
                )
            ]
    return []


# --------------------------------------------------------------------------------------------- callback


class OverfitBatchSanity(GradGuardCallback):
    r"""Pre-flight check: the model must be able to memorise one batch, and every parameter must learn.

    Runs once per ``fit`` in ``on_train_start``: after Lightning has set up the model, the optimizer and
    the dataloaders, before the first real training batch. It draws the first batch of a fresh pass over
    the train dataloader (cut to ``max_samples`` samples), then trains on it with the user's
    ``training_step`` and the user's optimizer (``trainer.optimizers[0]``; when
    ``configure_optimizers`` returned none, ``torch.optim.Adam(lr=fallback_lr)`` over the trainable
    parameters) for up to ``max_steps`` steps. The learning-rate scheduler is not stepped, gradient
    clipping and loss scaling are not applied, and ``self.log`` calls are swallowed. Each param group
    trains at its configured LR (``initial_lr``, recorded by a scheduler before it scaled ``lr``: a
    warm-up from 0 would learn nothing). It passes as soon as the loss is at or below the target:
    ``target * initial_loss`` (``target_mode="relative"``) or ``target`` (``"absolute"``); or, after
    ``max_steps``, when the loss sits on a floor above the target that the model reached (every sample
    classified correctly, or the gradient norm down to 5 %: label smoothing, soft targets). Randomness
    inside ``training_step`` that changes the model's output (noise, a diffusion timestep, mixup) is
    frozen: every step is re-seeded alike. When the user's optimizer misses, ``Adam(fallback_lr)`` tries
    again from the same weights; if it succeeds (a slow LR), or the user's curve kept falling and at
    least halved (a slow objective), ``overfit_failed`` is only a warning.

    In the same pass it checks (findings, each an alert of its own kind):

    * ``unused_parameter`` (error): a trainable parameter in the optimizer, whose module ran in
      ``training_step``, never received a gradient (warning: not in the optimizer either, or its module
      never ran — a teacher, a validation-only head);
    * ``parameter_not_updated`` (error): a parameter had a gradient but the optimizer never changed it
      (not in any param group, or its group's ``lr`` is 0);
    * ``initial_loss_mismatch``: for a classifier whose loss is the cross-entropy of its logits, the
      initial loss is far from ``ln C`` (what a fresh model predicting the uniform distribution
      scores): above is a warning, below (a pretrained model) is info. ``C`` is ``num_classes``, or
      inferred when the batch holds integer labels of shape ``[N]`` and the last leaf module outputs
      ``[N, C]`` with every label below ``C``. A loss ``N`` times that cross-entropy is summed, not
      averaged: an error. Skipped when the run resumes from a checkpoint (``global_step > 0``);
    * ``gradient_not_shrinking`` (warning): while the batch was learned, the last gradient norm stayed
      at or above both the first and the median of the run;
    * ``labels_unstable`` (error, with ``check_label_stability=True``, default): the samples of the
      first batch are fetched a second time (same indices from the sampler, ``dataset[i]``) with every
      global RNG re-seeded; identical inputs that come back with different integer labels mean the
      labels are not tied to their inputs (e.g. a dataset that looks labels up with a random index).
      Not judged when the inputs differ too (random augmentation), nor for iterable datasets;
    * ``batch_mixing`` (error, with ``check_batch_mixing=True``): the output of one sample depends on
      the input of another. Measured with the model in eval mode (BatchNorm then uses its running
      statistics; in train mode it legitimately mixes samples through the batch statistics), as the
      gradient of a random projection of sample ``i``'s output (the last leaf module output with the
      batch's leading dimension) with respect to the whole input batch: rows ``j != i`` must be exactly
      zero.

    If the loss does not reach the target, alert ``overfit_failed`` lists the curve, the findings and the
    likely causes (from the curve's shape: stuck at ``ln C``, flat, slow, diverging). With
    ``action="raise"`` (default) every rank raises :class:`SanityCheckError` (the verdict is reduced
    across ranks first, so no rank is left waiting); ``"warn"`` reports and trains on; ``"stop"`` asks
    the trainer to stop.

    Afterwards everything is put back exactly: parameters, gradients, buffers, train/eval flags,
    optimizer and scheduler state, the RNG states (torch, CUDA, NumPy, ``random``, sampler generators),
    the trainer's progress counters and torchmetrics states. The real run is bit for bit the one it
    would have been without the check.

    Limits: automatic optimization only (manual optimization: a one-time warning, nothing checked);
    under DDP each rank trains its own first batch locally (``training_step`` is called directly, so
    DDP's gradient all-reduce is not involved); sharded strategies (FSDP, DeepSpeed) are not supported.
    A label mix-up that is the same every time the batch is drawn cannot be told apart from real labels
    on one batch (a model memorises random labels too); labels that change from draw to draw can.

    Args:
        max_steps: the most optimizer steps the check may take.
        target: the loss to reach, relative to the initial loss or absolute (see ``target_mode``).
        target_mode: ``"relative"`` (pass at ``loss <= target * initial_loss``) or ``"absolute"``.
        max_samples: cut the batch to this many samples (``None``: the whole first batch).
        num_classes: number of classes for the initial-loss check (``None``: inferred when possible).
        check_initial_loss: compare the initial loss of a classifier with ``ln C``.
        initial_loss_tolerance: the initial loss may differ from ``ln C`` by this fraction of ``ln C``.
        check_batch_mixing: also run the batch-mixing check (one extra forward and two backward passes).
        check_label_stability: fetch the first batch's samples a second time and compare.
        ignore_parameters: ``fnmatch`` patterns of parameter names left out of the unused / not-updated
            findings (e.g. ``["head_aux.*"]``).
        fallback_lr: learning rate of the fallback Adam optimizer.
        action: ``"raise"`` (default), ``"warn"`` or ``"stop"``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard.callbacks.overfit_batch import OverfitBatchSanity, SanityCheckError

        check = OverfitBatchSanity(max_steps=200, max_samples=16)
        trainer = Trainer(callbacks=[check])
        try:
            trainer.fit(model, datamodule=dm)
        except SanityCheckError as err:
            print(err)            # the findings and the likely causes
        print(check.result)       # passed, steps, initial/final loss, curve, seconds
    """

    error_type = SanityCheckError

    def __init__(
        self,
        max_steps: int = 200,
        target: float = 0.1,
        target_mode: Literal["relative", "absolute"] = "relative",
        max_samples: int | None = 16,
        num_classes: int | None = None,
        check_initial_loss: bool = True,
        initial_loss_tolerance: float = 0.5,
        check_batch_mixing: bool = False,
        check_label_stability: bool = True,
        ignore_parameters: list[str] | None = None,
        fallback_lr: float = 1e-3,
        action: Literal["raise", "warn", "stop"] = "raise",
    ) -> None:
        super().__init__(action=action, cooldown_steps=0)
        self.max_steps: int = check_int("max_steps", max_steps, 1)
        self.target_mode: str = check_choice("target_mode", target_mode, ("relative", "absolute"))
        if target_mode == "relative":
            self.target: float = check_float("target", target, 0.0, 1.0, low_open=True)
        else:
            self.target = check_float("target", target, -math.inf)
        self.max_samples: int | None = check_int("max_samples", max_samples, 1, allow_none=True)
        self.num_classes: int | None = check_int("num_classes", num_classes, 2, allow_none=True)
        self.check_initial_loss = check_bool("check_initial_loss", check_initial_loss)
        self.initial_loss_tolerance: float = check_float(
            "initial_loss_tolerance", initial_loss_tolerance, 0.0, low_open=True
        )
        self.check_batch_mixing = check_bool("check_batch_mixing", check_batch_mixing)
        self.check_label_stability = check_bool("check_label_stability", check_label_stability)
        self.ignore_parameters: list[str] = check_str_list("ignore_parameters", ignore_parameters) or []
        self.fallback_lr: float = check_float("fallback_lr", fallback_lr, 0.0, low_open=True)
        self.result: OverfitResult | None = None
        self._in_checkpoint = False  # set by load_state_dict: the resumed run had this check

    @override
    def layout_charts(self) -> dict[str, list[str]]:
        return {
            "Pre-flight: overfit-one-batch loss (x = check step)": ["preflight/overfit_loss"],
            "Pre-flight: overfit-one-batch gradient norm (x = check step)": ["preflight/overfit_grad_norm"],
        }

    # ------------------------------------------------------------------ hook
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checked_before, self._in_checkpoint = self._in_checkpoint, False
        if not preflight_applies(self, trainer, pl_module, checked_before):
            return
        started = time.perf_counter()
        snapshot = TrainingSnapshot(pl_module, trainer=trainer)  # sampler generators included
        result: OverfitResult | None = None
        try:
            batch, _ = first_train_batch(trainer)
            again = None
            if self.check_label_stability:  # the same samples once more, under other random draws
                snapshot.rng.restore()
                again = redraw_first_samples(trainer)
            batch = slice_batch(batch, self.max_samples)
            result = self._run(trainer, pl_module, batch)
            if again is not None:
                result.findings[:0] = _label_stability(batch, slice_batch(again, self.max_samples))
                result.passed = result.passed and not any(f.severity == "error" for f in result.findings)
        except Exception as err:  # a model or loader shape we cannot drive: warn, never crash
            warn_once(
                trainer,
                "overfit_batch_error",
                f"OverfitBatchSanity could not run the check ({type(err).__name__}: {err}); skipped.",
            )
        finally:
            snapshot.restore()
        if result is not None:
            result.seconds = time.perf_counter() - started
        self.result = result
        self._conclude(trainer, result)  # on every rank, even a skipped one: the verdict is collective

    # ------------------------------------------------------------------ the check
    def _optimizer(self, trainer: pl.Trainer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from lightning.pytorch.core.optimizer import _MockOptimizer

        real = [o for o in trainer.optimizers if not isinstance(o, _MockOptimizer)]
        if real:
            if len(real) > 1:
                warn_once(
                    trainer,
                    "overfit_batch_many_optimizers",
                    "OverfitBatchSanity trains with the first optimizer only.",
                )
            return real[0]
        return torch.optim.Adam(params, lr=self.fallback_lr)

    def _ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.ignore_parameters)

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> OverfitResult:
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        params = [p for _, p in named]
        optimizer = self._optimizer(trainer, params)
        configured_lr(optimizer)
        start = [p.detach().clone() for p in params]
        n = batch_size_of(batch) or 0
        got_grad = torch.zeros(len(params), dtype=torch.bool)
        nonzero_flags: Tensor | None = None
        losses: list[float] = []
        grad_norms: list[float] = []
        pl_module.train()
        randomness = self._randomness(trainer, pl_module, batch, n)  # before any hook is left on the model
        frozen = randomness == "inputs"
        leaf = LeafOutputs(pl_module, n) if n else None
        calls: CalledModules | None = CalledModules(pl_module)
        logits: Tensor | None = None
        labels: Tensor | None = None
        reached = memorised = False
        pl_module.train()
        try:
            for step in range(self.max_steps + 1):
                optimizer.zero_grad(set_to_none=True)
                for p in params:
                    p.grad = None
                if frozen:  # the same random draws in every step: one fixed batch, one fixed objective
                    seed_all(_FROZEN_SEED)
                with (
                    torch.enable_grad(),
                    trainer.precision_plugin.train_step_context(),
                    quiet_logging(pl_module),
                ):
                    loss = loss_of(training_step_of(pl_module, batch))
                if calls is not None:
                    calls.remove()
                if leaf is not None:
                    out = None if leaf.last is None else leaf.last.detach()
                    leaf.last = None
                    if step == 0:
                        logits = out
                        labels = self._labels(batch, logits, n)[1]
                        if labels is None or logits is None or logits.dim() != 2:
                            leaf.remove()  # not a classifier we understand: no accuracy to follow
                            leaf = None
                    elif (
                        labels is not None
                        and out is not None
                        and logits is not None
                        and out.shape == logits.shape
                    ):
                        memorised = bool((out.argmax(dim=1) == labels).all())
                if loss is None:
                    warn_once(
                        trainer,
                        "overfit_batch_no_loss",
                        "OverfitBatchSanity: training_step returned no loss; the check was skipped.",
                    )
                    break
                value = float(loss.detach().float())
                losses.append(value)
                target_loss = self._target_loss(losses[0])
                if not math.isfinite(value):
                    break
                if step > 0 and value <= target_loss:
                    reached = True
                    break
                if step == self.max_steps:
                    break
                loss.backward()
                grads = [p.grad for p in params]
                present = [g for g in grads if g is not None]
                grad_norms.append(float(torch.nn.utils.get_total_norm(present)) if present else 0.0)
                with (
                    torch.no_grad()
                ):  # flags stay on the device: one host read at the end, not one per tensor
                    got_grad |= torch.tensor([g is not None for g in grads])
                    if present:
                        flags = torch.zeros(len(params), dtype=torch.bool, device=present[0].device)
                        for i, g in enumerate(grads):
                            if g is not None:
                                flags[i] = g.ne(0).any().to(flags.device)
                        nonzero_flags = flags if nonzero_flags is None else nonzero_flags | flags
                if isinstance(optimizer, torch.optim.LBFGS):

                    def closure() -> Tensor:
                        optimizer.zero_grad()
                        if frozen:
                            seed_all(_FROZEN_SEED)
                        with quiet_logging(pl_module):
                            out = loss_of(training_step_of(pl_module, batch))
                        assert out is not None
                        out.backward()
                        return out

                    optimizer.step(closure)
                else:
                    optimizer.step()
        finally:  # never leave a hook on the user's model, even when training_step fails
            if leaf is not None:
                leaf.remove()
            if calls is not None:
                calls.remove()
        steps = max(len(losses) - 1, 0)
        initial = losses[0] if losses else math.nan
        final = losses[-1] if losses else math.nan
        # the target was missed, but at the last step every sample is classified correctly with a loss
        # below the initial one: memorised, above a loss floor (label smoothing)
        memorised = memorised and not reached and final < initial
        result = OverfitResult(
            passed=False,
            reached_target=reached,
            memorised=memorised,
            steps=steps,
            initial_loss=initial,
            final_loss=final,
            target_loss=self._target_loss(initial),
            losses=losses,
            grad_norms=grad_norms,
            seconds=0.0,
            num_samples=n,
            optimizer=type(optimizer).__name__,
            randomness=randomness,
        )
        if not losses:
            result.passed = True  # nothing could be checked (warned above)
            return result
        findings = result.findings
        if steps > 0:
            nonzero_grad = (
                nonzero_flags.cpu()
                if nonzero_flags is not None
                else torch.zeros(len(params), dtype=torch.bool)
            )
            called = calls.called if calls is not None else set()
            findings.extend(
                self._parameter_findings(optimizer, names, params, start, got_grad, nonzero_grad, called)
            )
        if self.check_initial_loss and trainer.global_step == 0:  # a resumed model is not a fresh one
            findings.extend(self._initial_loss_finding(batch, logits, initial, n))
        c, labels = self._labels(batch, logits, n)
        if c is not None and labels is not None:
            freq = torch.bincount(labels.detach().long().cpu(), minlength=c).double() / n
            freq = freq[freq > 0]
            result.num_classes = c
            result.chance_loss = float(-(freq * freq.log()).sum())
        # Not shrinking: the last gradient norm is above where it started *and* above its typical value in
        # the run. A norm that first grows (leaving a flat start, as recurrent nets do) and then falls
        # back to slightly above its start is shrinking.
        if (
            (reached or memorised)
            and len(grad_norms) >= 5
            and grad_norms[-1] >= max(grad_norms[0], statistics.median(grad_norms))
        ):
            findings.append(
                Finding(
                    "gradient_not_shrinking",
                    "warning",
                    [],
                    f"The gradient norm went from {grad_norms[0]:.3g} to {grad_norms[-1]:.3g} while the "
                    f"loss fell from {initial:.4g} to {final:.4g}.",
                    _HINTS["gradient_not_shrinking"],
                    {"initial_grad_norm": grad_norms[0], "final_grad_norm": grad_norms[-1]},
                )
            )
        if self.check_batch_mixing:
            findings.extend(self._batch_mixing(trainer, pl_module, batch))
        result.converged = not (reached or memorised) and at_floor(
            losses, grad_norms, result.chance_loss, result.num_classes
        )
        learned = reached or memorised or result.converged
        if not learned and any(o is optimizer for o in trainer.optimizers):
            # The user's optimizer missed the target. Is it the pipeline, or only the optimizer's LR (a
            # fine-tuning LR such as 2e-5, a warm-up the check does not run)? Try again from the same
            # weights with Adam(fallback_lr): if that memorises the batch, the model, the loss and the data
            # are fine, and the finding is a warning.
            learned = self._fallback_trial(
                trainer, pl_module, batch, params, start, labels, n, frozen, result
            )
            result.fallback_reached = learned
        if not (reached or memorised or result.converged):
            failed = self._failed_finding(result)
            if result.fallback_reached:
                failed.severity = "warning"
                failed.message += (
                    f" Adam(lr={self.fallback_lr:g}) from the same weights did memorise it: the model, loss "
                    "and data can learn; your optimizer's LR is slow for memorising one batch."
                )
                failed.hint = (
                    "Fine for a small fine-tuning LR or a run that relies on warm-up; otherwise raise the LR "
                    "(an LR range test tells how far) or max_steps."
                )
            elif still_learning(losses, result.chance_loss, result.num_classes):
                learned = True
                failed.severity = "warning"
                failed.message += (
                    " The loss was still falling steadily and had at least halved: the model learns from its "
                    "inputs, more slowly than the check's budget."
                )
                failed.hint = (
                    "Objectives such as a VAE's ELBO or a regression on unnormalised targets take longer "
                    "to memorise a batch; raise max_steps (or the LR) to see the target reached."
                )
            findings.append(failed)
        result.passed = learned and not any(f.severity == "error" for f in findings)
        return result

    def _randomness(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, n: int) -> str:
        """Does ``training_step`` draw random numbers, and where do they act?

        Calls it twice on the batch under two different seeds. ``"none"``: the same loss. ``"inputs"``:
        the model's output changed (noise added to the inputs, a diffusion timestep, mixup, augmentation
        in ``training_step``, dropout). ``"targets"``: the same output but another loss (labels drawn or
        shuffled at random, sampled negatives).
        """
        seen: list[tuple[float, Tensor | None]] = []
        for seed in (1, 2):
            seed_all(seed)
            leaf = LeafOutputs(pl_module, n) if n else None
            try:
                with (
                    torch.enable_grad(),
                    trainer.precision_plugin.train_step_context(),
                    quiet_logging(pl_module),
                ):
                    loss = loss_of(training_step_of(pl_module, batch))
            finally:
                if leaf is not None:
                    leaf.remove()
            if loss is None:
                return "none"
            out = None if leaf is None or leaf.last is None else leaf.last.detach()
            seen.append((float(loss.detach().float()), out))
        (a, out_a), (b, out_b) = seen
        if a == b or (math.isnan(a) and math.isnan(b)):
            return "none"
        if out_a is not None and out_b is not None and torch.equal(out_a, out_b):
            return "targets"
        return "inputs"

    def _fallback_trial(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        params: list[nn.Parameter],
        start: list[Tensor],
        labels: Tensor | None,
        n: int,
        frozen: bool,
        result: OverfitResult,
    ) -> bool:
        """Train from ``start`` with ``Adam(fallback_lr)``: does it reach the target or memorise the batch?"""
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
        optimizer = torch.optim.Adam(params, lr=self.fallback_lr)
        leaf = LeafOutputs(pl_module, n) if labels is not None and n else None
        initial = math.nan
        losses: list[float] = []
        norms: list[float] = []
        try:
            for step in range(self.max_steps + 1):
                optimizer.zero_grad(set_to_none=True)
                if frozen:
                    seed_all(_FROZEN_SEED)
                with (
                    torch.enable_grad(),
                    trainer.precision_plugin.train_step_context(),
                    quiet_logging(pl_module),
                ):
                    loss = loss_of(training_step_of(pl_module, batch))
                if loss is None:
                    return False
                value = float(loss.detach().float())
                initial = value if step == 0 else initial
                losses.append(value)
                if not math.isfinite(value):
                    return False
                if step > 0 and value <= self._target_loss(initial):
                    return True
                if step == self.max_steps:
                    out = None if leaf is None else leaf.last
                    return at_floor(losses, norms, result.chance_loss, result.num_classes) or (
                        labels is not None
                        and out is not None
                        and out.dim() == 2
                        and out.shape[0] == labels.shape[0]
                        and bool((out.argmax(dim=1) == labels).all())
                        and value < initial
                    )
                loss.backward()
                grads = [p.grad for p in params if p.grad is not None]
                norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
                optimizer.step()
        finally:
            if leaf is not None:
                leaf.remove()
        return False

    def _target_loss(self, initial: float) -> float:
        return self.target * initial if self.target_mode == "relative" else self.target

    def _parameter_findings(
        self,
        optimizer: torch.optim.Optimizer,
        names: list[str],
        params: list[nn.Parameter],
        start: list[Tensor],
        got_grad: Tensor,
        nonzero_grad: Tensor,
        called: set[str],
    ) -> list[Finding]:
        findings: list[Finding] = []
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        no_grad, not_trained, outside = [], [], []
        for name, p, g in zip(names, params, got_grad.tolist(), strict=True):
            if g or self._ignored(name):
                continue
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            if id(p) not in in_optimizer:
                not_trained.append(name)  # no gradient and no optimizer: consistently left untrained
            elif owner and owner not in called:
                outside.append(name)  # its module never ran in training_step (e.g. a validation head)
            else:
                no_grad.append(name)
        if not_trained or outside:
            parts = []
            if not_trained:
                parts.append(f"in no param group of the optimizer either: {_listed(not_trained)}")
            if outside:
                parts.append(f"their module never runs in training_step: {_listed(outside)}")
            findings.append(
                Finding(
                    "unused_parameter",
                    "warning",
                    not_trained + outside,
                    f"{len(not_trained) + len(outside)} trainable parameter(s) get no gradient in "
                    "training_step; " + "; ".join(parts) + ". Fine if they are meant for another step "
                    "(validation, a teacher updated by hand); under DDP they need "
                    "find_unused_parameters=True.",
                    _HINTS["unused_parameter"],
                    {"count": float(len(not_trained) + len(outside))},
                )
            )
        zero_grad = [
            n
            for n, g, nz in zip(names, got_grad.tolist(), nonzero_grad.tolist(), strict=True)
            if g and not nz and not self._ignored(n)
        ]
        if no_grad:
            findings.append(
                Finding(
                    "unused_parameter",
                    "error",
                    no_grad,
                    f"{len(no_grad)} trainable parameter(s) never received a gradient: {_listed(no_grad)}.",
                    _HINTS["unused_parameter"],
                    {"count": float(len(no_grad))},
                )
            )
        if zero_grad:
            findings.append(
                Finding(
                    "unused_parameter",
                    "warning",
                    zero_grad,
                    f"{len(zero_grad)} parameter(s) got a gradient that was exactly zero at every step: "
                    f"{_listed(zero_grad)} (dead units, a multiplication by zero, or a constant branch).",
                    _HINTS["unused_parameter"],
                    {"count": float(len(zero_grad))},
                )
            )
        lr_of: dict[int, float] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                lr = group.get("lr", math.nan)
                lr_of[id(p)] = float(lr.item() if isinstance(lr, Tensor) else lr)
        missing, zero_lr, other = [], [], []
        for name, p, s, nz in zip(names, params, start, nonzero_grad.tolist(), strict=True):
            if not nz or self._ignored(name) or not torch.equal(p.detach(), s):
                continue
            if id(p) not in lr_of:
                missing.append(name)
            elif lr_of[id(p)] == 0:
                zero_lr.append(name)
            else:
                other.append(name)
        parts = []
        if missing:
            parts.append(f"not in any param group of {type(optimizer).__name__}: {_listed(missing)}")
        if zero_lr:
            parts.append(f"in a param group with lr=0: {_listed(zero_lr)}")
        if other:
            parts.append(
                "unchanged by optimizer.step() although their gradient was non-zero (or every update was "
                "below the weights' floating-point resolution: bf16/fp16 weights, a tiny LR): "
                + _listed(other)
            )
        if parts:
            stuck = missing + zero_lr + other
            findings.append(
                Finding(
                    "parameter_not_updated",
                    "error",
                    stuck,
                    f"{len(stuck)} parameter(s) with a gradient never changed; " + "; ".join(parts) + ".",
                    _HINTS["parameter_not_updated"],
                    {
                        "count": float(len(stuck)),
                        "not_in_optimizer": float(len(missing)),
                        "lr_zero": float(len(zero_lr)),
                    },
                )
            )
        return findings

    def _labels(self, batch: Any, logits: Tensor | None, n: int) -> tuple[int | None, Tensor | None]:
        """(number of classes, the label tensor): ``num_classes`` or inferred from logits and labels."""
        c = self.num_classes
        if c is None and logits is not None and logits.dim() == 2 and logits.shape[1] >= 2:
            c = int(logits.shape[1])
        if c is None:
            return None, None
        for t in tensors_in(batch):
            labels = t.dtype in (torch.int64, torch.int32) and t.dim() == 1 and t.shape[0] == n and n > 0
            if labels and int(t.min()) >= 0 and int(t.max()) < c:
                return c, t
        return (c, None) if self.num_classes is not None else (None, None)

    def _initial_loss_finding(
        self, batch: Any, logits: Tensor | None, initial: float, n: int
    ) -> list[Finding]:
        c, labels = self._labels(batch, logits, n)
        if c is None or not math.isfinite(initial):
            return []
        expected = math.log(c)
        ratio = initial / expected
        # Is the loss the mean (or the sum) cross-entropy of the logits the model produced? Computed on the
        # logits the hook kept: when it is neither (binary / multi-label BCE on integer labels, focal loss,
        # label smoothing on a pretrained model, ...), ln C says nothing about it.
        ce: float | None = None
        if labels is not None and logits is not None and logits.dim() == 2 and logits.shape == (n, c):
            ce = float(torch.nn.functional.cross_entropy(logits.float(), labels.long()))
        summed = ce is not None and n >= 2 and abs(initial - n * ce) <= 0.05 * n * ce
        if ce is None:
            summed = n >= 4 and abs(ratio - n) <= 0.25 * n
        elif not summed and abs(initial - ce) > 0.05 * max(ce, 1e-3):
            return []
        if not summed and abs(initial - expected) <= self.initial_loss_tolerance * expected:
            return []
        severity: Severity
        if summed:
            severity = "error"
            why = (
                f"The loss is {n}x the mean cross-entropy of the logits, the batch size: it is summed over "
                "the batch (reduction='sum') instead of averaged. Use reduction='mean' (or divide by the "
                "batch size), otherwise the effective learning rate grows with the batch size."
            )
        elif ratio > 1:
            severity = "warning"
            why = (
                "The model is confidently wrong at the start: the logits are far from zero (scale down the "
                "last layer's initial weights), softmax is applied twice or before a loss that expects "
                "logits, or the loss is summed over more than the batch dimension. Expected when fine-tuning "
                "a model trained on other data or labels."
            )
        else:
            severity = "info"
            why = (
                "The loss starts below chance: expected when the model is pretrained (fine-tuning) or the "
                "loss is not a softmax cross-entropy over the C outputs (binary / multi-label BCE, focal "
                "loss); otherwise the labels leak into the inputs or the loss is averaged over more "
                "elements than samples."
            )
        return [
            Finding(
                "initial_loss_mismatch",
                severity,
                [],
                f"Initial loss {initial:.4g} is {ratio:.3g}x the ln({c}) = {expected:.4g} a fresh {c}-class "
                "classifier scores by predicting the uniform distribution.",
                why + " If this is not a classification loss, pass check_initial_loss=False.",
                {"initial_loss": initial, "expected": expected, "ratio": ratio, "num_classes": float(c)},
            )
        ]

    def _batch_mixing(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> list[Finding]:
        n = batch_size_of(batch)
        source = next(
            (t for t in tensors_in(batch) if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == n),
            None,
        )
        if n is None or n < 2 or source is None:
            warn_once(
                trainer, "overfit_batch_mixing_input", "batch-mixing check skipped: no float input batch"
            )
            return []
        x = source.detach().clone().requires_grad_(True)
        probe = apply_to_collection(batch, Tensor, lambda t: x if t is source else t)
        leaf = LeafOutputs(pl_module, n)
        pl_module.eval()
        try:
            with torch.enable_grad(), quiet_logging(pl_module):
                training_step_of(pl_module, probe)
        finally:
            leaf.remove()
            pl_module.train()
        out = leaf.last
        if out is None or not out.requires_grad:
            warn_once(
                trainer, "overfit_batch_mixing_output", "batch-mixing check skipped: no per-sample output"
            )
            return []
        gen = torch.Generator().manual_seed(0)
        mixed: dict[int, list[int]] = {}
        for i in sorted({0, n // 2}):
            weights = torch.randn(out[i].shape, generator=gen).to(out)
            (g,) = torch.autograd.grad((out[i] * weights).sum(), x, retain_graph=True, allow_unused=True)
            if g is None:
                continue
            rows = g.detach().reshape(n, -1).abs().amax(dim=1)
            others = [j for j in range(n) if j != i and float(rows[j]) > 0]
            if others:
                mixed[i] = others
        if not mixed:
            return []
        desc = "; ".join(f"sample {i} <- samples {js[:_MAX_LISTED]}" for i, js in mixed.items())
        return [
            Finding(
                "batch_mixing",
                "error",
                [leaf.name or ""],
                f"The output of `{leaf.name}` for one sample depends on the inputs of other samples "
                f"(eval mode): {desc}.",
                _HINTS["batch_mixing"],
                {"samples_mixed": float(sum(len(v) for v in mixed.values()))},
            )
        ]

    def _failed_finding(self, result: OverfitResult) -> Finding:
        losses = result.losses
        initial, final = result.initial_loss, result.final_loss
        causes: list[str] = []
        shape = "slow"
        if not math.isfinite(final):
            shape = "diverged"
            causes = [
                "learning rate too high (lower it 10x)",
                "log(0) or a division by zero in the loss (use cross_entropy on logits, add eps)",
            ]
        elif (
            result.chance_loss is not None
            and result.num_classes is not None
            and abs(final - result.chance_loss) <= 0.15 * math.log(result.num_classes)
        ):
            shape = f"stuck at chance level: the label-frequency entropy {result.chance_loss:.4g}"
            causes = [
                "labels not matching their inputs (misaligned, or shuffled separately from the inputs): the "
                "model learned only how often each label occurs, nothing from the inputs",
                "the inputs do not reach the output (a `.detach()`, a constant input, inputs zeroed by a "
                "transform)",
                "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
            ]
        elif math.isfinite(initial) and final >= 0.9 * initial:
            shape = "flat"
            causes = [
                "labels not matching their inputs (misaligned or shuffled labels)",
                "the loss is not connected to the parameters (a `.detach()`, `torch.no_grad()`, `.item()`)",
                "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
                "the loss is computed on the wrong tensors or axis",
                "inputs not normalised (mean 0, std 1)",
            ]
        elif oscillates(losses):
            shape = "oscillating"
            causes = [
                "learning rate too high (lower it 10x)",
                "loss scaled by the batch size (reduction='sum')",
            ]
        else:
            causes = [
                "learning rate too low or too few steps (raise max_steps)",
                "the model is too small or too regularised (dropout, weight decay) to memorise a few samples",
                "identical inputs with different labels in the batch",
            ]
        if result.randomness == "targets":
            causes.insert(
                0,
                "training_step draws its targets at random: called twice, the model's output was the same "
                "but the loss was not (labels shuffled or drawn on every call; sampled negatives, which "
                "are fine — then use action='warn')",
            )
        return Finding(
            "overfit_failed",
            "error",
            [],
            f"Could not overfit one batch of {result.num_samples} samples with {result.optimizer}: the loss "
            f"went from {initial:.4g} to {final:.4g} in {result.steps} steps "
            f"(target {result.target_loss:.4g}; curve {shape}).",
            "Likely causes: " + "; ".join(causes) + ".",
            {
                "initial_loss": initial,
                "final_loss": final,
                "target_loss": result.target_loss,
                "steps": float(result.steps),
            },
        )

    # ------------------------------------------------------------------ verdict
    def _conclude(self, trainer: pl.Trainer, result: OverfitResult | None) -> None:
        if result is None:
            if reduce_any(trainer, False):
                alert = self.report(
                    trainer,
                    "overfit_failed",
                    "error",
                    None,
                    "This rank could not run the check; the overfit-one-batch check failed on another rank.",
                    "See the alerts of the other ranks.",
                )
                self.act(trainer, [alert] if alert is not None else [])
            return
        for i, value in enumerate(result.losses):
            metrics = {"preflight/overfit_loss": value}
            if i < len(result.grad_norms):
                metrics["preflight/overfit_grad_norm"] = result.grad_norms[i]
            _emit.log_scalars(trainer, metrics, i)
        alerts: list[Alert] = []
        for f in result.findings:
            if f.kind == "overfit_failed":  # the summary: reported below, once
                continue
            where = ", ".join(f.names[:_MAX_LISTED]) + (", ..." if len(f.names) > _MAX_LISTED else "")
            alert = self.report(trainer, f.kind, f.severity, where or None, f.message, f.hint, f.data)
            if alert is not None:
                alerts.append(alert)
        failed_here = not result.passed
        failed_anywhere = reduce_any(trainer, failed_here)
        summary = next((f for f in result.findings if f.kind == "overfit_failed"), None)
        if not failed_anywhere:
            if summary is not None:  # a warning: the target was missed, but the model learns (slow LR)
                self.report(
                    trainer, summary.kind, "warning", None, summary.message, summary.hint, summary.data
                )
            if trainer.is_global_zero:
                log.info(_passed_line(result))
            return
        if summary is not None:
            kinds = sorted(
                {f.kind for f in result.findings if f.severity == "error" and f.kind != "overfit_failed"}
            )
            extra = f" Findings: {', '.join(kinds)}." if kinds else ""
            message, hint, data = summary.message + extra, summary.hint, summary.data
        elif failed_here:
            kinds = sorted({f.kind for f in result.findings if f.severity == "error"})
            how = (
                "The loss reached the target"
                if result.reached_target
                else "The batch was memorised"
                if result.memorised
                else "The loss converged to a floor above the target"
            )
            message = (
                f"{how} ({result.initial_loss:.4g} -> {result.final_loss:.4g} in {result.steps} steps) but "
                f"the check found: {', '.join(kinds)}."
            )
            hint, data = "See the findings above.", {"steps": float(result.steps)}
        else:
            message = "This rank passed, but the overfit-one-batch check failed on another rank."
            hint, data = "See the alerts of the other ranks.", {}
        alert = self.report(trainer, "overfit_failed", "error", None, message, hint, data)
        if alert is not None:
            alerts.append(alert)
        self.act(trainer, alerts)

    # ------------------------------------------------------------------ state
    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        #: the summary of the check made when the run started (``passed``, ``steps``, losses), on resume
        self.resumed_result: dict[str, Any] | None = state_dict.get("result")
        self._in_checkpoint = True  # the run being resumed had this check: it is not repeated

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.result is not None:
            state["result"] = {
                "passed": self.result.passed,
                "steps": self.result.steps,
                "initial_loss": self.result.initial_loss,
                "final_loss": self.result.final_loss,
            }
        return state
