"""LossSpikeGuard's rules: what makes a step a spike, escalation, rollback points, and one declaration
per alert kind with its check right above it.

:func:`step_verdict` says whether a step's scores make it a spike (a gradient-norm spike counts only when
the loss confirms it, :data:`LOSS_CONFIRMS_Z`); :func:`escalated_action` is how a run of spikes climbs
``skip -> rollback -> raise``; :func:`snapshot_due` says when a rollback point is taken. A rule's check
reads its evidence (a :class:`Spiked` step, a :class:`Diverged` start) and puts what was found into words,
as the :class:`~lightning_gradguard.alerts.Finding` of its declaration: :func:`spike_finding` a spike (with
:data:`SPIKE_HINTS`), :func:`outlier_finding` a batch whose statistics are far out
(:func:`batch_variance_outlier`), :func:`early_finding` an early divergence (its rule is
:class:`~lightning_gradguard.monitors.spike.early.EarlyWatch`). The callback runs them from
:data:`STEP_RULES` and :data:`EARLY_RULES` (``run_rules``). Whether one value is a spike is the pure
score of :mod:`lightning_gradguard.functional.spikes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.functional.spikes import SpikeScore, is_spike, start_level
from lightning_gradguard.monitors.spike.early import SUSTAIN_STEPS

#: a gradient-norm spike is acted on only when the step's loss is at least this robust z-score above its
#: recent median (or when the loss is not judged). Healthy gradient-norm excursions came with losses of z
#: -69 to +1.5 (a deep net escaping a plateau: the norm 5-13x its median, z 6-10, while the loss fell;
#: transformers after warm-up: 2-2.7x, z 4-5.5, the loss falling): docs/loss_spike.md.
LOSS_CONFIRMS_Z = 2.0


def step_verdict(
    scores: dict[str, SpikeScore], thresholds: dict[str, float | None], min_ratio: float
) -> Literal["spike", "excursion", "calm"]:
    """What a step whose judged values scored ``scores`` is, once the windows are warm.

    ``"spike"``: the loss spiked; or the gradient norm did while the loss is not judged, or is
    :data:`LOSS_CONFIRMS_Z` or more above its median. ``"excursion"``: the gradient norm spiked and the loss
    did not confirm it; a large gradient with an ordinary or falling loss (a model leaving a plateau, a
    transformer waking up after warm-up) is no reason to drop the update. ``"calm"``: neither.
    """
    loss, norm = scores.get("loss"), scores.get("grad_norm")
    if loss is not None and is_spike(loss, thresholds["loss"] or 0.0, min_ratio):
        return "spike"
    if norm is None or not is_spike(norm, thresholds["grad_norm"] or 0.0, min_ratio):
        return "calm"
    return "spike" if loss is None or loss.zscore >= LOSS_CONFIRMS_Z else "excursion"


#: what a run of spikes escalates through, mildest first ("warn" never escalates)
ESCALATION = ("skip", "rollback", "raise")


def escalated_action(action: str, streak: int, patience: int, can_roll_back: bool) -> str:
    """What the ``streak``-th consecutive spike gets when the configured action is ``action``.

    Every ``patience`` consecutive spikes move one rung up ``skip -> rollback -> raise`` (``rollback`` is
    passed over when no snapshot can be restored), so a real divergence is not skipped forever: with
    ``patience=3`` and ``action="skip"`` spikes 1-3 are skipped, 4-6 rolled back, the 7th raises.
    """
    if action == "warn":
        return "warn"
    ladder = [a for a in ESCALATION if can_roll_back or a != "rollback"]
    start = ladder.index(action) if action in ladder else ladder.index("skip")
    return ladder[min(start + (max(streak, 1) - 1) // patience, len(ladder) - 1)]


def snapshot_due(
    judged: int, warmup: int, every: int, streak: int, calm: int, probation: bool, have: bool = True
) -> bool:
    """Whether a rollback point is taken after the ``judged``-th judged step (a calm one).

    At the end of the warm-up, then every ``every`` judged steps while no spike streak runs; at once when
    there is none (``have=False``: a resumed run, whose snapshot was not in the checkpoint). After a
    rollback (``probation``) the old point is kept until the run has had ``every`` healthy steps in a
    row (``calm``): the rollback held, and the streak of spikes behind it ends with the new point.
    """
    if not every or not judged:
        return False
    if probation:
        return calm >= every
    return not streak and (judged == warmup or judged % every == 0 or (not have and judged >= warmup))


SPIKE_HINTS = {
    "warn": "The update was applied. If spikes recur, use action='skip' or 'rollback'.",
    "skip": "The update of this step was dropped (optimizer state untouched); training goes on.",
    "rollback": "Weights, optimizer, scheduler and RNG went back to the last snapshot; the data moves on.",
    "raise": "Spikes kept coming past every recovery: lower the learning rate, clip gradients "
    "(gradient_clip_val), check the data around the recorded batches, or restart from an earlier checkpoint.",
}


def batch_variance_outlier(value: float | None, limit: float | None) -> bool:
    """Whether a BatchNorm layer's batch variance was ``limit`` times over (or under) its running variance."""
    return value is not None and limit is not None and max(value, 1 / max(value, 1e-300)) > limit


