"""The rules of the overfit-one-batch check: one declaration per rule (its kind, summary, docs row, hint
and the check itself), each check right above its declaration.

A check returns the :class:`~lightning_gradguard.core.preflight.PreflightFinding` s that hold (the
parameters or samples concerned as their ``names``), or none; a hint that does not depend on the
numbers is the declaration's. What the checks read is measured elsewhere: the trial's
:class:`~lightning_gradguard.monitors.overfit.findings.ParameterRecord` and the parameters that never
changed (:class:`~lightning_gradguard.monitors.overfit.findings.ParameterEvidence`), the batch mixing
(:func:`~lightning_gradguard.monitors.overfit.findings.mixing_of`), the loss curve's shape and the
chance level (:mod:`~lightning_gradguard.monitors.overfit.diagnosis`). Every check reads one evidence
object of the phase of the check it judges, and the check runs them from their declarations
(:func:`~lightning_gradguard.alerts.judge`) where it reaches that phase
(:func:`~lightning_gradguard.monitors.overfit.check.run_overfit_check`): :data:`PARAMETER_RULES` on a
:class:`~lightning_gradguard.monitors.overfit.findings.ParameterEvidence`, :data:`TRIAL_RULES` on a
:class:`Trial`, :data:`OUTCOME_RULES` on an :class:`Outcome`, :data:`REFETCH_RULES` on a
:class:`Refetched` (the callback's second draw of the batch). They are reported after the run is
restored, by the pre-flight base (``PreflightCheck.conclude``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gradguard.alerts import Finding, Rule, Severity, declare, judge
from lightning_gradguard.core.batch import tensors_in
from lightning_gradguard.core.preflight import MAX_LISTED, PreflightFinding
from lightning_gradguard.functional.overfit import still_learning
from lightning_gradguard.functional.updates import dtype_spacing
from lightning_gradguard.monitors.overfit.diagnosis import (
    NEAR_MINIMUM,
    at_chance,
    blow_up,
    curve_shape,
    labels_of,
    summed,
)
from lightning_gradguard.monitors.overfit.findings import (
    OverfitResult,
    ParameterEvidence,
    ParameterRecord,
    listed,
    mixing_of,
    used_elsewhere,
)


@dataclass(frozen=True, kw_only=True)
class Trial:
    """What the user's trial showed, as the rules judged after it read it: its ``result`` so far (losses,
    gradient norms, whether the target was reached or the batch memorised), the batch and the logits of its
    first forward, and the settings of the rules that may be off."""

    result: OverfitResult
    batch: Any
    logits: Tensor | None
    trainer: pl.Trainer
    pl_module: pl.LightningModule
    check_initial_loss: bool
    num_classes: int | None
    tolerance: float
    check_batch_mixing: bool


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The trial's end: whether the batch was ``learned`` (the target reached, memorised or a floor), the
    result (with the fallback trial's, when it ran) and the fallback's learning rate."""

    result: OverfitResult
    learned: bool
    fallback_lr: float


@dataclass(frozen=True)
class Refetched:
    """The first batch's samples, drawn twice from the loader (``first``, ``second``)."""

    first: Any
    second: Any


