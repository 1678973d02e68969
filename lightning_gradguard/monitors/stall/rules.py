"""The stall rules: one declaration per rule (its kind, summary, docs row, where, hint, thresholds and the
check itself), in the order they are judged (causes first; the symptoms, a loss at chance or on a plateau,
last: they defer to a cause found). Adding a rule is one more declaration here.

A check is ``check(evidence)`` (:class:`~lightning_gradguard.alerts.Check`): its evidence, a
:class:`Judged`, holds the :class:`~lightning_gradguard.monitors.stall.state.StallState` (what earlier
checks left, the streaks, the kinds named) and the new :class:`StallCheck`; it returns the :class:`Finding`
that holds, or ``None``. The callback runs :data:`RULES` in their declared order
(``GradGuardCallback.run_rules``). Pure host math: no Trainer, no device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.functional.updates import dtype_spacing
from lightning_gradguard.monitors.stall.check import (
    Rounding,
    StallCheck,
    batch_purity,
    loss_trend,
    spread,
)
from lightning_gradguard.monitors.stall.state import StallState


@dataclass(frozen=True)
class Judged:
    """What a stall check reads: the run's state (already holding ``check``) and the check itself."""

    state: StallState
    check: StallCheck


_LR_ZERO_HINT = "The LR is 0: check the scheduler and the optimizer's lr."
_NO_GRADIENT_HINT = (
    "The optimizer stepped without gradients. In manual optimization, call `opt.zero_grad()` before "
    "`self.manual_backward(loss)`, never between it and `opt.step()`; check also that the loss depends on "
    "the parameters (a `.detach()`, `torch.no_grad()`)."
)


