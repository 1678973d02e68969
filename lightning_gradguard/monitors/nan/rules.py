"""NaNSentinel's rules: the verdict of a step's flags, and one declaration per alert kind with its check.

:func:`decide` turns the :class:`~lightning_gradguard.monitors.nan.measure.Flags` of a step (or
micro-batch) into a :class:`Verdict`, a pure function of them and the skip counters: the
:class:`Detection`, if any (the rule that holds, the culprit rank and micro-batch: what the failure path,
:mod:`~lightning_gradguard.monitors.nan.report`, reports), and the skip counters the step implies. The
alert is worded once the forensic report is gathered (the replay names where the value was born): a
rule's check takes the :class:`~lightning_gradguard.monitors.nan.measure.NaNReport` and returns its
:class:`~lightning_gradguard.alerts.Finding` when the report is its rule's (the callback runs :data:`RULES`;
:func:`finding_of` gives the words for the error); a rule's own hint is in its
declaration, sharpened by the origin when the replay found one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.monitors.nan.measure import Flags, MicroBatch, NaNReport, SkipCounters

#: the non-finite tensors a message names, at most
_MAX_LISTED = 10


@dataclass(frozen=True)
class Detection:
    """What a verdict found, before its words: the rule that holds, the culprit rank, the micro-batch, and
    the step's optimizer.

    ``culprit`` ``None``: the gradients are all-reduced, the report is of the first rank whose replay finds
    an origin. ``optimizer`` is ``None`` for a micro-batch judged under accumulation.
    """

    rule: Rule[NaNReport]
    culprit: int | None
    micro: MicroBatch
    optimizer: Any = None
    can_replay: bool = True
    #: the GradScaler's scale, for a finding under 16-mixed
    scale: float | None = None


@dataclass(frozen=True)
class Verdict:
    """What the flags of a step (or micro-batch) imply: a detection, if any, and the skip counters after."""

    detection: Detection | None
    counters: SkipCounters


def _finding(r: NaNReport, what: str, general: str = "", label: str = "gradients") -> Finding:
    """The alert of report ``r``: ``what`` was found, the micro-batches, the non-finite tensors (named
    ``label``), the origin and the GradScaler; the hint ``general`` (default: the rule's), sharpened by
    where the value was born when the replay found it."""
    among = r.micro_batches
    batch = f"batch {r.batch_idx}" if not among else f"micro-batches {among[0]}-{among[-1]}"
    parts = [f"{r.rule.kind} at step {r.step} (rank {r.rank}, {batch}): {what}."]
    if among:
        if r.losses_checked:
            parts.append("Every loss of the step's micro-batches was finite.")
        parts.append(
            "Which micro-batch's backward made the gradients non-finite is not known "
            "(NaNSentinel(check_micro_batches=True) names it)."
        )
    bad = r.nonfinite_parameters
    if bad:
        listed = ", ".join(f"{b.name} ({b.nonfinite}/{b.numel})" for b in bad[:_MAX_LISTED])
        more = f" and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
        parts.append(f"Non-finite {label}, in model order: {listed}{more}.")
    if r.origin:
        parts.append(f"Origin: {r.origin['description']}.")
    if r.grad_scaler:
        gs = r.grad_scaler
        parts.append(f"Scale {gs.scale:g}, {gs.consecutive} consecutive skips, {gs.skipped_steps} in all.")
    data = {"step": float(r.step), "rank": float(r.rank)}
    hint = _origin_hint(r.origin, general or r.rule.hint)
    return Finding(r.rule, " ".join(parts), data, hint=hint, where=_where(r))


def _where(r: NaNReport) -> str | None:
    """The place an alert names: the origin's module or op, else the first non-finite tensor."""
    origin = r.origin or {}
    if origin.get("module") is not None and origin.get("phase") == "forward":
        return str(origin["module"]) or "<root>"
    if origin.get("op"):
        return str(origin["op"])
    return r.nonfinite_parameters[0].name if r.nonfinite_parameters else None


def _origin_hint(origin: dict[str, Any] | None, general: str) -> str:
    """Advice for what was found (``general``), sharpened by where the value was born when the replay
    found it."""
    if origin and origin.get("phase") == "forward":
        return _forward_hint(origin, general.split(". ", 1)[-1])
    if origin and origin.get("phase") == "backward":
        return (
            f"The forward pass was finite; the backward of `{origin.get('op')}` made the first NaN/inf. "
            "Derivatives of sqrt/pow/log/div blow up at 0: add eps or clamp the input there."
        )
    return general


def _forward_hint(origin: dict[str, Any], general: str) -> str:
    """The advice when the forward replay found where the value was born (``origin``: its dict)."""
    module, guard = f"`{origin.get('module')}`", "guard its divisions, logs and sqrt (add eps, clamp)"
    if origin.get("in_input") and origin.get("inputs_finite"):
        return (
            f"The batch was finite but the input of {module} was not: the code of the step before it "
            "(training_step, or the forward that calls it) made NaN/inf: guard the divisions, logs and sqrt "
            "there (add eps, clamp)."
        )
    if origin.get("in_input"):
        return (
            "The batch itself holds NaN/inf (it entered the model that way): inspect the saved batch.pt "
            "and the data pipeline (missing values, division in preprocessing, corrupt samples); filter "
            "or impute them."
        )
    if origin.get("root"):  # the model's own code, not one of its submodules
        code = "step code (training_step)" if origin.get("in_step") else "forward"
        module = f"{module}'s own {code}, outside its submodules,"
    return (
        f"{module} turned finite inputs into NaN/inf: {guard}, compute softmax/log-softmax stably, and "
        f"check its parameters' scale. {general}"
    )


# ------------------------------------------------------------------ nonfinite_loss
def _nonfinite_loss(r: NaNReport) -> Finding | None:
    if r.rule is not NONFINITE_LOSS:  # the verdict (:func:`decide`) named another rule
        return None
    return _finding(r, f"the loss is {r.loss}")


NONFINITE_LOSS: Rule[NaNReport] = Rule(
    kind="nonfinite_loss",
    severity="critical",
    monitor="NaNSentinel",
    summary="the loss was NaN/inf before backward (NaNSentinel)",
    when=(
        "the loss of a micro-batch was NaN/inf before backward. The run fails before the optimizer "
        "step (see [NaNSentinel](nan_sentinel.md))."
    ),
    hint=(
        "Check the batch for NaN/inf (data pipeline, bad labels), then the loss: use log-softmax / "
        "cross_entropy on logits instead of log(softmax), clamp before log/sqrt/division, add eps to "
        "normalisers. If the loss grew until it overflowed, lower the learning rate and clip gradients "
        "(gradient_clip_val=1.0)."
    ),
    check=_nonfinite_loss,
)


# ------------------------------------------------------------------ nonfinite_gradient
def _nonfinite_gradient(r: NaNReport) -> Finding | None:
    if r.rule is not NONFINITE_GRADIENT:  # the verdict (:func:`decide`) named another rule
        return None
    # the loss went unchecked (check_loss=False): never claim it was finite
    unchecked = r.loss is not None and not math.isfinite(r.loss)
    return _finding(r, "gradients hold NaN/inf", NONFINITE_LOSS.hint if unchecked else "")


NONFINITE_GRADIENT: Rule[NaNReport] = Rule(
    kind="nonfinite_gradient",
    severity="critical",
    monitor="NaNSentinel",
    summary="a gradient held NaN/inf before the optimizer step (NaNSentinel)",
    when=(
        "a gradient held NaN/inf before the optimizer step while the loss was finite "
        "(and no GradScaler was active)."
    ),
    hint=(
        "The loss was finite, so a backward op overflowed or divided by zero: look at the named op "
        "(sqrt/pow/div/log at 0 are the usual suspects; add eps or clamp). Exploding gradients: clip "
        "them (gradient_clip_val=1.0) and lower the learning rate."
    ),
    check=_nonfinite_gradient,
)


# ------------------------------------------------------------------ nonfinite_parameter
def _nonfinite_parameter(r: NaNReport) -> Finding | None:
    if r.rule is not NONFINITE_PARAMETER:  # the verdict (:func:`decide`) named another rule
        return None
    return _finding(r, "parameters hold NaN/inf after the update", label="parameters")


NONFINITE_PARAMETER: Rule[NaNReport] = Rule(
    kind="nonfinite_parameter",
    severity="critical",
    monitor="NaNSentinel",
    summary="a parameter held NaN/inf after an optimizer step (NaNSentinel)",
    when="with `check_parameters_every_n_steps`, a weight held NaN/inf after the update.",
    hint=(
        "An update wrote NaN/inf into the weights: lower the learning rate, clip gradients, and enable "
        "check_gradients so the next occurrence is caught before the update."
    ),
    check=_nonfinite_parameter,
)


# ------------------------------------------------------------------ loss_scale_collapse
def _loss_scale_collapse(r: NaNReport) -> Finding | None:
    if r.rule is not LOSS_SCALE_COLLAPSE:  # the verdict (:func:`decide`) named another rule
        return None
    return _finding(r, "the GradScaler keeps skipping steps")


LOSS_SCALE_COLLAPSE: Rule[NaNReport] = Rule(
    kind="loss_scale_collapse",
    severity="error",
    monitor="NaNSentinel",
    summary="the 16-mixed GradScaler scale fell below its floor or kept skipping",
    when=(
        "16-mixed: the GradScaler scale fell below `loss_scale_floor` or `max_consecutive_skips` "
        "steps in a row were skipped."
    ),
    hint=(
        "16-mixed keeps overflowing: something produces values beyond fp16's range. Use bf16-mixed if the "
        "hardware supports it, keep softmax/normalisation/loss in float32, lower the learning rate, or "
        "clip gradients."
    ),
    check=_loss_scale_collapse,
)

#: every kind this monitor reports; a check words the report of its own rule (the one :func:`decide` named)
RULES: tuple[Rule[NaNReport], ...] = declare(
    NONFINITE_LOSS, NONFINITE_GRADIENT, NONFINITE_PARAMETER, LOSS_SCALE_COLLAPSE
)


def finding_of(report: NaNReport) -> Finding:
    """The alert of ``report``, in its rule's words (its check, run from :data:`RULES` as
    ``NaNSentinel`` runs them): the error's message."""
    (found,) = [f for rule in RULES for f in rule.findings(report)]
    return found


def decide(
    flags: Flags,
    *,
    current: MicroBatch,
    previous: MicroBatch | None,
    optimizer: Any,
    counters: SkipCounters,
    loss_scale_floor: float,
    max_consecutive_skips: int,
) -> Verdict:
    """The verdict of ``flags`` (reduced across ranks, read once: the same on every rank); changes nothing.

    ``optimizer`` is ``None`` for a micro-batch judged under accumulation (``on_before_backward``); there
    ``flags.earlier_ranks`` says whether the gradients summed over the step's earlier micro-batches are
    non-finite, which names ``previous`` (the micro-batch just before ``current``) as the culprit.
    ``counters`` are the skip counters before the step; the verdict holds them after it.
    """
    if flags.earlier_ranks and previous is not None:  # the first poisoned micro-batch is the previous one
        found = Detection(NONFINITE_GRADIENT, culprit=flags.earlier_ranks[0], micro=previous)
        return Verdict(detection=found, counters=counters)
    if flags.loss_ranks:
        found = Detection(NONFINITE_LOSS, culprit=flags.loss_ranks[0], micro=current, optimizer=optimizer)
        return Verdict(detection=found, counters=counters)
    if flags.scale is not None:  # a GradScaler is active: non-finite gradients mean "skip this step"
        after, scale = counters.after(flags.grads_bad), flags.scale
        if scale < loss_scale_floor or after.consecutive_skips >= max_consecutive_skips:
            found = Detection(LOSS_SCALE_COLLAPSE, culprit=0, micro=current, optimizer=optimizer, scale=scale)
            return Verdict(detection=found, counters=after)
        return Verdict(detection=None, counters=after)
    if flags.grads_bad and optimizer is not None:
        found = Detection(NONFINITE_GRADIENT, culprit=None, micro=current, optimizer=optimizer)
        return Verdict(detection=found, counters=counters)
    return Verdict(detection=None, counters=counters)
