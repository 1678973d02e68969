"""The search after the sweep: the range test brackets the learning rate, short trainings decide.

A range test's curve says where the loss starts to fall fast (its steep point) and where it blows up; it
does not say which LR in between trains best, least of all under gradient clipping, a warm-up or a
one-cycle schedule, or on a noisy curve. The search trains a few candidates, log-spaced across that
bracket, each for the same short number of optimizer steps from the same start (the snapshot taken
before the sweep: same parameters, optimizer state, random numbers and batches), with the run's own
optimizer, clipping, precision and accumulation, and its LR schedule compressed to the trial's length. Each
candidate is scored by the loss it reached: the mean of ``training_step``'s loss over a fixed set of
held-out batches (the validation loader's when the run has one, else training samples the trials never
train on: :mod:`.holdout`), in eval mode and without gradients.

Successive halving keeps the cost small: every candidate trains ``r`` steps; the best two, and one more
point (between them where the losses' parabola in log-LR has its low, or half a grid step past the
bracket's edge when the best sits on it), train ``2 r`` steps; the lowest loss of that round wins, and the
search chooses the winner's LR over :data:`SHORT_HORIZON` (short trials favour large LRs). The
search chooses nothing when no candidate got clearly below the loss before training, or when what the
winner learned does not depend on its inputs (:data:`INPUT_SHARE`); the engine then runs it again with
trials twice as long (:func:`too_short`, :func:`joined`), and where even those learn nothing, the sweep's
suggestion stands. When twice the steps did not get the second round's best clearly below the first round's,
the trials learned nothing more: the search says so (``SearchResult.note``). The caller restores
everything afterwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gradguard.core.batch import batch_size_of, mismatched, prepare_batch
from lightning_gradguard.core.snapshot import TrainingSnapshot
from lightning_gradguard.core.trial import NoTrialLoss, TrialClosure, quiet_logging, trial_optimizer_step
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult, SearchResult, Trial
from lightning_gradguard.monitors.lr_finder.schedule import Schedule, compressed

#: the evaluation batches aim at this many samples ...
EVAL_SAMPLES = 512

#: ... in at least 2 and at most this many batches (and never more than a first-round trial's steps)
MAX_EVAL_BATCHES = 32

#: a first-round trial shorter than this is no trial: the search is skipped (the budget is too small)
MIN_TRIAL_STEPS = 5

#: two losses within this share of each other are the same loss (summation order)
UNCHANGED = 1e-5

#: candidates of the second round: the best two of the first, and one more point
SECOND_ROUND = 3

#: two candidates closer than this factor are one (the extra point of the second round is dropped)
SAME_LR = 1.1

Batches = Iterator[tuple[Any, int]]


#: the search chooses its winner's LR over this. Trials of a few dozen steps favour large LRs: a large LR
#: makes the most of a few steps, and the noise it keeps, or the blow-up it risks, shows over a long run.
#: Training every LR of the brute-force grid for 54 steps (the second round of a 300-step budget), its best
#: sat a median 1.33x above the 150-1,500-step run's best on 18 tasks; and a run's loss rises slowly below its
#: best LR and steeply above it, so a pick too high costs more than one as far too low. On the 23 tasks of
#: ``benchmarks/lr_hard.py`` (six seeds), any divisor from 1.2 to 1.5 lowered the mean ratio to the best about
#: equally (docs/benchmarks.md), so the value is no knife-edge; 1.25 sits low in that range. Kept at the
#: 600-step default (trials of 54 and 108 steps): dividing by 1.0, 1.25, 1.6 and 2.0 there scored 2.59, 2.22,
#: 2.01 and 1.92 at the grid's mean loss on the 38 tasks (within 10 % on 16, 20, 19 and 19), measured on
#: the tasks that chose the budget, so not a choice a held-out set has judged
SHORT_HORIZON = 1.25

#: a run whose LR holds its level, unclipped (no schedule, or a warm-up to a level it keeps), is searched up
#: to its divergence edge over this: a short range test's edge is no constant LR's (Smith 2017 sets a cycle's
#: base LR 3-4x below the edge of its range test); the digits MLP of examples/lr_find.py, searched up to its
#: edge, picked 0.24 (edge 0.53), which its trials liked and its 110-step run did not: at chance on one
#: machine's rounding, 95 % on another. A CTC recogniser warmed up to a constant LR, searched up to its
#: edge (a warm-up counted as safe), scored 6.83 times the best loss; 1.83 with the margin
CONSTANT_MARGIN = 3.0


def bracket(
    result: LRFinderResult, schedule: Schedule | None, clipped: bool = False
) -> tuple[float, float] | None:
    """The configured-LR range to search: from the curve's steep point (or the sweep's suggestion, if
    lower) to :func:`top`. Under a warm-up both ends are divided by the schedule's peak factor, as the
    ``peak`` rule is. ``None``: the sweep gave no suggestion (see :func:`blind_bracket`) or no range."""
    if result.suggestion is None or not result.lrs:
        return None
    scale = _peak_scale(schedule)
    steep = result.suggestions.get("steep")
    low = min(result.suggestion, steep / scale if steep else result.suggestion)
    high = top(result, schedule, clipped, guessed_edge=False)
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0:
        return None
    return low, max(high, low)


#: a sweep whose descent is lost in its noise is searched over this many decades below its :func:`top`
BLIND_DECADES = 2.0


def blind_bracket(
    result: LRFinderResult, schedule: Schedule | None, clipped: bool = False
) -> tuple[float, float] | None:
    """The range to search when the sweep's descent did not stand out of its noise: the curve cannot say
    where the loss falls fastest, only how far the LR went before it blew up, so the search spans
    :data:`BLIND_DECADES` below :func:`top` (with its margin even where the sweep never diverged: the edge
    then lies somewhere above its last LR). ``None``: no sweep, or a descent that stood out (that has a
    :func:`bracket`)."""
    check = result.descent
    if result.suggestion is not None or not result.lrs or check is None or check.stands_out:
        return None
    high = top(result, schedule, clipped, guessed_edge=True)
    if not math.isfinite(high) or high <= 0:
        return None
    return max(result.lrs[0] / _peak_scale(schedule), high / 10**BLIND_DECADES), high


def top(result: LRFinderResult, schedule: Schedule | None, clipped: bool, guessed_edge: bool) -> float:
    """The highest configured LR to search: the sweep's last LR before its diverging tail (its last LR when
    it never diverged), over the schedule's peak factor under a warm-up. A run whose LR meets most of its
    steps at full size, unclipped (no schedule, or a warm-up to a level it then holds; not one that decays
    from its peak), stops :data:`CONSTANT_MARGIN` below the edge the sweep found, or below the sweep's
    last LR with ``guessed_edge``."""
    warms = schedule is not None and schedule.warms_up and schedule.peak > 0
    decays = warms and schedule is not None and schedule.decays
    top_at = result.divergence_at - 1 if result.divergence_at else len(result.lrs) - 1
    high = result.lrs[max(0, top_at)] / _peak_scale(schedule)
    if not decays and not clipped and (result.divergence_at or guessed_edge):
        high /= CONSTANT_MARGIN
    return high


def _peak_scale(schedule: Schedule | None) -> float:
    """The schedule's peak factor under a warm-up (its configured LR is reached at that factor), else 1."""
    return schedule.peak if schedule is not None and schedule.warms_up and schedule.peak > 0 else 1.0


