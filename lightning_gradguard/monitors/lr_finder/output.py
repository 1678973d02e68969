"""Where a range test's result goes (rank 0): scalars, the summary line, CSV, figure, hyperparameters."""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_gradguard.alerts import write_atomically
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.cadence import log_step
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult
from lightning_gradguard.monitors.lr_finder.search import SHORT_HORIZON
from lightning_gradguard.monitors.lr_finder.tags import LR_FINDER, LR_FINDER_CURVE

log = logging.getLogger("lightning_gradguard")


def write_result(trainer: pl.Trainer, result: LRFinderResult, *, plot: bool, log_curve: bool) -> None:
    """Send ``result`` to the loggers, the ``lightning_gradguard`` logger and the log directory (rank 0).

    ``log_curve=False`` leaves the per-step curve out of the scalars (lr_find's throwaway fit, which has
    no logger on purpose). ``plot`` saves the figure (with matplotlib) and sends it to TensorBoard.
    """
    if not trainer.is_global_zero:
        return
    suffix = "" if result.epoch == 0 else f"_epoch{result.epoch}"
    if log_curve:
        _log_curve(trainer, result, suffix)
        _log_search(trainer, result, suffix)
    if result.suggestion is not None and trainer.loggers:
        _emit.log_scalars(trainer, {LR_FINDER.tag("suggested_lr"): result.suggestion}, log_step(trainer))
    if result.applied_lr is not None:
        hparams: dict[str, Any] = {LR_FINDER.tag(f"applied_lr{suffix}"): result.applied_lr}
        hparams[LR_FINDER.tag(f"method{suffix}")] = result.rule
        _log_hparams(trainer, hparams)
    _log_summary(result)
    if not trainer.loggers:  # no log directory: the curve stays in ``self.results``
        return
    folder = _emit.log_dir(trainer)
    _write_csv(trainer, folder, result, suffix)
    _write_search_csv(trainer, folder, result, suffix)
    if plot and result.lrs:
        _write_figure(trainer, folder, result, suffix)


def _log_curve(trainer: pl.Trainer, result: LRFinderResult, suffix: str) -> None:
    """The raw and smoothed loss and the LR of every recorded point, against the sweep step."""
    for i, (lr, loss, smooth) in enumerate(zip(result.lrs, result.losses, result.smoothed, strict=False)):
        _emit.log_scalars(
            trainer,
            {
                LR_FINDER.tag(f"loss{suffix}"): loss,
                LR_FINDER.tag(f"smoothed_loss{suffix}"): smooth,
                LR_FINDER.tag(f"lr{suffix}"): lr,
            },
            i,
        )


def _log_search(trainer: pl.Trainer, result: LRFinderResult, suffix: str) -> None:
    """Every candidate of the search: its LR, the loss it reached and its round, against the trial's
    index (``inf``, a candidate that diverged, is not logged as its loss)."""
    if result.search is None:
        return
    for i, trial in enumerate(result.search.trials):
        values = {
            LR_FINDER.tag(f"search_lr{suffix}"): trial.lr,
            LR_FINDER.tag(f"search_round{suffix}"): float(trial.round),
        }
        if math.isfinite(trial.loss):
            values[LR_FINDER.tag(f"search_loss{suffix}")] = trial.loss
        _emit.log_scalars(trainer, values, i)


def search_in_words(result: LRFinderResult) -> str:
    """What the search did, for the summary line (empty without one)."""
    search = result.search
    if search is None:
        return ""
    if not search.trials:
        return f"; no search: {search.reason}"
    tried = ", ".join(f"{t.lr:.2e}: {t.loss:.4g}" for t in search.trials)
    if search.chosen is not None and search.winner is not None:
        chose = f"won {search.winner:.3e}, chose {search.chosen:.3e} (the winner over {SHORT_HORIZON:g})"
    else:
        chose = f"chose none ({search.reason})"
    if search.note:
        chose += f" ({search.note})"
    blind = " (blind: the sweep's descent did not stand out of its noise)" if search.blind else ""
    return (
        f"; search{blind} in [{search.bracket[0]:.2e}, {search.bracket[1]:.2e}] by the loss on "
        f"{search.evaluated_on} ({tried}) {chose}, {search.steps} steps, {search.seconds:.1f}s"
    )


def _log_summary(result: LRFinderResult) -> None:
    """The one INFO line on the ``lightning_gradguard`` logger."""
    chosen = f"{result.suggestion:.3e}" if result.suggestion is not None else "none"
    if result.applied:  # only then: with apply=False (and in lr_find) the optimizer is not touched
        chosen += " applied"
    others = ", ".join(f"{k} {v:.2e}" for k, v in result.suggestions.items() if v is not None)
    log.info(
        "LRFinderPlus [epoch %d]: suggestion (%s) %s; all: %s; %d points%s, stopped: %s%s%s; %.1fs",
        result.epoch,
        "search" if result.search is not None and result.search.chosen is not None else rule_in_words(result),
        chosen,
        others or "none",
        len(result.lrs),
        f" (mean of {result.sweeps} sweeps)" if result.sweeps > 1 else "",
        result.stop_reason,
        _end_in_words(result),
        search_in_words(result),
        result.seconds,
    )


