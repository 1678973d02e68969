"""OptimizerMonitor's rules, one declaration each (its kind, docs row, constant hint and its check, right
above it): Adam's ``eps`` dominating its step, an update ratio far off, trainable parameters no optimizer
holds, an Adam step far above its learning rate.

Whether a layer is dominated by ``eps`` or an outlier is decided by
:func:`~lightning_gradguard.functional.optimizer_state.epsilon_dominated` and
:func:`~lightning_gradguard.functional.optimizer_state.ratio_outliers` over the callback's consecutive
checks, how large an Adam step may be by
:func:`~lightning_gradguard.functional.optimizer_state.adam_step_threshold`. A check reads a
:class:`Measured` (one check of an optimizer and what the rules remember: their streaks, the layers born
at zero) or, for the parameters no optimizer holds, an :class:`Orphans`, and returns the
:class:`~lightning_gradguard.alerts.Finding` (always a warning, one per layer where the rule names layers),
with the numbers and the setting to change. The callback runs them from :data:`STEP_RULES` and
:data:`HELD_RULES` (``run_rules``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.runstate import Streaks
from lightning_gradguard.functional.health import sizeable_share
from lightning_gradguard.functional.optimizer_state import (
    adam_step_threshold,
    epsilon_dominated,
    ratio_outliers,
)
from lightning_gradguard.monitors.optimizer.measure import AdamStep, OptimizerReading


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What the rules read on a check of one optimizer.

    Attributes:
        reading: what the check measured (its moments, update geometry, Adam steps).
        suffix: the optimizer's suffix (``""`` for the first), in the streaks' and cooldowns' keys.
        layers: the layers are compared with each other (a logging step, or past the dense start).
        selection: the layers watched (``include`` / ``exclude`` / ``max_layers``).
        epsilon_ratio, outlier_factor, max_adam_step, patience: the callback's thresholds.
        strikes: the consecutive checks per rule and layer (``"epsilon<suffix>"``, ``"outlier<suffix>"``).
        born_zero: per optimizer, the layers whose weights were exactly 0 before a step.
    """

    reading: OptimizerReading
    suffix: str
    layers: bool
    selection: LayerSelection
    epsilon_ratio: float
    outlier_factor: float
    max_adam_step: float
    patience: int
    strikes: dict[str, Streaks]
    born_zero: dict[str, set[str]]

    def strike(self, name: str, found: set[str]) -> dict[str, int]:
        """Consecutive checks per layer, for the layers ``found`` this time (the others start over)."""
        streaks = self.strikes.setdefault(name + self.suffix, Streaks())
        streaks.advance(found)
        return streaks.reached(self.patience)


@dataclass(frozen=True)
class Orphans:
    """Trainable parameters that got a gradient but that no optimizer holds (name -> entries), and the
    model's entries."""

    orphans: Mapping[str, int]
    total: int


def sizeable(found: Collection[str], checked: Collection[str], numels: Mapping[str, int]) -> bool:
    """Whether the layers ``found`` hold a sizeable share of the entries of the layers ``checked``
    (:func:`~lightning_gradguard.functional.health.sizeable_share`); without their sizes, yes (the rule
    judges as before)."""
    if not found:
        return False
    if not numels:
        return True
    return sizeable_share(sum(numels.get(k, 0) for k in found), sum(numels.get(k, 0) for k in checked))


def _epsilon(ev: Measured) -> list[Finding]:
    m = ev.reading.moments
    rms = ev.selection.keep(m.exp_avg_sq_rms)
    dominated = {k for k, v in rms.items() if epsilon_dominated(v, m.eps[k], ev.epsilon_ratio)}
    if not ev.layers and 2 * len(dominated) < len(rms):
        # the dense start judges eps as a setting, over most of the model (eps=0.1 dominates every
        # layer from step 0); a few layers whose gradient starts tiny (LayerScale's branches, ELECTRA's
        # first query and key) grow out of it within steps: they are judged on the logging steps
        dominated = set()
    if not sizeable(dominated, rms, m.entries):
        # a sliver whose gradient is tiny by design (Mamba's A_log, a router, a forget gate, a key
        # bias that softmax ignores) learns slowly while the model learns: the same share as
        # vanishing_gradient's under Adam, of the entries Adam holds (Muon may hold the rest)
        dominated = set()
    return [
        epsilon_finding(layer, rms[layer], m.eps[layer], n)
        for layer, n in ev.strike("epsilon", dominated).items()
    ]


