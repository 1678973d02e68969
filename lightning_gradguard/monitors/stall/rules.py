"""When a run has quietly stopped learning, and why: rules on host numbers a few checks apart.

A stalled run neither crashes nor goes NaN; its loss just stops moving. The causes leave traces in
numbers a monitor has anyway: the learning rate (which the scheduler may have driven to ~0, or never
let rise), the size of the applied update against the weights (the update/weight ratio, which collapses
when the LR or the clipping shrinks every step, and is exactly 0 when nothing moves), the gradient
before and after clipping, the loss against the chance level of a classifier, and the labels of the
batches (a loader sorted by class feeds one class at a time). :class:`StallState` takes one
:class:`StallCheck` every few steps and returns the :class:`StallFinding` s that hold. Pure host math:
no Trainer, no device.

The rules (thresholds in :class:`~lightning_gradguard.monitors.stall.check.StallRules`):

* ``no_update``: the update of every parameter was exactly 0 on ``patience`` checks in a row;
* ``clipped_updates``: the gradient the optimizer used was ``clip_factor`` times smaller than the raw
  one on ``patience`` checks in a row, under an optimizer whose step scales with the gradient (not Adam
  and its family, which divide the step by the gradient's running size);
* ``lr_decayed``: most layers' update ratio fell ``collapse_factor`` times below the highest level it
  reached, for ``patience`` checks and ``collapse_share`` of the steps so far, with the LR down by a
  similar factor within the first quarter of the planned run, and the loss no longer improving;
  without the LR fall the same finding is ``updates_collapsed``;
* ``weight_decay_collapse``: most decayed layers' weight norms fell ``decay_fall`` times below their
  highest, lower at every check, while the decay's part of the update (``lr * weight_decay * ||w||``)
  was ``decay_dominance`` times the rest of it, on ``patience`` checks, and the loss stopped improving;
* ``update_below_precision``: more than ``rounding_share`` of the 16-bit weight entries that had a
  non-zero gradient did not change (their update was under half the gap between neighbouring values of
  their dtype, and rounded away), on ``patience`` checks in a row, while the loss is above half its first
  value (measured only for models with 16-bit weights);
* ``chance_level``: after ``warmup_steps``, on ``chance_checks`` checks in a row, over the last
  ``patience`` check intervals the loss stayed in the chance band (from ``1 - chance_margin`` times the
  chance level, the entropy of the labels or of the tokens seen, to ``chance_ceiling`` times it or just
  above ``ln V``, a uniform guess over ``V`` tokens) and did not fall (a fall counts when it is
  ``trend_floor`` of the level and ``trend_sigmas`` standard errors); armed only when the first loss was
  near the band, as a fresh model's is; not while the LR is ``collapse_factor`` times below its highest;
* ``loss_plateau``: no new best smoothed loss for ``plateau_checks`` checks while the loss is
  ``plateau_factor`` times its best, or still at its initial level;
* ``lr_jump``: the LR went past ``lr_jump_factor`` times the highest LR the optimizer was configured
  with (a scheduled group's ``initial_lr`` / ``max_lr``, a ``CyclicLR``'s ``max_lrs``);
* ``warmup_missing``: a transformer trained by an adaptive optimizer (Adam and its family) at its full LR
  from step 0, whose first updates rewrite ``warmup_ratio`` of its weights a step, on ``patience`` checks
  of the dense start;
* ``warmup_never_ends``: the LR has stayed under ``warmup_lr_fraction`` of the configured LR, and a
  warm-up rising at the pace it kept so far would reach the configured LR only after the planned run
  (judged from ``warmup_min_steps`` on; with the plan unknown, at ``warmup_lr_steps``);
* ``sorted_labels``: on ``patience`` checks in a row a batch was (almost) one class while that class
  is a minority of the labels seen so far (a batch on a class boundary neither counts nor breaks the
  streak).

"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from lightning_gradguard.functional.updates import dtype_spacing
from lightning_gradguard.monitors.stall.check import (
    HINTS,
    Rounding,
    StallCheck,
    StallFinding,
    StallRules,
    batch_purity,
    label_entropy,
    loss_trend,
    spread,
    token_entropy,
)

#: what :meth:`StallState.state` saves
_SAVED = (
    "streaks",
    "peak_ratio",
    "collapsed_since",
    "smoothed",
    "first_loss",
    "best",
    "checks_since_best",
    "best_raw",
    "checks_since_best_raw",
    "lr_fell_at",
    "label_counts",
    "lr_history",
    "fired",
    "window",
    "peak_weight",
    "last_weight",
    "decay_since",
)


class StallState:
    """The history the rules need, fed one :class:`StallCheck` at a time (:meth:`observe`)."""

    def __init__(self, rules: StallRules, num_classes: int | None = None) -> None:
        self.rules, self.num_classes = rules, num_classes
        self.streaks: dict[str, int] = {}
        self.peak_ratio: dict[str, float] = {}  # per layer: the highest update ratio seen
        self.collapsed_since: int | None = None
        self.smoothed: float | None = None  # EMA of the check losses
        self.first_loss: float | None = None
        self.best = math.inf
        self.checks_since_best = 0
        self.best_raw = math.inf  # the lowest check loss (no smoothing: no lag)
        self.checks_since_best_raw = 0
        self.lr_fell_at: int | None = None  # the first check where the LR was under 1/collapse of its max
        self.label_counts: list[float] = []
        self.token_counts: torch.Tensor | None = None  # float64, on the host, indexed by token id
        self.lr_history: list[tuple[int, float]] = []  # (step, LR) at every check
        self.fired: set[str] = set()
        #: (step, mean loss, its standard error) of the last ``patience + 1`` checks with a loss
        self.window: list[tuple[int, float, float | None]] = []
        self.peak_weight: dict[str, float] = {}  # per decayed layer: the highest weight norm seen
        self.last_weight: dict[str, float] = {}  # per decayed layer: the previous check's weight norm
        self.decay_since: int | None = None  # the first check of the current weight-decay streak

    # ------------------------------------------------------------------ bookkeeping
    def state_dict(self) -> dict[str, Any]:
        """Everything the rules remember, as plain Python values (for a checkpoint)."""
        out = {k: copy.deepcopy(getattr(self, k)) for k in _SAVED}
        out["fired"] = sorted(self.fired)
        out["lr_history"] = [list(x) for x in self.lr_history]
        out["window"] = [list(x) for x in self.window]
        if self.token_counts is not None:  # trailing zeros dropped: a large vocabulary's tail is unseen
            seen = torch.nonzero(self.token_counts).reshape(-1)
            end = int(seen[-1]) + 1 if seen.numel() else 0
            out["token_counts"] = self.token_counts[:end].clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (missing entries keep their fresh values)."""
        for k in _SAVED:
            if k in state:
                setattr(self, k, copy.deepcopy(state[k]))
        self.fired = set(self.fired)
        self.lr_history = [(int(s), float(lr)) for s, lr in self.lr_history]
        self.window = [(int(s), float(v), None if e is None else float(e)) for s, v, e in self.window]
        counts = state.get("token_counts")
        self.token_counts = None if counts is None else torch.as_tensor(counts, dtype=torch.float64).clone()

    def _streak(self, kind: str, holds: bool) -> bool:
        self.streaks[kind] = self.streaks.get(kind, 0) + 1 if holds else 0
        return self.streaks[kind] >= self.rules.patience

    def _loss(self, loss: float | None) -> None:
        if loss is None or not math.isfinite(loss):
            return
        if self.first_loss is None:
            self.first_loss = loss
        if loss < self.best_raw * (1 - self.rules.improvement):
            self.best_raw, self.checks_since_best_raw = loss, 0
        else:
            self.checks_since_best_raw += 1
        self.smoothed = loss if self.smoothed is None else 0.7 * self.smoothed + 0.3 * loss
        if self.smoothed < self.best * (1 - self.rules.improvement):
            self.best, self.checks_since_best = self.smoothed, 0
        else:
            self.best = min(self.best, self.smoothed)
            self.checks_since_best += 1

    def _improving(self) -> bool:
        return self.checks_since_best_raw < self.rules.patience

    def _far_from_done(self) -> bool:
        """The loss is still above half its first value (a run that learned and converged is not stalled)."""
        return (
            self.smoothed is not None
            and self.first_loss is not None
            and self.smoothed > 0.5 * self.first_loss
        )

    def _lr_fell_early(self, c: StallCheck) -> bool:
        """The LR fell ``collapse_factor`` times below its maximum within the first ``early_phase`` of the
        planned run (a schedule that decays over the run gets there near its end); unknown plan: the loss
        decides."""
        if self.lr_fell_at is None:
            return False
        if c.planned_steps is not None:
            return self.lr_fell_at < self.rules.early_phase * c.planned_steps
        return self._far_from_done()

    def chance(self) -> float:
        """The chance-level loss: the entropy of the tokens seen (token targets), else of the labels, else
        ``log(num_classes)``; NaN if none is known."""
        if self.token_counts is not None:
            return token_entropy(self.token_counts)
        if len([c for c in self.label_counts if c > 0]) >= 2:
            return label_entropy(self.label_counts)
        return math.log(self.num_classes) if self.num_classes and self.num_classes > 1 else math.nan

    def uniform(self) -> float:
        """The loss of a uniform guess, ``ln V``, for token targets: ``V`` is ``num_classes`` when given,
        else the largest token id seen plus one; for class targets the chance level itself."""
        if self.token_counts is None:
            return self.chance()
        if self.num_classes:
            return math.log(self.num_classes)
        seen = torch.nonzero(self.token_counts).reshape(-1)
        return math.log(int(seen[-1]) + 1) if seen.numel() and int(seen[-1]) > 0 else math.nan

    def chance_band(self) -> tuple[float, float]:
        """The losses that count as "at chance": from ``1 - chance_margin`` times the chance level to
        ``chance_ceiling`` times it, or to ``1 + chance_margin`` times ``ln V`` if that is higher."""
        r, chance, uniform = self.rules, self.chance(), self.uniform()
        high = r.chance_ceiling * chance
        if math.isfinite(uniform):
            high = max(high, (1 + r.chance_margin) * uniform)
        return (1 - r.chance_margin) * chance, high

    # ------------------------------------------------------------------ the rules
    def observe(self, c: StallCheck) -> list[StallFinding]:
        """Take one check; the findings that hold now (each kind once per run)."""
        self.lr_history.append((c.step, c.lr))
        if len(self.lr_history) > 512:  # a long run keeps every other entry: the first and the spread stay
            self.lr_history = self.lr_history[::2]
        if c.lr_max > 0 and c.lr < c.lr_max / self.rules.collapse_factor:
            self.lr_fell_at = c.step if self.lr_fell_at is None else self.lr_fell_at
        else:
            self.lr_fell_at = None
        self._loss(c.loss)
        if c.loss is not None and math.isfinite(c.loss):
            self.window = [*self.window, (c.step, c.loss, c.loss_stderr)][-(self.rules.patience + 1) :]
        self._count(c)
        causes = (
            self._below_precision,  # before no_update: updates rounded away are not missing gradients
            self._no_update,
            self._clipped,
            self._collapse,
            self._weight_decay,
            self._lr_jump,
            self._warmup,
            self._no_warmup,
            self._sorted,
        )
        found = []
        for rule in (*causes, self._chance, self._plateau):  # symptoms last: they defer to a cause found
            f = rule(c)
            if f is not None and f.kind not in self.fired:
                found.append(f)
                self.fired.add(f.kind)
        return found

    def _count(self, c: StallCheck) -> None:
        """Add the check's class counts and token counts to those seen so far."""
        if c.labels is not None:
            counts = list(c.labels)
            if len(counts) > len(self.label_counts):
                self.label_counts += [0.0] * (len(counts) - len(self.label_counts))
            for i, n in enumerate(counts):
                self.label_counts[i] += n
        if c.tokens is not None:
            new = c.tokens.detach().to("cpu", torch.float64).reshape(-1)
            old = self.token_counts if self.token_counts is not None else new.new_zeros(0)
            size = max(old.numel(), new.numel())
            total = new.new_zeros(size)
            total[: old.numel()] += old
            total[: new.numel()] += new
            self.token_counts = total

    def _no_update(self, c: StallCheck) -> StallFinding | None:
        if c.update_total is None or not self._streak("no_update", c.update_total == 0.0):
            return None
        if self.streaks.get("update_below_precision", 0):
            return None  # the gradients are there: their updates are being rounded away (now, not earlier)
        if self._lr_fell_early(c) or (c.lr_max > 0 and 0.0 < c.lr < c.lr_max * 1e-6):
            return self._lr_finding(c, share=1.0, why="every update was exactly 0")
        n = self.streaks["no_update"]
        lr_zero = c.lr == 0.0
        return StallFinding(
            "no_update",
            f"No parameter changed in {n} checked optimizer steps in a row (step {c.step}): every update "
            f"was exactly 0{' (the LR is 0)' if lr_zero else ''}.",
            "The LR is 0: check the scheduler and the optimizer's lr."
            if lr_zero
            else "The optimizer stepped without gradients. In manual optimization, call "
            "`opt.zero_grad()` before `self.manual_backward(loss)`, never between it and `opt.step()`; "
            "check also that the loss depends on the parameters (a `.detach()`, `torch.no_grad()`).",
            {"checks": float(n), "lr": c.lr},
        )

    def _below_precision(self, c: StallCheck) -> StallFinding | None:
        r, rounding = self.rules, c.rounding
        # a run that learned is not stalled (16-bit weights stop moving once the steps shrink near the end)
        learning = self.smoothed is None or self._far_from_done()
        lost = rounding is not None and rounding.graded > 0 and rounding.share > r.rounding_share
        if not self._streak("update_below_precision", lost and learning) or rounding is None:
            return None
        return self._precision_finding(c, rounding)

    def _precision_finding(self, c: StallCheck, rounding: Rounding) -> StallFinding:
        kind = str(rounding.dtype).removeprefix("torch.")
        eps = torch.finfo(rounding.dtype).eps
        bits = round(-math.log2(eps)) + 1
        gap = float(dtype_spacing(torch.tensor(rounding.weight), rounding.dtype))
        needed = gap / 2 / rounding.update if rounding.update > 0 else math.nan
        at = rounding.lost_weight
        lost_at = f" (of the unchanged entries {at:.2g})" if math.isfinite(at) else ""
        checks = self.streaks["update_below_precision"]
        return StallFinding(
            "update_below_precision",
            f"{rounding.share:.0%} of the {kind} weight entries that had a non-zero gradient did not "
            f"change on {checks} checks in a row (step {c.step}, {rounding.parameters} parameters): "
            f"their updates were rounded away. {kind} keeps {bits} significant bits: neighbouring values "
            f"are {eps / 2:.2%} to {eps:.2%} of |w| apart, and an update under half that gap (under "
            f"{eps / 4:.2%} to {eps / 2:.2%} of |w|) leaves the weight as it was. The typical update that "
            f"landed was {rounding.update:.2g}; the typical |w| is {rounding.weight:.2g}{lost_at}, where "
            f"{kind} values are {gap:.2g} apart: a step there must exceed {gap / 2:.2g}, {needed:.3g}x "
            f"the typical update. LR {c.lr:.3g}.",
            HINTS["update_below_precision"],
            {
                "share": rounding.share,
                "update": rounding.update,
                "weight": rounding.weight,
                "spacing": gap,
                "relative_spacing": eps,
                "lr": c.lr,
            },
        )

    def _clipped(self, c: StallCheck) -> StallFinding | None:
        # under an adaptive optimizer a gradient clipped 500x moves the weights as far as the raw one (the
        # usual AdamW + gradient_clip_val=1 of a MobileNetV2 or a small transformer): no finding
        shrunk = not c.adaptive and c.clip_ratio is not None and c.clip_ratio < 1.0 / self.rules.clip_factor
        if not self._streak("clipped_updates", shrunk) or c.clip_ratio is None:
            return None
        return StallFinding(
            "clipped_updates",
            f"The gradient the optimizer used was {1 / max(c.clip_ratio, 1e-30):.3g}x smaller than the "
            f"raw gradient on {self.streaks['clipped_updates']} checks in a row (step {c.step}): clipping "
            "shrinks every update.",
            HINTS["clipped_updates"],
            {"clip_ratio": c.clip_ratio},
        )

    def _collapse(self, c: StallCheck) -> StallFinding | None:
        r = self.rules
        ratios = {k: v for k, v in c.update_ratios.items() if math.isfinite(v)}
        if not ratios:
            return None
        for name, v in ratios.items():
            if v > self.peak_ratio.setdefault(name, v):
                self.peak_ratio[name] = v
        low = [k for k, v in ratios.items() if v < self.peak_ratio[k] / r.collapse_factor]
        collapsed = len(low) > r.collapse_layers * len(ratios)
        if collapsed and self.collapsed_since is None:
            self.collapsed_since = c.step
        if not collapsed:
            self.collapsed_since = None
        late = c.planned_steps is not None and c.step >= (1 - r.final_phase) * c.planned_steps
        lasted = (
            self.collapsed_since is not None and c.step - self.collapsed_since >= r.collapse_share * c.step
        )
        lr_fell = self._lr_fell_early(c)
        # the LR fell early in the plan: the schedule did it; else the loss must still be far from done
        evidence = lr_fell or (self._far_from_done() and lasted and not late)
        holds = collapsed and evidence and not self._improving()
        if not self._streak("collapse", holds):
            return None
        share = len(low) / len(ratios)
        why = (
            f"the update/weight ratio of {share:.0%} of the layers fell more than {r.collapse_factor:g}x "
            "below its highest level"
        )
        if lr_fell:
            return self._lr_finding(c, share, why)
        history = ", ".join(f"{lr:.3g} at step {s}" for s, lr in spread(self.lr_history, 5))
        return StallFinding(
            "updates_collapsed",
            f"Since step {self.collapsed_since} {why}, while the LR did not, and the loss stopped improving "
            f"(best {self.best:.4g}, first {self.first_loss:.4g}). LR: {history}.",
            HINTS["updates_collapsed"],
            {"collapsed_share": share, "lr": c.lr, "best_loss": self.best},
        )

    def _lr_finding(self, c: StallCheck, share: float, why: str) -> StallFinding:
        history = ", ".join(f"{lr:.3g} at step {s}" for s, lr in spread(self.lr_history, 5))
        planned = f" of {c.planned_steps} planned" if c.planned_steps is not None else ""
        message = (
            f"The LR fell to {c.lr:.3g}, {c.lr_max / max(c.lr, 1e-300):.3g}x below its highest "
            f"{c.lr_max:.3g}, by step {self.lr_fell_at}{planned}, and {why}; the loss stopped improving "
            f"(best {self.best_raw:.4g}). LR: {history}."
        )
        hint = HINTS["lr_decayed"]
        data = {"collapsed_share": share, "lr": c.lr, "lr_max": c.lr_max, "best_loss": self.best_raw}
        return StallFinding("lr_decayed", message, hint, data)

    def _lr_jump(self, c: StallCheck) -> StallFinding | None:
        factor = c.lr_max / c.lr_configured if c.lr_configured > 0 else 0.0
        if factor < self.rules.lr_jump_factor:
            return None
        return StallFinding(
            "lr_jump",
            f"The LR reached {c.lr_max:.3g}, {factor:.3g}x the highest LR the optimizer and its scheduler "
            f"were configured with ({c.lr_configured:.3g}); it is {c.lr:.3g} at step {c.step}.",
            HINTS["lr_jump"],
            {"lr_max": c.lr_max, "lr_configured": c.lr_configured, "factor": factor},
        )

    def _warmup(self, c: StallCheck) -> StallFinding | None:
        r = self.rules
        low = c.lr_configured > 0 and c.lr_max <= r.warmup_lr_fraction * c.lr_configured
        if not low or c.step < r.warmup_min_steps:
            return None
        # a warm-up rising linearly from 0 at the pace it has kept so far ends at this step
        reach = (c.step + 1) * c.lr_configured / max(c.lr_max, 1e-300)
        if c.planned_steps is not None:
            late = reach > c.planned_steps
            ends = (
                f"at this pace it would reach it around step {reach:.3g}, after the planned {c.planned_steps}"
            )
        else:
            late = c.step >= r.warmup_lr_steps
            ends = f"at this pace it would reach it around step {reach:.3g}"
        if not late:
            return None
        share = c.lr_max / c.lr_configured
        return StallFinding(
            "warmup_never_ends",
            f"After {c.step + 1} steps the LR has never been above {share:.2%} of the configured "
            f"{c.lr_configured:.3g} (highest so far {c.lr_max:.3g}); {ends}.",
            HINTS["warmup_never_ends"],
            {"lr_max": c.lr_max, "lr_configured": c.lr_configured, "share": share, "reach_step": reach},
        )

    def _no_warmup(self, c: StallCheck) -> StallFinding | None:
        """A transformer under an adaptive optimizer at its full LR from step 0, whose first updates rewrite
        ``warmup_ratio`` of the weights a step, on ``patience`` checks of the dense start."""
        r, ratio = self.rules, c.update_ratio_total
        if not (c.adaptive and c.attention) or c.step >= r.warmup_min_steps:
            return None
        full = c.lr_configured > 0 and c.lr >= 0.5 * c.lr_configured and self.lr_history[0][1] >= 0.5 * c.lr
        holds = full and ratio is not None and ratio >= r.warmup_ratio
        if not self._streak("warmup_missing", holds) or ratio is None:
            return None
        return StallFinding(
            "warmup_missing",
            f"No learning-rate warm-up: the LR is {c.lr:.3g} from step 0 (configured {c.lr_configured:.3g}), "
            f"and the first updates rewrite {ratio:.1%} of the weights a step (update/weight ratio "
            f"{ratio:.3g} on {self.streaks['warmup_missing']} checks in a row, step {c.step}; runs with a "
            f"warm-up start near 0.5 %).",
            HINTS["warmup_missing"],
            {"update_ratio": ratio, "lr": c.lr, "lr_configured": c.lr_configured},
        )

    def _chance(self, c: StallCheck) -> StallFinding | None:
        r, chance = self.rules, self.chance()
        low, high = self.chance_band()
        warm = c.lr_configured <= 0 or c.lr_max > r.warmup_lr_fraction * c.lr_configured
        # a fresh model's loss starts near the chance level (CS231n), about ln V for tokens: a first loss
        # far from it says the loss is not a cross-entropy over these targets (a regression, say)
        top = r.chance_ceiling * max(chance, self.uniform()) if self.token_counts is not None else high
        armed = self.num_classes is not None or (
            self.first_loss is not None and chance / r.chance_ceiling <= self.first_loss <= top
        )
        judged = (
            warm  # while the LR has not risen yet no learning is expected (see warmup_never_ends)
            and armed
            and not self.fired & _CAUSES  # a symptom of a cause already named
            and c.loss is not None
            and c.step >= r.warmup_steps
            and self.lr_fell_at is None  # an LR 100x down: lr_decayed names it, with its history
            and math.isfinite(chance)
            and len(self.window) > r.patience
        )
        trend = loss_trend(self.window) if judged else None
        # a slow learner still falls, by more than its noise: a stuck one does not
        stuck = (
            trend is not None
            and low <= trend.level <= high
            and (trend.fall < r.trend_floor * trend.level or trend.fall < r.trend_sigmas * trend.noise)
        )
        self.streaks["chance_level"] = self.streaks.get("chance_level", 0) + 1 if stuck else 0
        if trend is None or self.streaks["chance_level"] < r.chance_checks:
            return None
        return self._chance_finding(c, trend.level, trend.fall, trend.noise)

    def _chance_finding(self, c: StallCheck, level: float, fall: float, noise: float) -> StallFinding:
        chance, uniform, since = self.chance(), self.uniform(), self.window[0][0]
        if self.token_counts is not None:
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
        return StallFinding(
            "chance_level",
            f"From step {since} to step {c.step} the training loss ({level:.4g}) stayed at the chance level "
            f"({what}); over those steps it fell {fall:.3g} ({fall / level:.1%}; noise {noise:.2g})."
            + self._decay_note(c),
            f"Nothing about the inputs is being learned: {inputs}; that the model's parameters are in the "
            f"optimizer and not frozen; and the LR (now {c.lr:.3g}).",
            {"loss": level, "chance": chance, "uniform": uniform, "fall": fall, "lr": c.lr},
        )

    def _decay_note(self, c: StallCheck) -> str:
        """A sentence when the weight decay drives most decayed layers' updates now (their weights below
        their highest, the decay's part of the update the larger), else nothing."""
        layers = [k for k, (d, _) in c.decay.items() if d > 0 and k in c.weight_norms]
        heavy = [
            k
            for k in layers
            if c.decay[k][0] >= self.rules.decay_dominance * c.decay[k][1]
            and c.weight_norms[k] < self.peak_weight.get(k, 0.0)
        ]
        if not layers or len(heavy) <= self.rules.collapse_layers * len(layers) or not c.decay_groups:
            return ""
        lr, wd = max(c.decay_groups, key=lambda g: g[0] * g[1])
        return (
            f" The weight decay's part of the update is larger than the rest of it in {len(heavy)} of the "
            f"{len(layers)} decayed layers, whose weights are shrinking (weight_decay={wd:.3g} at "
            f"lr={lr:.3g}): the decay may be what holds the loss there."
        )

    def _weight_decay(self, c: StallCheck) -> StallFinding | None:
        r = self.rules
        layers = {
            k: dr for k, dr in c.decay.items() if dr[0] > 0 and math.isfinite(c.weight_norms.get(k, math.nan))
        }
        shrunk = []
        for k in layers:
            w, previous = c.weight_norms[k], self.last_weight.get(k)
            self.peak_weight[k] = max(self.peak_weight.get(k, w), w)
            self.last_weight[k] = w
            decay, rest = layers[k]
            falling = previous is not None and w < previous and w * r.decay_fall <= self.peak_weight[k]
            if falling and decay >= r.decay_dominance * rest:
                shrunk.append(k)
        shrinking = bool(layers) and len(shrunk) > r.collapse_layers * len(layers)
        self.decay_since = (
            (self.decay_since if self.decay_since is not None else c.step) if shrinking else None
        )
        # shrinking on `patience` checks in a row, and the loss stopped improving far from done
        if (
            not self._streak("weight_decay_collapse", shrinking)
            or not self._far_from_done()
            or self._improving()
        ):
            return None
        return self._decay_finding(c, shrunk, len(layers))

    def _decay_finding(self, c: StallCheck, shrunk: list[str], decayed: int) -> StallFinding:
        worst = max(shrunk, key=lambda k: self.peak_weight[k] / max(c.weight_norms[k], 1e-300))
        fall = self.peak_weight[worst] / max(c.weight_norms[worst], 1e-300)
        decay = math.sqrt(sum(c.decay[k][0] ** 2 for k in shrunk))
        rest = math.sqrt(sum(c.decay[k][1] ** 2 for k in shrunk))
        share = decay / (decay + rest) if decay + rest > 0 else 1.0
        times = decay / max(rest, 1e-300)
        lr, wd = max(c.decay_groups, key=lambda g: g[0] * g[1]) if c.decay_groups else (c.lr, math.nan)
        return StallFinding(
            "weight_decay_collapse",
            f"Weight decay is shrinking the weights away: since step {self.decay_since} the weight norms of "
            f"{len(shrunk)} of the {decayed} decayed layers fell {self.rules.decay_fall:g}x or more below "
            "their highest, "
            f"lower at every check ({worst}: {self.peak_weight[worst]:.3g} -> {c.weight_norms[worst]:.3g}, "
            f"{fall:.3g}x), while the decay term lr * weight_decay * ||w|| was {times:.3g}x "
            f"the rest of the update (its share {share:.0%}). weight_decay={wd:.3g} at lr={lr:.3g} removes "
            f"{lr * wd:.3g} of every weight per step; the loss stopped improving (best {self.best_raw:.4g}, "
            f"first {self.first_loss:.4g}).",
            HINTS["weight_decay_collapse"],
            {"weight_decay": wd, "lr": lr, "fall": fall, "decay_share": share, "layers": float(len(shrunk))},
        )

    def _plateau(self, c: StallCheck) -> StallFinding | None:
        r = self.rules
        if self.smoothed is None or self.first_loss is None or c.step < r.warmup_steps:
            return None
        regressed = self.smoothed > r.plateau_factor * self.best
        never = self.smoothed >= 0.9 * self.first_loss
        if self.checks_since_best < r.plateau_checks or not (regressed or never) or self.fired:
            return None
        return StallFinding(
            "loss_plateau",
            f"The smoothed training loss ({self.smoothed:.4g}) has not improved for {self.checks_since_best} "
            f"checks; its best was {self.best:.4g}, its first {self.first_loss:.4g}.",
            HINTS["loss_plateau"],
            {"loss": self.smoothed, "best": self.best, "first": self.first_loss},
        )

    def _sorted(self, c: StallCheck) -> StallFinding | None:
        r, labels = self.rules, c.labels
        if labels is None or not labels or sum(labels) < 8:
            return None
        total, seen = sum(labels), sum(self.label_counts)
        order = sorted(range(len(labels)), key=lambda i: -labels[i])
        one, two = batch_purity(labels)
        classes_seen = sum(n > 0 for n in self.label_counts)

        def minority(i: int) -> bool:
            return seen > 0 and self.label_counts[i] <= r.sorted_minority * seen

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
        if not self._streak("sorted_labels", pure):
            return None
        top = order[0]
        return StallFinding(
            "sorted_labels",
            f"{self.streaks['sorted_labels']} checked batches in a row were almost one class each (step "
            f"{c.step}: {labels[top] / total:.0%} class {top}), while that class is "
            f"{self.label_counts[top] / seen:.0%} of the labels seen.",
            HINTS["sorted_labels"],
            {"majority": labels[top] / total, "class_share": self.label_counts[top] / seen},
        )


#: findings that name a cause; a loss at chance or on a plateau after one of them is its symptom
_CAUSES = frozenset(
    {
        "no_update",
        "clipped_updates",
        "lr_decayed",
        "updates_collapsed",
        "lr_jump",
        "warmup_never_ends",
        "warmup_missing",
        "sorted_labels",
        "weight_decay_collapse",
        "update_below_precision",
    }
)