def _end_in_words(result: LRFinderResult) -> str:
    """The sweep's end when it went past ``max_lr``, or when its loss was still falling there."""
    if result.extended_to is not None:
        return f" (extended to lr {result.extended_to:.2e}: the loss was still falling at max_lr)"
    if result.still_falling and result.lrs:
        return (
            f" (the loss was still falling at lr {result.lrs[-1]:.2e}, the sweep's end: raise max_lr to see "
            "where it turns up)"
        )
    return ""


def rule_in_words(result: LRFinderResult) -> str:
    """Which rule gave the suggestion, and why that one (the schedule it was fitted to)."""
    schedule = result.schedule
    if result.rule == "peak" and schedule is not None and schedule.warms_up:
        return f"peak: the run's schedule has {schedule.describe()}; its peak at the curve's lowest point"
    if result.method == "auto" and result.rule:
        return f"{result.rule}: {'the run does not warm up' if schedule is not None else 'a constant LR'}"
    return result.rule or result.method


def _write_csv(trainer: pl.Trainer, folder: str, result: LRFinderResult, suffix: str) -> None:
    """``lr_finder<suffix>.csv`` in ``folder`` (created if needed): one row per recorded point, written
    atomically (a reader never sees half a table); a failed write is one warning naming the path."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(["step", "lr", "loss", "smoothed_loss", "curve"])
    for i, row in enumerate(zip(result.lrs, result.losses, result.smoothed, result.curve, strict=True)):
        writer.writerow([i, *row])
    path = os.path.join(folder, f"lr_finder{suffix}.csv")
    _emit.write_file(trainer, path, lambda: write_atomically(path, buf.getvalue()))


def _write_search_csv(trainer: pl.Trainer, folder: str, result: LRFinderResult, suffix: str) -> None:
    """``lr_search<suffix>.csv`` in ``folder``: one row per candidate's training (round, lr, steps, the loss
    it reached, its last quarter's training loss, whether it won: the search suggests the winner's LR over
    ``search.SHORT_HORIZON``; how much of its loss rests on its inputs, in the last round), written
    atomically."""
    search = result.search
    if search is None or not search.trials:
        return
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(["round", "lr", "steps", "loss", "train_loss", "won", "input_dependence"])
    last = max(t.round for t in search.trials)
    for t in search.trials:
        won = int(t.round == last and search.winner is not None and t.lr == search.winner)
        writer.writerow([t.round, t.lr, t.steps, t.loss, t.train_loss, won, t.input_dependence])
    path = os.path.join(folder, f"lr_search{suffix}.csv")
    _emit.write_file(trainer, path, lambda: write_atomically(path, buf.getvalue()))


def _write_figure(trainer: pl.Trainer, folder: str, result: LRFinderResult, suffix: str) -> None:
    """``lr_finder<suffix>.png`` in ``folder`` and on TensorBoard; nothing without matplotlib."""
    try:
        fig = result.plot()
    except ImportError:
        return
    path = os.path.join(folder, f"lr_finder{suffix}.png")
    _emit.write_file(trainer, path, lambda: fig.savefig(path, dpi=100))
    tag, at = LR_FINDER_CURVE.tag(f"curve{suffix}"), log_step(trainer)
    for tb in _emit.tensorboard_writers(trainer):
        _emit.safely(
            trainer,
            "the range test's figure",
            lambda w=tb: w.add_figure(tag, fig, global_step=at, close=False),
        )


def _log_hparams(trainer: pl.Trainer, params: dict[str, Any]) -> None:
    """Add ``params`` to the hyperparameters of every logger (rank zero), as Lightning's own hparams are.

    TensorBoard: ``metrics={}`` records them in ``logger.hparams`` without the ``hp_metric = -1`` placeholder
    and without a second hparams session in the event file (TensorBoard shows only a run's first one);
    ``hparams.yaml``, which the logger writes once at fit start, is brought up to date. Other loggers
    (CSV, MLflow, W&B, ...) get a plain ``log_hyperparams`` call. A logger that refuses (MLflow will not
    change a parameter a reused run already has) costs that record only, with one warning.
    """
    if not trainer.is_global_zero:
        return

    def tensorboard(logger: TensorBoardLogger) -> None:
        logger.log_hyperparams(params, metrics={})
        path = os.path.join(logger.log_dir, logger.NAME_HPARAMS_FILE)
        if get_filesystem(path).isfile(path):  # later saves do not rewrite it
            save_hparams_to_yaml(path, logger.hparams)

    for logger in trainer.loggers:
        what = f"the applied LR to {type(logger).__name__}'s hyperparameters"
        if isinstance(logger, TensorBoardLogger):
            _emit.safely(trainer, what, lambda lg=logger: tensorboard(lg))
        else:
            _emit.safely(trainer, what, lambda lg=logger: lg.log_hyperparams(params))
