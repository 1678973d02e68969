r"""
OverfitBatchSanity
==================

Before the real run spends hours, prove in seconds that the model can learn: train on the first batch
until its loss collapses, check on the way that every parameter gets a gradient and moves, that the
initial loss is the one a fresh classifier should have, and put everything back exactly as it was.

This module holds the callback: its arguments, when it runs (the first batch drawn and cut, everything
put back afterwards) and its verdict in words (the closing ``overfit_failed`` finding, the line that says
it passed). The check itself is
:func:`~lightning_gradguard.monitors.overfit.check.run_overfit_check`; its rules, their checks and words
are :mod:`~lightning_gradguard.monitors.overfit.rules`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gradguard.alerts import Finding, judge
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.batch import first_train_batch, redraw_first_samples, slice_batch
from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.core.preflight import OTHER_RANKS, PreflightCheck
from lightning_gradguard.core.runstate import LEFT_OUT, RunField, nothing
from lightning_gradguard.core.snapshot import TrainingSnapshot
from lightning_gradguard.core.validate import check_bool, check_choice, check_float, check_int, check_str_list
from lightning_gradguard.monitors.overfit.check import OverfitSettings, run_overfit_check
from lightning_gradguard.monitors.overfit.diagnosis import blow_up
from lightning_gradguard.monitors.overfit.findings import OverfitResult
from lightning_gradguard.monitors.overfit.rules import OVERFIT_FAILED, REFETCH_RULES, Refetched
from lightning_gradguard.monitors.overfit.tags import CHARTS, PREFLIGHT


class OverfitBatchSanity(PreflightCheck):
    r"""Pre-flight check: the model must be able to memorise one batch, and every parameter must learn.

    Runs in ``on_train_start`` of a fit that starts a new run (step 0): after Lightning has set up the
    model, the optimizer and the dataloaders, before the first real training batch. A fit that resumes
    from a checkpoint or continues the Trainer's run (a second ``fit()``) skips it with one INFO line.
    It draws the first batch of a fresh pass over the train dataloader (cut to ``max_samples``
    samples), then trains on it with the user's
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
      never ran — a teacher; info: its module never ran and the code of ``validation_step``,
      ``test_step`` or ``predict_step`` uses it — a validation-only head, read from the source);
    * ``parameter_not_updated`` (error): a parameter had a gradient but the optimizer never changed it
      (not in any param group, its group's ``lr`` is 0, or ``optimizer.step()`` computes no update
      for it);
    * ``update_below_precision`` (warning): a parameter had a gradient and the optimizer does update it,
      but by less than its dtype resolves at its value, so rounding keeps it unchanged (bf16 weights
      near 1.0 under ``precision="bf16-true"``: Adam's steps of about the LR, 1e-3, are under half
      of bfloat16's spacing 2**-7 there). The update is measured with one more step taken with the
      parameter at zero, where no rounding hides it;
    * ``initial_loss_mismatch``: for a classifier whose loss is the cross-entropy of its logits, the
      initial loss is far from ``ln C`` (what a fresh model predicting the uniform distribution
      scores): above is a warning, below (a pretrained model) is info. ``C`` is ``num_classes``, or
      inferred when the batch holds integer labels of shape ``[N]`` and the last leaf module outputs
      ``[N, C]`` with every label below ``C``. A loss ``N`` times that cross-entropy is summed, not
      averaged: an error;
    * ``overfit_unstable`` (warning): the batch was learned, but on the way the loss rose above 1.5x its
      start: the LR overshoots and the trial bounced into the target;
    * ``gradient_not_shrinking`` (warning): the batch was learned to 1 % of its initial loss or less
      (a target of 1 % or below; the default target stops the trial first) and the last gradient norm
      stayed at or above both the first and the median of the run;
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
    likely causes (from the curve's shape: stuck at ``ln C``, flat, slow, diverging, blown up above its
    start and stuck there or at chance). A curve that diverged or blew up and never recovered is a
    too-high LR: an error even when ``Adam(fallback_lr)`` memorises the batch (a warning when a
    scheduler warms up to that LR, which the check skips). With
    ``action="raise"`` (default) every rank raises :class:`SanityCheckError` (the verdict is reduced
    across ranks first, so no rank is left waiting); ``"warn"`` reports and trains on; ``"stop"`` asks
    the trainer to stop.

    Afterwards everything is put back exactly: parameters, gradients, buffers, train/eval flags,
    optimizer and scheduler state, the RNG states (torch, CUDA, NumPy, ``random``, sampler generators),
    the trainer's progress counters and torchmetrics states; a persistent worker pool is left as it was
    (the first batch is drawn by workers of the check's own). The real run is bit for bit the one it
    would have been without the check.

    Limits: automatic optimization only (manual optimization: one INFO line, nothing checked);
    under DDP each rank trains its own first batch locally (``training_step`` is called directly, so
    DDP's gradient all-reduce is not involved); sharded strategies (FSDP, DeepSpeed) are not supported.
    A label mix-up that is the same every time the batch is drawn cannot be told apart from real labels
    on one batch (a model memorises random labels too); labels that change from draw to draw can.

    Args:
        action: ``"raise"`` (default), ``"warn"`` or ``"stop"``.
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

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import OverfitBatchSanity, SanityCheckError

        check = OverfitBatchSanity(max_steps=200, max_samples=16)
        trainer = Trainer(callbacks=[check])
        try:
            trainer.fit(model, datamodule=dm)
        except SanityCheckError as err:
            print(err)            # the findings and the likely causes
        print(check.result)       # passed, steps, initial/final loss, curve, seconds
    """

    charts = CHARTS

    sharded_reason = (
        "its trial steps train this rank's first batch alone, for as many steps as this rank needs, so the "
        "strategy's all-gathers would run out of step with the other ranks"
    )

    #: the check's result, kept past the run for inspection; a checkpoint holds its numbers (read by people,
    #: not loaded back: a resumed run does not run the check again, and the curve is not in it)
    result: RunField[OverfitResult | None] = RunField(
        nothing,
        per_run=False,
        save=lambda _, r: LEFT_OUT if r is None else _result_numbers(r),
        load=lambda o, _: o.result,
    )

    def __init__(
        self,
        *,
        action: Literal["raise", "warn", "stop"] = "raise",
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
    ) -> None:
        super().__init__(action=action)
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

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.applies(trainer, pl_module):
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
            # uncompiled: a cut batch, eval mode and hooks would each make dynamo recompile the user's model
            with Uncompiled(pl_module):
                result = run_overfit_check(trainer, pl_module, batch, self._settings())
            if again is not None:
                result.findings[:0] = judge(
                    REFETCH_RULES, Refetched(batch, slice_batch(again, self.max_samples))
                )
                result.passed = result.passed and not any(f.severity == "error" for f in result.findings)
        except Exception as err:  # a model or loader shape we cannot drive: warn, never crash
            self.could_not_run(trainer, err)  # our own failure: raised under GRADGUARD_STRICT=1
        finally:
            snapshot.restore()
        if result is not None:
            result.seconds = time.perf_counter() - started
        self.result = result
        self._conclude(trainer, result)  # on every rank, even a skipped one: the verdict is collective

    def _settings(self) -> OverfitSettings:
        return OverfitSettings(
            max_steps=self.max_steps,
            target=self.target,
            target_mode=self.target_mode,
            num_classes=self.num_classes,
            check_initial_loss=self.check_initial_loss,
            initial_loss_tolerance=self.initial_loss_tolerance,
            check_batch_mixing=self.check_batch_mixing,
            ignore_parameters=list(self.ignore_parameters),
            fallback_lr=self.fallback_lr,
        )

    # ------------------------------------------------------------------ verdict
    def _conclude(self, trainer: pl.Trainer, result: OverfitResult | None) -> None:
        if result is None:
            message = "This rank could not run the check; the overfit-one-batch check failed on another rank."
            failure = Finding(OVERFIT_FAILED, message, hint=OTHER_RANKS)
            self.conclude(trainer, [], failed_here=False, on_failure=failure, passed_line=None)
            return
        for i, value in enumerate(result.losses):
            metrics = {PREFLIGHT.tag("overfit_loss"): value}
            if i < len(result.grad_norms):
                metrics[PREFLIGHT.tag("overfit_grad_norm")] = result.grad_norms[i]
            _emit.log_scalars(trainer, metrics, i)
        # the summary (overfit_failed) is reported once, by conclude
        alerts = self.report_findings(trainer, [f for f in result.findings if f.rule is not OVERFIT_FAILED])
        summary = next((f for f in result.findings if f.rule is OVERFIT_FAILED), None)
        self.conclude(
            trainer,
            alerts,
            failed_here=not result.passed,
            on_failure=_failure_summary(result, summary),
            passed_line=_passed_line(result),
            # a warning: the target was missed, but the model learns (slow LR)
            on_success=summary,
        )


def _result_numbers(result: OverfitResult) -> dict[str, Any]:
    return {
        "passed": result.passed,
        "steps": result.steps,
        "initial_loss": result.initial_loss,
        "final_loss": result.final_loss,
    }


def _failure_summary(result: OverfitResult, summary: Finding | None) -> Finding:
    """The closing error when the check failed on some rank: this rank's ``overfit_failed`` finding with
    the kinds of the other errors; the errors alone when the batch was learned; or, when this rank
    passed, a pointer to the other ranks."""
    errors = sorted(
        {f.kind for f in result.findings if f.severity == "error" and f.rule is not OVERFIT_FAILED}
    )
    if summary is not None:
        extra = f" Findings: {', '.join(errors)}." if errors else ""
        return Finding(OVERFIT_FAILED, summary.message + extra, summary.data, hint=summary.hint)
    if result.passed:
        message = "This rank passed, but the overfit-one-batch check failed on another rank."
        return Finding(OVERFIT_FAILED, message, hint=OTHER_RANKS)
    how = (
        "The loss reached the target"
        if result.reached_target
        else "The batch was memorised"
        if result.memorised
        else "The loss converged to a floor above the target"
    )
    message = (
        f"{how} ({result.initial_loss:.4g} -> {result.final_loss:.4g} in {result.steps} steps) but "
        f"the check found: {', '.join(errors)}."
    )
    return Finding(OVERFIT_FAILED, message, {"steps": float(result.steps)}, hint="See the findings above.")


def _passed_line(result: OverfitResult) -> str:
    """The one line that says the check ran and passed, with the numbers behind the verdict."""
    if result.reached_target:
        how = f"reached the target {result.target_loss:.4g}"
    elif result.memorised:
        how = "memorised the batch (every sample classified right)"
    elif result.converged:
        how = "converged to a loss floor above the target"
    else:
        how = _missed(result)
    return (
        f"OverfitBatchSanity: passed - loss {result.initial_loss:.4g} -> {result.final_loss:.4g} in "
        f"{result.steps} steps on {result.num_samples} samples with {result.optimizer} ({how}; "
        f"{result.seconds:.1f} s)."
    )


def _missed(result: OverfitResult) -> str:
    """Why a check that missed its target passed (with a warning), for the line that says it passed."""
    jump = blow_up(result.losses)
    if jump is not None:  # only under a warm-up the check skipped, or a loss that fell again
        return f"missed the target; the loss rose to {jump.ratio:.3g}x its start at step {jump.step}"
    if result.final_loss >= result.initial_loss:
        return "missed the target; the loss ended above its start"
    if result.fallback_reached:
        return "missed the target; the fallback Adam memorised the batch: a slow LR"
    share = result.final_loss / result.initial_loss
    return f"missed the target but kept learning, down to {share:.0%} of its start"