@dataclass(frozen=True, kw_only=True)
class Spiked:
    """A step that got an action: its verdict (``"spike"``, or a batch far out), the action its streak
    escalated to, its judged values (and the batch statistics far out), their scores, its place in the
    streak."""

    step: int
    spike: bool
    action: str
    values: dict[str, float]
    scores: dict[str, SpikeScore]
    streak: int


@dataclass(frozen=True, kw_only=True)
class Diverged:
    """The early-divergence watch fired: the step, the run's first losses, the loss now, the factor of the
    start it stood at, the learning rate of param group 0."""

    step: int
    first: list[float]
    loss: float
    factor: float
    lr: float | None


def _times(factor: float) -> str:
    """``"1e+06x over"`` / ``"100x under"``."""
    return f"{factor:.3g}x over" if factor >= 1 else f"{1 / max(factor, 1e-300):.3g}x under"


def _step_finding(
    rule: Rule[Any],
    what: str,
    parts: list[str],
    zscores: dict[str, float],
    *,
    step: int,
    action: str,
    values: dict[str, float],
    streak: int,
) -> Finding:
    """The words of a step that got ``action`` (a spike, or a batch far out): ``what`` it was and the
    ``parts`` seen (the judged values' ``zscores`` lead its data), the batch's statistics that were far
    out, the streak; an error when it raises."""
    if "batch_variance" in values:
        parts.append(
            f"a BatchNorm layer's batch variance is {_times(values['batch_variance'])} its running one"
        )
    if "inputs" in values:
        parts.append(f"the batch's inputs have {_times(values['inputs'])} the mean square of recent batches'")
    run = f"; {streak} spikes in a row" if streak > 1 else ""
    hint = SPIKE_HINTS[action]
    if "batch_variance" in values or "inputs" in values:
        hint += " Batch statistics this far off usually mean corrupt data: check the batch's inputs."
    data = zscores | {"streak": float(streak)}
    data |= {f"{k}_factor": values[k] for k in ("batch_variance", "inputs") if k in values}
    return Finding(
        rule,
        f"{what} at step {step}: " + "; ".join(parts) + f"{run}. Action: {action}.",
        data,
        hint=hint,
        severity="error" if action == "raise" else "warning",
    )


# ---------------------------------------------------------------- loss_spike
def spike_finding(
    *, step: int, action: str, values: dict[str, float], scores: dict[str, SpikeScore], streak: int
) -> Finding:
    """The alert of the ``streak``-th spike in a row (:func:`step_verdict`), at ``step``, that got ``action``:
    each judged value against its recent median; it names no place (the whole step is concerned)."""
    parts = [
        f"{k.replace('_', ' ')} {values[k]:.4g} is {s.ratio:.3g}x the recent median {s.level:.4g} "
        f"(robust z-score {s.zscore:.1f})"
        for k, s in scores.items()
    ]
    zscores = {f"{k}_zscore": s.zscore for k, s in scores.items()}
    return _step_finding(
        LOSS_SPIKE, "Spike", parts, zscores, step=step, action=action, values=values, streak=streak
    )


LOSS_SPIKE: Rule[Spiked] = Rule(
    kind="loss_spike",
    severity="warning",
    monitor="LossSpikeGuard",
    also=("error",),
    summary="LossSpikeGuard: a step's loss or gradient norm spiked far above the recent steps",
    when=(
        "a step's loss or total gradient norm reached its robust z-score threshold (and `min_ratio`"
        " times the recent median) before the update; the message gives both numbers and the action"
        " taken (warning for warn / skip / rollback, error when spikes kept coming until it raised "
        "`LossSpikeError`). See [LossSpikeGuard](loss_spike.md)."
    ),
    check=lambda ev: (
        spike_finding(step=ev.step, action=ev.action, values=ev.values, scores=ev.scores, streak=ev.streak)
        if ev.spike
        else None
    ),
)


