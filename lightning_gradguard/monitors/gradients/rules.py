"""GradientNormLogger's rules: one declaration per rule (its kind, summary, docs row and the check itself).

The clipping rules judge the statistics of the recent pre-clip norms
(:func:`~lightning_gradguard.functional.clipping.clip_window_stats`): a ``gradient_clip_val`` that clips
nearly every step, or never comes near a norm of a full window (their evidence: a :class:`ClipWindow`).
The update-ratio rule (its evidence: a :class:`RatioCheck`): once the total update/weight ratio of the
logging steps has stayed above the ceiling long enough (its check asks
:class:`~lightning_gradguard.monitors.gradients.ratio.RatioWatch`), it names the optimizer's learning
rate, or its weight decay when ``lr * weight_decay`` alone is half
the ratio or more (AdamW with a decay far too strong: the update is mostly the decay's shrinking, and
lowering the LR would not be the fix). A check returns the :class:`~lightning_gradguard.alerts.Finding`
that holds (or ``None``); the callback runs them from their declarations (``run_rules``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.core.progress import LossProgress
from lightning_gradguard.functional.clipping import ClipWindowStats
from lightning_gradguard.monitors.gradients.ratio import OptimizerSetting, RatioWatch, optimizer_setting
from lightning_gradguard.monitors.gradients.tags import GRAD_CLIP


@dataclass(frozen=True, kw_only=True)
class ClipWindow:
    """What the clipping rules judge: the statistics of the recent pre-clip norms and the clip's setting.

    Attributes:
        stats: the window's statistics (:func:`~lightning_gradguard.functional.clipping.clip_window_stats`).
        clip_val: the Trainer's ``gradient_clip_val``; ``norm_type`` 2.0 clips the norm, inf each value.
        window: ``clip_window``, the steps a full window holds.
        adaptive: the name of an adaptive optimizer (Adam and its family) the clipped gradient goes to.
    """

    stats: ClipWindowStats
    clip_val: float
    norm_type: float = 2.0
    window: int = 1000
    adaptive: str | None = None


def _clip_words(w: ClipWindow) -> tuple[str, str, dict[str, float]]:
    """What is clipped (``"norm"`` or ``"largest |g|"``), the setting in words, and the window's numbers."""
    s = w.stats
    what, by = ("norm", "") if w.norm_type == 2.0 else ("largest |g|", " (clipping by value)")
    data = {"fraction_clipped": s.fraction_clipped, "clip_val": w.clip_val, "steps": float(s.steps)}
    data.update({GRAD_CLIP.tag(name): x for name, x in s.metrics().items()})
    return what, f"gradient_clip_val={w.clip_val:g}{by}", data


# ------------------------------------------------------------------ clipping_always_active
def _always_active(w: ClipWindow) -> Finding | None:
    s, adaptive = w.stats, w.adaptive
    n, fraction, suggested = s.steps, s.fraction_clipped, s.suggested
    if not (n >= min(100, w.window) and fraction >= 0.95 and suggested is not None):
        return None
    what, setting, data = _clip_words(w)
    message = (
        f"{setting} clipped {fraction:.0%} of the last {n} steps (median pre-clip {what} "
        f"{s.percentiles[50]:.3g})."
    )
    if adaptive is not None:
        hint = (
            f"{adaptive} divides each step by the gradient's running size, so clipping every step does "
            "not slow it: it normalises the gradient and weighs the steps alike. To clip only the "
            f"outliers, try gradient_clip_val={suggested:g} (90th percentile of recent values)."
        )
        return Finding(CLIPPING_ALWAYS_ACTIVE, message, data, hint=hint, severity="info")
    hint = (
        f"The threshold is below the typical gradient {what}, which slows learning. Clip only the "
        f"outliers: try gradient_clip_val={suggested:g} (90th percentile of recent values)."
    )
    return Finding(CLIPPING_ALWAYS_ACTIVE, message, data, hint=hint)


CLIPPING_ALWAYS_ACTIVE: Rule[ClipWindow] = Rule(
    kind="clipping_always_active",
    severity="warning",
    monitor="GradientNormLogger",
    also=("info",),
    summary="gradient clipping fired on nearly every step: the threshold is too low",
    when=(
        "with `gradient_clip_val` set, at least 95 % of the last `clip_window` steps were clipped "
        "(checked once `min(100, clip_window)` steps were seen). The hint proposes the 90th "
        "percentile of recent pre-clip norms as the new threshold. Under an adaptive optimizer "
        "(Adam and its family) it is an `info` line: their step does not scale with the gradient, "
        "so a clip on every step (the usual `gradient_clip_val=1` of a small transformer) does not "
        "slow them."
    ),
    check=_always_active,
)


