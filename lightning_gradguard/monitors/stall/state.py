"""What the stall rules remember between checks: the LR history, the losses, the labels and tokens seen,
the streaks; with the chance level they judge the loss against. Saved in checkpoints as plain values."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from lightning_gradguard.alerts import Rule
from lightning_gradguard.functional.health import label_lean
from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds, label_entropy, token_entropy

#: what :meth:`StallState.state_dict` saves
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
    "profiles",
)


class StallState:
    """What the stall rules remember between checks, fed one :class:`StallCheck` at a time (:meth:`update`)
    and judged by :func:`~lightning_gradguard.monitors.stall.rules.observe`."""

    def __init__(self, thresholds: StallThresholds, num_classes: int | None = None) -> None:
        self.thresholds, self.num_classes = thresholds, num_classes
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
        #: (step, sums, counts) of the outputs' class profile since the check before, for the last
        #: ``patience + 1`` checks that measured it (:mod:`~lightning_gradguard.monitors.stall.evidence`)
        self.profiles: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._leaning: tuple[tuple[int, ...], tuple[float, float, int] | None] = ((), None)  # (steps, lean)
        # the schedule read ahead against the LRs the checked steps used (not saved: a resumed run is not
        # read ahead): the last step compared, how many matched, whether one did not
        self._ahead_upto, self._ahead_matched, self._ahead_wrong = -1, 0, False

    # ------------------------------------------------------------------ bookkeeping
    def state_dict(self) -> dict[str, Any]:
        """Everything the rules remember, as plain Python values (for a checkpoint)."""
        out = {k: copy.deepcopy(getattr(self, k)) for k in _SAVED}
        out["fired"] = sorted(self.fired)
        out["lr_history"] = [list(x) for x in self.lr_history]
        out["window"] = [list(x) for x in self.window]
        out["profiles"] = [[s, a.tolist(), n.tolist()] for s, a, n in self.profiles]
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
        self.profiles = [(int(s), torch.as_tensor(a), torch.as_tensor(n)) for s, a, n in self.profiles]
        self._leaning = ((), None)
        counts = state.get("token_counts")
        self.token_counts = None if counts is None else torch.as_tensor(counts, dtype=torch.float64).clone()

    def count(self, rule: Rule, holds: bool) -> int:
        """The checks in a row on which ``rule``'s condition held, this one counted (0 when it does not)."""
        self.streaks[rule.kind] = self.streaks.get(rule.kind, 0) + 1 if holds else 0
        return self.streaks[rule.kind]

    def streak(self, rule: Rule, holds: bool) -> bool:
        """Count this check for ``rule`` (:meth:`count`): whether it held on ``patience`` checks in a row."""
        return self.count(rule, holds) >= self.thresholds.patience

    def checks_in_a_row(self, rule: Rule) -> int:
        """The checks in a row on which ``rule``'s condition held, up to the last one counted."""
        return self.streaks.get(rule.kind, 0)

    def _loss(self, loss: float | None) -> None:
        if loss is None or not math.isfinite(loss):
            return
        if self.first_loss is None:
            self.first_loss = loss
        if loss < self.best_raw * (1 - self.thresholds.improvement):
            self.best_raw, self.checks_since_best_raw = loss, 0
        else:
            self.checks_since_best_raw += 1
        self.smoothed = loss if self.smoothed is None else 0.7 * self.smoothed + 0.3 * loss
        if self.smoothed < self.best * (1 - self.thresholds.improvement):
            self.best, self.checks_since_best = self.smoothed, 0
        else:
            self.best = min(self.best, self.smoothed)
            self.checks_since_best += 1

    def improving(self) -> bool:
        return self.checks_since_best_raw < self.thresholds.patience

    def far_from_done(self) -> bool:
        """The loss is still above half its first value (a run that learned and converged is not stalled)."""
        return (
            self.smoothed is not None
            and self.first_loss is not None
            and self.smoothed > 0.5 * self.first_loss
        )

    def lr_fell_early(self, c: StallCheck) -> bool:
        """The LR fell ``collapse_factor`` times below its maximum within the first ``early_phase`` of the
        planned run (a schedule that decays over the run gets there near its end); unknown plan: the loss
        decides."""
        if self.lr_fell_at is None:
            return False
        if c.planned_steps is not None:
            return self.lr_fell_at < self.thresholds.early_phase * c.planned_steps
        return self.far_from_done()

    def ahead_confirmed(self, c: StallCheck) -> bool:
        """The schedule read ahead is the run's: the LR of at least ``patience`` checked steps so far was
        the one read ahead for that step (a scheduler that reads something else than its step count, the
        Trainer's ``global_step`` say, would be read ahead wrongly: its verdicts are not given)."""
        lrs = c.ahead.lrs if c.ahead is not None else ()
        for step, lr in self.lr_history:  # the checks since the last call (each LR is compared once)
            if self._ahead_upto < step < len(lrs):
                self._ahead_matched += 1
                self._ahead_wrong |= not math.isclose(lr, lrs[step], rel_tol=1e-6, abs_tol=1e-12)
                self._ahead_upto = step
        return self._ahead_matched >= self.thresholds.patience and not self._ahead_wrong

    def leaning(self) -> tuple[float, float, int] | None:
        """How far the outputs leaned toward the labels over the steps of the loss window
        (:func:`~lightning_gradguard.functional.health.label_lean` of their summed class profile): the
        mean own-class score, the share of the relabelings that lean as far, the examples measured;
        ``None`` when not measured."""
        since = self.window[0][0] if self.window else -1
        parts = [p for p in self.profiles if p[0] > since]
        key = tuple(p[0] for p in parts)
        if self._leaning[0] != key:  # once per check: the rules, the message and the chart read it
            self._leaning = (key, self._lean_of(parts))
        return self._leaning[1]

    @staticmethod
    def _lean_of(parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[float, float, int] | None:
        if not parts:
            return None
        sums, counts = sum(p[1] for p in parts), sum(p[2] for p in parts)
        assert isinstance(sums, torch.Tensor) and isinstance(counts, torch.Tensor)
        lean, p = label_lean(sums, counts)
        return (lean, p, int(counts.sum())) if math.isfinite(lean) else None

    def learning(self) -> bool:
        """The outputs leaned toward the labels more than all but ``learning_p`` of the relabelings of the
        classes would: the model is learning something that carries over to new inputs, whatever its loss
        says."""
        lean = self.leaning()
        return lean is not None and lean[1] <= self.thresholds.learning_p

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
        r, chance, uniform = self.thresholds, self.chance(), self.uniform()
        high = r.chance_ceiling * chance
        if math.isfinite(uniform):
            high = max(high, (1 + r.chance_margin) * uniform)
        return (1 - r.chance_margin) * chance, high

    # ------------------------------------------------------------------ the rules
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

    def update(self, c: StallCheck) -> None:
        """Take one check into the history (the LR, the loss and its window, the labels and tokens seen);
        the rules then judge it (:func:`~lightning_gradguard.monitors.stall.rules.observe`)."""
        self.lr_history.append((c.step, c.lr))
        if len(self.lr_history) > 512:  # a long run keeps every other entry: the first and the spread stay
            self.lr_history = self.lr_history[::2]
        if c.lr_max > 0 and c.lr < c.lr_max / self.thresholds.collapse_factor:
            self.lr_fell_at = c.step if self.lr_fell_at is None else self.lr_fell_at
        else:
            self.lr_fell_at = None
        self._loss(c.loss)
        if c.loss is not None and math.isfinite(c.loss):
            self.window = [*self.window, (c.step, c.loss, c.loss_stderr)][-(self.thresholds.patience + 1) :]
        self._count(c)
        if c.class_profile is not None:
            entry = (c.step, *c.class_profile)
            self.profiles = [*(p for p in self.profiles if p[1].shape == entry[1].shape), entry]
            self.profiles = self.profiles[-(self.thresholds.patience + 1) :]