# ------------------------------------------------------------------ adam_epsilon_dominates
def epsilon_finding(layer: str, rms: float, eps: float, checks: int) -> Finding:
    """``eps`` outweighs the typical ``sqrt(v_hat)`` of ``layer`` (RMS ``rms``) on ``checks`` checks."""
    return Finding(
        ADAM_EPSILON_DOMINATES,
        f"In layer {layer} Adam's eps ({eps:.3g}) outweighs the typical sqrt(v_hat) (RMS {rms:.3g}, "
        f"{eps / rms:.3g}x smaller) on {checks} consecutive checks: the denominator sqrt(v_hat) + eps is "
        f"mostly eps, so the layer's steps are about {rms / (rms + eps):.2g} of Adam's normalised step "
        "and it trains like SGD with momentum at lr / eps.",
        {"rms_sqrt_v_hat": rms, "eps": eps, "checks": float(checks)},
        where=layer,
    )


ADAM_EPSILON_DOMINATES: Rule[Measured] = Rule(
    kind="adam_epsilon_dominates",
    severity="warning",
    monitor="OptimizerMonitor",
    summary="Adam's eps outweighs a layer's typical sqrt(v_hat) (OptimizerMonitor)",
    when=(
        "a layer's RMS of sqrt(v_hat) (Adam family) stayed below `epsilon_ratio` × `eps` on "  # noqa: RUF001
        "`patience` consecutive checks: `eps` dominates the denominator and the layer's steps "
        "shrink; when such layers hold 5 % of the checked entries or more (a state-space layer's "
        "A_log, a router's gate are small by design). The hint: lower `eps` or fix the gradient's "
        "scale. See "
        "[OptimizerMonitor](optimizer.md)."
    ),
    hint=(
        "Its gradients are tiny (about the RMS above). Lower eps (1e-8 -> 1e-12 is safe with float32 "
        "optimizer states), or fix the gradient's scale: a loss that is divided down, a vanishing signal "
        "upstream (see grad_norm/<layer>)."
    ),
    check=_epsilon,
)


# ------------------------------------------------------------------ update_ratio_outlier
def _outliers(ev: Measured) -> list[Finding]:
    """The layers beyond ``outlier_factor`` of the median layer's ratio on ``patience`` checks in a row
    (judged when the layers are compared)."""
    if not ev.layers:
        return []
    reading = ev.reading
    graded = reading.graded
    ratios = {k: v for k, v in ev.selection.keep(reading.geometry.update_ratio).items() if k in graded}
    median, outliers = ratio_outliers(ratios, ev.outlier_factor)
    # a layer whose weights were exactly 0 (MultiheadAttention's in_proj_bias, LoRA's B) moves by ~1/t of
    # its norm at step t, whatever its lr: far above the median for its first steps, never an lr to blame
    born = ev.born_zero.setdefault(ev.suffix, set())
    born |= {k for k in graded if k not in reading.geometry.update_ratio}  # weight norm 0 before the step
    outliers = {k: x for k, x in outliers.items() if x < 1.0 or k not in born}
    slow = {k for k, x in outliers.items() if 0.0 < x < 1.0}
    if not sizeable(slow, ratios, reading.numels):
        # layers that move, only far slower than the median, on a sliver of the model: a gradient tiny
        # by design (a state-space layer's A_log, a router's gate) or weights large by design, not an
        # lr to blame; a layer that does not move at all (lr 0) and one far above are named whatever
        # their size
        outliers = {k: x for k, x in outliers.items() if k not in slow}
    return [
        outlier_finding(layer, ratios[layer], median, ev.outlier_factor, n)
        for layer, n in ev.strike("outlier", set(outliers)).items()
    ]


def outlier_finding(layer: str, ratio: float, median: float, factor: float, checks: int) -> Finding:
    """``layer``'s update/weight ``ratio`` is beyond ``factor`` from the ``median`` layer's."""
    x = ratio / median
    far = f"{x:.3g}x" if x > 1 else "0 times" if x == 0 else f"1/{1 / x:.3g} of"
    hint = (
        "Its param group's learning rate (or an lr multiplier) is too high for it, or its weights are "
        "near 0 (a zero-initialised layer early on). Check that group's lr; a per-layer trust ratio "
        "(LARS/LAMB) keeps layers in step."
        if x > 1
        else "The layer barely moves: its param group has lr 0 or a tiny lr (frozen by mistake?), weight "
        "decay cancels its update, or it is sparse (an embedding whose batches touch few rows: leave it "
        "out with exclude=...)."
    )
    return Finding(
        UPDATE_RATIO_OUTLIER,
        f"The update/weight ratio of layer {layer} is {ratio:.3g}, {far} the median layer's "
        f"({median:.3g}), beyond {factor:g}x on {checks} consecutive checks.",
        {"update_ratio": ratio, "median": median, "checks": float(checks)},
        hint=hint,
        where=layer,
    )