# ---------------------------------------------------------------- early_divergence
def early_finding(*, step: int, first: list[float], loss: float, factor: float, lr: float | None) -> Finding:
    """The alert of an early divergence (:class:`~lightning_gradguard.monitors.spike.early.EarlyWatch`
    fired): the loss at ``step`` stood at ``factor`` starts or more for
    :data:`~lightning_gradguard.monitors.spike.early.SUSTAIN_STEPS` judged steps; ``first`` are the run's
    first losses, ``lr`` group 0's rate."""
    start = start_level(first)
    now = start.factor(loss)
    if start.level > 0 and start.scale == start.level:  # a ratio reads as one
        rise = f"{now:.3g}x the start"
    else:  # a difference, counted in the same unit as the factor
        unit = "the start's magnitude" if start.scale == abs(start.level) else "the first losses' spread"
        rise = f"up by {loss - start.level:.4g}: {now:.3g} starts, a start being {start.scale:.3g}, {unit}"
    rate = f"the learning rate (param group 0: {lr:.3g})" if lr is not None else "the learning rate"
    message = (
        f"Early divergence at step {step}: the loss started at {start.level:.4g} (median of the first "
        f"{len(first)} steps) and is {loss:.4g} now ({rise}); the last {SUSTAIN_STEPS} steps all lay at "
        f"{factor:g} starts or more. The likely cause: {rate} or another optimizer setting (momentum, betas, "
        "eps) is too aggressive for this model."
    )
    data = {"start": start.level, "loss": loss, "factor": now, "steps": float(SUSTAIN_STEPS)}
    if lr is not None:
        data["lr"] = lr
    return Finding(EARLY_DIVERGENCE, message, data)


EARLY_DIVERGENCE: Rule[Diverged] = Rule(
    kind="early_divergence",
    severity="error",
    monitor="LossSpikeGuard",
    summary="LossSpikeGuard: in the first steps the loss climbed and stayed far above its start",
    when=(
        "while the spike windows warm up (the first `warmup_steps`, 50), 5 judged losses in a row "
        "stood at `early_divergence_factor` (6) times the run's start (the median of its first 3 "
        "losses; a difference in units of the start's magnitude when the loss is at or below zero)."
        " Measured: healthy starts stayed at or below 3.2x, far too high learning rates got there "
        "by steps 7-31 (`benchmarks/spike_healthy.py`). The message gives the start, the loss, the "
        'step and the LR of param group 0; reported once; nothing is skipped, `action="raise"` '
        "raises `LossSpikeError`. See [LossSpikeGuard](loss_spike.md#early-divergence)."
    ),
    hint=(
        "Lower the learning rate (3-10x), add a warm-up, or clip gradients (gradient_clip_val); LRFinderPlus "
        "finds a rate that trains. No update was skipped: this early there is no good state to go back to "
        "(action='raise' stops the run here)."
    ),
    check=lambda ev: early_finding(step=ev.step, first=ev.first, loss=ev.loss, factor=ev.factor, lr=ev.lr),
)


# ---------------------------------------------------------------- batch_statistics_outlier
def outlier_finding(*, step: int, action: str, values: dict[str, float], streak: int) -> Finding:
    """The alert of a step whose batch statistics were far out (:func:`batch_variance_outlier`) while its
    loss and gradient norm did not spike (BatchNorm normalises a batch x1000 away in training mode, so the
    loss may not move at all), at ``step``, that got ``action`` as the ``streak``-th in a row."""
    parts = [f"loss {values['loss']:.4g}"] if "loss" in values else []
    what = "Batch far outside the run's statistics"
    return _step_finding(
        BATCH_STATISTICS_OUTLIER, what, parts, {}, step=step, action=action, values=values, streak=streak
    )


BATCH_STATISTICS_OUTLIER: Rule[Spiked] = Rule(
    kind="batch_statistics_outlier",
    severity="warning",
    monitor="LossSpikeGuard",
    also=("error",),
    summary="LossSpikeGuard: a batch's BatchNorm variance was far off the running one",
    when=(
        "some BatchNorm layer's batch variance (read back from its running update, averaged over "
        "its channels) was more than `batch_variance_factor` (100) times over or under the running "
        "variance the run has built, judged once the running statistics hold the run's data (step "
        "30 at momentum 0.1); or the mean square of the batch's floating inputs was that many times"
        " over or under the median of the recent accepted steps' (from 8 of them on). A corrupt "
        "batch (inputs x1000) that BatchNorm or an input LayerNorm normalises away in the loss. The"
        " step gets the action like a spike (skip by default, with the buffers its forward wrote "
        "put back). See [LossSpikeGuard](loss_spike.md#what-is-judged-and-when). An error when it "
        'raises (`action="raise"`).'
    ),
    check=lambda ev: (
        None
        if ev.spike
        else outlier_finding(step=ev.step, action=ev.action, values=ev.values, streak=ev.streak)
    ),
)

#: the rules of a step that got an action, in the order they are judged (on a :class:`Spiked`)
STEP_RULES: tuple[Rule[Spiked], ...] = declare(LOSS_SPIKE, BATCH_STATISTICS_OUTLIER)
#: the rule of the early-divergence watch (on a :class:`Diverged`)
EARLY_RULES: tuple[Rule[Diverged], ...] = declare(EARLY_DIVERGENCE)
#: every kind this monitor reports
RULES = (LOSS_SPIKE, EARLY_DIVERGENCE, BATCH_STATISTICS_OUTLIER)