def log_spaced(low: float, high: float, count: int) -> list[float]:
    """``count`` LRs from ``low`` to ``high``, evenly spaced in log (one when they coincide)."""
    if high <= low * SAME_LR or count < 2:
        return [math.sqrt(low * high)]
    step = math.log(high / low) / (count - 1)
    return [low * math.exp(i * step) for i in range(count)]


def trial_steps(budget: int, candidates: int) -> int:
    """Steps of a first-round trial: the budget over ``candidates`` trials of ``r`` steps and
    :data:`SECOND_ROUND` of ``2 r``."""
    return budget // (candidates + 2 * SECOND_ROUND)


def refinement(grid: list[float], losses: list[float]) -> float | None:
    """The extra point of the second round, from the first round's ``losses`` on the log-spaced ``grid``:
    where a parabola through the best point and its two neighbours (in log-LR) has its low, kept between
    the neighbours; half a grid step outward when the best is an end of the grid; ``None`` for a grid of
    one point or when no loss is finite."""
    finite = [v for v in losses if math.isfinite(v)]
    if len(grid) < 2 or not finite:
        return None
    best = losses.index(min(finite))
    ratio = grid[1] / grid[0]
    if best == 0:
        return grid[0] / math.sqrt(ratio)
    if best == len(grid) - 1:
        return grid[-1] * math.sqrt(ratio)
    left, mid, right = losses[best - 1], losses[best], losses[best + 1]
    curvature = left - 2 * mid + right
    if not (math.isfinite(left) and math.isfinite(right)) or curvature <= 0:
        return grid[best]
    offset = 0.5 * (left - right) / curvature  # in grid steps, within (-0.5, 0.5) at a lowest middle point
    return grid[best] * ratio ** max(-0.5, min(0.5, offset))