UPDATE_RATIO_OUTLIER: Rule[Measured] = Rule(
    kind="update_ratio_outlier",
    severity="warning",
    monitor="OptimizerMonitor",
    summary="a layer's update/weight ratio is far from the median layer's (OptimizerMonitor)",
    when=(
        "a layer's update/weight ratio stayed more than `outlier_factor` (300) times above or below"
        " the median layer's on `patience` consecutive checks (below it: when such layers, still "
        "moving, hold 5 % of the compared entries or more; a layer that does not move at all is "
        "named whatever its size); the hint names the likely cause (its"
        " param group's lr, a frozen-by-mistake layer, weight decay, a sparse layer)."
    ),
    check=_outliers,
)


# ------------------------------------------------------------------ parameters_not_in_optimizer
def _orphans(ev: Orphans) -> Finding | None:
    return orphans_finding(dict(ev.orphans), ev.total) if ev.orphans else None


def orphans_finding(orphans: dict[str, int], total: int) -> Finding:
    """Trainable parameters with a gradient that no optimizer holds (name -> entries)."""
    names = sorted(orphans)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    entries = sum(orphans.values())
    modules = sorted({n.rsplit(".", 1)[0] for n in names})
    return Finding(
        PARAMETERS_NOT_IN_OPTIMIZER,
        f"{len(names)} trainable parameter tensor{'s' if len(names) > 1 else ''} ({entries:,} entries, "
        f"{entries / max(total, 1):.1%} of the model) got a gradient but no optimizer holds them, so they "
        f"never change: {shown}.",
        {"tensors": float(len(names)), "entries": float(entries), "share": entries / max(total, 1)},
        where=modules[0] if len(modules) == 1 else "parameters",
    )


PARAMETERS_NOT_IN_OPTIMIZER: Rule[Orphans] = Rule(
    kind="parameters_not_in_optimizer",
    severity="warning",
    monitor="OptimizerMonitor",
    summary="trainable parameters got a gradient but no optimizer holds them",
    when=(
        "at the first measured step, trainable parameters got a gradient but no optimizer holds "
        "them (a head replaced after `configure_optimizers`, a module added in a hook): they never "
        "train. Names the tensors, their entries and share of the model. Frozen parameters "
        "(`requires_grad=False`) are never named. See [OptimizerMonitor](optimizer.md#alerts)."
    ),
    hint=(
        "They were created or replaced after configure_optimizers built the optimizer (a new head set in "
        "on_train_start or a callback, a module added later). Build the model completely before "
        "configure_optimizers, or add them to the optimizer (optimizer.add_param_group)."
    ),
    check=_orphans,
)