# ------------------------------------------------------------------ update_below_precision
def _below_precision(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r, rounding = s.thresholds, c.rounding
    # a run that learned is not stalled (16-bit weights stop moving once the steps shrink near the end)
    learning = s.smoothed is None or s.far_from_done()
    lost = rounding is not None and rounding.graded > 0 and rounding.share > r.rounding_share
    if not s.streak(UPDATE_BELOW_PRECISION, lost and learning) or rounding is None:
        return None
    return _precision_finding(s, c, rounding)


def _precision_finding(s: StallState, c: StallCheck, rounding: Rounding) -> Finding:
    kind = str(rounding.dtype).removeprefix("torch.")
    eps = torch.finfo(rounding.dtype).eps
    bits = round(-math.log2(eps)) + 1
    gap = float(dtype_spacing(torch.tensor(rounding.weight), rounding.dtype))
    needed = gap / 2 / rounding.update if rounding.update > 0 else math.nan
    at = rounding.lost_weight
    lost_at = f" (of the unchanged entries {at:.2g})" if math.isfinite(at) else ""
    checks = s.checks_in_a_row(UPDATE_BELOW_PRECISION)
    return Finding(
        UPDATE_BELOW_PRECISION,
        f"{rounding.share:.0%} of the {kind} weight entries that had a non-zero gradient did not "
        f"change on {checks} checks in a row (step {c.step}, {rounding.parameters} parameters): "
        f"their updates were rounded away. {kind} keeps {bits} significant bits: neighbouring values "
        f"are {eps / 2:.2%} to {eps:.2%} of |w| apart, and an update under half that gap (under "
        f"{eps / 4:.2%} to {eps / 2:.2%} of |w|) leaves the weight as it was. The typical update that "
        f"landed was {rounding.update:.2g}; the typical |w| is {rounding.weight:.2g}{lost_at}, where "
        f"{kind} values are {gap:.2g} apart: a step there must exceed {gap / 2:.2g}, {needed:.3g}x "
        f"the typical update. LR {c.lr:.3g}.",
        {
            "share": rounding.share,
            "update": rounding.update,
            "weight": rounding.weight,
            "spacing": gap,
            "relative_spacing": eps,
            "lr": c.lr,
        },
    )


UPDATE_BELOW_PRECISION = Rule(
    kind="update_below_precision",
    severity="warning",
    monitor="StallDetector",
    summary=("a parameter's updates were below its dtype's resolution: rounded away (bf16)"),
    when=(
        "In training (`StallDetector`): more than half of the bfloat16/float16 weight entries with "
        "a non-zero gradient kept their value on 3 checks in a row while the loss is above half its"
        " first (measured: 0.69-0.87 under bf16-true Adam 1e-4 on the digits MLP, named at step 19;"
        " at most 0.34 on 3 checks in a row for bf16-true runs that train); the message adds the "
        "share lost and the LR, the hint a higher LR or an optimizer that keeps the lost bits. See "
        "[StallDetector](stall.md#16-bit-weights-whose-updates-round-away-issue-24)."
    ),
    where="precision",
    hint=(
        'The weights themselves are 16-bit (`precision="bf16-true"` or `"16-true"`, or a model cast'
        " with `.to(torch.bfloat16)`): a step smaller than half the gap between two neighbouring "
        "values of the weight's dtype rounds back to the old value, so most of the network stays at"
        " its initial values although the gradient and the optimizer say otherwise. Keep float32 "
        'master weights: `precision="bf16-mixed"` (or `"16-mixed"`) computes in 16 bits and updates'
        " float32 weights. Or raise the LR until the steps clear that gap (Adam's per-entry step is"
        " about the LR), or use an optimizer that keeps the lost low bits (float32 master weights, "
        "Kahan summation) or rounds stochastically."
    ),
    cause=True,
    thresholds=(
        "rounding_share",
        "patience",
    ),
    check=_below_precision,
)


# ------------------------------------------------------------------ no_update
def _no_update(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    if c.update_total is None or not s.streak(NO_UPDATE, c.update_total == 0.0):
        return None
    if s.checks_in_a_row(UPDATE_BELOW_PRECISION):
        return None  # the gradients are there: their updates are being rounded away (now, not earlier)
    if s.lr_fell_early(c) or (c.lr_max > 0 and 0.0 < c.lr < c.lr_max * 1e-6):
        return _lr_finding(s, c, share=1.0, why="every update was exactly 0")
    n = s.checks_in_a_row(NO_UPDATE)
    lr_zero = c.lr == 0.0
    return Finding(
        NO_UPDATE,
        f"No parameter changed in {n} checked optimizer steps in a row (step {c.step}): every update "
        f"was exactly 0{' (the LR is 0)' if lr_zero else ''}.",
        {"checks": float(n), "lr": c.lr},
        hint=_LR_ZERO_HINT if lr_zero else _NO_GRADIENT_HINT,
    )


NO_UPDATE = Rule(
    kind="no_update",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: every update was exactly 0 on consecutive checks (nothing moves)",
    when=(
        "every update was exactly 0 on `patience` (3) checks in a row: the optimizer stepped "
        "without gradients (manual optimization zeroing them between backward and step) or the LR "
        "is 0. See [StallDetector](stall.md)."
    ),
    where="optimizer step",
    cause=True,
    thresholds=("patience",),
    check=_no_update,
)


# ------------------------------------------------------------------ clipped_updates
def _clipped(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    # under an adaptive optimizer a gradient clipped 500x moves the weights as far as the raw one (the
    # usual AdamW + gradient_clip_val=1 of a MobileNetV2 or a small transformer): no finding
    shrunk = not c.adaptive and c.clip_ratio is not None and c.clip_ratio < 1.0 / s.thresholds.clip_factor
    if not s.streak(CLIPPED_UPDATES, shrunk) or c.clip_ratio is None:
        return None
    return Finding(
        CLIPPED_UPDATES,
        f"The gradient the optimizer used was {1 / max(c.clip_ratio, 1e-30):.3g}x smaller than the "
        f"raw gradient on {s.checks_in_a_row(CLIPPED_UPDATES)} checks in a row (step {c.step}): clipping "
        "shrinks every update.",
        {"clip_ratio": c.clip_ratio},
    )


CLIPPED_UPDATES = Rule(
    kind="clipped_updates",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the gradient the optimizer used was far smaller than the raw one",
    when=(
        "the gradient the optimizer used was `clip_factor` (100) times smaller than the raw one on "
        "`patience` checks: clipping far below the gradient norm, wherever it is done. Not under an"
        " adaptive optimizer (Adam and its family), whose step does not shrink with the gradient."
    ),
    where="gradient clipping",
    hint=(
        "Something clips far below the gradient norm: a custom `configure_gradient_clipping`, a "
        "`clip_grad_norm_` in the model, or `Trainer(gradient_clip_val=...)`. Clip at about the "
        "90th percentile of the pre-clip norm (GradientNormLogger's "
        "`grad_clip/suggested_clip_val`)."
    ),
    cause=True,
    thresholds=(
        "clip_factor",
        "patience",
    ),
    check=_clipped,
)


# ------------------------------------------------------------------ lr_decayed
def _lr_finding(s: StallState, c: StallCheck, share: float, why: str) -> Finding:
    history = ", ".join(f"{lr:.3g} at step {s}" for s, lr in spread(s.lr_history, 5))
    planned = f" of {c.planned_steps} planned" if c.planned_steps is not None else ""
    message = (
        f"The LR fell to {c.lr:.3g}, {c.lr_max / max(c.lr, 1e-300):.3g}x below its highest "
        f"{c.lr_max:.3g}, by step {s.lr_fell_at}{planned}, and {why}; the loss stopped improving "
        f"(best {s.best_raw:.4g}). LR: {history}."
    )
    data = {"collapsed_share": share, "lr": c.lr, "lr_max": c.lr_max, "best_loss": s.best_raw}
    return Finding(LR_DECAYED, message, data)


#: a schedule read ahead is judged over at least this many steps
_MIN_SPAN = 20


def _schedule_collapse(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    """Read ahead: the schedule keeps the LR ``collapse_factor`` times below its peak for all but the
    first ``early_phase`` of the planned run (a per-epoch schedule stepped per batch)."""
    r, a = s.thresholds, c.ahead
    if a is None or a.span < _MIN_SPAN or not s.ahead_confirmed(c):
        return None
    lrs = list(a.lrs[: a.span])
    peak = max(lrs)
    floor = peak / r.collapse_factor
    useful = sum(lr >= floor for lr in lrs)
    if peak <= 0 or useful >= r.early_phase * len(lrs):
        return None
    top = lrs.index(peak)
    fell = next((i for i in range(top, len(lrs)) if lrs[i] < floor), None)
    if fell is None:  # low only before its peak: a long warm-up (warmup_never_ends judges that)
        return None
    over = f"of the {a.planned} planned" if a.planned == len(lrs) else f"read ahead (of {a.planned or '?'})"
    history = ", ".join(f"{lr:.3g} at step {i}" for i, lr in spread(list(enumerate(lrs)), 6))
    return Finding(
        LR_DECAYED,
        f"The LR schedule, read ahead at the start (and confirmed by the first steps), takes the LR "
        f"from {peak:.3g} (step {top}) "
        f"to {lrs[fell]:.3g} by step {fell}, {r.collapse_factor:g}x below its peak, and keeps it under "
        f"{floor:.3g} for {len(lrs) - useful} of the {len(lrs)} steps {over}: most of the run would train "
        f"at almost no LR. LR ahead: {history}.",
        {"lr_max": peak, "lr": lrs[fell], "fell_at": float(fell), "useful_share": useful / len(lrs)},
    )


LR_DECAYED = Rule(
    kind="lr_decayed",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the LR fell ~100x early in the run and the updates collapsed with it",
    when=(
        "read ahead (the run's schedulers stepped on copies over the planned run, up to 2,000 steps; "
        "judged once the first `patience` checked steps used the LRs read ahead): the LR stays "
        "`collapse_factor` (100) times below its peak for all but "
        "`early_phase` (a quarter) of those steps; or, seen, most layers' update ratios collapsed 100x"
        " with the LR within the first quarter of the planned run, and the loss stopped improving: a "
        "per-epoch schedule stepping per batch; the message lists the LR history."
    ),
    where="lr_scheduler",
    hint=(
        'A scheduler meant to step per epoch may be stepping per batch (`"interval": "step"` in '
        "`configure_optimizers`), or its step_size / T_max / gamma is in the wrong unit. Make the "
        "decay span the run (`trainer.estimated_stepping_batches` optimizer steps)."
    ),
    cause=True,
    thresholds=(
        "collapse_factor",
        "early_phase",
        "patience",
    ),
    check=_schedule_collapse,
)


# ------------------------------------------------------------------ updates_collapsed
def _collapse(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r = s.thresholds
    ratios = {k: v for k, v in c.update_ratios.items() if math.isfinite(v)}
    if not ratios:
        return None
    for name, v in ratios.items():
        if v > s.peak_ratio.setdefault(name, v):
            s.peak_ratio[name] = v
    low = [k for k, v in ratios.items() if v < s.peak_ratio[k] / r.collapse_factor]
    collapsed = len(low) > r.collapse_layers * len(ratios)
    if collapsed and s.collapsed_since is None:
        s.collapsed_since = c.step
    if not collapsed:
        s.collapsed_since = None
    late = c.planned_steps is not None and c.step >= (1 - r.final_phase) * c.planned_steps
    lasted = s.collapsed_since is not None and c.step - s.collapsed_since >= r.collapse_share * c.step
    lr_fell = s.lr_fell_early(c)
    # the LR fell early in the plan: the schedule did it; else the loss must still be far from done
    evidence = lr_fell or (s.far_from_done() and lasted and not late)
    holds = collapsed and evidence and not s.improving()
    if not s.streak(UPDATES_COLLAPSED, holds):
        return None
    share = len(low) / len(ratios)
    why = (
        f"the update/weight ratio of {share:.0%} of the layers fell more than {r.collapse_factor:g}x "
        "below its highest level"
    )
    if lr_fell:
        return _lr_finding(s, c, share, why)
    history = ", ".join(f"{lr:.3g} at step {s}" for s, lr in spread(s.lr_history, 5))
    return Finding(
        UPDATES_COLLAPSED,
        f"Since step {s.collapsed_since} {why}, while the LR did not, and the loss stopped improving "
        f"(best {s.best:.4g}, first {s.first_loss:.4g}). LR: {history}.",
        {"collapsed_share": share, "lr": c.lr, "best_loss": s.best},
    )


UPDATES_COLLAPSED = Rule(
    kind="updates_collapsed",
    severity="warning",
    monitor="StallDetector",
    summary=("StallDetector: most layers' updates collapsed while the LR did not"),
    when="the same collapse of the update ratios while the LR did not fall and the loss is far from done.",
    where="updates",
    hint=(
        "The updates shrank while the LR did not: clipping far below the gradient norm, weight "
        "decay or a constraint pulling every step back, or gradients that vanished. Compare "
        "grad_norm/* and update_ratio/* (GradientNormLogger)."
    ),
    cause=True,
    thresholds=(
        "collapse_factor",
        "collapse_layers",
        "collapse_share",
        "final_phase",
        "patience",
    ),
    check=_collapse,
)


# ------------------------------------------------------------------ weight_decay_collapse
def _weight_decay(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r = s.thresholds
    layers = {
        k: dr for k, dr in c.decay.items() if dr[0] > 0 and math.isfinite(c.weight_norms.get(k, math.nan))
    }
    shrunk = []
    for k in layers:
        w, previous = c.weight_norms[k], s.last_weight.get(k)
        s.peak_weight[k] = max(s.peak_weight.get(k, w), w)
        s.last_weight[k] = w
        decay, rest = layers[k]
        falling = previous is not None and w < previous and w * r.decay_fall <= s.peak_weight[k]
        if falling and decay >= r.decay_dominance * rest:
            shrunk.append(k)
    shrinking = bool(layers) and len(shrunk) > r.collapse_layers * len(layers)
    s.decay_since = (s.decay_since if s.decay_since is not None else c.step) if shrinking else None
    # shrinking on `patience` checks in a row, and the loss stopped improving far from done
    if not s.streak(WEIGHT_DECAY_COLLAPSE, shrinking) or not s.far_from_done() or s.improving():
        return _decay_ahead(s, c)
    return _decay_finding(s, c, shrunk, len(layers))


def _decay_ahead(s: StallState, c: StallCheck) -> Finding | None:
    """Read ahead: at the schedule's highest LR the decoupled decay alone removes ``decay_rate`` or more
    of every weight a step, on more than ``collapse_layers`` of the trainable entries."""
    r, a = s.thresholds, c.ahead
    if a is None or not a.decay or a.trainable <= 0 or (a.lrs and not s.ahead_confirmed(c)):
        return None
    heavy = [(lr, wd, n) for lr, wd, n in a.decay if lr * wd >= r.decay_rate]
    share = sum(n for *_, n in heavy) / a.trainable
    if share <= r.collapse_layers:
        return None
    lr, wd, _ = max(heavy, key=lambda g: g[0] * g[1])
    rate = lr * wd
    return Finding(
        WEIGHT_DECAY_COLLAPSE,
        f"The weight decay, read at the start, removes {rate:.3g} of every weight a step at the "
        f"schedule's highest LR (lr {lr:.3g} x weight_decay {wd:.3g}) on {share:.0%} of the trainable "
        f"entries: on its own it halves those weights every {math.log(2) / rate:.3g} steps, faster than "
        "a gradient step can hold them up (usual recipes remove 1e-5 to 1e-3 a step: a half-life of "
        "hundreds to tens of thousands of steps).",
        {"weight_decay": wd, "lr": lr, "decay_rate": rate, "share": share},
    )


def _decay_finding(s: StallState, c: StallCheck, shrunk: list[str], decayed: int) -> Finding:
    worst = max(shrunk, key=lambda k: s.peak_weight[k] / max(c.weight_norms[k], 1e-300))
    fall = s.peak_weight[worst] / max(c.weight_norms[worst], 1e-300)
    decay = math.sqrt(sum(c.decay[k][0] ** 2 for k in shrunk))
    rest = math.sqrt(sum(c.decay[k][1] ** 2 for k in shrunk))
    share = decay / (decay + rest) if decay + rest > 0 else 1.0
    times = decay / max(rest, 1e-300)
    lr, wd = max(c.decay_groups, key=lambda g: g[0] * g[1]) if c.decay_groups else (c.lr, math.nan)
    return Finding(
        WEIGHT_DECAY_COLLAPSE,
        f"Weight decay is shrinking the weights away: since step {s.decay_since} the weight norms of "
        f"{len(shrunk)} of the {decayed} decayed layers fell {s.thresholds.decay_fall:g}x or more below "
        "their highest, "
        f"lower at every check ({worst}: {s.peak_weight[worst]:.3g} -> {c.weight_norms[worst]:.3g}, "
        f"{fall:.3g}x), while the decay term lr * weight_decay * ||w|| was {times:.3g}x "
        f"the rest of the update (its share {share:.0%}). weight_decay={wd:.3g} at lr={lr:.3g} removes "
        f"{lr * wd:.3g} of every weight per step; the loss stopped improving (best {s.best_raw:.4g}, "
        f"first {s.first_loss:.4g}).",
        {"weight_decay": wd, "lr": lr, "fall": fall, "decay_share": share, "layers": float(len(shrunk))},
    )


WEIGHT_DECAY_COLLAPSE = Rule(
    kind="weight_decay_collapse",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: weight decay outweighed the gradient, shrank most layers 10x+",
    when=(
        "read ahead (once the first checked steps confirm the schedule): with decoupled weight "
        "decay (AdamW; plain SGD), `lr * "
        "weight_decay` at the schedule's highest LR is `decay_rate` (1e-2: a half-life of 69 steps; "
        "usual recipes 1e-5 to 1e-3) or more on more than half of the trainable entries. Or, seen: "
        "more than half of the decayed layers' "
        "weight norms fell `decay_fall` (10) times below their highest, lower at every check, while"
        " the decay's part of the update (`lr * weight_decay * ‖w‖`) was at least the rest of it, "
        "on `patience` checks, and the loss stopped improving far from done. Threshold: measured "
        "(AdamW weight_decay=100 at lr 1e-3 on a token model: named at step 49, the embedding "
        "155-159x fallen, the decay 2.7-2.8x the rest; healthy runs, down to weight_decay=1 at lr "
        "1e-2: at most 3.2x fallen). See [StallDetector](stall.md)."
    ),
    where="weight_decay",
    hint=(
        "The weight decay is far too strong for this LR: decoupled decay (AdamW) removes lr * "
        "weight_decay of every weight each step, whatever the gradient says, and the gradient can "
        "no longer hold the weights up. Typical AdamW values are 0.01-0.1 (a weight_decay of "
        "1e-4..5e-4 is SGD's L2 scale); lower it, or the LR it multiplies, and keep biases and norm"
        " layers out of the decayed group."
    ),
    cause=True,
    thresholds=(
        "decay_rate",
        "decay_fall",
        "decay_dominance",
        "collapse_layers",
        "patience",
    ),
    check=_weight_decay,
)


# ------------------------------------------------------------------ lr_jump
def _lr_jump(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    factor = c.lr_max / c.lr_configured if c.lr_configured > 0 else 0.0
    if factor < s.thresholds.lr_jump_factor:
        return None
    return Finding(
        LR_JUMP,
        f"The LR reached {c.lr_max:.3g}, {factor:.3g}x the highest LR the optimizer and its scheduler "
        f"were configured with ({c.lr_configured:.3g}); it is {c.lr:.3g} at step {c.step}.",
        {"lr_max": c.lr_max, "lr_configured": c.lr_configured, "factor": factor},
    )


LR_JUMP = Rule(
    kind="lr_jump",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the LR went far past the highest LR it was configured with",
    when=(
        "the LR went `lr_jump_factor` (10) times past the highest LR the optimizer and its "
        "schedulers were configured with."
    ),
    where="lr_scheduler",
    hint=(
        "A schedule bug multiplies the LR: a LambdaLR factor that is not a fraction, a warm-up that"
        " multiplies instead of interpolating, two schedulers on one optimizer, or an LR set by "
        "hand in a hook. Print `optimizer.param_groups[i]['lr']` around the jump."
    ),
    cause=True,
    thresholds=("lr_jump_factor",),
    check=_lr_jump,
)


# ------------------------------------------------------------------ warmup_never_ends
def _warmup(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r, a = s.thresholds, c.ahead
    if (
        a is not None
        and a.planned is not None
        and len(a.lrs) >= a.planned >= _MIN_SPAN
        and s.ahead_confirmed(c)
    ):  # the whole plan read ahead, and the run's LRs so far are those read: no pace to extrapolate
        top = max(a.lrs[: a.planned])
        if c.lr_configured <= 0 or top > r.warmup_lr_fraction * c.lr_configured:
            return None
        return Finding(
            WARMUP_NEVER_ENDS,
            f"The LR schedule, read ahead at the start (and confirmed by the first steps), never "
            f"takes the LR above {top:.3g} in "
            f"the {a.planned} planned steps: {top / c.lr_configured:.2%} of the configured "
            f"{c.lr_configured:.3g}.",
            {"lr_max": top, "lr_configured": c.lr_configured, "share": top / c.lr_configured},
        )
    low = c.lr_configured > 0 and c.lr_max <= r.warmup_lr_fraction * c.lr_configured
    if not low or c.step < r.warmup_min_steps:
        return None
    # a warm-up rising linearly from 0 at the pace it has kept so far ends at this step
    reach = (c.step + 1) * c.lr_configured / max(c.lr_max, 1e-300)
    if c.planned_steps is not None:
        late = reach > c.planned_steps
        ends = f"at this pace it would reach it around step {reach:.3g}, after the planned {c.planned_steps}"
    else:
        late = c.step >= r.warmup_lr_steps
        ends = f"at this pace it would reach it around step {reach:.3g}"
    if not late:
        return None
    share = c.lr_max / c.lr_configured
    return Finding(
        WARMUP_NEVER_ENDS,
        f"After {c.step + 1} steps the LR has never been above {share:.2%} of the configured "
        f"{c.lr_configured:.3g} (highest so far {c.lr_max:.3g}); {ends}.",
        {"lr_max": c.lr_max, "lr_configured": c.lr_configured, "share": share, "reach_step": reach},
    )


WARMUP_NEVER_ENDS = Rule(
    kind="warmup_never_ends",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the LR never rose above a few percent of its configured value",
    when=(
        "the LR stays under 5 % of the configured LR over the whole planned run (read ahead, for runs "
        "of up to 2,000 steps, once the first checked steps confirm it), or stayed there and, at "
        "its pace, would reach it "
        "only after the planned run: a warm-up length in the wrong unit."
    ),
    where="lr_scheduler",
    hint=(
        "The warm-up is far longer than meant: its length may be in samples or epochs where the "
        "scheduler counts optimizer steps (or the reverse). Give warm-up steps in optimizer steps "
        "(`trainer.estimated_stepping_batches` is the run's total)."
    ),
    cause=True,
    thresholds=(
        "warmup_lr_fraction",
        "warmup_min_steps",
        "warmup_lr_steps",
    ),
    check=_warmup,
)


# ------------------------------------------------------------------ warmup_missing
def _no_warmup(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    """A transformer under an adaptive optimizer at its full LR from step 0, whose first updates rewrite
    ``warmup_ratio`` of the weights a step, on ``patience`` checks of the dense start."""
    r, ratio = s.thresholds, c.update_ratio_total
    if not (c.adaptive and c.attention) or c.orthogonalized or c.step >= r.warmup_min_steps:
        return None  # Muon's orthogonalized step rewrites a few percent a step by design, warm-up or not
    full = c.lr_configured > 0 and c.lr >= 0.5 * c.lr_configured and s.lr_history[0][1] >= 0.5 * c.lr
    holds = full and ratio is not None and ratio >= r.warmup_ratio
    if not s.streak(WARMUP_MISSING, holds) or ratio is None:
        return None
    return Finding(
        WARMUP_MISSING,
        f"No learning-rate warm-up: the LR is {c.lr:.3g} from step 0 (configured {c.lr_configured:.3g}), "
        f"and the first updates rewrite {ratio:.1%} of the weights a step (update/weight ratio "
        f"{ratio:.3g} on {s.checks_in_a_row(WARMUP_MISSING)} checks in a row, step {c.step}; runs with a "
        f"warm-up start near 0.5 %).",
        {"update_ratio": ratio, "lr": c.lr, "lr_configured": c.lr_configured},
    )


WARMUP_MISSING = Rule(
    kind="warmup_missing",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: a transformer at its full LR from step 0 rewrote far too much a step",
    when=(
        "a transformer (attention layers) trained by Adam or its family at its full LR from step 0,"
        " whose first updates rewrite 3 % or more of its weights a step, on 3 checks of the dense "
        "start: no learning-rate warm-up (post-LN transformers do not recover from it). Not under an "
        "optimizer that orthogonalizes most of the update (Muon): its step's size is its design. See "
        "[StallDetector](stall.md)."
    ),
    where="lr_scheduler",
    hint=(
        "Add a linear warm-up of the learning rate (5-10 % of the steps, e.g. transformers' "
        '`get_linear_schedule_with_warmup` or a `LambdaLR`, with `"interval": "step"`), or lower '
        "the LR. Adam's first steps move every entry by about the LR whatever its gradient; a "
        "transformer with its LayerNorm after the residual (post-LN: BERT, the original "
        "Transformer) does not recover from them (Xiong et al. 2020), and the loss sits at chance."
    ),
    cause=True,
    thresholds=(
        "warmup_ratio",
        "warmup_min_steps",
        "patience",
    ),
    check=_no_warmup,
)


# ------------------------------------------------------------------ dropout_too_high
def _dropout(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r, a = s.thresholds, c.ahead
    high = [(where, p) for where, p in a.dropouts if p >= r.dropout_note] if a is not None else []
    if not high:
        return None
    rate = max(p for _, p in high)
    # 0.8 keeps a fifth: a keep probability most likely (TF-slim MobileNets' 0.8, ported as a rate), yet a
    # classifier head still learns behind it (an INFO line); 0.9 and up keep a tenth or less: a warning
    places = ", ".join(f"{where} {p:g}" for where, p in high[:6]) + (", ..." if len(high) > 6 else "")
    return Finding(
        DROPOUT_TOO_HIGH,
        f"{len(high)} dropout rate{'s' if len(high) > 1 else ''} of {r.dropout_note:g} or more, read "
        f"before the first step ({places}): a dropout of {rate:g} zeroes {rate:.0%} of its inputs on every "
        f"training step and scales the rest {1 / max(1 - rate, 1e-12):.3g}x, so each step trains a "
        "different sliver of the network on mostly noise.",
        {"rate": rate, "count": float(len(high))},
        severity="warning" if rate >= r.dropout_ceiling else "info",
        hint=f"PyTorch's `p` (and a Hugging Face config's `*_dropout*`) is the probability to DROP an "
        f"element: a rate of {rate:g} is likely a keep probability (TensorFlow 1's `keep_prob`); use "
        f"{1 - rate:.2g}. Usual rates are 0 to 0.3 in transformers, up to 0.5 in a classifier head.",
    )


DROPOUT_TOO_HIGH = Rule(
    kind="dropout_too_high",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: a dropout rate of 0.9 or more (a keep probability given as the drop rate)",
    when=(
        "read at the first check: a dropout module (`nn.Dropout` and its family, a `*Drop*` module's "
        "`p` / `drop_prob` / `drop_rate`: DropPath) or a Hugging Face config's `*drop*` rate is "
        "`dropout_ceiling` (0.9) or more: it keeps a tenth of its inputs or less. An INFO line from "
        "`dropout_note` (0.8) on: `transformers`' MobileNetV2 default (0.8, TF-slim's keep probability)."
    ),
    also=("info",),
    where="dropout",
    cause=True,
    thresholds=("dropout_ceiling", "dropout_note"),
    check=_dropout,
)


# ------------------------------------------------------------------ sorted_labels
def _sorted(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r, labels = s.thresholds, c.labels
    if labels is None or not labels or sum(labels) < 8:
        return None
    total, seen = sum(labels), sum(s.label_counts)
    order = sorted(range(len(labels)), key=lambda i: -labels[i])
    one, two = batch_purity(labels)
    classes_seen = sum(n > 0 for n in s.label_counts)

    def minority(i: int) -> bool:
        return seen > 0 and s.label_counts[i] <= r.sorted_minority * seen

    pure = one >= r.sorted_purity and minority(order[0])
    # a batch on a class boundary (two classes) neither adds to the streak nor breaks it
    boundary = (
        not pure
        and classes_seen >= 4
        and total >= 16
        and two >= r.sorted_purity
        and len(order) > 1
        and minority(order[1])
    )
    if boundary:
        return None
    if not s.streak(SORTED_LABELS, pure):
        return None
    top = order[0]
    return Finding(
        SORTED_LABELS,
        f"{s.checks_in_a_row(SORTED_LABELS)} checked batches in a row were almost one class each (step "
        f"{c.step}: {labels[top] / total:.0%} class {top}), while that class is "
        f"{s.label_counts[top] / seen:.0%} of the labels seen.",
        {"majority": labels[top] / total, "class_share": s.label_counts[top] / seen},
    )


SORTED_LABELS = Rule(
    kind="sorted_labels",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: batches came one class at a time (a loader sorted by class)",
    when=(
        "`patience` checked batches in a row were almost one class while that class is a minority "
        "of the labels seen: a loader sorted by class and not shuffled."
    ),
    where="train_dataloader",
    hint=(
        "The loader feeds the classes one after the other: shuffle the training data "
        "(`DataLoader(shuffle=True)` or a sampler that shuffles); the model forgets each class "
        "while it learns the next."
    ),
    cause=True,
    thresholds=(
        "sorted_purity",
        "sorted_minority",
        "patience",
    ),
    check=_sorted,
)


# ------------------------------------------------------------------ chance_level
def _chance(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r, chance = s.thresholds, s.chance()
    low, high = s.chance_band()
    warm = c.lr_configured <= 0 or c.lr_max > r.warmup_lr_fraction * c.lr_configured
    # a fresh model's loss starts near the chance level (CS231n), about ln V for tokens: a first loss
    # far from it says the loss is not a cross-entropy over these targets (a regression, say)
    top = r.chance_ceiling * max(chance, s.uniform()) if s.token_counts is not None else high
    armed = s.num_classes is not None or (
        s.first_loss is not None and chance / r.chance_ceiling <= s.first_loss <= top
    )
    judged = (
        warm  # while the LR has not risen yet no learning is expected (see warmup_never_ends)
        and armed
        and not s.fired & CAUSES  # a symptom of a cause already named
        and c.loss is not None
        and c.step >= r.warmup_steps
        and s.lr_fell_at is None  # an LR 100x down: lr_decayed names it, with its history
        and math.isfinite(chance)
        and len(s.window) > r.patience
    )
    trend = loss_trend(s.window) if judged else None
    # a slow learner still falls, by more than its noise: a stuck one does not; and a plateau that is
    # learning already leans its outputs toward the labels (monitors.stall.evidence)
    stuck = (
        trend is not None
        and low <= trend.level <= high
        and (trend.fall < r.trend_floor * trend.level or trend.fall < r.trend_sigmas * trend.noise)
        and not s.learning()
    )
    if s.count(CHANCE_LEVEL, stuck) < r.chance_checks or trend is None:
        return None
    return _chance_finding(s, c, trend.level, trend.fall, trend.noise)


def _chance_finding(s: StallState, c: StallCheck, level: float, fall: float, noise: float) -> Finding:
    chance, uniform, since = s.chance(), s.uniform(), s.window[0][0]
    if s.token_counts is not None:
        what = (
            f"the entropy of the target tokens seen, {chance:.4g}: the loss of predicting only how often "
            f"each token occurs, whatever the input; a uniform guess over the vocabulary, ln V, is "
            f"{uniform:.4g}"
        )
        inputs = "the model's output does not depend on its input: check what the model is fed (ids, "
        inputs += "not the attention mask), the causal mask, and a collapse of a post-LN transformer "
        inputs += "without a warm-up"
    else:
        what = f"{chance:.4g}: the loss of predicting only the class frequencies"
        inputs = "check that each target belongs to its input (a shifted or shuffled label pipeline)"
    lean = s.leaning()
    data = {"loss": level, "chance": chance, "uniform": uniform, "fall": fall, "lr": c.lr}
    leaned = ""
    if lean is not None:
        data["label_lean"], data["label_lean_p"] = lean[0], lean[1]
        leaned = (
            f" Nor do its outputs lean toward the labels: over those steps' {lean[2]} examples, "
            f"{lean[1]:.0%} of the relabelings of the classes lean as far (own-class score {lean[0]:.3g})."
        )
    return Finding(
        CHANCE_LEVEL,
        f"From step {since} to step {c.step} the training loss ({level:.4g}) stayed at the chance level "
        f"({what}); over those steps it fell {fall:.3g} ({fall / level:.1%}; noise {noise:.2g})."
        + leaned
        + _decay_note(s, c),
        data,
        hint=f"Nothing about the inputs is being learned: {inputs}; that the model's parameters are in the "
        f"optimizer and not frozen; and the LR (now {c.lr:.3g}).",
    )


def _decay_note(s: StallState, c: StallCheck) -> str:
    """A sentence when the weight decay drives most decayed layers' updates now (their weights below
    their highest, the decay's part of the update the larger), else nothing."""
    layers = [k for k, (d, _) in c.decay.items() if d > 0 and k in c.weight_norms]
    heavy = [
        k
        for k in layers
        if c.decay[k][0] >= s.thresholds.decay_dominance * c.decay[k][1]
        and c.weight_norms[k] < s.peak_weight.get(k, 0.0)
    ]
    if not layers or len(heavy) <= s.thresholds.collapse_layers * len(layers) or not c.decay_groups:
        return ""
    lr, wd = max(c.decay_groups, key=lambda g: g[0] * g[1])
    return (
        f" The weight decay's part of the update is larger than the rest of it in {len(heavy)} of the "
        f"{len(layers)} decayed layers, whose weights are shrinking (weight_decay={wd:.3g} at "
        f"lr={lr:.3g}): the decay may be what holds the loss there."
    )


CHANCE_LEVEL = Rule(
    kind="chance_level",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the training loss stayed at the chance level after the warm-up",
    when=(
        "after the warm-up the loss stayed at the chance level (the labels' entropy, ln C for "
        "balanced classes; for token targets the tokens' entropy up to ln V) on two checks in a row"
        " without falling by more than its noise over the last `patience` check intervals, while the "
        "outputs did not lean toward the labels (a classifier of 4 to 128 classes: its examples' "
        "own-class scores, over those intervals, not above all but `learning_p` (5 %) of the "
        "relabelings of its classes): labels "
        "that do not match their inputs, a model whose output ignores its input, a frozen model, a "
        "far too small LR."
    ),
    where="training loss",
    thresholds=(
        "warmup_steps",
        "chance_margin",
        "chance_ceiling",
        "trend_floor",
        "trend_sigmas",
        "chance_checks",
        "warmup_lr_fraction",
        "patience",
        "learning_p",
    ),
    check=_chance,
)


# ------------------------------------------------------------------ loss_plateau
def _plateau(e: Judged) -> Finding | None:
    s, c = e.state, e.check
    r = s.thresholds
    if s.smoothed is None or s.first_loss is None or c.step < r.warmup_steps:
        return None
    regressed = s.smoothed > r.plateau_factor * s.best
    never = s.smoothed >= 0.9 * s.first_loss and not s.learning()  # still at its start, learning nothing
    if s.checks_since_best < r.plateau_checks or not (regressed or never) or s.fired:
        return None
    return Finding(
        LOSS_PLATEAU,
        f"The smoothed training loss ({s.smoothed:.4g}) has not improved for {s.checks_since_best} "
        f"checks; its best was {s.best:.4g}, its first {s.first_loss:.4g}.",
        {"loss": s.smoothed, "best": s.best, "first": s.first_loss},
    )


LOSS_PLATEAU = Rule(
    kind="loss_plateau",
    severity="warning",
    monitor="StallDetector",
    summary="StallDetector: the smoothed loss stopped improving far above its best or initial level",
    when=(
        "the smoothed loss set no new best for `plateau_checks` (30) checks while far above its "
        "best or still at its first level (and the outputs not leaning toward the labels, as for "
        "`chance_level`), with no cause found."
    ),
    where="training loss",
    hint=(
        "Training stalled: look at the LR history (a jump or a collapse), the update ratios and the"
        " data order; a loss stuck far above its best after a jump usually means the LR is too "
        "high."
    ),
    thresholds=(
        "warmup_steps",
        "plateau_checks",
        "plateau_factor",
        "improvement",
        "learning_p",
    ),
    check=_plateau,
)


#: every stall rule, in the order they are judged: the causes first, the symptoms (a loss at chance or on a
#: plateau) last, since they defer to a cause found
RULES: tuple[Rule[Judged], ...] = declare(
    UPDATE_BELOW_PRECISION,  # before no_update: updates rounded away are not missing gradients
    NO_UPDATE,
    CLIPPED_UPDATES,
    LR_DECAYED,  # named by the no_update and updates_collapsed checks when the LR fell early
    UPDATES_COLLAPSED,
    WEIGHT_DECAY_COLLAPSE,
    LR_JUMP,
    WARMUP_NEVER_ENDS,
    WARMUP_MISSING,
    DROPOUT_TOO_HIGH,
    SORTED_LABELS,
    CHANCE_LEVEL,
    LOSS_PLATEAU,
)
#: findings that name a cause; a loss at chance or on a plateau after one of them is its symptom
CAUSES = frozenset(r.kind for r in RULES if r.cause)


def evidence_wanted(s: StallState) -> bool:
    """Whether the outputs' lean toward the labels may still decide something: class targets (or none
    seen yet), no cause and no ``chance_level`` named, and the last check's loss not below the chance band."""
    if s.token_counts is not None or s.fired & (CAUSES | {CHANCE_LEVEL.kind}):
        return False
    if not s.window:
        return True
    return len(s.label_counts) >= 2 and s.window[-1][1] >= s.chance_band()[0]


def observe(state: StallState, c: StallCheck) -> list[Finding]:
    """Take one check into ``state`` and judge it, without reporting: the findings that hold now (each kind
    once per run), as ``StallDetector`` reports them (its ``run_rules`` runs the same declarations)."""
    state.update(c)
    evidence = Judged(state=state, check=c)
    return [f for rule in RULES for f in rule.findings(evidence) if state.first_time(f)]


if any(a.cause < b.cause for a, b in itertools.pairwise(RULES)):  # a symptom before a cause
    raise ValueError("stall RULES: declare the causes before the symptoms")