# ------------------------------------------------------------------ clipping_never_active
def _never_active(w: ClipWindow) -> Finding | None:
    s = w.stats
    n, suggested = s.steps, s.suggested
    if not (n >= w.window and s.fraction_clipped == 0.0 and s.largest < w.clip_val / 10):
        return None
    what, setting, data = _clip_words(w)
    message = f"{setting} never fired in {n} steps; the largest pre-clip {what} was {s.largest:.3g}."
    if suggested is None:
        hint = (
            f"Every pre-clip {what} of the window was exactly 0: no parameter of this optimizer got a "
            "gradient, so nothing learns. Check that the loss depends on the parameters (a "
            "`.detach()`, `torch.no_grad()`, a zero loss weight); OverfitBatchSanity names them."
        )
    else:
        hint = f"Clipping guards nothing at this level. To catch spikes, use about {suggested:g}."
    return Finding(CLIPPING_NEVER_ACTIVE, message, data, hint=hint)


CLIPPING_NEVER_ACTIVE: Rule[ClipWindow] = Rule(
    kind="clipping_never_active",
    severity="info",
    monitor="GradientNormLogger",
    summary="gradient clipping never fired: the threshold is far above every norm seen",
    when=(
        "a full window of `clip_window` steps (default 1000) without a single clip, and the largest"
        " norm below a tenth of `gradient_clip_val`: clipping guards nothing. When every norm of "
        "the window was exactly 0, the hint says that no parameter got a gradient."
    ),
    check=_never_active,
)


# ------------------------------------------------------------------ update_ratio_high
#: the top of the band the healthy runs sat in after their first 20 steps: what a suggested lr aims at
_HEALTHY_TOP = 1e-2
#: the weight decay is named instead of the LR when ``lr * weight_decay`` is at least this share of the
#: lowest ratio seen (a decay that removes half of what moves is the cause, not a side effect)
DECAY_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class RatioCheck:
    """What the update-ratio rule judges on a logging step: the total ratio, its ceiling, what the rule
    remembers (``watch``), the loss's progress and the optimizer whose setting it names."""

    watch: RatioWatch
    step: int
    ratio: float
    ceiling: float
    optimizer: Any
    progress: LossProgress | None = None


def _ratio_high(ev: RatioCheck) -> Finding | None:
    """The ratio noted; its words once it has stayed high long enough (a high ratio that the loss follows
    down is a fast learner, not an LR too high: :class:`RatioWatch`)."""
    if not ev.watch.check(ev.step, ev.ratio, ev.ceiling, ev.progress):
        return None
    return ratio_finding(ev.watch, ev.step, ev.ceiling, ev.optimizer)


def ratio_finding(watch: RatioWatch, step: int, ceiling: float, optimizer: Any) -> Finding:
    """The check's words once the ratio has stayed above ``ceiling`` long enough (``watch.check`` said so at
    ``step``; a logging step whose ratio is not judged high costs no more call): the learning rate of
    ``optimizer`` named; its weight decay instead when the decay alone removes most of that ratio each
    step."""
    setting = optimizer_setting(optimizer)
    if setting.decay >= DECAY_SHARE * watch.lowest:
        return _decay_finding(watch, step, ceiling, setting)
    unbounded = setting.betas is not None and setting.betas[1] <= setting.betas[0] ** 2
    cause = (
        "Adam's beta2 is far too small (beta2 <= beta1^2: its step has no bound), or the lr too high"
        if unbounded
        else "The learning rate is likely too high"
    )
    message = (
        f"The update/weight ratio ||delta w|| / ||w|| over all trainable parameters stayed above {ceiling:g} "
        f"on {watch.count} checks in a row (steps {watch.first}-{step}; latest {watch.last:.3g}, lowest "
        f"{watch.lowest:.3g}): {watch.lowest / 1e-3:.0f}x the ~1e-3 of a healthy layer (CS231n), so every "
        f"step rewrites about {watch.lowest:.1%} of the weights. {cause}: {setting}."
    )
    factor = watch.lowest / _HEALTHY_TOP
    lr = max(setting.lrs) if setting.lrs else math.nan
    hint = (
        f"Lower the learning rate about {factor:.2g}x (the ratio grows with it: try lr={lr / factor:.2g}), "
        "or warm it up; LRFinderPlus measures a good one. Healthy runs sat at 2e-3 to 2e-2 after their "
        "first 20 steps."
    )
    if unbounded:
        hint += (
            " Here beta2 <= beta1^2: Adam's own step has no bound, so raise beta2 first (OptimizerMonitor "
            "reports it as adam_step_too_large)."
        )
    return Finding(UPDATE_RATIO_HIGH, message, {**_ratio_data(watch, ceiling), "lr": lr}, hint=hint)