# ------------------------------------------------------------------ adam_step_too_large
def _adam_step_words(layer: str, s: AdamStep, others: int) -> Finding:
    """An entry of ``layer`` moved far more than Adam's ``lr`` allows (``others``: more layers did too)."""
    moved = (
        f"{s.optimizer} moved an entry of layer {layer} by {s.step:.3g} x lr in one step (lr={s.lr:.3g}: "
        f"|delta w| = {s.step * s.lr:.3g}, after {s.steps_taken:.0f} steps)"
        + (f", and {others} more layer(s) by more than the limit too" if others else "")
        + "; a healthy Adam step is at most a few x lr per entry (below 2 x lr in every healthy run we "
        "measured)."
    )
    data = {
        "step_over_lr": s.step,
        "lr": s.lr,
        "beta1": s.beta1,
        "beta2": s.beta2,
        "eps": s.eps,
        "bound": s.bound,
        "other_layers": float(others),
    }
    tiny_eps = (
        f" eps={s.eps:.3g} lets the step reach |m_hat| / eps: keep eps at 1e-8 or above."
        if s.eps < 1e-10
        else ""
    )
    if math.isinf(s.bound):
        growth = s.beta1 / math.sqrt(s.beta2) if s.beta2 > 0 else math.inf
        why = (
            f" With betas=({s.beta1:g}, {s.beta2:g}), beta2 <= beta1^2 = {s.beta1**2:.3g}: the per-entry "
            "step m_hat / (sqrt(v_hat) + eps) has no bound (Kingma & Ba 2015, Sec. 2.1, bound it by about "
            "lr for the usual betas; a bound needs beta1 / sqrt(beta2) < 1, as in Reddi et al. 2018). v "
            "forgets a large gradient faster than m does: each quieter step after it multiplies the step "
            f"by up to beta1 / sqrt(beta2) = {growth:.3g}, until it reaches |m_hat| / eps (eps={s.eps:.3g})."
        )
        hint = (
            f"beta2={s.beta2:g} is far too small: use the default 0.999 (0.95-0.99 for large models); "
            "beta2 must stay above beta1^2." + tiny_eps
        )
        return Finding(ADAM_STEP_TOO_LARGE, moved + why, data, hint=hint, where=layer)
    why = (
        f" That is above {s.bound:.3g} x lr, the most Adam can move an entry with betas=({s.beta1:g}, "
        f"{s.beta2:g}) after {s.steps_taken:.0f} steps, whatever the gradients: the weights moved by more "
        "than the optimizer's step."
    )
    hint = (
        "Something else writes to the weights between on_before_optimizer_step and the end of the batch "
        "(a custom optimizer_step, weight clipping or re-initialisation in a hook), or the lr changed "
        "within the step." + tiny_eps
    )
    return Finding(ADAM_STEP_TOO_LARGE, moved + why, data, hint=hint, where=layer)


def _adam_step(ev: Measured) -> Finding | None:
    watched = {k: s for k, s in ev.reading.adam_steps.items() if ev.selection.watches(k)}
    return adam_step_finding(watched, ev.max_adam_step)


def adam_step_finding(steps: Mapping[str, AdamStep], max_adam_step: float) -> Finding | None:
    """The layer whose Adam step went furthest past its limit (a setting, not a layer, is at fault: the
    others are counted in it), or ``None`` when no layer's step did. At once: no healthy Adam step comes
    near the limit.

    Args:
        steps: the largest Adam step of each watched layer, over its lr.
        max_adam_step: the callback's ``max_adam_step`` (:func:`adam_step_threshold` with each bound).
    """
    over = {k: s.step / adam_step_threshold(s.bound, max_adam_step) for k, s in steps.items()}
    over = {k: x for k, x in over.items() if x > 1.0}
    if not over:
        return None
    worst = max(over, key=lambda k: over[k])
    return _adam_step_words(worst, steps[worst], len(over) - 1)


ADAM_STEP_TOO_LARGE: Rule[Measured] = Rule(
    kind="adam_step_too_large",
    severity="warning",
    monitor="OptimizerMonitor",
    summary="an Adam entry moved far more than lr allows: beta2 <= beta1^2 (OptimizerMonitor)",
    when=(
        "on the first check where Adam, AdamW, NAdam or RAdam (once rectified) moved an entry by "
        "more than `max_adam_step` (10) times its lr and more than Adam can move one with its betas"
        " at that step (`adam_step_bound`: 7.3 x lr at (0.9, 0.999), 1 x lr at (0.9, 0.9); none "
        "when beta2 <= beta1², Kingma & Ba 2015 Sec. 2.1, Reddi et al. 2018). Measured: healthy "
        "Adam/AdamW runs stayed under 2 x lr per entry (NAdam 6 x, within its bound); Adam(0.9, "
        "0.1) passed 10 x at step 4, (0.9, 0.5) at step 16. Names beta2, and eps when below 1e-10. "
        "See [OptimizerMonitor](optimizer.md#the-adam-step-rule)."
    ),
    check=_adam_step,
)

#: the rules of a check, in the order they are judged (on a :class:`Measured`)
STEP_RULES: tuple[Rule[Measured], ...] = declare(
    ADAM_EPSILON_DOMINATES, UPDATE_RATIO_OUTLIER, ADAM_STEP_TOO_LARGE
)
#: the rule of the first measured step (on :class:`Orphans`)
HELD_RULES: tuple[Rule[Orphans], ...] = declare(PARAMETERS_NOT_IN_OPTIMIZER)
#: every kind this monitor reports
RULES = (ADAM_EPSILON_DOMINATES, UPDATE_RATIO_OUTLIER, PARAMETERS_NOT_IN_OPTIMIZER, ADAM_STEP_TOO_LARGE)