@dataclass(kw_only=True)
class CandidateSearch:
    """The search of one range test: what it trains, on what, and how it scores.

    ``training`` returns a fresh pass over the training batches (the same batches in the same order
    after a restore of the snapshot); ``held_out``, the evaluation batches (raw, prepared on use);
    ``skip``, how many of the training pass's first batches are ``held_out`` (0 with a validation loader).
    ``factors`` is the run's LR schedule (group 0's factor per scheduler step; ``[1.0]``: constant).
    """

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    optimizer: Any
    snapshot: TrainingSnapshot
    ratios: list[float]
    factors: list[float]
    training: Callable[[], Batches]
    held_out: list[tuple[Any, int]]
    skip: int
    evaluated_on: str
    on_step: Callable[[], None] = lambda: None

    def run(
        self, grid: list[float], steps: int, prior: float | None = None, first_round: int = 0
    ) -> SearchResult:
        """Train every LR of ``grid`` for ``steps`` steps, then the best two and a refinement for twice as
        many; the last round's winner is chosen (:func:`choose`; ``prior``: the sweep's suggestion). The
        rounds are numbered from ``first_round`` (a retry's follow its predecessor's)."""
        started = time.perf_counter()
        self.snapshot.restore()
        start = self.evaluate()  # the loss before any training: a winner must have learned something
        first = [self.trial(lr, steps, first_round, mismatch=len(grid) == 1) for lr in grid]
        trials, last = list(first), first
        ranked = sorted(first, key=lambda t: t.loss)
        if len(first) > 1 and math.isfinite(ranked[0].loss):
            second = [t.lr for t in ranked[:2] if math.isfinite(t.loss)]
            extra = refinement(grid, [t.loss for t in first])
            if extra is not None and all(max(extra / lr, lr / extra) > SAME_LR for lr in second):
                second.append(extra)
            last = [self.trial(lr, 2 * steps, first_round + 1, mismatch=True) for lr in second]
            trials += last
        best = choose(last, prior)
        reason = _nothing_learned(best, start)
        return SearchResult(
            trials=trials,
            winner=None if reason else best.lr,
            chosen=None if reason else best.lr / SHORT_HORIZON,
            note="" if reason or last is first else plateau_note(first, last),
            bracket=(grid[0], grid[-1]),
            evaluated_on=self.evaluated_on,
            steps=sum(t.steps for t in trials),
            seconds=time.perf_counter() - started,
            reason=reason,
            start_loss=_mean(start),
        )

    def trial(self, lr: float, steps: int, round_: int, mismatch: bool = False) -> Trial:
        """``steps`` optimizer steps at ``lr`` (times the compressed schedule) from the snapshot; its loss
        (and with ``mismatch``, how much of it rests on the inputs: :meth:`input_dependence`)."""
        self.snapshot.restore()
        batches = self.training()
        for _ in range(self.skip):
            next(batches, None)
        draw = _drawer(self.trainer, batches)
        accumulate = max(1, int(self.trainer.accumulate_grad_batches))
        losses: list[float] = []
        with quiet_logging(self.pl_module):
            for factor in compressed(self.factors, steps):
                for group, ratio in zip(self.optimizer.param_groups, self.ratios, strict=True):
                    group["lr"] = lr * factor * ratio
                loss = self._step(draw, accumulate)
                self.on_step()
                losses.append(loss)
                if not math.isfinite(loss):
                    return Trial(lr=lr, round=round_, steps=len(losses), loss=math.inf, train_loss=math.inf)
        self.optimizer.zero_grad(set_to_none=True)
        tail = losses[-max(1, len(losses) // 4) :]
        each = self.evaluate()
        loss = sum(each) / len(each) if each else math.inf
        depends = self.input_dependence(each) if mismatch and math.isfinite(loss) else math.nan
        return Trial(
            lr=lr,
            round=round_,
            steps=len(losses),
            loss=loss if math.isfinite(loss) else math.inf,
            train_loss=sum(tail) / len(tail),
            batch_losses=tuple(each) if math.isfinite(loss) else (),
            input_dependence=depends,
        )

    def _step(self, draw: Callable[[], tuple[Any, int]], accumulate: int) -> float:
        """One optimizer step of a trial; its loss (mean over ranks), ``nan`` when there was none."""
        closure = TrialClosure(
            self.trainer, self.pl_module, self.optimizer, draw, accumulate, through_strategy=True
        )
        try:
            done = trial_optimizer_step(self.trainer, self.optimizer, lambda: self._mean(closure()))
        except (NoTrialLoss, StopIteration):
            return math.nan
        return float(done.loss)

    def _mean(self, loss: torch.Tensor) -> torch.Tensor:
        if self.trainer.world_size > 1:
            return self.trainer.strategy.reduce(loss, reduce_op="mean")
        return loss

    def evaluate(self, mismatch: bool = False) -> list[float]:
        """``training_step``'s loss on each held-out batch, in eval mode, without gradients (each the mean
        over ranks, read in one transfer). With ``mismatch``, on the batches with every sample's inputs
        paired with another sample's targets (:func:`~lightning_gradguard.core.batch.mismatched`): a batch
        that cannot be mismatched, or whose loss fails there, gives ``nan`` (on every rank alike, so the
        ranks' reduction always meets)."""
        each: list[torch.Tensor] = []
        score = self._mismatched_loss if mismatch else self._loss
        self.pl_module.eval()
        with torch.no_grad(), quiet_logging(self.pl_module):
            for batch, batch_idx in self.held_out:
                loss = score(prepare_batch(self.trainer, batch), batch_idx)
                if loss is not None:
                    each.append(loss)
        if not each:
            return []
        return [float(v) for v in self._mean(torch.stack(each)).cpu()]

    def _loss(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """``training_step``'s loss on ``batch`` (a 0-d float tensor); ``None`` for a step that returned no
        loss."""
        out = self.trainer.strategy.training_step(batch, batch_idx)
        loss = out["loss"] if isinstance(out, dict) else out
        return loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else None

    def _mismatched_loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss on ``batch`` with inputs and targets mismatched; ``nan`` where it cannot be built, the
        step fails on it (a batch the user's code never meets: ours to absorb, not theirs to see) or
        returns no loss."""
        other = mismatched(batch)
        nan = torch.tensor(math.nan, device=self.pl_module.device)
        if other is None:
            return nan
        try:
            loss = self._loss(other, batch_idx)
        except Exception:
            return nan
        return nan if loss is None else loss

    def input_dependence(self, each: list[float]) -> float:
        """How much of the trained model's loss rests on its inputs: the rise of the held-out loss when
        every sample's inputs meet another sample's targets, as a share of that mismatched loss, over the
        batches that can be mismatched (below 0 where mismatching lowered it). ``nan`` where none can, where
        mismatching changed nothing (a loss that does not depend on the pairing, such as an autoencoder's
        of ``x`` against itself), or where a share below :data:`INPUT_SHARE` meets a second evaluation of
        the same batches that gives another loss (a stochastic loss, such as one of sampled latents: its
        noise could pass for either answer; a share above it says the model uses its inputs either way)."""
        other = self.evaluate(mismatch=True)
        if len(other) != len(each):
            return math.nan
        pairs = [(m, a) for m, a in zip(other, each, strict=True) if math.isfinite(m)]
        mismatched, matched = _mean([m for m, _ in pairs]), _mean([a for _, a in pairs])
        if not pairs or mismatched == 0 or _same(mismatched, matched):
            return math.nan
        share = (mismatched - matched) / abs(mismatched)
        if share < INPUT_SHARE:
            again = self.evaluate()
            if len(again) != len(each) or not all(_same(a, b) for a, b in zip(again, each, strict=True)):
                return math.nan
        return share


def choose(last: list[Trial], prior: float | None = None) -> Trial:
    """The winner of the last round: of the candidates whose loss is within one standard error of the
    lowest (the mean of their batch-by-batch differences against that mean's standard error), the one
    nearest in log-LR to ``prior`` (the sweep's own suggestion), or the smallest LR without one.

    The held-out batches overrule the curve only where they can tell candidates apart. Where they cannot,
    the curve's suggestion decides; it is the bracket's bottom under a constant LR, so there the smallest
    LR of the tie wins, the safer one: a short trial favours large LRs (they make the most of a few steps,
    and the noise they keep shows only over a long run)."""
    best = min(last, key=lambda t: t.loss)
    tied = [t for t in last if t is best or _within_one_se(t, best)]
    if prior is None or prior <= 0 or not math.isfinite(best.loss):
        return min(tied, key=lambda t: t.lr)
    return min(tied, key=lambda t: (abs(math.log(t.lr / prior)), t.lr))


#: a winner whose held-out loss rises by less than this share when its inputs meet other samples' targets has
#: learned what does not depend on its inputs. On the 28 tasks of ``benchmarks/lr_hard.py`` (six seeds), the
#: winners of the 22 tasks whose trials learned the task rose by 26-99 %; those of the 3 whose trials end
#: where a model that ignores its inputs does (a ViT and a pre-LN transformer tagger at the label
#: frequencies, a VAE at the mean image) by -0.1 to 4 %, when 0.1 was chosen, between the two. With the
#: schedule read right (schedule.guessed_end), the tagger's trials learn a little more: 1.9-14 %, below
#: 0.1 on 5 of 6 seeds. On the 34 healthy transformers runs of ``benchmarks/real_models.py`` (lr_find at its
#: defaults, 33 searches) it fired on none, before and after the targets took the inputs' place as what
#: moves; the lowest winners (targets moved): a ViT 15-17 %, T5 18.7 %, DeiT 20.5 %
INPUT_SHARE = 0.1


def _nothing_learned(best: Trial, start: list[float]) -> str:
    """Why the trials cannot choose (empty when they can): every candidate diverged, the winner did not
    get clearly below the loss before training (:func:`_learned`), or what it learned does not depend on
    its inputs (:data:`INPUT_SHARE`)."""
    if not math.isfinite(best.loss):
        return "every candidate's training loss became non-finite"
    if not _learned(best, start):
        return (
            f"no candidate's loss fell clearly below the loss before training ({_mean(start):.4g}) in "
            f"{best.steps} steps: the trials are too short for this model"
        )
    if best.input_dependence < INPUT_SHARE:  # False for nan: no evidence either way
        return (
            f"the best candidate's held-out loss rose only {best.input_dependence:.1%} when each sample's "
            "inputs met another sample's targets: in "
            f"{best.steps} steps the trials learned what does not depend on the inputs (such as how often "
            "each target occurs), not the task, so their losses cannot rank the LRs"
        )
    return ""


def too_short(result: SearchResult) -> bool:
    """Whether longer trials might choose where these could not: the search chose nothing, though a
    candidate trained without diverging (its loss did not fall clearly below the start, or what it learned
    does not depend on its inputs) and moved the held-out loss at all (a loss that does not depend on the
    trained weights stays where it started, however long the trials)."""
    finite = [t.loss for t in result.trials if math.isfinite(t.loss)]
    return result.chosen is None and any(not _same(v, result.start_loss) for v in finite)


def joined(attempts: list[SearchResult]) -> SearchResult:
    """The search's outcome from its attempts, each one's trials twice as long as the one before (the
    engine runs another while :func:`too_short`): the last one's choice and reason, every attempt's
    trials, steps and seconds, and a note of the retries."""
    last = attempts[-1]
    retried = ""
    if len(attempts) > 1:
        first = attempts[0]
        longest = max((t.steps for t in first.trials), default=0)
        retried = (
            f"in trials of up to {longest} steps, {first.reason}; the search ran {len(attempts) - 1} more "
            f"time{'s' if len(attempts) > 2 else ''}, its trials twice as long each time"
        )
    return SearchResult(
        trials=[t for a in attempts for t in a.trials],
        winner=last.winner,
        chosen=last.chosen,
        bracket=attempts[0].bracket,
        evaluated_on=last.evaluated_on,
        steps=sum(a.steps for a in attempts),
        seconds=sum(a.seconds for a in attempts),
        reason=last.reason + (" (raise search_steps)" if too_short(last) else ""),
        start_loss=last.start_loss,
        note="; ".join(n for n in (retried, last.note) if n),
        retries=len(attempts) - 1,
    )


def plateau_note(first: list[Trial], last: list[Trial]) -> str:
    """What to say when the second round, trained twice as long, did not get its best loss clearly (two
    standard errors of the batch-by-batch differences) and materially (:data:`LEARNED_SHARE` of its level)
    below the first round's best: the trials learned nothing more after their first ``r`` steps, so they
    tell how fast an LR gets the loss to where it stays, not how it trains over a run. Empty otherwise.

    Said, not acted on: the sweep's suggestion instead of the choice did worse on both sets of
    ``benchmarks/lr_hard.py`` (docs/lr_finder.md, *The search after the sweep*)."""
    before = min(first, key=lambda t: t.loss)
    after = min(last, key=lambda t: t.loss)
    diffs = _differences(before.batch_losses, after.batch_losses)
    if diffs is None or not math.isfinite(before.loss):
        return ""
    if diffs[0] > 2 * diffs[1] and diffs[0] >= LEARNED_SHARE * abs(before.loss):
        return ""
    return (
        f"twice the steps ({after.steps}) did not lower the held-out loss clearly below the first round's "
        f"best ({before.loss:.4g} -> {after.loss:.4g}): the trials learned nothing more, so the choice rests "
        "on how fast each LR got there; if the model learns slowly, raise search_steps"
    )


def _within_one_se(trial: Trial, best: Trial) -> bool:
    """Whether ``trial``'s loss exceeds ``best``'s by at most one standard error of their paired
    batch-by-batch differences."""
    if not math.isfinite(trial.loss):
        return False
    diffs = _differences(trial.batch_losses, best.batch_losses)
    return diffs is not None and diffs[0] <= diffs[1]


#: a winner must have lowered the held-out loss by this share of its level before training: a classifier
#: whose trials only learned the class frequencies moves it by a few tenths of a percent on every batch
#: (the digits MLP of examples/lr_find.py at chance: 2.302 -> 2.293), a sure but empty gain
LEARNED_SHARE = 0.02


def _learned(best: Trial, start: list[float]) -> bool:
    """Whether the winner's loss lies clearly (two standard errors of the batch-by-batch differences) and
    materially (:data:`LEARNED_SHARE` of the level) below the loss before training; ``True`` when there is
    nothing to compare."""
    diffs = _differences(list(start), best.batch_losses)
    return diffs is None or (diffs[0] > 2 * diffs[1] and diffs[0] >= LEARNED_SHARE * abs(_mean(start)))


def _differences(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """The mean of ``a - b`` batch by batch and its standard error (``None``: fewer than two pairs)."""
    n = len(a)
    if n < 2 or n != len(b):
        return None
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / n
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return mean, spread / math.sqrt(n)


def _same(a: float, b: float) -> bool:
    """Whether two losses are equal up to :data:`UNCHANGED` of their size (a nan is never the same)."""
    return abs(a - b) <= UNCHANGED * max(abs(a), abs(b), 1e-12)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _drawer(trainer: pl.Trainer, batches: Batches) -> Callable[[], tuple[Any, int]]:
    """The next training micro-batch, prepared as the training loop prepares it (``StopIteration`` at the
    end of the data)."""

    def draw() -> tuple[Any, int]:
        batch, batch_idx = next(batches)
        return prepare_batch(trainer, batch, dataloader_idx=0), batch_idx

    return draw


def eval_batch_count(first_batch: Any, trial: int) -> int:
    """How many batches to evaluate on: :data:`EVAL_SAMPLES` samples, between 2 and
    :data:`MAX_EVAL_BATCHES` batches, never more than a first-round trial's steps."""
    size = batch_size_of(first_batch) or 1
    return max(2, min(MAX_EVAL_BATCHES, trial, math.ceil(EVAL_SAMPLES / size)))


def take(batches: Batches, count: int) -> list[tuple[Any, int]]:
    """The first ``count`` items of ``batches`` (fewer when it ends)."""
    out: list[tuple[Any, int]] = []
    for item in batches:
        out.append(item)
        if len(out) == count:
            break
    return out
