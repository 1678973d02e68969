r"""
LRFinderPlus
============

A learning-rate range test (Smith 2017) that runs inside the real training run: at the start of fit and,
optionally, at milestone epochs later on. It sweeps the learning rate over a few optimizer steps of the
real model, optimizer, precision, accumulation and (under DDP) all-reduced gradients, suggests a
learning rate, applies it, and puts every other piece of state back exactly as it was: parameters,
buffers, gradients, optimizer state, schedulers, the GradScaler, metric states and the random number
generators. The Trainer's loops never see the sweep, so step counters and logged metrics are untouched
and the rest of the run is identical to one started with the suggested learning rate.

This module holds the callback (when a test runs, its alert, its state) and :func:`lr_find`, which runs
one test before training in a throwaway Trainer. The range test itself is
:mod:`~lightning_gradguard.monitors.lr_finder.engine`; where its result goes,
:mod:`~lightning_gradguard.monitors.lr_finder.output`; the alert's rule and words,
:mod:`~lightning_gradguard.monitors.lr_finder.rules`.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.preflight import manual_optimization_note
from lightning_gradguard.core.runstate import RunField
from lightning_gradguard.core.state import skipped_for_fast_dev_run, warn_once
from lightning_gradguard.core.validate import check_bool, check_choice, check_float, check_int, check_int_list
from lightning_gradguard.functional.lr_suggest import SUGGESTION_METHODS
from lightning_gradguard.monitors.lr_finder import engine
from lightning_gradguard.monitors.lr_finder.output import write_result
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult
from lightning_gradguard.monitors.lr_finder.rules import RULES, Tested
from lightning_gradguard.monitors.lr_finder.tags import CHARTS

#: the search's default budget in optimizer steps: 5 trials of 54 steps and up to 3 of 108. A run that
#: blows up (or collapses to a constant output) only after a hundred steps at a large LR, as SGD with
#: momentum often does, looks best in a 54-step trial; a 108-step one sees the blow-up. On the 38 tasks of
#: ``benchmarks/lr_hard.py`` (six seeds), 300 -> 600 -> 1,200 steps gave a mean ratio to the best loss of
#: 2.89 -> 1.94 -> 1.73 (docs/lr_finder.md, *Budget*; what it costs: docs/benchmarks.md)
DEFAULT_SEARCH_STEPS = 600

#: how many times the search runs again with trials twice as long when its trials learned nothing it can
#: rank by: a model that needs longer than the default's 54- and 108-step trials to use its inputs (a ViT, a
#: transformer tagger; docs/lr_finder.md); paid only there. ``MAX_SEARCH_RETRIES``: 64 times the trials
DEFAULT_SEARCH_RETRIES = 2
MAX_SEARCH_RETRIES = 6


def _check_search_steps(value: Any) -> int | float:
    """``search_steps``: an int of at least 0 (steps), or a float in (0, 1] (a share of the first epoch)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"`search_steps` must be an int (optimizer steps) or a float (a share of the first epoch), "
            f"got {type(value).__name__}"
        )
    if isinstance(value, int):
        return check_int("search_steps", value, 0)
    return check_float("search_steps", value, 0.0, 1.0, low_open=True)


