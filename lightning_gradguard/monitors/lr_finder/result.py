"""The outcome of one learning-rate range test, and its figure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_gradguard.functional.lr_suggest import DescentCheck
from lightning_gradguard.monitors.lr_finder.schedule import Schedule


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One candidate's short training in the search after the sweep.

    Attributes:
        lr: the candidate: the LR group 0 is configured with (under a schedule, the LR it scales).
        round: the search round (0: every candidate; 1: the best two and one more point; 2 and 3 the same
            again with trials twice as long, after a retry: ``SearchResult.retries``).
        steps: optimizer steps it took (fewer than planned when its loss became non-finite).
        loss: the loss it reached: the mean over the evaluation batches after its last step (``inf``:
            its training loss became non-finite).
        train_loss: the mean training loss of its last quarter of steps (``inf`` as ``loss``).
        batch_losses: the loss on each evaluation batch (empty when it diverged): the candidates of a
            round are compared batch by batch.
        input_dependence: the rise of the held-out loss when every sample's inputs meet another sample's
            targets, as a share of that mismatched loss (the last round only): near 0 for a model that
            predicts the same for every input (the targets' frequencies), near 1 for one that uses its
            inputs; ``nan`` where the batches' inputs and targets cannot be told apart, where the loss
            does not depend on their pairing, or where a small rise meets a loss that differs between two
            evaluations of the same batches (its noise could pass for either answer).
    """

    lr: float
    round: int
    steps: int
    loss: float
    train_loss: float
    batch_losses: tuple[float, ...] = ()
    input_dependence: float = math.nan


@dataclass(kw_only=True)
class SearchResult:
    """The search inside the sweep's bracket: candidates trained a short, equal number of steps each.

    Attributes:
        trials: every candidate's training, round by round.
        winner: of the last round's candidates whose loss is within one standard error of its lowest (their
            batch-by-batch difference to it), the one nearest the sweep's suggestion (``None``: see
            ``reason``).
        chosen: the LR the search suggests, ``winner`` over ``search.SHORT_HORIZON`` (1.25): short trials
            favour large LRs (``None``: see ``reason``).
        bracket: the lowest and highest candidate of the first round.
        evaluated_on: ``"validation batches"``, ``"N held-out training samples"`` (a subset of the dataset
            that the trials never train on) or ``"held-out training batches"`` (the first batches of a
            pass, where the loader cannot be split by sample: ``holdout.py``).
        steps: optimizer steps the search took in all.
        seconds: its wall time.
        reason: why it chose nothing (empty when it chose): every candidate diverged, none got its
            loss clearly below the loss before training (two standard errors of the batch-by-batch
            difference, and 2 % of its level) in its steps, or what the best learned does not depend on its
            inputs (``search.INPUT_SHARE``); the sweep's suggestion then stands.
        note: what is said beside the outcome (empty when there is nothing to say): that the search ran
            again with longer trials (``retries``), and why; or that the second round, twice the steps, did
            not get its best loss clearly below the first round's, so the trials learned nothing more after
            their first steps (raise ``search_steps`` for a model that learns slowly).
        start_loss: the loss on the evaluation batches before any training.
        retries: how many times the search ran again, its trials twice as long each time, because the
            trials before chose nothing though a candidate trained without diverging (at most the
            ``search_retries`` setting); ``steps``, ``seconds`` and ``trials`` count every run, whose
            rounds follow on (a retry's are 2 and 3, the next one's 4 and 5).
        blind: the sweep gave no suggestion (its descent did not stand out of its noise), so the bracket
            is the ``search.BLIND_DECADES`` below the sweep's top and no suggestion of the curve's breaks a
            tie: the trials alone decide, and where they learn nothing the refusal stands.
    """

    trials: list[Trial] = field(default_factory=list)
    winner: float | None = None
    chosen: float | None = None
    bracket: tuple[float, float] = (math.nan, math.nan)
    evaluated_on: str = ""
    steps: int = 0
    seconds: float = 0.0
    reason: str = ""
    start_loss: float = math.nan
    note: str = ""
    retries: int = 0
    blind: bool = False


