"""What the stall rules remember between checks: the LR history, the losses, the labels and tokens seen,
the streaks; with the chance level they judge the loss against. Saved in checkpoints as plain values."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_gradguard.alerts import Finding, Rule
from lightning_gradguard.core.runstate import LEFT_OUT, RunField, Stateful, Streaks, nothing
from lightning_gradguard.functional.health import label_lean
from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds, label_entropy, token_entropy


def _token_counts_saved(state: StallState, counts: torch.Tensor | None) -> Any:
    """Trailing zeros dropped (a large vocabulary's tail is unseen); no key before any token target."""
    if counts is None:
        return LEFT_OUT
    seen = torch.nonzero(counts).reshape(-1)
    return counts[: int(seen[-1]) + 1 if seen.numel() else 0].clone()


def _token_counts(state: StallState, saved: Any) -> torch.Tensor | None:
    return None if saved is None else torch.as_tensor(saved, dtype=torch.float64).clone()


def _lr_history(state: StallState, saved: Any) -> list[tuple[int, float]]:
    return [(int(s), float(lr)) for s, lr in saved]


def _window(state: StallState, saved: Any) -> list[tuple[int, float, float | None]]:
    return [(int(s), float(v), None if e is None else float(e)) for s, v, e in saved]


def _profiles_saved(state: StallState, profiles: list[tuple[int, torch.Tensor, torch.Tensor]]) -> Any:
    return [[s, a.tolist(), n.tolist()] for s, a, n in profiles]


def _profiles(state: StallState, saved: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    return [(int(s), torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(n)) for s, a, n in saved]


def _no_lean() -> tuple[tuple[int, ...], tuple[float, float, int] | None]:
    return (), None


def _minus_one() -> int:
    return -1


def _infinity() -> float:
    return math.inf


class StallState(Stateful):
    """What the stall rules remember between checks, fed one :class:`StallCheck` at a time (:meth:`update`)
    and judged by :func:`~lightning_gradguard.monitors.stall.rules.observe`. Saved in checkpoints as plain
    values, one key per field (``core.runstate``)."""

    streaks: RunField[Streaks] = RunField(Streaks)  # per rule kind: the checks in a row it held
    peak_ratio: RunField[dict[str, float]] = RunField(dict)  # per layer: the highest update ratio seen
    collapsed_since: RunField[int | None] = RunField(nothing)
    smoothed: RunField[float | None] = RunField(nothing)  # EMA of the check losses
    first_loss: RunField[float | None] = RunField(nothing)
    best: RunField[float] = RunField(_infinity)
    checks_since_best: RunField[int] = RunField(int)
    best_raw: RunField[float] = RunField(_infinity)  # the lowest check loss (no smoothing: no lag)
    checks_since_best_raw: RunField[int] = RunField(int)
    #: the first check where the LR was under 1/collapse of its max
    lr_fell_at: RunField[int | None] = RunField(nothing)
    label_counts: RunField[list[float]] = RunField(list)
    #: float64, on the host, indexed by token id
    token_counts: RunField[torch.Tensor | None] = RunField(
        nothing, save=_token_counts_saved, load=_token_counts
    )
    lr_history: RunField[list[tuple[int, float]]] = RunField(list, load=_lr_history)  # (step, LR) per check
    fired: RunField[set[str]] = RunField(set)
    #: (step, mean loss, its standard error) of the last ``patience + 1`` checks with a loss
    window: RunField[list[tuple[int, float, float | None]]] = RunField(list, load=_window)
    peak_weight: RunField[dict[str, float]] = RunField(dict)  # per decayed layer: its highest weight norm
    last_weight: RunField[dict[str, float]] = RunField(dict)  # per decayed layer: the previous check's norm
    decay_since: RunField[int | None] = RunField(nothing)  # the first check of the weight-decay streak
    #: (step, sums, counts) of the outputs' class profile since the check before, for the last
    #: ``patience + 1`` checks that measured it (:mod:`~lightning_gradguard.monitors.stall.evidence`)
    profiles: RunField[list[tuple[int, torch.Tensor, torch.Tensor]]] = RunField(
        list, save=_profiles_saved, load=_profiles
    )
    #: the lean of the last window read, by the steps of its profiles (read once per check)
    _leaning: RunField[tuple[tuple[int, ...], tuple[float, float, int] | None]] = RunField(_no_lean, key=None)
    # the schedule read ahead against the LRs the checked steps used (not saved: a resumed run is not
    # read ahead): the last step compared, how many matched, whether one did not
    _ahead_upto: RunField[int] = RunField(_minus_one, key=None)
    _ahead_matched: RunField[int] = RunField(int, key=None)
    _ahead_wrong: RunField[bool] = RunField(bool, key=None)

    def __init__(self, thresholds: StallThresholds, num_classes: int | None = None) -> None:
        self.thresholds, self.num_classes = thresholds, num_classes

    def count(self, rule: Rule[Any], holds: bool) -> int:
        """The checks in a row on which ``rule``'s condition held, this one counted (0 when it does not)."""
        return self.streaks.update(rule.kind, holds)

    def first_time(self, finding: Finding) -> bool:
        """Whether ``finding``'s kind is named for the first time this run (then it is noted as named)."""
        if finding.kind in self.fired:
            return False
        self.fired.add(finding.kind)
        return True

    def streak(self, rule: Rule[Any], holds: bool) -> bool:
        """Count this check for ``rule`` (:meth:`count`): whether it held on ``patience`` checks in a row."""
        return self.count(rule, holds) >= self.thresholds.patience

    def checks_in_a_row(self, rule: Rule[Any]) -> int:
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