class LRFinderPlus(GradGuardCallback):
    r"""Learning-rate range test at fit start (and at milestone epochs) that applies its suggestion.

    For ``num_training`` optimizer steps the learning rate rises from ``min_lr`` to ``max_lr``
    (exponentially or linearly); each step records the training loss. With ``accumulate_grad_batches``
    a step is several micro-batches and one point; steps the GradScaler skipped are dropped; several
    parameter groups move together with their ratios kept (the LR reported is group 0's). Each step hands
    ``optimizer.step`` a closure, as Lightning does, so ``LBFGS`` re-evaluates the loss on the step's
    micro-batches. Under ``limit_train_batches`` or ``overfit_batches`` the sweep draws only the limited
    batches, epoch by epoch, and takes at most the run's optimizer steps, as Lightning's finder (said
    once when that shortens it). The loss is
    smoothed with a bias-corrected EMA counted by the finder's own steps; the sweep stops early when
    the smoothed loss has climbed back above its best by ``divergence_threshold`` times the descent so
    far (a rule on differences, so negative or near-zero losses work), and at the first non-finite
    loss (not recorded).

    Four suggestions are computed on a zero-lag (Gaussian) smoothed curve and all reported: ``valley``
    (middle of the longest stretch falling at least half as fast as the steepest point), ``steep``
    (steepest descent per decade), ``minimum`` (LR at the lowest loss / 10) and ``slide``. ``method``
    picks the one applied (default ``steep``: chosen by leave-one-task-out on our benchmark and checked
    on held-out tasks, see the docs). With ``apply=True`` every parameter group's LR is scaled so
    that group 0 gets the suggestion (ratios kept) and the schedulers' ``base_lrs`` are scaled with it.
    Everything else is restored exactly, and training continues as if started with that LR.

    Under DDP and FSDP every rank runs the same sweep on its own shard; the loss of each step is averaged
    across ranks, so all ranks see the same curve and stop at the same step; rank 0's result is
    broadcast. A suggestion needs a descent that stands out of the curve's own noise (its fall at least
    six times the noise of that fall, read from the raw losses' step-to-step scatter before the diverging
    tail); a curve of a loss that cannot fall gives none, and a faint descent gets repeats of the sweep
    averaged in (``max_sweeps``). ``method="auto"`` (default) fits the suggestion to the run's schedule:
    under a warm-up, the LR that puts the schedule's peak at the curve's lowest point (``peak``);
    otherwise the steepest descent (``steep``). When no suggestion is possible the LR is left alone and an
    ``lr_finder_failed`` alert says why. The sweep needs automatic optimization with one optimizer, on a
    single device, under DDP or under FSDP (``FSDPStrategy``, ``ModelParallelStrategy``): in any other
    setup no sweep runs, and the alert says that the setup is not supported and what to do instead;
    under manual optimization (a design, not a fault) one INFO line, shared with the pre-flight checks,
    says what to run instead.

    Output (rank 0): scalars ``lr_finder/loss``, ``lr_finder/smoothed_loss`` and ``lr_finder/lr``
    against the sweep step, ``lr_finder/suggested_lr`` at the trainer's step; a CSV
    ``lr_finder.csv`` and (with matplotlib) a figure ``lr_finder.png`` in the log directory (when the
    trainer has a logger), the figure also sent to TensorBoard. An applied LR is written to every
    logger's hyperparameters (``lr_finder/applied_lr`` and ``lr_finder/method``; in ``hparams.yaml`` for
    TensorBoard and CSV) and to ``result.applied_lr``. Later milestones get an ``_epoch<N>`` suffix.
    While the sweep runs, a tqdm bar of its own (stderr, below Lightning's training bar, gone when the
    sweep ends) shows the LR and loss, if the Trainer shows tqdm bars; the result is one INFO line on the
    ``lightning_gradguard`` logger.
    Under ``fast_dev_run`` the test is skipped, like Lightning's tuner.

    The range test brackets, short trainings decide (``search_steps > 0``, the default): after the sweep,
    ``search_candidates`` LRs log-spaced from the curve's steep point to the last LR before its diverging
    tail each train the same few optimizer steps from the restored start, with the run's optimizer,
    clipping, precision, accumulation and LR schedule (compressed to the trial); they are scored by the
    loss on held-out batches (the validation loader's when the run has one, else training batches the
    trials skip); the best two and one refinement point train twice as long, and the winner's LR over 1.25
    (short trials favour large LRs) is the suggestion (``result.search``; the curve's own in
    ``result.sweep_suggestion``). Trials that learned nothing to rank the LRs by run again, twice as long
    (``search_retries``). A sweep still falling at ``max_lr`` is first extended, up to two decades. A
    sweep whose descent does not stand out of its noise is searched blind, over the two decades below its
    top (``result.search.blind``); where those trials learn nothing either, the refusal stands.
    Everything is restored exactly afterwards, as after the sweep. Candidates and their losses go to
    TensorBoard (``lr_finder/search_*``), ``lr_search.csv`` and the summary line.

    Args:
        min_lr: first learning rate of the sweep.
        max_lr: last learning rate of the sweep.
        num_training: optimizer steps in the sweep.
        mode: ``"exponential"`` or ``"linear"`` spacing.
        method: the suggestion applied: ``"valley"``, ``"steep"``, ``"minimum"`` or ``"slide"``.
        beta: EMA factor of the online smoothing the stop rule uses (bias corrected). 0.9 follows a
            100-step sweep closely; fastai's 0.98 lags about 50 steps behind.
        divergence_threshold: stop once the smoothed loss has risen this many times the descent achieved
            (reference minus best) above its best; ``None`` sweeps to ``max_lr``.
        milestones: epochs at whose start the test runs (default ``[0]``: fit start).
        apply: set the suggested LR on the optimizer and schedulers.
        plot: save a figure (needs matplotlib; skipped quietly without it).
        progress: show the sweep's progress bar on rank 0, when the Trainer shows tqdm bars itself: with
            ``enable_progress_bar=False`` (or a ``RichProgressBar``) there is none, whatever ``progress``.
        min_points: fewest recorded points for a suggestion (default: a tenth of ``num_training``, >= 5).
        max_sweeps: the most sweeps averaged when one sweep's descent is lost in its noise (each repeat runs
            from the same state at the same LRs on the next batches; looks after 1, 2, 4, 8, ... sweeps);
            ``None``: as many as make 400 points, at least 4 and at most 16; ``1``: never repeat.
        search_steps: the budget of the search after the sweep: an int, optimizer steps in all; a float in
            (0, 1], that share of the first epoch's optimizer steps; ``0``: the range test alone, as
            before the search existed (a sweep still falling at ``max_lr`` is then said, not extended).
        search_candidates: candidate LRs of the search's first round, log-spaced across the bracket.
        search_retries: when the search's trials learned nothing it can rank the LRs by (no candidate got
            clearly below the loss before training, or what the best learned does not depend on its inputs,
            as a model that only learned how often each target occurs), run it again from the start with
            trials twice as long, up to this many times; each retry costs twice the one before (the
            default, 2, at most 7 times ``search_steps`` in all). ``0``: say so and keep the sweep's
            suggestion.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import LRFinderPlus

        finder = LRFinderPlus(min_lr=1e-6, max_lr=1.0, num_training=100)
        trainer = Trainer(callbacks=[finder], max_epochs=10)
        trainer.fit(model)
        print(finder.result.suggestion, finder.result.suggestions)
    """

    charts = CHARTS

    state_key_args = ("milestones", "method")

    #: the epochs whose range test ran (the same callback reused for a new run tests that run again)
    _done_epochs: RunField[set[int]] = RunField(set)
    #: every range test of this instance, kept across runs; a checkpoint holds each one's
    #: ``(epoch, suggestion)`` for people to read, not loaded back (a result's curves are not in it)
    results: RunField[list[LRFinderResult]] = RunField(
        list,
        key="suggestions",
        per_run=False,
        save=lambda _, rs: [(r.epoch, r.suggestion) for r in rs],
        load=lambda f, _: f.results,
    )

    def __init__(
        self,
        *,
        min_lr: float = 1e-7,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: Literal["exponential", "linear"] = "exponential",
        method: Literal["auto", "steep", "valley", "minimum", "slide", "peak"] = "auto",
        beta: float = 0.9,
        divergence_threshold: float | None = 1.0,
        milestones: list[int] | None = None,
        apply: bool = True,
        plot: bool = True,
        progress: bool = True,
        min_points: int | None = None,
        max_sweeps: int | None = None,
        search_steps: int | float = DEFAULT_SEARCH_STEPS,
        search_candidates: int = 5,
        search_retries: int = DEFAULT_SEARCH_RETRIES,
    ) -> None:
        # every finding is a warning, and a failed test already leaves the LR alone: nothing to act on
        super().__init__(action="warn", cooldown_steps=0)
        self.min_lr: float = check_float("min_lr", min_lr, 0.0, low_open=True)
        self.max_lr: float = check_float("max_lr", max_lr, 0.0, low_open=True)
        if self.max_lr <= self.min_lr:
            raise ValueError(f"`max_lr` must be greater than `min_lr` ({min_lr!r}); got {max_lr!r}")
        self.num_training: int = check_int("num_training", num_training, 5)
        self.mode: str = check_choice("mode", mode, ("exponential", "linear"))
        self.method: str = check_choice("method", method, ("auto", *SUGGESTION_METHODS))
        self.beta: float = check_float("beta", beta, 0.0, 0.999)
        self.divergence_threshold: float | None = check_float(
            "divergence_threshold", divergence_threshold, 0.0, low_open=True, allow_none=True
        )
        self.milestones = sorted(
            set(check_int_list("milestones", [0] if milestones is None else milestones, 0))
        )
        min_points = check_int("min_points", min_points, 2, allow_none=True)
        self.apply = check_bool("apply", apply)
        self.plot = check_bool("plot", plot)
        self.progress = check_bool("progress", progress)
        self.max_sweeps: int | None = check_int("max_sweeps", max_sweeps, 1, allow_none=True)
        self.search_steps: int | float = _check_search_steps(search_steps)
        self.search_candidates: int = check_int("search_candidates", search_candidates, 3, maximum=9)
        self.search_retries: int = check_int("search_retries", search_retries, 0, maximum=MAX_SEARCH_RETRIES)
        self.min_points: int = min_points if min_points is not None else max(5, self.num_training // 10)
        self._stop_after = False  # set by lr_find: end the fit once the sweep is done
        self._standalone_bar = False  # set by lr_find: its Trainer's bars are off by lr_find's choice

    @property
    def result(self) -> LRFinderResult | None:
        """The latest range test's result (``None`` before the first)."""
        return self.results[-1] if self.results else None

    @property
    def suggestion(self) -> float | None:
        return self.result.suggestion if self.result is not None else None

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stop_after:  # lr_find's throwaway fit: sweep now, then end it before any epoch starts
            self._at_milestone(trainer, pl_module)
            engine.end_fit_before_training(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._stop_after:
            self._at_milestone(trainer, pl_module)

    def _at_milestone(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = int(trainer.current_epoch)
        if epoch not in self.milestones or epoch in self._done_epochs:
            return
        self._done_epochs.add(epoch)
        if not skipped_for_fast_dev_run(trainer, "LRFinderPlus", "the learning-rate range test"):
            self.find(trainer, pl_module)

    # ------------------------------------------------------------------ the test
    def find(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LRFinderResult | None:
        """Run one range test now (inside a fit, where the optimizer and dataloader exist)."""
        epoch = int(trainer.current_epoch)
        test = engine.RangeTest(
            min_lr=self.min_lr,
            max_lr=self.max_lr,
            num_training=self.num_training,
            mode=self.mode,
            method=self.method,
            beta=self.beta,
            divergence_threshold=self.divergence_threshold,
            min_points=self.min_points,
            progress=self.progress,
            max_sweeps=self.max_sweeps,
            standalone_bar=self._standalone_bar,
            search_steps=self.search_steps,
            search_candidates=self.search_candidates,
            search_retries=self.search_retries,
            run_length_known=not self._stop_after,
        )
        if not pl_module.automatic_optimization:  # a setup, not a failure: one INFO line for every check
            manual_optimization_note(trainer)
            self.results.append(test.not_run(epoch, "manual optimization"))
            return None
        problem = engine.unsupported_setup(trainer, pl_module)
        if problem is not None:
            warn_once(
                trainer, f"lr_finder_unsupported:{problem.message}", f"{problem.message}; no range test ran."
            )
            self.results.append(test.not_run(epoch, problem.message))
            tested = Tested(result=self.results[-1], epoch=epoch, min_points=self.min_points, problem=problem)
            self.run_rules(trainer, RULES, tested)
            return None
        result = test.run(trainer, pl_module, epoch=epoch, apply=self.apply)
        self.results.append(result)
        self.run_rules(trainer, RULES, Tested(result=result, epoch=epoch, min_points=self.min_points))
        # lr_find's throwaway fit has no logger on purpose: no "the trainer has no logger" line for it
        write_result(
            trainer, result, plot=self.plot, log_curve=not (self._stop_after and not trainer.loggers)
        )
        return result


def lr_find(
    model: pl.LightningModule,
    train_dataloaders: Any = None,
    datamodule: pl.LightningDataModule | None = None,
    *,
    trainer_kwargs: dict[str, Any] | None = None,
    attr_name: str | None = "",
    **finder_kwargs: Any,
) -> LRFinderResult | None:
    """Run a range test before training, in a throwaway Trainer; the model comes back unchanged.

    The suggestion is written to the model's ``attr_name`` attribute (``""``: the first of ``lr``,
    ``learning_rate`` found on the model or in its ``hparams``; ``None``: do not write it), so the real
    ``Trainer.fit`` builds its optimizer with it. ``finder_kwargs`` go to :class:`LRFinderPlus`;
    ``trainer_kwargs`` to the throwaway ``Trainer`` (default: CPU/GPU auto, one device, no logger,
    checkpointing, progress bar or validation).

    The throwaway fit ends cleanly right after the sweep, before its first training batch (also with
    ``min_epochs`` / ``min_steps`` in ``trainer_kwargs``): callbacks passed there see a finished fit
    (``on_train_end``), never ``on_exception``. With ``fast_dev_run`` in ``trainer_kwargs`` the test is
    skipped, like Lightning's tuner does: one INFO line, no fit, ``None`` returned.

    Returns the :class:`LRFinderResult` (its ``suggestion`` is ``None`` when none was possible), or
    ``None`` when skipped.
    """
    finder_kwargs.setdefault("apply", False)
    finder_kwargs.setdefault("plot", False)
    finder = LRFinderPlus(milestones=[0], **finder_kwargs)
    finder._stop_after = True
    # lr_find turns its throwaway Trainer's bars off (it trains nothing); the sweep's bar follows only a
    # choice the user made in trainer_kwargs
    finder._standalone_bar = "enable_progress_bar" not in (trainer_kwargs or {})
    kwargs: dict[str, Any] = dict(
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(trainer_kwargs or {})
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), finder]
    trainer = pl.Trainer(**kwargs)
    if skipped_for_fast_dev_run(trainer, "lr_find", "the learning-rate range test"):
        return None  # its fit would train a batch on the model, which lr_find must leave unchanged
    trainer.fit(model, train_dataloaders=train_dataloaders, datamodule=datamodule)
    result = finder.result
    if result is not None and result.suggestion is not None and attr_name is not None:
        engine.set_lr_attr(model, attr_name, result.suggestion)
    return result