def _decay_finding(watch: RatioWatch, step: int, ceiling: float, setting: OptimizerSetting) -> Finding:
    """The ratio is the weight decay's doing: it removes ``lr * weight_decay`` of every weight a step."""
    message = (
        f"The update/weight ratio ||delta w|| / ||w|| over all trainable parameters stayed above {ceiling:g} "
        f"on {watch.count} checks in a row (steps {watch.first}-{step}; latest {watch.last:.3g}, lowest "
        f"{watch.lowest:.3g}), and the weight decay alone accounts for most of it: {setting} removes "
        f"lr * weight_decay = {setting.decay:.3g} of every weight each step (weight_decay="
        f"{setting.weight_decay:g}). The weight decay is far too strong for this learning rate."
    )
    usual = (
        "SGD's usual values are 1e-4 to 5e-4"
        if setting.name == "SGD"
        else f"{setting.name}'s usual values are 0.01-0.1 (1e-4 to 5e-4 is SGD's L2 scale)"
    )
    hint = (
        f"Lower weight_decay: {usual}, so that lr * weight_decay stays near 1e-4 or below. "
        "StallDetector's weight_decay_collapse says when the weights have shrunk."
    )
    data = {**_ratio_data(watch, ceiling), "decay_share": setting.decay}
    return Finding(UPDATE_RATIO_HIGH, message, data, hint=hint)


def _ratio_data(watch: RatioWatch, ceiling: float) -> dict[str, float]:
    return {
        "update_ratio": watch.last,
        "lowest": watch.lowest,
        "ceiling": ceiling,
        "checks": float(watch.count),
    }


UPDATE_RATIO_HIGH: Rule[RatioCheck] = Rule(
    kind="update_ratio_high",
    severity="warning",
    monitor="GradientNormLogger",
    summary="the update/weight ratio stayed far above ~1e-3: LR too high (GradientNormLogger)",
    when=(
        "the total update/weight ratio stayed above `max_update_ratio` (0.03, 30x the ~1e-3 of "
        "CS231n) on 3 logging checks in a row spanning 20 steps or more, from step 20 on, while the "
        "loss (the median of the last three logging steps') is not a tenth below the run's first: a "
        "high ratio at which the run learns is a fast learner's (a BatchNorm CNN at SGD 0.5, whose "
        "loss falls faster than at 0.05; a pick of LRFinderPlus's search); names the"
        " learning rate and suggests one (the weight decay instead, when `lr · weight_decay` alone "
        "is half the ratio or more). Measured: healthy digits runs held at most 0.024 for 20 steps "
        "(0.020 without the fine-tuned head at Adam 1e-2: an LSTM at Adam 3e-3), SGD at 10x its lr "
        "0.04-0.055. Not for an optimizer that orthogonalizes most of the update (Muon: its step "
        "rewrites a few percent of each matrix by design; one INFO line says so). See [the learning-rate "
        "rule](optimizer.md#the-learning-rate-rule-gradientnormlogger)."
    ),
    check=_ratio_high,
)

#: the clipping rules, in the order they are judged (on a :class:`ClipWindow`)
CLIP_RULES: tuple[Rule[ClipWindow], ...] = declare(CLIPPING_ALWAYS_ACTIVE, CLIPPING_NEVER_ACTIVE)
#: the update-ratio rule (on a :class:`RatioCheck`)
RATIO_RULES: tuple[Rule[RatioCheck], ...] = declare(UPDATE_RATIO_HIGH)
#: every rule of this monitor
RULES = (*CLIP_RULES, *RATIO_RULES)
