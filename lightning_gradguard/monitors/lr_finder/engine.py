"""The learning-rate range test itself: which setups it supports, the sweep, the decision, applying the LR.

The sweep runs its own small loop over the training dataloader (the one Lightning has already set up,
with its distributed sampler); it does not re-enter ``Trainer.fit`` and does not swap loggers, which is
what makes Lightning's own finder fail after training has started. Each sweep step is built from the
trial steps of :mod:`lightning_gradguard.core.trial` (through the strategy, so DDP all-reduces the
gradients and FSDP gathers and reduce-scatters as in the run), on batches prepared in Lightning's
order by :func:`~lightning_gradguard.core.batch.prepare_batch`; a
:class:`~lightning_gradguard.core.snapshot.TrainingSnapshot` puts everything back afterwards. The stop
rule is :class:`~lightning_gradguard.monitors.lr_finder.divergence.DivergenceMonitor`; the schedule and
the suggestions are :mod:`lightning_gradguard.functional.lr_suggest`. Also here: the two helpers of
:func:`~lightning_gradguard.lr_find` (ending its throwaway fit, writing the suggestion to the model).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, TQDMProgressBar
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import Tensor

from lightning_gradguard.core.batch import prepare_batch
from lightning_gradguard.core.cadence import steps_per_epoch
from lightning_gradguard.core.lr import clip_setting, group_lr, rescale_learning_rates, step_cap
from lightning_gradguard.core.snapshot import RNGState, TrainingSnapshot, train_loader_generators
from lightning_gradguard.core.state import info_once, warn_once
from lightning_gradguard.core.stats import active_scaler
from lightning_gradguard.core.trial import (
    NoTrialLoss,
    TrialClosure,
    needs_closure,
    quiet_logging,
    trial_optimizer_step,
)
from lightning_gradguard.functional.lr_suggest import (
    NOISE_POINTS,
    SUGGESTION_METHODS,
    CurveReading,
    ema_smooth,
    read_curve,
    sweep_lrs,
)
from lightning_gradguard.monitors.lr_finder.divergence import DivergenceMonitor
from lightning_gradguard.monitors.lr_finder.holdout import split
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult, SearchResult
from lightning_gradguard.monitors.lr_finder.schedule import Schedule, read_schedule, schedule_factors
from lightning_gradguard.monitors.lr_finder.search import (
    MIN_TRIAL_STEPS,
    SECOND_ROUND,
    CandidateSearch,
    blind_bracket,
    bracket,
    eval_batch_count,
    joined,
    log_spaced,
    take,
    too_short,
    trial_steps,
)

#: another sweep is averaged in when the descent, with the noise of ``max_sweeps`` averaged sweeps, would
#: reach this share of the required multiple (a faint real descent; a curve that never fell stays one sweep)
REPEAT_REACH = 0.67

#: with ``max_sweeps=None``, sweeps are averaged up to this many points in all (a 100-point sweep: 4)
REPEAT_POINTS = 400

#: ... and never more sweeps than this
MAX_AUTO_SWEEPS = 16

#: a sweep whose loss still falls at ``max_lr`` goes on, at the same pace, up to this many decades further
EXTEND_DECADES = 2.0

#: the extension's points per decade in a linear sweep (an exponential one keeps its own spacing)
EXTEND_PER_DECADE = 20

#: the sweep's stop reason where the optimizer caps its step below the next LR (``core.lr.step_cap``:
#: torch's Adafactor). Past it the curve would plot more steps at the cap against LRs that do nothing: a
#: transformer under Adafactor kept falling to the sweep's end and on through its extension to 112, so the
#: curve's steep point sat at 0.5 (the best 300-step run's LR is 0.1, and 0.18 already fails)
CAPPED = "capped"


@dataclass(frozen=True)
class Unsupported:
    """Why the sweep cannot run in this setup (``message``) and what to do instead (``hint``)."""

    message: str
    hint: str


@dataclass(frozen=True)
class SweepPlan:
    """How many optimizer steps the sweep takes: ``steps``; ``limit``, why that is below ``num_training``
    (the Trainer's batch limit, in words), or ``""``; ``per_pass``, the micro-batches of one pass over the
    loader under a batch limit (``None``: the whole loader)."""

    steps: int
    limit: str = ""
    per_pass: int | None = None


@dataclass
class SweepResult:
    """What the sweep recorded: one point per optimizer step the GradScaler did not skip."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    stop_reason: str
    skipped: int
    plan: SweepPlan
    extended_to: float | None = None


@dataclass(frozen=True, kw_only=True)
class RangeTest:
    """The settings of one range test (see :class:`~lightning_gradguard.LRFinderPlus` for each)."""

    min_lr: float
    max_lr: float
    num_training: int
    mode: str
    method: str
    beta: float
    divergence_threshold: float | None
    min_points: int
    progress: bool
    max_sweeps: int | None = None
    standalone_bar: bool = False  # lr_find's throwaway Trainer: its bars are off by lr_find's choice
    search_steps: int | float = 0  # 0: no search (and no extension of a sweep still falling at max_lr)
    search_candidates: int = 5
    search_retries: int = 0  # runs of the search again, trials twice as long, while they learned nothing
    run_length_known: bool = True  # False in lr_find: its Trainer's length is not the run's

    def run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, epoch: int, apply: bool
    ) -> LRFinderResult:
        """Sweep, restore everything, decide (rank 0's result on every rank); with ``apply``, set the LR."""
        optimizer = trainer.optimizers[0]
        started = time.perf_counter()
        snapshot = TrainingSnapshot(pl_module, trainer=trainer)
        base = [_configured(g) for g in optimizer.param_groups]
        try:
            schedule = read_schedule(trainer, optimizer, base[0])  # on copies of the schedulers
            result = self.sweeps(trainer, pl_module, optimizer, base, snapshot, epoch, schedule)
            result.sweep_suggestion, result.sweep_reason = result.suggestion, result.reason
            if self.search_steps:
                self.search(trainer, pl_module, optimizer, base, snapshot, result, schedule)
        finally:
            snapshot.restore()
        result.seconds = time.perf_counter() - started
        if trainer.world_size > 1:
            result = trainer.strategy.broadcast(result, src=0)
        if apply and result.suggestion is not None:
            _apply_lr(trainer, optimizer, base, result.suggestion)
            result.applied = True
            result.applied_lr = _configured(optimizer.param_groups[0])
        return result

    def sweeps(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        base: list[float],
        snapshot: TrainingSnapshot,
        epoch: int,
        schedule: Schedule | None,
    ) -> LRFinderResult:
        """The sweep, and repeats of it averaged in while its descent is lost in a noise they can lift.

        Every repeat starts from the same state (the snapshot) at the first sweep's learning rates, on the
        next batches of the data and the next random numbers (dropout), so its noise is its own: the mean
        of ``k`` sweeps has ``1 / sqrt(k)`` of one sweep's noise and the same descent. Every rank takes
        the same decisions (each point's loss is the mean over ranks).
        """
        plan = self.plan(trainer)
        batches = _batches(trainer.train_dataloader, plan.per_pass)
        runs = [self.sweep(trainer, pl_module, optimizer, base, plan, batches)]
        result = self.decide(runs, epoch, schedule)
        budget = self.sweep_budget(len(runs[0].lrs))
        while self.worth_repeating(result, len(runs), budget):
            for _ in range(min(2 * len(runs), budget) - len(runs)):  # looks after 1, 2, 4, 8, ... sweeps
                moved_on = RNGState(train_loader_generators(trainer))
                snapshot.restore()
                moved_on.restore()  # the repeat draws new batches and new dropout masks
                runs.append(self.sweep(trainer, pl_module, optimizer, base, plan, batches, lrs=runs[0].lrs))
            result = self.decide(runs, epoch, schedule)
        return result

    def sweep_budget(self, points: int) -> int:
        """The most sweeps averaged: ``max_sweeps``, or (``None``) as many as make :data:`REPEAT_POINTS`
        points, at least 4 and at most :data:`MAX_AUTO_SWEEPS` (a 40-point sweep gets 10)."""
        if self.max_sweeps is not None:
            return self.max_sweeps
        return min(MAX_AUTO_SWEEPS, max(4, math.ceil(REPEAT_POINTS / max(1, points))))

    def worth_repeating(self, result: LRFinderResult, sweeps: int, budget: int) -> bool:
        """Whether to average in more sweeps: the descent did not stand out of the noise, but would with the
        noise of ``budget`` averaged sweeps at :data:`REPEAT_REACH` of the required multiple."""
        check = result.descent
        if sweeps >= budget or check is None or check.stands_out:
            return False
        if len(result.lrs) < max(self.min_points, NOISE_POINTS):  # too few points to read a noise from
            return False
        return check.ratio * math.sqrt(budget / sweeps) >= REPEAT_REACH * check.required

    def sweep(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        base: list[float],
        plan: SweepPlan,
        batches: Iterator[tuple[Any, int]],
        lrs: list[float] | None = None,
    ) -> SweepResult:
        """Raise the LR step by step (group ratios kept) and record the loss until done or diverged.

        ``lrs``: a repeat at these learning rates, to their end (no stop rule but a non-finite loss).
        """
        planned = sweep_lrs(self.min_lr, self.max_lr, plan.steps, self.mode) if lrs is None else lrs
        extension = self.extension(planned) if lrs is None and self.search_steps else []
        threshold = self.divergence_threshold if lrs is None else None
        sweep = _Sweep(
            trainer=trainer,
            pl_module=pl_module,
            optimizer=optimizer,
            ratios=[b / base[0] for b in base] if base[0] > 0 else [1.0] * len(base),
            accumulate=max(1, int(trainer.accumulate_grad_batches)),
            batches=batches,
            monitor=DivergenceMonitor(self.beta, threshold, warmup=max(2, plan.steps // 10)),
            bar=_progress_bar(trainer, len(planned)) if self.shows_bar(trainer) else None,
        )
        # the sweep's losses are not the run's metrics (also what the batch hooks would log)
        with quiet_logging(pl_module):
            try:
                stop_reason = sweep.through(planned, extension)
            finally:
                sweep.close()
        extended = bool(sweep.lrs) and bool(planned) and sweep.lrs[-1] > planned[-1]
        return SweepResult(
            lrs=sweep.lrs,
            losses=sweep.losses,
            smoothed=list(sweep.monitor.smoothed),
            stop_reason=stop_reason,
            skipped=sweep.skipped,
            plan=plan,
            extended_to=sweep.lrs[-1] if extended else None,
        )

    def extension(self, planned: list[float]) -> list[float]:
        """The LRs past ``max_lr`` a sweep still falling there goes on to: :data:`EXTEND_DECADES` more, at
        the sweep's own pace when it is exponential (else :data:`EXTEND_PER_DECADE` a decade)."""
        if len(planned) < 2 or planned[-1] <= 0:
            return []
        step = math.log(10) / EXTEND_PER_DECADE
        if self.mode == "exponential" and planned[0] > 0:
            step = math.log(planned[-1] / planned[0]) / (len(planned) - 1)
        count = math.ceil(EXTEND_DECADES * math.log(10) / step) if step > 0 else 0
        return [planned[-1] * math.exp(step * i) for i in range(1, count + 1)]

    def shows_bar(self, trainer: pl.Trainer) -> bool:
        """Whether this rank shows the sweep's tqdm bar: the Trainer decides, ``progress=False`` vetoes.

        Only rank 0, only with ``progress=True``, and only when the Trainer itself draws tqdm bars (its
        progress bar callback is an enabled ``TQDMProgressBar``, a subclass included): a user who turned
        the Trainer's bars off (``enable_progress_bar=False``, or ``refresh_rate=0``) gets none from the
        sweep either, and under a ``RichProgressBar`` (or any other bar) a tqdm bar would write across
        its live display. The one exception is :func:`~lightning_gradguard.lr_find`'s throwaway Trainer,
        whose bars are off because it trains nothing (``standalone_bar``), not because the user asked.
        """
        if not (self.progress and trainer.is_global_zero):
            return False
        return self.standalone_bar or _tqdm_bar_of(trainer) is not None

    def plan(self, trainer: pl.Trainer) -> SweepPlan:
        """``num_training`` steps, or what Lightning's own finder takes under a batch limit.

        Under ``limit_train_batches`` (or ``overfit_batches``) each pass over the loader stops after the
        epoch's ``trainer.num_training_batches`` micro-batches and starts over, as the run's epochs do
        (:func:`_batches`), and the sweep takes no more optimizer steps than the run has
        (``trainer.estimated_stepping_batches``: the limited epochs times ``max_epochs``, or
        ``max_steps``). That is what ``Tuner.lr_find`` does on the same Trainer, a real fit under the
        same limits. Said once per Trainer when it shortens the sweep. Without a limit a loader shorter
        than the sweep is started over and the run's length does not matter (the sweep's steps are not
        the run's).
        """
        per_pass = _limited_pass(trainer)
        if per_pass is None:
            return SweepPlan(self.num_training)
        run_steps = trainer.estimated_stepping_batches
        if not math.isfinite(run_steps) or int(run_steps) >= self.num_training:
            return SweepPlan(self.num_training, per_pass=per_pass)
        steps = max(0, int(run_steps))
        overfit = getattr(trainer, "overfit_batches", 0)  # set by the Trainer; not in its annotations
        name = "overfit_batches" if overfit else "limit_train_batches"
        limit = overfit or trainer.limit_train_batches
        what = (
            f"{name}={limit!r} ({per_pass} training batch{'es' if per_pass != 1 else ''} an epoch, "
            f"{steps} optimizer step{'s' if steps != 1 else ''} in the run)"
        )
        info_once(
            trainer,
            "lr_finder_limited",
            f"LRFinderPlus: {what} caps the sweep at {steps} of its num_training={self.num_training} "
            f"steps, still from min_lr to max_lr, on the limited batches only (as Lightning's lr_find on "
            f"this Trainer). Raise {name} or max_epochs, or lower num_training, to change this.",
        )
        return SweepPlan(steps, f"capped at {steps} by {what}", per_pass=per_pass)

    def decide(self, runs: list[SweepResult], epoch: int, schedule: Schedule | None) -> LRFinderResult:
        """The suggestions on the (averaged) sweep's curve, and the chosen one (or why there is none).

        The curve is read by :func:`~lightning_gradguard.functional.lr_suggest.read_curve`: the diverging
        tail cut off, the rest smoothed without lag, and no method suggests anything unless its fall
        stands out of its own noise (the reason then gives the numbers). ``method="auto"`` takes ``peak``
        when the run's schedule warms up (the suggestion is the LR the schedule is configured with, so
        that its peak lands on the curve's low) and ``steep`` otherwise.
        """
        sweep, each = _average(runs, self.beta)
        lrs, rule = sweep.lrs, self.rule(schedule)
        reading = read_curve(lrs, sweep.losses, sweeps=each if len(each) > 1 else ())
        suggestion, reason = reading.suggestions[rule], ""
        suggestions = reading.suggestions
        if len(lrs) < self.min_points:
            suggestions = dict.fromkeys(SUGGESTION_METHODS)
            cap = f"; the sweep was {sweep.plan.limit}" if sweep.plan.limit else ""
            reason = (
                f"only {len(lrs)} of {sweep.plan.steps} sweep steps were usable "
                f"(stopped: {sweep.stop_reason}{cap}); at least {self.min_points} are needed"
            )
        elif not reading.descent.stands_out:
            reason = _lost_in_noise(lrs, reading, len(runs))
        elif suggestion is None:
            reason = (
                f"the loss curve gives no '{rule}' suggestion between {lrs[0]:.2e} and "
                f"{lrs[-1]:.2e} (it never clearly decreased)"
            )
        elif rule == "peak" and schedule is not None and schedule.warms_up:
            suggestion /= schedule.peak  # configured so that the schedule's peak is the curve's low
        return LRFinderResult(
            lrs=lrs,
            losses=sweep.losses,
            smoothed=sweep.smoothed,
            curve=reading.curve,
            suggestions=suggestions,
            method=self.method,
            suggestion=None if reason else suggestion,
            rule=rule,
            schedule=schedule,
            sweeps=len(runs),
            divergence_at=reading.cut if reading.cut < len(lrs) else None,
            epoch=epoch,
            stop_reason=sweep.stop_reason,
            reason=reason,
            descent=reading.descent if lrs else None,
            skipped_steps=sweep.skipped,
            limited_to=sweep.plan.steps if sweep.plan.limit else None,
            extended_to=sweep.extended_to,
            still_falling=sweep.stop_reason == "completed" and still_falling(reading.curve),
        )

    def search(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        base: list[float],
        snapshot: TrainingSnapshot,
        result: LRFinderResult,
        schedule: Schedule | None,
    ) -> None:
        """Train candidates inside the sweep's bracket (:mod:`.search`) and make the best the suggestion.

        A sweep refused because its descent did not stand out of its noise is searched blind
        (:func:`~.search.blind_bracket`: the trials alone decide, and where they learn nothing the refusal
        stands); any other refusal stays one. The budget is ``search_steps``
        optimizer steps (a float: that share of the first epoch's); too small a budget for
        ``MIN_TRIAL_STEPS``-step trials is said in ``result.search.reason``. The caller restores
        everything afterwards."""
        clipped = clip_setting(trainer) is not None
        span, blind = bracket(result, schedule, clipped=clipped), False
        if span is None and len(result.lrs) >= self.min_points:  # a refusal for noise: trials may see more
            span, blind = blind_bracket(result, schedule, clipped=clipped), True
        if span is None:
            return
        budget = self.search_budget(trainer)
        steps = trial_steps(budget or 0, self.search_candidates)
        if steps < MIN_TRIAL_STEPS:
            need = MIN_TRIAL_STEPS * (self.search_candidates + 2 * SECOND_ROUND)
            reason = f"a search budget of {budget} steps is too small ({need} at least)"
            if budget is None:
                reason = (
                    f"search_steps={self.search_steps} is a share of the first epoch, whose length is "
                    "unknown (an iterable dataset without a length): give search_steps as an int"
                )
            result.search = SearchResult(reason=reason, blind=blind)
            return
        snapshot.restore()
        factors = schedule_factors(trainer, optimizer, base[0], self.horizon(trainer, schedule))
        grid = log_spaced(*span, self.search_candidates)

        def attempt(steps: int, first_round: int) -> SearchResult:
            search = self.candidate_search(trainer, pl_module, optimizer, base, snapshot, factors, steps)
            total = len(grid) * steps + SECOND_ROUND * 2 * steps
            bar = _progress_bar(trainer, total, "search") if self.shows_bar(trainer) else None
            if bar is not None:
                search.on_step = lambda: bar.update(1)
            try:
                return search.run(grid, steps, prior=result.suggestion, first_round=first_round)
            finally:
                if bar is not None:
                    bar.close()

        attempts = [attempt(steps, 0)]
        # trials that learned nothing the search can rank by: again, from the start, with trials twice as long
        while too_short(attempts[-1]) and len(attempts) <= self.search_retries:
            attempts.append(attempt(steps << len(attempts), 2 * len(attempts)))
        result.search = joined(attempts)
        result.search.blind = blind
        _settle(result)

    def candidate_search(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        base: list[float],
        snapshot: TrainingSnapshot,
        factors: list[float],
        steps: int,
    ) -> CandidateSearch:
        """The search's trainer of candidates: its training passes, and the batches it scores on (the
        validation loader's first ones when the run has one, else the first ones of a training pass,
        which the trials then skip)."""
        per_pass = self.plan(trainer).per_pass

        def training() -> Iterator[tuple[Any, int]]:
            return _batches(trainer.train_dataloader, per_pass)

        first = take(training(), 1)
        count = eval_batch_count(first[0][0] if first else None, steps)
        held_out, skip, where = take(_validation_batches(trainer), count), 0, "validation batches"
        # the micro-batches the longest trial draws after skipping held-out ones: past a pass, a held-out
        # batch of the first pass comes back inside a later one, so the hold-out is by sample
        drawn = count + 2 * steps * max(1, int(trainer.accumulate_grad_batches))
        by_sample = (
            None if held_out or per_pass is not None else split(trainer.train_dataloader, count, drawn)
        )
        if by_sample is not None:  # samples the trials never train on (holdout.py)
            trial_loader = by_sample.training

            def training() -> Iterator[tuple[Any, int]]:
                return _batches(trial_loader())

            held_out = take(_batches(by_sample.held_out), len(by_sample.held_out))
            where = f"{by_sample.samples} held-out training samples"
        elif not held_out:  # the first batches of a pass from the snapshot's state: each trial skips them
            snapshot.restore()
            held_out, skip, where = take(training(), count), count, "held-out training batches"
        return CandidateSearch(
            trainer=trainer,
            pl_module=pl_module,
            optimizer=optimizer,
            snapshot=snapshot,
            ratios=[b / base[0] for b in base] if base[0] > 0 else [1.0] * len(base),
            factors=factors,
            training=training,
            held_out=held_out,
            skip=skip,
            evaluated_on=where,
        )

    def search_budget(self, trainer: pl.Trainer) -> int | None:
        """``search_steps`` as optimizer steps: an int as it is, a float as that share of the first epoch's
        optimizer steps (``core.cadence.steps_per_epoch``; ``None``: unknown)."""
        if isinstance(self.search_steps, int):
            return self.search_steps
        per_epoch = steps_per_epoch(trainer)
        return None if per_epoch is None else int(self.search_steps * per_epoch)

    def horizon(self, trainer: pl.Trainer, schedule: Schedule | None) -> int | None:
        """The scheduler steps the run has left, when this Trainer's length is the run's (not in lr_find):
        its optimizer steps (or epochs, for a per-epoch schedule) less those already taken."""
        if not self.run_length_known or schedule is None:
            return None
        total: float | None = trainer.max_epochs
        done = trainer.current_epoch
        if schedule.interval == "step":
            total, done = trainer.estimated_stepping_batches, trainer.global_step
        if total is None or not math.isfinite(total) or total - done <= 0:
            return None
        return int(total - done)

    def rule(self, schedule: Schedule | None) -> str:
        """The suggestion method that decides: ``method``, or for ``"auto"`` the one the schedule asks for."""
        if self.method != "auto":
            return self.method
        return "peak" if schedule is not None and schedule.warms_up else "steep"

    def not_run(self, epoch: int, reason: str) -> LRFinderResult:
        """The result of a test that could not run (an unsupported setup: ``reason``)."""
        return LRFinderResult(
            lrs=[],
            losses=[],
            smoothed=[],
            curve=[],
            suggestions=dict.fromkeys(SUGGESTION_METHODS),
            method=self.method,
            suggestion=None,
            epoch=epoch,
            stop_reason="not run",
            reason=reason,
        )


def _settle(result: LRFinderResult) -> None:
    """The search's choice as the suggestion; after a refusal for noise (a blind search) that chose
    nothing, the refusal stands, its reason saying what the trials saw."""
    search = result.search
    if search is None:
        return
    if search.chosen is not None:
        result.suggestion, result.reason = search.chosen, ""
    elif search.blind and search.trials:
        longest = max(t.steps for t in search.trials)
        result.reason += (
            f"; nor did training: candidates from {search.bracket[0]:.2e} to {search.bracket[1]:.2e}, "
            f"trained up to {longest} steps each, chose nothing ({search.reason})"
        )


def _lost_in_noise(lrs: list[float], reading: CurveReading, sweeps: int) -> str:
    """Why a curve whose fall does not stand out of its noise gives no suggestion, with the numbers."""
    check, curve = reading.descent, reading.head  # the curve the descent was judged on
    if check.fall <= 0:
        what = f"the smoothed loss never fell below its level at {lrs[0]:.2e}"
    else:
        top, low = curve[check.start], curve[check.lowest]
        share = 100 * check.fall / (abs(top) or 1.0)
        what = (
            f"the smoothed loss fell by only {check.fall:.3g} ({share:.3g} % of its level), from {top:.5g} "
            f"at lr {lrs[check.start]:.2e} to {low:.5g} at lr {lrs[check.lowest]:.2e}, "
            f"{check.ratio:.2g} times the noise of that fall ({check.fall_noise:.3g})"
        )
    if reading.cut < len(lrs):
        what += f", before it diverged from lr {lrs[reading.cut]:.2e} on"
    averaged = f" (the mean of {sweeps} sweeps)" if sweeps > 1 else ""
    return (
        f"the loss curve's descent does not stand out of its noise{averaged}: {what}; a suggestion needs "
        f"{check.required:g} times (the raw losses scatter by {check.noise:.3g} from step to step)"
    )


def _average(runs: list[SweepResult], beta: float) -> tuple[SweepResult, list[list[float]]]:
    """One sweep, or the mean of several at the learning rates they all recorded (a GradScaler skip drops
    a point from one of them); with every sweep's losses at those learning rates."""
    if len(runs) == 1:
        return runs[0], [runs[0].losses]
    by_lr = [dict(zip(r.lrs, r.losses, strict=True)) for r in runs]
    lrs = [lr for lr in runs[0].lrs if all(lr in d for d in by_lr)]
    each = [[d[lr] for lr in lrs] for d in by_lr]
    losses = [sum(column) / len(runs) for column in zip(*each, strict=True)]
    first = runs[0]
    mean = SweepResult(
        lrs=lrs,
        losses=losses,
        smoothed=ema_smooth(losses, beta),
        stop_reason=first.stop_reason,
        skipped=sum(r.skipped for r in runs),
        plan=first.plan,
        extended_to=first.extended_to,
    )
    return mean, each


def still_falling(curve: Sequence[float]) -> bool:
    """Whether a smoothed loss curve is still falling at its end: its lowest point lies in its last tenth
    (at least its last 3 points) and below its first."""
    finite = [v if math.isfinite(v) else math.inf for v in curve]
    if len(finite) < 5:
        return False
    low = min(range(len(finite)), key=finite.__getitem__)
    return low >= len(finite) - max(3, len(finite) // 10) and finite[low] < finite[0]


class _SweepStopped(Exception):
    """Ends a sweep before its schedule does; ``reason`` is the sweep's stop reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(kw_only=True)
class _Sweep:
    """One sweep in progress: what it drives, and the points it has recorded so far."""

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    optimizer: Any
    ratios: list[float]  # each group's LR relative to group 0's, kept while the LR rises
    accumulate: int
    batches: Iterator[tuple[Any, int]]
    monitor: DivergenceMonitor
    bar: Tqdm | None
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    skipped: int = 0

    def through(self, schedule: Sequence[float], extension: Sequence[float] = ()) -> str:
        """A step per LR of ``schedule`` until the schedule ends or the sweep stops, then of ``extension``
        while the loss is still falling at the schedule's end; returns why it ended."""
        try:
            for lr in schedule:
                if self.step(lr):
                    return self.monitor.reason
            if extension and still_falling(self.monitor.smoothed):
                if self.bar is not None:
                    self.bar.total += len(extension)
                for lr in extension:
                    if self.step(lr):
                        return self.monitor.reason
        except _SweepStopped as stopped:
            return stopped.reason
        return "completed"

    def step(self, lr: float) -> bool:
        """One optimizer step at ``lr``, recorded unless the GradScaler skipped it; ``True``: stop now.

        The step's closure (:class:`~lightning_gradguard.core.trial.TrialClosure`) zeroes the gradients
        and runs forward and backward over the step's micro-batches; ``LBFGS`` calls it again on the
        same micro-batches. The point recorded is its first loss: the loss at the parameters the step
        started from, as for every other optimizer.
        """
        cap = step_cap(self.optimizer)
        if cap is not None and lr * self.ratios[0] > cap:  # from here every LR takes the same step
            raise _SweepStopped(CAPPED)
        for group, ratio in zip(self.optimizer.param_groups, self.ratios, strict=True):
            group["lr"] = lr * ratio
        closure = TrialClosure(
            self.trainer,
            self.pl_module,
            self.optimizer,
            self._draw,
            self.accumulate,
            through_strategy=True,
        )
        try:
            done = trial_optimizer_step(self.trainer, self.optimizer, lambda: self._checked(closure()))
        except NoTrialLoss:
            raise _SweepStopped("no loss") from None
        loss = float(done.loss)
        if self.bar is not None:
            self.bar.set_postfix({"lr": f"{lr:.2e}", "loss": f"{loss:.4g}"}, refresh=False)
            self.bar.update(1)
        if done.skipped:
            self.skipped += 1
            return False
        self.lrs.append(lr)
        self.losses.append(loss)
        return self.monitor.update(loss)

    def _draw(self) -> tuple[Any, int]:
        """The next micro-batch of the sweep, prepared as the training loop prepares it."""
        try:
            batch, batch_idx = next(self.batches)
        except StopIteration:
            raise _SweepStopped("no data") from None
        return prepare_batch(self.trainer, batch, dataloader_idx=0), batch_idx

    def _checked(self, mean: Tensor) -> Tensor:
        """A step's mean micro-batch loss, averaged across ranks (every rank's closure sees the same value,
        so an ``LBFGS`` takes the same decisions on every rank); a non-finite one stops the sweep."""
        if self.trainer.world_size > 1:
            mean = self.trainer.strategy.reduce(mean, reduce_op="mean")
        if not math.isfinite(float(mean)):
            raise _SweepStopped("non-finite loss")
        return mean

    def close(self) -> None:
        """Remove the progress bar and the sweep's last gradients."""
        if self.bar is not None:
            self.bar.close()
        self.optimizer.zero_grad(set_to_none=True)


def unsupported_setup(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Unsupported | None:
    """Why the sweep cannot run in this setup, or ``None`` when it can."""
    for check in (_optimizer_problem, _strategy_problem, _data_problem):
        problem = check(trainer, pl_module)
        if problem is not None:
            return problem
    _warn_about_persistent_workers(trainer)
    return None


def _optimizer_problem(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Unsupported | None:
    if len(trainer.optimizers) != 1:
        return Unsupported(
            message=f"LRFinderPlus needs exactly one optimizer, found {len(trainer.optimizers)}",
            hint="Set the learning rate by hand, or run lr_find() on a version of the model with one "
            "optimizer and use its suggestion.",
        )
    optimizer = trainer.optimizers[0]
    if any(group_lr(g) is None for g in optimizer.param_groups):
        name, held = type(optimizer).__name__, optimizer.param_groups[0].get("lr")
        return Unsupported(
            message=f"{name} sets its own step size (a param group holds lr={held!r}, Adafactor's relative "
            "step): there is no learning rate to sweep",
            hint=f"Nothing to tune here; to search an LR, give {name} one (Adafactor: relative_step=False, "
            "lr=1e-3 or so).",
        )
    if active_scaler(trainer) is None or not needs_closure(optimizer):
        return None
    name = type(optimizer).__name__
    return Unsupported(  # Lightning refuses the pair at its first step: "AMP and the LBFGS optimizer ..."
        message=f"{name} needs a closure in its step, which 16-mixed precision's GradScaler cannot pass",
        hint=f"Train {name} in 32-bit or bf16-mixed precision (Lightning does not run it under 16-mixed).",
    )


def _strategy_problem(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Unsupported | None:
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    # FSDP1 and FSDP2 (ModelParallelStrategy): the sweep's steps go through the strategy like the run's,
    # every rank takes every step (the stop rule reads the loss averaged across ranks), and the snapshot
    # copies each rank's pieces back into the live parameters: tested against DDP's curve
    strategy = trainer.strategy
    supported = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)
    if isinstance(strategy, supported) and not isinstance(strategy, DeepSpeedStrategy):
        return None
    return Unsupported(
        message=f"LRFinderPlus runs on a single device, under DDP or under FSDP, not under "
        f"{type(strategy).__name__}",
        hint="Run lr_find() on the model with one device (trainer_kwargs={'devices': 1}) or under DDP, "
        "and set its suggestion as this run's learning rate.",
    )


def _data_problem(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Unsupported | None:
    if trainer.train_dataloader is not None:
        return None
    return Unsupported(
        message="LRFinderPlus found no training dataloader to sweep over",
        hint="Give Trainer.fit the training data (train_dataloaders or a datamodule with "
        "train_dataloader) and keep limit_train_batches above 0.",
    )


def _warn_about_persistent_workers(trainer: pl.Trainer) -> None:
    """The sweep restarts a persistent worker pool's iterator: say once that the batch order may change."""
    loaders = trainer.train_dataloader
    flat = loaders.flattened if isinstance(loaders, CombinedLoader) else [loaders]
    if isinstance(loaders, (list, tuple)):
        flat = list(loaders)
    elif isinstance(loaders, dict):
        flat = list(loaders.values())
    if any(getattr(dl, "persistent_workers", False) and getattr(dl, "num_workers", 0) > 0 for dl in flat):
        warn_once(
            trainer,
            "lr_finder_persistent_workers",
            "LRFinderPlus: a dataloader with persistent_workers=True restarts its shared iterator "
            "for the sweep; the first epoch's batch order may differ from a run without the finder.",
        )


def _limited_pass(trainer: pl.Trainer) -> int | None:
    """The micro-batches of one epoch when the Trainer limits them (``limit_train_batches`` as an int or a
    fraction below ``1.0``, or ``overfit_batches``), else ``None``."""
    limit = trainer.limit_train_batches
    # Lightning's convention: an int is a number of batches, a float a fraction (1.0: all of them)
    limited = limit < 1.0 if isinstance(limit, float) else isinstance(limit, int)
    per_epoch = trainer.num_training_batches
    if not limited or not math.isfinite(per_epoch):
        return None
    return int(per_epoch)


def _batches(loader: Any, per_pass: int | None = None) -> Iterator[tuple[Any, int]]:
    """Batches of the training dataloader(s), starting over when they run out (a new pass, as an epoch);
    under a batch limit a pass ends after ``per_pass`` of them, as a limited epoch does."""
    combined = loader if isinstance(loader, CombinedLoader) else CombinedLoader(loader, "max_size_cycle")
    while True:
        produced = 0
        for item in combined:
            if per_pass is not None and produced >= per_pass:
                break
            batch, batch_idx = item[0], item[1]
            produced += 1
            yield batch, batch_idx
        if not produced:
            return


def _tqdm_bar_of(trainer: pl.Trainer) -> TQDMProgressBar | None:
    """The Trainer's own tqdm progress bar callback when it draws (``None``: no bar, disabled, or another
    kind of bar such as ``RichProgressBar``)."""
    main = trainer.progress_bar_callback
    if isinstance(main, TQDMProgressBar) and main.is_enabled:
        return main
    return None


def _validation_batches(trainer: pl.Trainer) -> Iterator[tuple[Any, int]]:
    """The batches of the run's first validation dataloader, when the Trainer has one set up (after the
    sanity check, as at fit start by default); none otherwise."""
    if not trainer.limit_val_batches:
        return
    loaders = trainer.val_dataloaders
    if isinstance(loaders, CombinedLoader):
        loaders = loaders.flattened
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    if loaders is None:
        return
    yield from ((batch, i) for i, batch in enumerate(loaders))


def _progress_bar(trainer: pl.Trainer, total: int, what: str = "") -> Tqdm:
    """The sweep's own bar: placed like Lightning's validation bar, under the training bar when there is one.

    ``leave=False``: it disappears when the sweep ends and leaves Lightning's bars as they were. It writes
    to stderr (tqdm's default), so the program's own output on stdout stays clean.
    """
    main = _tqdm_bar_of(trainer)
    position = 0 if main is None else 2 * main.process_position + 1
    return Tqdm(
        total=total,
        desc=f"LRFinderPlus{' ' + what if what else ''} [epoch {trainer.current_epoch}]",
        position=position,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
        bar_format=TQDMProgressBar.BAR_FORMAT,
    )


def _configured(group: dict[str, Any]) -> float:
    """The LR a group was configured with, before a scheduler scaled it (OneCycleLR: its peak)."""
    for key in ("max_lr", "initial_lr"):
        value = group.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    lr = group_lr(group)
    return math.nan if lr is None else lr


def _apply_lr(trainer: pl.Trainer, optimizer: Any, base: list[float], suggestion: float) -> None:
    """Scale every group's LR (and the schedulers' base LRs) so that group 0 gets ``suggestion``.

    A value equal to group 0's LR becomes exactly ``suggestion`` (no ``x * (s / x)`` rounding), so the run
    matches one started with the suggested LR bit for bit.
    """
    ref = base[0]

    def scaled(value: float) -> float:
        if ref <= 0 or value == ref:
            return suggestion
        return value * (suggestion / ref)

    rescale_learning_rates(trainer, optimizer, scaled)


def end_fit_before_training(trainer: pl.Trainer) -> None:
    """End the running fit cleanly before its first training batch (the throwaway fit of :func:`lr_find`).

    Called from ``on_train_start``. ``should_stop`` alone would wait for ``min_epochs`` / ``min_steps``; a
    step limit already reached does not: Lightning's fit loop is done before its first epoch, as at
    ``max_steps``, so no epoch hook runs on an empty epoch (an ``EarlyStopping`` or a module's
    ``on_train_epoch_end`` would meet missing metrics or no outputs there), and every callback gets
    ``on_train_end`` as in any finished fit, never ``on_exception``.
    """
    trainer.should_stop = True
    trainer.fit_loop.epoch_loop.max_steps = trainer.global_step


def set_lr_attr(model: pl.LightningModule, attr_name: str, value: float) -> None:
    """Write ``value`` to the model's ``attr_name`` (``""``: the first of ``lr``, ``learning_rate``)."""
    names = [attr_name] if attr_name else ["lr", "learning_rate"]
    for name in names:
        if hasattr(model, name) and not callable(getattr(model, name)):
            setattr(model, name, value)
            if name in getattr(model, "hparams", {}):
                model.hparams[name] = value
            return
        if name in getattr(model, "hparams", {}):
            model.hparams[name] = value
            return
    if attr_name:
        raise AttributeError(f"lr_find: the model has no attribute or hparam {attr_name!r}")