# ------------------------------------------------------------------ overfit_failed
#: the likely causes of a batch not learned, by the shape of its loss curve
_CAUSES: dict[str, list[str]] = {
    "diverged": [
        "learning rate too high (lower it 10x)",
        "log(0) or a division by zero in the loss (use cross_entropy on logits, add eps)",
    ],
    "chance": [
        "labels not matching their inputs (misaligned, or shuffled separately from the inputs): the "
        "model learned only how often each label occurs, nothing from the inputs",
        "the inputs do not reach the output (a `.detach()`, a constant input, inputs zeroed by a transform)",
        "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
    ],
    "flat": [
        "labels not matching their inputs (misaligned or shuffled labels)",
        "the loss is not connected to the parameters (a `.detach()`, `torch.no_grad()`, `.item()`)",
        "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
        "the loss is computed on the wrong tensors or axis",
        "inputs not normalised (mean 0, std 1)",
    ],
    "blew_up": [
        "learning rate too high (lower it 10x): the first large steps threw the loss far above its start "
        "and it never recovered; overshooting kills ReLUs or saturates units, and a network with no working "
        "path left from its inputs predicts only how often each label occurs (chance level)",
        "a large LR without the warm-up or gradient clipping the run relies on (the check applies neither)",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "overshot": [
        "learning rate too high (lower it 3-10x, or warm up to it): the loss rose far above its start "
        "before it fell again",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "oscillating": [
        "learning rate too high (lower it 10x)",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "slow": [
        "learning rate too low or too few steps (raise max_steps)",
        "the model is too small or too regularised (dropout, weight decay) to memorise a few samples",
        "identical inputs with different labels in the batch",
    ],
}

#: the first likely cause when ``training_step`` draws its targets at random (``randomness="targets"``)
_RANDOM_TARGETS = (
    "training_step draws its targets at random: called twice, the model's output was the same "
    "but the loss was not (labels shuffled or drawn on every call; sampled negatives, which "
    "are fine — then use action='warn')"
)


def _described(shape: str, result: OverfitResult) -> str:
    """How the message names the curve's ``shape``."""
    entropy = math.nan if result.chance_loss is None else result.chance_loss
    chance = f"stuck at chance level: the label-frequency entropy {entropy:.4g}"
    jump = blow_up(result.losses)
    if shape == "chance" or jump is None or shape not in ("blew_up", "overshot"):
        return chance if shape == "chance" else shape
    if shape == "overshot":
        end = "then fell again"
    else:
        end = chance if at_chance(result) else "then stuck near or above its start"
    return f"blew up to {jump.loss:.4g} ({jump.ratio:.3g}x its start) at step {jump.step}, {end}"


def failed_finding(result: OverfitResult) -> PreflightFinding:
    """``overfit_failed``: the batch was not learned, with the likely causes from the curve's shape."""
    shape = curve_shape(result)
    causes = [_RANDOM_TARGETS] if result.randomness == "targets" else []
    causes += _CAUSES[shape]
    initial, final = result.initial_loss, result.final_loss
    return PreflightFinding(
        OVERFIT_FAILED,
        f"Could not overfit one batch of {result.num_samples} samples with {result.optimizer}: "
        f"the loss went from {initial:.4g} to {final:.4g} in {result.steps} steps "
        f"(target {result.target_loss:.4g}; curve {_described(shape, result)}).",
        {
            "initial_loss": initial,
            "final_loss": final,
            "target_loss": result.target_loss,
            "steps": float(result.steps),
        },
        hint="Likely causes: " + "; ".join(causes) + ".",
    )


def _too_high(failed: PreflightFinding, result: OverfitResult, fallback_lr: float) -> PreflightFinding:
    """The verdict on a curve that diverged or blew up and never recovered: the LR is too high."""
    message = failed.message
    if result.fallback_reached:
        message += (
            f" Adam(lr={fallback_lr:g}) from the same weights did memorise it: the model, loss and data can "
            "learn; your optimizer's LR is too high for them."
        )
    hint = "Lower the learning rate (10x; an LR range test tells how far). " + failed.hint
    if result.warm_up:  # the run may reach this LR gently; the check jumped to it
        message += (
            " Your LR scheduler warms up to this LR, and the check trained at it from the first step: "
            "the warm-up may carry the run through."
        )
        return replace(failed, message=message, hint=hint, severity="warning")
    return replace(failed, message=message, hint=hint)


def missed_target(result: OverfitResult, fallback_lr: float) -> PreflightFinding:
    """``overfit_failed`` for a batch not learned: :func:`failed_finding`, an error; info when the user's
    own loss was still falling steadily and had at least halved (a slow objective or a small LR: the check
    passes); a warning when ``Adam(fallback_lr)`` from the same weights memorised the batch
    (``result.fallback_reached``) while the user's curve did not learn so. The user's LR is called slow
    only when the user's curve never rose above its start; a curve that diverged, or blew up and sat at
    chance or near its start, is a too-high LR: an error whatever the fallback did (a warning when a
    scheduler warms up to that LR, which the check skips)."""
    failed = failed_finding(result)
    shape = curve_shape(result)
    if shape in ("diverged", "blew_up"):
        return _too_high(failed, result, fallback_lr)
    rose = shape == "overshot" or result.final_loss > result.initial_loss
    if not rose and still_learning(result.losses, result.chance_loss, result.num_classes):
        # the user's own curve learns (halved, still falling): a slow objective or a small LR is no
        # fault of the pipeline, whatever Adam(fallback_lr) did (Lion at its usual lr, a fine-tune's)
        return replace(
            failed,
            severity="info",
            message=failed.message + " The loss was still falling steadily and had at least halved: the "
            "model learns from its inputs, more slowly than the check's budget.",
            hint="Objectives such as a VAE's ELBO or a regression on unnormalised targets, and small LRs "
            "(a fine-tune's, Lion's), take longer to memorise a batch; raise max_steps (or the LR) to see "
            "the target reached.",
        )
    if result.fallback_reached:
        learns = failed.message + (
            f" Adam(lr={fallback_lr:g}) from the same weights did memorise it: the model, loss and data can "
            "learn; "
        )
        if rose:
            return replace(
                failed,
                severity="warning",
                message=learns + "your optimizer's loss rose above its start instead: its LR is too high.",
                hint="Lower the LR (3-10x; an LR range test tells how far) or warm up to it. " + failed.hint,
            )
        return replace(
            failed,
            severity="warning",
            message=learns + "your optimizer's LR is slow for memorising one batch.",
            hint="Fine for a small fine-tuning LR or a run that relies on warm-up; otherwise raise the LR "
            "(an LR range test tells how far) or max_steps.",
        )
    return failed


OVERFIT_FAILED: Rule[Outcome] = Rule(
    kind="overfit_failed",
    severity="error",
    monitor="OverfitBatchSanity",
    also=("warning", "info"),
    summary="OverfitBatchSanity: the model could not overfit one batch; findings and likely causes",
    when=(
        "the model could not drive the loss of one batch below the target within `max_steps`; the "
        "message lists the findings and likely causes. A warning when only `Adam(fallback_lr)` "
        "reached the target while the user's curve did not halve (the configured LR is too slow for "
        "the check); info (the check passes) when the user's curve fell steadily and at least halved "
        "(a slow objective or LR: Cohere's logit scale of 1/16 took 4.2 -> 0.72 in 200 steps, Lion "
        "at 3e-4 4.2 -> 0.56), unless the user's curve rose above its "
        "start: a curve that diverged, or blew up above 1.5x its start and stayed at chance or near"
        ' its start, is a too-high LR ("Lower the learning rate"), an error (a warning under a '
        "warm-up the check skipped). See [pre-flight "
        "checks](preflight.md#a-too-high-learning-rate)."
    ),
    check=lambda o: None if o.learned else missed_target(o.result, o.fallback_lr),
)


# ------------------------------------------------------------------ unused_parameter
#: the share of the entries the optimizer holds from which parameters of modules that ran, yet got no
#: gradient, are a cut graph (a `.detach()`, `torch.no_grad()`): below it they are parameters the forward
#: does not read on this path, a design (a masked-image-modeling token in a classifier, a relative-attention
#: table a block type does not use, a pooler a head ignores: BigBird's pooler is 4.7 % of its shrunk model)
SIZEABLE = 0.1
#: the share from which parameters without a gradient, whatever the reason, mean the model mostly never
#: learns (modules that never run are otherwise a design: the cross-attention of an encoder-decoder run as
#: a decoder, the vision tower of a multimodal model on text)
MOST = 0.5

#: the hint of ``unused_parameter`` (info): parameters of a module only another step uses
_OTHER_STEPS_HINT = (
    "Nothing to do when that is the design (an auxiliary head read in validation). If they should learn, "
    "add their loss to training_step's; if not, freeze them (requires_grad=False: the optimizer then holds "
    "no state for them) or list them in `ignore_parameters` to drop this line."
)
#: the hint of ``unused_parameter`` (info): a minority of the model gets no gradient
_UNREAD_HINT = (
    "Nothing to do when the forward does not read them by design (a mask token in a classifier, a table a "
    "block type does not use, an unused pooler). If they should learn, look for a `.detach()` or "
    "`torch.no_grad()` on their way to the loss. Freezing them (requires_grad=False) saves their optimizer "
    "state; under DDP, parameters without a gradient need find_unused_parameters=True, which walks the "
    "graph after every forward: freezing them avoids that cost. `ignore_parameters` drops this line."
)
#: the DDP note of parameters that get no gradient at all (a zero gradient is no problem for DDP)
_DDP_NOTE = " Under DDP they need find_unused_parameters=True (a walk over the graph after every forward)."


def _entries(ev: ParameterEvidence, names: list[str], held: bool = False) -> tuple[int, float]:
    """The entries of the kept parameters ``names``, and their share of every kept trainable entry (with
    ``held``: of those an optimizer holds, the part of the model that is meant to learn)."""
    in_optimizer = {id(p) for group in ev.optimizer.param_groups for p in group["params"]}
    rows = zip(ev.record.names, ev.record.params, ev.kept, strict=True)
    sizes = {n: p.numel() for n, p, keep in rows if keep and (not held or id(p) in in_optimizer)}
    entries = sum(sizes.get(n, 0) for n in names)
    return entries, entries / max(sum(sizes.values()), 1)


def _unused(
    ev: ParameterEvidence, names: list[str], what: str, *, most: bool, ddp: bool, severity: Severity = "error"
) -> PreflightFinding:
    """``unused_parameter`` for ``names`` (``what`` happened to them): ``severity`` when ``most`` (they
    are too large a part of what the optimizer trains to be a design), else info with their share of the
    model."""
    entries, share = _entries(ev, names)
    held = _entries(ev, names, held=True)[1]
    said = (
        f"{len(names)} trainable parameter(s) ({entries:,} entries, {share:.1%} of the trainable model) "
        f"{what}: {listed(names)}."
    )
    data = {"count": float(len(names)), "entries": float(entries), "share": share}
    if most:
        said += f" That is {held:.0%} of what the optimizer trains: it never learns."
        return PreflightFinding(UNUSED_PARAMETER, said, data, names=names, severity=severity)
    said += " They never train." + (_DDP_NOTE if ddp else "")
    return PreflightFinding(UNUSED_PARAMETER, said, data, hint=_UNREAD_HINT, severity="info", names=names)


def _without_gradient(ev: ParameterEvidence) -> list[PreflightFinding]:
    """``unused_parameter``: info for those of a module that only another step uses (a validation-only
    head) and for those in no param group (a teacher updated by hand); for those the optimizer holds, info
    with their share of the model, an error for those of modules that ran when they are :data:`SIZEABLE`
    of what it trains (a cut graph, not a token), and one error for all when they are :data:`MOST` of it."""
    record = ev.record
    in_optimizer = {id(p) for group in ev.optimizer.param_groups for p in group["params"]}
    no_grad, not_trained, outside = [], [], []
    for name, p, g, keep in zip(record.names, record.params, record.got_grad, ev.kept, strict=True):
        if g or not keep:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if id(p) not in in_optimizer:
            not_trained.append(name)  # no gradient and no optimizer: consistently left untrained
        elif owner and owner not in record.called:
            outside.append(name)  # its module never ran in training_step
        else:
            no_grad.append(name)
    idle = [n for n in not_trained + outside if "." in n and n.rsplit(".", 1)[0] not in record.called]
    by_step = used_elsewhere(record, idle)
    elsewhere = {name for names in by_step.values() for name in names}
    not_trained = [n for n in not_trained if n not in elsewhere]
    outside = [n for n in outside if n not in elsewhere]
    findings = [_other_steps(by_step)] if by_step else []
    if _entries(ev, no_grad + outside, held=True)[1] >= MOST:  # one error for all of them
        findings.append(_unused(ev, no_grad + outside, "never received a gradient", most=True, ddp=True))
    else:
        if no_grad:
            cut = _entries(ev, no_grad, held=True)[1] >= SIZEABLE
            findings.append(_unused(ev, no_grad, "never received a gradient", most=cut, ddp=True))
        if outside:
            what = "get no gradient: their module never runs in training_step"
            findings.append(_unused(ev, outside, what, most=False, ddp=True))
    if not_trained:
        what = (
            "get no gradient and are in no param group of the optimizer either (a teacher updated by hand?)"
        )
        findings.append(_unused(ev, not_trained, what, most=False, ddp=True))
    return findings


def _other_steps(by_step: dict[str, list[str]]) -> PreflightFinding:
    """``unused_parameter`` (info): parameters of modules only another step uses, by that step."""
    names = [name for step in by_step.values() for name in step]
    parts = [f"only {step} uses their module: {listed(found)}" for step, found in by_step.items()]
    return PreflightFinding(
        UNUSED_PARAMETER,
        f"{len(names)} trainable parameter(s) get no gradient in training_step; "
        + "; ".join(parts)
        + ". Expected for a head that only evaluates; nothing trains them, so they keep their initial "
        "values unless you update them yourself." + _DDP_NOTE,
        {"count": float(len(names))},
        hint=_OTHER_STEPS_HINT,
        severity="info",
        names=names,
    )


def _zero_gradient(ev: ParameterEvidence) -> list[PreflightFinding]:
    """``unused_parameter``: a gradient at some step, but exactly zero at every one (info with the share of
    the model; a warning from :data:`SIZEABLE` of what the optimizer trains: dead units, a constant
    branch)."""
    record = ev.record
    zero_grad = [
        n
        for n, g, nz, keep in zip(record.names, record.got_grad, record.nonzero_grad, ev.kept, strict=True)
        if g and not nz and keep
    ]
    if not zero_grad:
        return []
    what = (
        "got a gradient that was exactly zero at every step (a token the batch never selects, dead units, a "
        "multiplication by zero, or a constant branch)"
    )
    sizeable = _entries(ev, zero_grad, held=True)[1] >= SIZEABLE
    return [_unused(ev, zero_grad, what, most=sizeable, ddp=False, severity="warning")]


def unused_parameters(ev: ParameterEvidence) -> list[PreflightFinding]:
    """``unused_parameter``: parameters that got no gradient, then those whose gradient was always zero."""
    return [*_without_gradient(ev), *_zero_gradient(ev)]


UNUSED_PARAMETER: Rule[ParameterEvidence] = Rule(
    kind="unused_parameter",
    severity="error",
    monitor="OverfitBatchSanity",
    also=("warning", "info"),
    summary="trainable parameters got no gradient (or only zeros); an error for most of the model",
    when=(
        "error: parameters of modules that ran got no gradient and are 10 % or more of the entries "
        "the optimizer holds (a `.detach()`, a cut graph), or the parameters without a gradient are "
        "half of them or more (the model mostly never learns); warning: a gradient of exact zeros on "
        "10 % or more (dead units, a constant branch); info otherwise, with their entries, share of "
        "the model and a DDP note (a mask token a classifier never reads, a table a block type does "
        "not use, a pooler a head ignores, cross-attention without an encoder, a teacher in no param "
        "group, a module that never runs), and for a module only `validation_step`, `test_step` or "
        "`predict_step` uses (read from the source)."
    ),
    hint=(
        "These parameters are not in the graph that produced the loss: look for a `.detach()`, "
        "`torch.no_grad()`, `.item()`/`.numpy()` or `.data` on the way from them to the loss, a layer that "
        "forward() never calls, or a branch that is never taken. If they are unused on purpose, freeze "
        "them (requires_grad=False) or list them in `ignore_parameters`."
    ),
    check=unused_parameters,
)


# ------------------------------------------------------------------ parameter_not_updated
#: why a parameter with a gradient never changed, by the key
#: :attr:`~lightning_gradguard.monitors.overfit.findings.Unchanged.why` files it under
_NOT_UPDATED_WHY = {
    "missing": "not in any param group of {optimizer}",
    "zero_lr": "in a param group with lr=0",
    "not_stepped": "in a param group with a non-zero lr, but optimizer.step() computes no update for them "
    "(an optimizer or a step hook that skips them or zeroes their gradient)",
    "unmeasured": "unchanged by optimizer.step() although their gradient was non-zero and their lr is not 0 "
    "(the update could not be measured to tell whether it was below the weights' floating-point "
    "resolution)",
}


def not_updated(ev: ParameterEvidence) -> list[PreflightFinding]:
    """``parameter_not_updated`` (error) for the parameters the optimizer does not update, and why."""
    why = ev.unchanged.why
    stuck = [name for names in why.values() for name in names]
    if not stuck:
        return []
    parts = [
        _NOT_UPDATED_WHY[key].format(optimizer=type(ev.optimizer).__name__) + ": " + listed(names)
        for key, names in why.items()
        if names
    ]
    return [
        PreflightFinding(
            PARAMETER_NOT_UPDATED,
            f"{len(stuck)} parameter(s) with a gradient never changed; " + "; ".join(parts) + ".",
            {
                "count": float(len(stuck)),
                "not_in_optimizer": float(len(why["missing"])),
                "lr_zero": float(len(why["zero_lr"])),
            },
            names=stuck,
        )
    ]


PARAMETER_NOT_UPDATED: Rule[ParameterEvidence] = Rule(
    kind="parameter_not_updated",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="a parameter with a gradient did not change (missing from the optimizer, lr 0)",
    when=(
        "a parameter with a gradient never changed: missing from the optimizer, its group has lr 0,"
        " or `optimizer.step()` computes no update for it."
    ),
    hint=(
        "The optimizer never changes these parameters: add them to configure_optimizers() (e.g. "
        "`self.parameters()` instead of one sub-module's), and check each param group's learning rate."
    ),
    check=not_updated,
)


# ------------------------------------------------------------------ update_below_precision
def _below_precision(
    record: ParameterRecord, lost: dict[int, Tensor], indices: list[int]
) -> PreflightFinding:
    """``update_below_precision`` (warning) for parameters of one dtype: the numbers of the lost updates."""
    dtype = record.params[indices[0]].dtype
    names = [record.names[i] for i in indices]
    magnitude = float(
        torch.cat([record.params[i].detach().float().abs().flatten() for i in indices]).median()
    )
    resolution = float(dtype_spacing(torch.tensor(magnitude), dtype))
    sizes = torch.cat([lost[i] for i in indices])
    typical, largest = float(sizes.median()), float(sizes.max())
    kind = str(dtype).removeprefix("torch.")
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1
    return PreflightFinding(
        UPDATE_BELOW_PRECISION,
        f"{len(names)} {kind} parameter(s) never changed although their gradient was non-zero and "
        f"the optimizer updated them: {listed(names)}. Their typical |value| is {magnitude:.3g}, where "
        f"{kind} numbers ({bits} significant bits) are {resolution:.2g} apart; the optimizer's updates "
        f"(typically {typical:.2g}, at most {largest:.2g}) are too small for that: an update under half the "
        "gap rounds back to the old value.",
        {
            "count": float(len(names)),
            "magnitude": magnitude,
            "resolution": resolution,
            "update": typical,
            "largest_update": largest,
        },
        names=names,
    )


def below_precision(ev: ParameterEvidence) -> list[PreflightFinding]:
    """``update_below_precision`` (warning), one per dtype: parameters the optimizer does update, by less
    than their dtype resolves at their values."""
    lost = ev.unchanged.lost
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in lost:
        by_dtype.setdefault(ev.record.params[i].dtype, []).append(i)
    return [_below_precision(ev.record, lost, indices) for indices in by_dtype.values()]


UPDATE_BELOW_PRECISION: Rule[ParameterEvidence] = Rule(
    kind="update_below_precision",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="a parameter's updates were below its dtype's resolution: rounded away (bf16)",
    when=(
        "a parameter with a gradient never changed although the optimizer updates it: every update "
        "was below its dtype's resolution at its value and rounded away (BatchNorm weights at 1.0 "
        "under `precision=\"bf16-true\"`: Adam's ~1e-3 steps against bfloat16's spacing of 2^-7 = "
        "0.0078 there). The message gives the dtype, the typical value, the spacing there and the "
        'update\'s size; the hint: float32 master weights (`precision="bf16-mixed"`). See '
        "[pre-flight checks](preflight.md#findings)."
    ),
    hint=(
        "Nothing is disconnected: the optimizer does compute these updates, and the weights' dtype cannot "
        "hold them, so every step rounds back to the old value and the parameters keep their initial "
        'values. Keep float32 master weights: precision="bf16-mixed" (or "16-mixed") computes in half '
        "precision and updates float32 weights; or keep these parameters (typically normalisation weights "
        "near 1) in float32. With float32 weights, the LR is tiny for the parameters' scale."
    ),
    check=below_precision,
)


# ------------------------------------------------------------------ initial_loss_mismatch
#: why the initial loss is off ``ln C``, by the severity of the finding (``{n}``: the batch size)
_INITIAL_LOSS_WHY: dict[Severity, str] = {
    "error": (
        "The loss is {n}x the mean cross-entropy of the logits, the batch size: it is summed over "
        "the batch (reduction='sum') instead of averaged. Use reduction='mean' (or divide by the "
        "batch size), otherwise the effective learning rate grows with the batch size."
    ),
    "warning": (
        "The model is confidently wrong at the start: the logits are far from zero (scale down the "
        "last layer's initial weights), softmax is applied twice or before a loss that expects "
        "logits, or the loss is summed over more than the batch dimension. Expected when fine-tuning "
        "a model trained on other data or labels."
    ),
    "info": (
        "The loss starts below chance: expected when the model is pretrained (fine-tuning) or the "
        "loss is not a softmax cross-entropy over the C outputs (binary / multi-label BCE, focal "
        "loss); otherwise the labels leak into the inputs or the loss is averaged over more "
        "elements than samples."
    ),
}


def initial_loss_finding(
    batch: Any, logits: Tensor | None, initial: float, n: int, *, num_classes: int | None, tolerance: float
) -> list[PreflightFinding]:
    """``initial_loss_mismatch``: a classifier's initial loss far from ``ln C`` (or ``N`` times the
    cross-entropy of its logits: a summed loss)."""
    c, labels = labels_of(batch, logits, n, num_classes)
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
    is_summed = summed(initial, ratio, n, ce)
    if is_summed is None or (not is_summed and abs(initial - expected) <= tolerance * expected):
        return []
    severity: Severity = "error" if is_summed else "warning" if ratio > 1 else "info"
    return [
        PreflightFinding(
            INITIAL_LOSS_MISMATCH,
            f"Initial loss {initial:.4g} is {ratio:.3g}x the ln({c}) = {expected:.4g} a fresh "
            f"{c}-class classifier scores by predicting the uniform distribution.",
            {"initial_loss": initial, "expected": expected, "ratio": ratio, "num_classes": float(c)},
            hint=_INITIAL_LOSS_WHY[severity].format(n=n)
            + " If this is not a classification loss, pass check_initial_loss=False.",
            severity=severity,
        )
    ]


INITIAL_LOSS_MISMATCH: Rule[Trial] = Rule(
    kind="initial_loss_mismatch",
    severity="error",
    monitor="OverfitBatchSanity",
    also=(
        "warning",
        "info",
    ),
    summary="a classifier's initial loss is far from ln(C) (wrong loss, reduction or init)",
    when=(
        "error: the loss is N times the cross-entropy of the logits (a summed instead of averaged "
        "loss); warning: a plain cross-entropy far above ln C (bad init or logits scale); info: far"
        " below ln C (a pretrained model). No verdict when the loss is not the plain cross-entropy "
        "(label smoothing, focal, multi-label)."
    ),
    check=lambda t: (
        initial_loss_finding(
            t.batch,
            t.logits,
            t.result.initial_loss,
            t.result.num_samples,
            num_classes=t.num_classes,
            tolerance=t.tolerance,
        )
        if t.check_initial_loss  # the check runs only when a run starts: the model is a fresh one
        else None
    ),
)


# ------------------------------------------------------------------ batch_mixing
def batch_mixing(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> list[PreflightFinding]:
    """``batch_mixing``: the output of one sample depends on the input of another (eval mode)."""
    mixing = mixing_of(trainer, pl_module, batch)
    if mixing is None or not mixing.samples:
        return []
    desc = "; ".join(f"sample {i} <- samples {js[:MAX_LISTED]}" for i, js in mixing.samples.items())
    return [
        PreflightFinding(
            BATCH_MIXING,
            f"The output of `{mixing.leaf}` for one sample depends on the inputs of other samples "
            f"(eval mode): {desc}.",
            {"samples_mixed": float(sum(len(v) for v in mixing.samples.values()))},
            names=[mixing.leaf or ""],
        )
    ]


BATCH_MIXING: Rule[Trial] = Rule(
    kind="batch_mixing",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="the output of one sample depends on the input of another sample",
    when=("with `check_batch_mixing=True`: one sample's output depends on another sample's input."),
    hint=(
        "A reshape/view/permute mixes the batch dimension (e.g. `x.view(features, batch)` where "
        "`x.view(batch, features)` was meant, or a transpose before a flatten), or an op reduces over "
        "dim 0. Every sample's output must depend only on that sample's input."
    ),
    check=lambda t: batch_mixing(t.trainer, t.pl_module, t.batch) if t.check_batch_mixing else None,
)


# ------------------------------------------------------------------ labels_unstable
def label_stability(first: Any, second: Any) -> list[PreflightFinding]:
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
                PreflightFinding(
                    LABELS_UNSTABLE,
                    "Fetching the first batch's samples twice gave identical inputs but different "
                    f"labels for {count} of {n} samples.",
                    {"samples_changed": float(count), "samples": float(n)},
                )
            ]
    return []


LABELS_UNSTABLE: Rule[Refetched] = Rule(
    kind="labels_unstable",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="the same samples fetched again came back with other labels",
    when=("the first batch's samples fetched again came back with the same inputs and other labels."),
    hint=(
        "Labels must be tied to their inputs: look for a dataset that draws or shuffles labels separately "
        "from the inputs (an index into the label array that is not the sample's index, a shuffle applied "
        "to one array only, a random label transform). A model cannot learn labels that change under it."
    ),
    check=lambda r: label_stability(r.first, r.second),
)


# ------------------------------------------------------------------ gradient_not_shrinking
def not_shrinking(losses: list[float], grad_norms: list[float]) -> list[PreflightFinding]:
    """``gradient_not_shrinking``: the batch was learned to near its minimum, and the gradient norm did not
    shrink.

    Judged only where the last gradient was measured at a loss of at most
    :data:`~lightning_gradguard.monitors.overfit.diagnosis.NEAR_MINIMUM` times the initial one
    (``grad_norms[k]`` is the gradient at ``losses[k]``): before that, a cross-entropy's gradient
    legitimately grows as the logits sharpen. With the default relative target (0.1) the trial stops
    first, so the rule speaks only for targets of 1 % or less (or absolute ones near 0). Not shrinking:
    the last gradient norm is above where it started *and* above its typical value in the run.
    """
    k = len(grad_norms) - 1
    if k < 4 or k >= len(losses) or not (losses[0] > 0 and 0 <= losses[k] <= NEAR_MINIMUM * losses[0]):
        return []
    if grad_norms[-1] < max(grad_norms[0], statistics.median(grad_norms)):
        return []
    return [
        PreflightFinding(
            GRADIENT_NOT_SHRINKING,
            f"The gradient norm went from {grad_norms[0]:.3g} to {grad_norms[-1]:.3g} while the "
            f"loss fell from {losses[0]:.4g} to {losses[k]:.4g} ({losses[k] / losses[0]:.2%} of its start).",
            {"initial_grad_norm": grad_norms[0], "final_grad_norm": grad_norms[-1]},
        )
    ]


GRADIENT_NOT_SHRINKING: Rule[Trial] = Rule(
    kind="gradient_not_shrinking",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="the batch was learned but the gradient norm did not shrink",
    when=(
        "the batch was learned to 1 % of its initial loss or less (targets of 1 % or below; the "
        "default target of 10 % stops the trial first) and the last gradient norm is at or above "
        "both the first and the median of the run. Judged only there: a cross-entropy's gradient "
        "grows while the logits sharpen (healthy digits runs: 0.16-1.17x the first norm at 10 % of "
        "the initial loss, 0.03-0.28x at 1 %, measured)."
    ),
    hint=(
        "Near its minimum the loss's gradient should be small: the loss may have a term that does "
        "not vanish (a regularisation term, label noise within the batch), or the LR is so high that the "
        "optimizer bounces around the minimum."
    ),
    check=lambda t: (
        not_shrinking(t.result.losses, t.result.grad_norms)
        if t.result.reached_target or t.result.memorised
        else None
    ),
)


# ------------------------------------------------------------------ overfit_unstable
def overshot(losses: list[float]) -> list[PreflightFinding]:
    """``overfit_unstable`` (warning): the batch was learned, but on the way the loss rose above
    :data:`~lightning_gradguard.monitors.overfit.diagnosis.BLOW_UP` times its start: the LR overshoots,
    and the trial landed on the target anyway."""
    jump = blow_up(losses)
    if jump is None:
        return []
    return [
        PreflightFinding(
            OVERFIT_UNSTABLE,
            f"The batch was learned ({losses[0]:.4g} -> {losses[-1]:.4g} in {len(losses) - 1} "
            f"steps), but on the way the loss rose to {jump.loss:.4g} ({jump.ratio:.3g}x its start) at step "
            f"{jump.step}: the optimizer overshoots and bounced into the target.",
            {"initial_loss": losses[0], "peak_loss": jump.loss, "peak_step": float(jump.step)},
        )
    ]


OVERFIT_UNSTABLE: Rule[Outcome] = Rule(
    kind="overfit_unstable",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="OverfitBatchSanity: the loss rose far above its start before the batch was learned",
    when=(
        "the batch was learned, but on the way the loss rose above 1.5x its start: the LR "
        "overshoots and the trial bounced into the target. Healthy trials measured never rose above"
        " their first loss; too-high LRs rose 3-15x (measured, see [pre-flight "
        "checks](preflight.md#findings))."
    ),
    hint=(
        "Lower the learning rate (3-10x), or warm up to it: the check trains at the configured LR "
        "without warm-up or gradient clipping, on one batch. A run at this LR may blow up the same way "
        "(dead ReLUs, a loss stuck at chance)."
    ),
    check=lambda o: overshot(o.result.losses) if o.learned else None,  # learned, but did it blow up?
)

#: the rules about the trial's parameters, in the order they are judged and reported
PARAMETER_RULES: tuple[Rule[ParameterEvidence], ...] = declare(
    UNUSED_PARAMETER, PARAMETER_NOT_UPDATED, UPDATE_BELOW_PRECISION
)
#: the rules judged after the user's trial, in the order they are reported (after the parameter rules)
TRIAL_RULES: tuple[Rule[Trial], ...] = declare(INITIAL_LOSS_MISMATCH, GRADIENT_NOT_SHRINKING, BATCH_MIXING)
#: the rules of the trial's end: a batch learned after a blow-up, or not learned
OUTCOME_RULES: tuple[Rule[Outcome], ...] = declare(OVERFIT_UNSTABLE, OVERFIT_FAILED)
#: the rule of the batch drawn a second time
REFETCH_RULES: tuple[Rule[Refetched], ...] = declare(LABELS_UNSTABLE)
#: every kind this monitor reports
RULES = (
    OVERFIT_FAILED,
    UNUSED_PARAMETER,
    PARAMETER_NOT_UPDATED,
    UPDATE_BELOW_PRECISION,
    INITIAL_LOSS_MISMATCH,
    BATCH_MIXING,
    LABELS_UNSTABLE,
    GRADIENT_NOT_SHRINKING,
    OVERFIT_UNSTABLE,
)


def parameter_findings(
    optimizer: torch.optim.Optimizer, record: ParameterRecord, ignore: list[str]
) -> list[Finding]:
    """The parameters that got no gradient (``unused_parameter``) or never moved although they had one:
    not updated (``parameter_not_updated``), or updated by less than their dtype resolves
    (``update_below_precision``); names matching an ``fnmatch`` pattern of ``ignore`` are left out."""
    return judge(PARAMETER_RULES, ParameterEvidence(optimizer, record, ignore))