@dataclass
class LRFinderResult:
    """The outcome of one range test.

    Attributes:
        lrs: learning rate of parameter group 0 at each recorded optimizer step.
        losses: the raw training loss of each recorded step (mean over micro-batches and ranks).
        smoothed: the online bias-corrected EMA the stop rule used.
        curve: the zero-lag smoothed curve the suggestions were computed on.
        suggestions: every method's suggestion (``None`` where a method had none).
        method: the ``method`` setting (``"auto"``: ``rule`` is chosen from the run's schedule).
        suggestion: the learning rate to configure parameter group 0 with, or ``None`` (see ``reason``).
            Under the ``peak`` rule it is the LR that puts the schedule's peak on the curve's low point.
        rule: the suggestion method that gave ``suggestion`` (``method``, or what ``"auto"`` chose).
        schedule: what the run's LR schedule does (read by stepping its schedulers ahead), or ``None``.
        sweeps: how many sweeps were averaged into ``losses`` (more than one when the first one's descent
            was lost in its noise).
        divergence_at: index of the first point of the diverging tail that the curve was read without
            (``None``: no such tail).
        epoch: the epoch at whose start the test ran.
        stop_reason: why the sweep ended: ``"completed"`` (all its steps), ``"diverged"``
            (the stop rule fired), ``"non-finite loss"``, ``"capped"`` (the optimizer caps its step below
            the next LR: torch's Adafactor takes ``min(lr, 1 / sqrt(t))``), ``"no loss"``
            (``training_step`` returned no loss), ``"no data"`` (the training dataloader yielded no batch),
            or ``"not run"`` (an unsupported setup: see ``reason``).
        reason: why there is no suggestion (empty when there is one).
        descent: how far the smoothed curve falls to its minimum against its own noise (``None`` without
            points); with ``descent.stands_out`` false no method suggests anything.
        skipped_steps: optimizer steps the GradScaler skipped (their points are dropped).
        limited_to: the steps the sweep was cut to because the Trainer limits the training batches of
            an epoch (``limit_train_batches``, ``overfit_batches``); ``None``: it planned ``num_training``.
        seconds: wall time of the sweep.
        applied: whether the suggestion was set on the optimizer (``apply=True`` and a suggestion).
        applied_lr: the learning rate group 0 is configured with after applying, read back from the
            optimizer (the LR a scheduler scales from, e.g. OneCycleLR's peak): the suggestion. ``None``
            when nothing was applied. It is also written to the loggers' hyperparameters.
        sweep_suggestion: the suggestion the curve alone gave (``suggestion`` before the search).
        sweep_reason: why the curve alone gave none (``reason`` before the search; empty when it gave one).
        search: the search after the sweep (``None``: ``search_steps=0``, or no bracket to search).
        extended_to: the LR the sweep was extended to past ``max_lr`` because its loss was still falling
            there (``None``: not extended).
        still_falling: the loss was still falling at the sweep's last LR (it never turned up).
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    curve: list[float]
    suggestions: dict[str, float | None]
    method: str
    suggestion: float | None
    rule: str = ""
    schedule: Schedule | None = None
    sweeps: int = 1
    divergence_at: int | None = None
    epoch: int = 0
    stop_reason: str = "completed"
    reason: str = ""
    descent: DescentCheck | None = None
    skipped_steps: int = 0
    limited_to: int | None = None
    seconds: float = 0.0
    applied: bool = False
    applied_lr: float | None = None
    sweep_suggestion: float | None = None
    sweep_reason: str = ""
    search: SearchResult | None = None
    extended_to: float | None = None
    still_falling: bool = False

    def plot(self, ax: Any = None) -> Any:
        """Draw the raw and smoothed curves against log-LR, every suggestion marked; returns the figure."""
        from matplotlib.figure import Figure

        if ax is None:
            fig = Figure(figsize=(6.4, 4.2))
            ax = fig.add_subplot(1, 1, 1)
        else:
            fig = ax.figure
        ax.plot(self.lrs, self.losses, color="0.75", lw=1, label="loss")
        ax.plot(self.lrs, self.curve, color="C0", lw=2, label="smoothed")
        colors = {"valley": "C1", "steep": "C2", "minimum": "C3", "slide": "C4", "peak": "C5"}
        for name, lr in self.suggestions.items():
            if lr is None:
                continue
            searched = self.search is not None and self.search.chosen is not None
            chosen = " (chosen)" if name == self.rule and not searched else ""
            style = "-" if chosen else "--"
            label = "minimum/10" if name == "minimum" else name  # the rule is the lowest loss's LR / 10
            ax.axvline(lr, color=colors.get(name, "k"), ls=style, lw=1.5, label=f"{label} {lr:.2e}{chosen}")
        if self.search is not None:
            self._plot_search(ax)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.set_title(f"LR range test (epoch {self.epoch})")
        finite = [v for v in self.curve if math.isfinite(v)]
        if finite:
            lo, hi = min(finite), max([*finite[: max(1, len(finite) // 3)], min(finite)])
            pad = 0.1 * (hi - lo if hi > lo else abs(lo) + 1.0)
            ax.set_ylim(lo - pad, max(finite[0], hi) + pad)
        ax.legend(fontsize=8)
        return fig

    def _plot_search(self, ax: Any) -> None:
        """The search's candidates as triangles on the top edge, the one it chose as a black line."""
        search = self.search
        if search is None:
            return
        tried = sorted({t.lr for t in search.trials})
        if tried:
            ax.plot(
                tried, [1.0] * len(tried), "kv", ms=5, transform=ax.get_xaxis_transform(), label="searched"
            )
        if search.chosen is not None:
            label = f"search {search.chosen:.2e} (chosen)"
            if search.winner is not None and search.winner != search.chosen:
                over = search.winner / search.chosen
                label = f"search {search.chosen:.2e} (chosen: its winner {search.winner:.2e} over {over:.3g})"
            ax.axvline(search.chosen, color="k", lw=2, label=label)
