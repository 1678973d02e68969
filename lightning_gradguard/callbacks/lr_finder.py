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

The sweep runs its own small loop over the training dataloader (the one Lightning has already set up,
with its distributed sampler); it does not re-enter ``Trainer.fit`` and does not swap loggers, which is
what makes Lightning's own finder fail after training has started.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, TQDMProgressBar
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.cadence import log_step
from lightning_gradguard.core.snapshot import TrainingSnapshot
from lightning_gradguard.core.state import skipped_for_fast_dev_run, warn_once
from lightning_gradguard.core.trial import loss_of, quiet_logging
from lightning_gradguard.core.validate import check_bool, check_choice, check_float, check_int, check_int_list
from lightning_gradguard.functional.lr_suggest import (
    SUGGESTION_METHODS,
    DivergenceMonitor,
    centered_smooth,
    suggest_all,
    sweep_lrs,
)

__all__ = ["LRFinderPlus", "LRFinderResult", "lr_find"]

log = logging.getLogger("lightning_gradguard")

_SCALED_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr")  # scheduler bookkeeping kept in param groups


@dataclass
class LRFinderResult:
    """The outcome of one range test.

    Attributes:
        lrs: learning rate of parameter group 0 at each recorded optimizer step.
        losses: the raw training loss of each recorded step (mean over micro-batches and ranks).
        smoothed: the online bias-corrected EMA the stop rule used.
        curve: the zero-lag smoothed curve the suggestions were computed on.
        suggestions: every method's suggestion (``None`` where a method had none).
        method: the method that picks ``suggestion``.
        suggestion: the suggested learning rate for parameter group 0, or ``None`` (see ``reason``).
        epoch: the epoch at whose start the test ran.
        stop_reason: why the sweep ended: ``"completed"`` (all ``num_training`` steps), ``"diverged"``
            (the stop rule fired), ``"non-finite loss"``, ``"no loss"`` (``training_step`` returned no
            loss), ``"no data"`` (the training dataloader yielded no batch), or ``"not run"`` (an
            unsupported setup: see ``reason``).
        reason: why there is no suggestion (empty when there is one).
        skipped_steps: optimizer steps the GradScaler skipped (their points are dropped).
        seconds: wall time of the sweep.
        applied: whether the suggestion was set on the optimizer (``apply=True`` and a suggestion).
        applied_lr: the learning rate group 0 is configured with after applying, read back from the
            optimizer (the LR a scheduler scales from, e.g. OneCycleLR's peak): the suggestion. ``None``
            when nothing was applied. It is also written to the loggers' hyperparameters.
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    curve: list[float]
    suggestions: dict[str, float | None]
    method: str
    suggestion: float | None
    epoch: int = 0
    stop_reason: str = "completed"
    reason: str = ""
    skipped_steps: int = 0
    seconds: float = 0.0
    applied: bool = False
    applied_lr: float | None = None

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
        colors = {"valley": "C1", "steep": "C2", "minimum": "C3", "slide": "C4"}
        for name, lr in self.suggestions.items():
            if lr is None:
                continue
            chosen = " (chosen)" if name == self.method else ""
            style = "-" if chosen else "--"
            label = "minimum/10" if name == "minimum" else name  # the rule is the lowest loss's LR / 10
            ax.axvline(lr, color=colors.get(name, "k"), ls=style, lw=1.5, label=f"{label} {lr:.2e}{chosen}")
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


def _batches(loader: Any) -> Iterator[tuple[Any, int]]:
    """Batches of the training dataloader(s), starting over when they run out (a new pass, as an epoch)."""
    combined = loader if isinstance(loader, CombinedLoader) else CombinedLoader(loader, "max_size_cycle")
    while True:
        produced = False
        for item in combined:
            batch, batch_idx = item[0], item[1]
            produced = True
            yield batch, batch_idx
        if not produced:
            return


class LRFinderPlus(GradGuardCallback):
    r"""Learning-rate range test at fit start (and at milestone epochs) that applies its suggestion.

    For ``num_training`` optimizer steps the learning rate rises from ``min_lr`` to ``max_lr``
    (exponentially or linearly); each step records the training loss. With ``accumulate_grad_batches``
    a step is several micro-batches and one point; steps the GradScaler skipped are dropped; several
    parameter groups move together with their ratios kept (the LR reported is group 0's). The loss is
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

    Under DDP every rank runs the same sweep on its own shard; the loss of each step is averaged
    across ranks, so all ranks see the same curve and stop at the same step; rank 0's result is
    broadcast. When no suggestion is possible the LR is left alone and an ``lr_finder_failed`` alert
    says why. The sweep needs automatic optimization with one optimizer, on a single device or under
    DDP: in any other setup (manual optimization, for one) no sweep runs, and the alert says that the
    setup is not supported and what to do instead.

    Output (rank 0): scalars ``lr_finder/loss``, ``lr_finder/smoothed_loss`` and ``lr_finder/lr``
    against the sweep step, ``lr_finder/suggested_lr`` at the trainer's step; a CSV
    ``lr_finder.csv`` and (with matplotlib) a figure ``lr_finder.png`` in the log directory (when the
    trainer has a logger), the figure also sent to TensorBoard. An applied LR is written to every
    logger's hyperparameters (``lr_finder/applied_lr`` and ``lr_finder/method``; in ``hparams.yaml`` for
    TensorBoard and CSV) and to ``result.applied_lr``. Later milestones get an ``_epoch<N>`` suffix.
    While the sweep runs, a tqdm bar of its own (stderr, below Lightning's training bar, gone when the
    sweep ends) shows the LR and loss; the result is one INFO line on the ``lightning_gradguard`` logger.
    Under ``fast_dev_run`` the test is skipped, like Lightning's tuner.

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
        progress: show the sweep's progress bar on rank 0.
        min_points: fewest recorded points for a suggestion (default: a tenth of ``num_training``, >= 5).

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import LRFinderPlus

        finder = LRFinderPlus(min_lr=1e-6, max_lr=1.0, num_training=100)
        trainer = Trainer(callbacks=[finder], max_epochs=10)
        trainer.fit(model)
        print(finder.result.suggestion, finder.result.suggestions)
    """

    state_key_args = ("milestones", "method")

    def __init__(
        self,
        min_lr: float = 1e-7,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: Literal["exponential", "linear"] = "exponential",
        method: Literal["steep", "valley", "minimum", "slide"] = "steep",
        beta: float = 0.9,
        divergence_threshold: float | None = 1.0,
        milestones: list[int] | None = None,
        apply: bool = True,
        plot: bool = True,
        progress: bool = True,
        min_points: int | None = None,
        action: Literal["warn", "stop", "raise"] = "warn",
    ) -> None:
        super().__init__(action=action, cooldown_steps=0)
        self.min_lr: float = check_float("min_lr", min_lr, 0.0, low_open=True)
        self.max_lr: float = check_float("max_lr", max_lr, 0.0, low_open=True)
        if self.max_lr <= self.min_lr:
            raise ValueError(f"`max_lr` must be greater than `min_lr` ({min_lr!r}); got {max_lr!r}")
        self.num_training: int = check_int("num_training", num_training, 5)
        self.mode: str = check_choice("mode", mode, ("exponential", "linear"))
        self.method: str = check_choice("method", method, SUGGESTION_METHODS)
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
        self.min_points: int = min_points if min_points is not None else max(5, self.num_training // 10)
        self.results: list[LRFinderResult] = []
        self._done_epochs: set[int] = set()
        self._stop_after = False  # set by lr_find: end the fit once the sweep is done

    @property
    def result(self) -> LRFinderResult | None:
        """The latest range test's result (``None`` before the first)."""
        return self.results[-1] if self.results else None

    @property
    def suggestion(self) -> float | None:
        return self.result.suggestion if self.result is not None else None

    @override
    def layout_charts(self) -> dict[str, list[str]]:
        return {
            "LR finder: loss per sweep step": [r"lr_finder/loss.*", r"lr_finder/smoothed_loss.*"],
            "LR finder: learning rate per sweep step (use the log y axis)": [r"lr_finder/lr.*"],
        }

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):  # the same callback reused for a new run tests that run again
            self._done_epochs.clear()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stop_after:  # lr_find's throwaway fit: sweep now, then end it before any epoch starts
            self._at_milestone(trainer, pl_module)
            _end_fit_before_training(trainer)

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
        problem = self._unsupported(trainer, pl_module)
        if problem is not None:
            message, hint = problem
            warn_once(trainer, f"lr_finder_unsupported:{message}", f"{message}; no range test ran.")
            self.results.append(
                LRFinderResult(
                    lrs=[],
                    losses=[],
                    smoothed=[],
                    curve=[],
                    suggestions=dict.fromkeys(SUGGESTION_METHODS),
                    method=self.method,
                    suggestion=None,
                    epoch=epoch,
                    stop_reason="not run",
                    reason=message,
                )
            )
            self._alert(trainer, epoch, f"No LR range test: {message}.", hint, points=0)
            return None
        optimizer = trainer.optimizers[0]
        started = time.perf_counter()
        snapshot = TrainingSnapshot(pl_module, trainer=trainer)
        base = [_configured(g) for g in optimizer.param_groups]
        try:
            lrs, losses, smoothed, stop_reason, skipped = self._sweep(trainer, pl_module, optimizer, base)
        finally:
            snapshot.restore()
        result = self._decide(lrs, losses, smoothed, stop_reason, skipped, epoch)
        result.seconds = time.perf_counter() - started
        if trainer.world_size > 1:
            result = trainer.strategy.broadcast(result, src=0)
        self.results.append(result)
        if result.suggestion is None:
            self._alert(
                trainer,
                epoch,
                f"LR range test gave no suggestion: {result.reason}.",
                "Widen the sweep (lower min_lr if it diverged at once, raise max_lr if the loss never fell), "
                "raise num_training, or check that the loss depends on the learning rate at all.",
                points=len(result.lrs),
            )
        elif self.apply:
            _apply_lr(trainer, optimizer, base, result.suggestion)
            result.applied = True
            result.applied_lr = _configured(optimizer.param_groups[0])
        self._output(trainer, result)
        return result

    def _unsupported(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[str, str] | None:
        """``(message, hint)`` when the sweep cannot run in this setup, else ``None``."""
        if not pl_module.automatic_optimization:
            return (
                "LRFinderPlus needs automatic optimization (training_step returning the loss): the range "
                "test drives the optimizer itself, and this module uses manual optimization",
                "Set the learning rate by hand, or run lr_find() on an automatic-optimization version of "
                "the model and use its suggestion.",
            )
        if len(trainer.optimizers) != 1:
            return (
                f"LRFinderPlus needs exactly one optimizer, found {len(trainer.optimizers)}",
                "Set the learning rate by hand, or run lr_find() on a version of the model with one "
                "optimizer and use its suggestion.",
            )
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(
            strategy, DeepSpeedStrategy
        ):
            return (
                f"LRFinderPlus runs on a single device or under DDP, not under {type(strategy).__name__}",
                "Run lr_find() on the model with one device (trainer_kwargs={'devices': 1}) or under DDP, "
                "and set its suggestion as this run's learning rate.",
            )
        if trainer.train_dataloader is None:
            return (
                "LRFinderPlus found no training dataloader to sweep over",
                "Give Trainer.fit the training data (train_dataloaders or a datamodule with "
                "train_dataloader) and keep limit_train_batches above 0.",
            )
        loaders = trainer.train_dataloader
        flat = loaders.flattened if isinstance(loaders, CombinedLoader) else [loaders]
        if isinstance(loaders, (list, tuple)):
            flat = list(loaders)
        elif isinstance(loaders, dict):
            flat = list(loaders.values())
        for dl in flat:
            if getattr(dl, "persistent_workers", False) and getattr(dl, "num_workers", 0) > 0:
                warn_once(
                    trainer,
                    "lr_finder_persistent_workers",
                    "LRFinderPlus: a dataloader with persistent_workers=True restarts its shared iterator "
                    "for the sweep; the first epoch's batch order may differ from a run without the finder.",
                )
        return None

    def _sweep(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, base: list[float]
    ) -> tuple[list[float], list[float], list[float], str, int]:
        ratios = [b / base[0] for b in base] if base[0] > 0 else [1.0] * len(base)
        schedule = sweep_lrs(self.min_lr, self.max_lr, self.num_training, self.mode)
        monitor = DivergenceMonitor(
            self.beta, self.divergence_threshold, warmup=max(2, self.num_training // 10)
        )
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        clip_val = trainer.gradient_clip_val
        clip_algo = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm")
        strategy = trainer.strategy
        lrs: list[float] = []
        losses: list[float] = []
        skipped = 0
        stop_reason = "completed"
        quiet = contextlib.ExitStack()
        quiet.enter_context(quiet_logging(pl_module))  # the sweep's losses are not the run's metrics
        batches = _batches(trainer.train_dataloader)
        bar = _progress_bar(trainer, len(schedule)) if self.progress and trainer.is_global_zero else None
        try:
            for lr in schedule:
                for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
                    group["lr"] = lr * ratio
                optimizer.zero_grad(set_to_none=True)
                total = None
                for _ in range(accumulate):
                    try:
                        batch, batch_idx = next(batches)
                    except StopIteration:
                        stop_reason = "no data"
                        break
                    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
                    batch = strategy.batch_to_device(batch, dataloader_idx=0)
                    batch = trainer.precision_plugin.convert_input(batch)
                    loss = loss_of(strategy.training_step(batch, batch_idx))
                    if loss is None:
                        stop_reason = "no loss"
                        break
                    value = loss.detach().float()
                    total = value if total is None else total + value
                    scaled = loss / accumulate
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
                    scaled.backward()
                if stop_reason != "completed" or total is None:
                    if stop_reason == "completed":
                        stop_reason = "no loss"
                    break
                mean = total / accumulate
                if trainer.world_size > 1:
                    mean = strategy.reduce(mean, reduce_op="mean")
                value_f = float(mean)
                if not math.isfinite(value_f):
                    stop_reason = "non-finite loss"
                    break
                step_skipped = False
                if scaler is not None:
                    scale_before = float(scaler.get_scale())
                    if clip_val:
                        scaler.unscale_(optimizer)
                        trainer.precision_plugin.clip_gradients(optimizer, clip_val, clip_algo)
                    scaler.step(optimizer)
                    scaler.update()
                    step_skipped = float(scaler.get_scale()) < scale_before
                else:
                    if clip_val:
                        trainer.precision_plugin.clip_gradients(optimizer, clip_val, clip_algo)
                    optimizer.step()
                if bar is not None:
                    bar.set_postfix({"lr": f"{lr:.2e}", "loss": f"{value_f:.4g}"}, refresh=False)
                    bar.update(1)
                if step_skipped:
                    skipped += 1
                    continue
                lrs.append(lr)
                losses.append(value_f)
                if monitor.update(value_f):
                    stop_reason = monitor.reason
                    break
        finally:
            if bar is not None:
                bar.close()
            quiet.close()
            optimizer.zero_grad(set_to_none=True)
        return lrs, losses, list(monitor.smoothed), stop_reason, skipped

    def _decide(
        self,
        lrs: list[float],
        losses: list[float],
        smoothed: list[float],
        stop_reason: str,
        skipped: int,
        epoch: int,
    ) -> LRFinderResult:
        curve = centered_smooth(losses) if losses else []
        suggestions: dict[str, float | None] = dict.fromkeys(SUGGESTION_METHODS)
        reason = ""
        if len(lrs) < self.min_points:
            reason = (
                f"only {len(lrs)} of {self.num_training} sweep steps were usable (stopped: {stop_reason}); "
                f"at least {self.min_points} are needed"
            )
        else:
            suggestions = suggest_all(lrs, curve)
            if suggestions[self.method] is None:
                reason = (
                    f"the loss curve gives no '{self.method}' suggestion between {lrs[0]:.2e} and "
                    f"{lrs[-1]:.2e} (it never clearly decreased)"
                )
        return LRFinderResult(
            lrs=lrs,
            losses=losses,
            smoothed=smoothed,
            curve=curve,
            suggestions=suggestions,
            method=self.method,
            suggestion=None if reason else suggestions[self.method],
            epoch=epoch,
            stop_reason=stop_reason,
            reason=reason,
            skipped_steps=skipped,
        )

    def _alert(self, trainer: pl.Trainer, epoch: int, message: str, hint: str, points: int) -> None:
        """The ``lr_finder_failed`` alert: no LR was applied (an unsupported setup, or no suggestion)."""
        alert = self.report(
            trainer,
            "lr_finder_failed",
            "warning",
            f"epoch {epoch}",
            f"{message} The learning rate was left unchanged.",
            hint,
            data={"points": float(points)},
        )
        self.act(trainer, [alert] if alert else [])

    # ------------------------------------------------------------------ output
    def _output(self, trainer: pl.Trainer, result: LRFinderResult) -> None:
        if not trainer.is_global_zero:
            return
        suffix = "" if result.epoch == 0 else f"_epoch{result.epoch}"
        # lr_find's throwaway fit has no logger on purpose: no "the trainer has no logger" line for it
        curve = [] if self._stop_after and not trainer.loggers else result.lrs
        for i, (lr, loss, smooth) in enumerate(zip(curve, result.losses, result.smoothed, strict=False)):
            _emit.log_scalars(
                trainer,
                {
                    f"lr_finder/loss{suffix}": loss,
                    f"lr_finder/smoothed_loss{suffix}": smooth,
                    f"lr_finder/lr{suffix}": lr,
                },
                i,
            )
        if result.suggestion is not None and trainer.loggers:
            _emit.log_scalars(trainer, {"lr_finder/suggested_lr": result.suggestion}, log_step(trainer))
        if result.applied_lr is not None:
            hparams: dict[str, Any] = {f"lr_finder/applied_lr{suffix}": result.applied_lr}
            hparams[f"lr_finder/method{suffix}"] = result.method
            _log_hparams(trainer, hparams)
        chosen = f"{result.suggestion:.3e}" if result.suggestion is not None else "none"
        if result.applied:  # only then: with apply=False (and in lr_find) the optimizer is not touched
            chosen += " applied"
        others = ", ".join(f"{k} {v:.2e}" for k, v in result.suggestions.items() if v is not None)
        log.info(
            "LRFinderPlus [epoch %d]: suggestion (%s) %s; all: %s; %d points, stopped: %s; %.1fs",
            result.epoch,
            result.method,
            chosen,
            others or "none",
            len(result.lrs),
            result.stop_reason,
            result.seconds,
        )
        if not trainer.loggers:  # no log directory: the curve stays in ``self.results``
            return
        folder = _emit.log_dir(trainer)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"lr_finder{suffix}.csv"), "w", newline="") as fh:
                writer = csv.writer(fh)
                writer.writerow(["step", "lr", "loss", "smoothed_loss", "curve"])
                for i, row in enumerate(
                    zip(result.lrs, result.losses, result.smoothed, result.curve, strict=True)
                ):
                    writer.writerow([i, *row])
        except OSError as err:  # pragma: no cover - read-only log dirs
            log.warning("LRFinderPlus: could not write the CSV to %s: %s", folder, err)
        if not self.plot or not result.lrs:
            return
        try:
            fig = result.plot()
        except ImportError:
            return
        try:
            fig.savefig(os.path.join(folder, f"lr_finder{suffix}.png"), dpi=100)
        except OSError as err:  # pragma: no cover
            log.warning("LRFinderPlus: could not save the figure: %s", err)
        for writer in _emit.tensorboard_writers(trainer):
            writer.add_figure(f"lr_finder/curve{suffix}", fig, global_step=log_step(trainer), close=False)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["done_epochs"] = sorted(self._done_epochs)
        state["suggestions"] = [(r.epoch, r.suggestion) for r in self.results]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._done_epochs = set(state_dict.get("done_epochs", []))


def _progress_bar(trainer: pl.Trainer, total: int) -> Tqdm:
    """The sweep's own bar: placed like Lightning's validation bar, under the training bar when there is one.

    ``leave=False``: it disappears when the sweep ends and leaves Lightning's bars as they were. It writes
    to stderr (tqdm's default), so the program's own output on stdout stays clean.
    """
    main = trainer.progress_bar_callback
    position = 0
    if main is not None and getattr(main, "is_enabled", True):
        offset = main.process_position if isinstance(main, TQDMProgressBar) else 0
        position = 2 * offset + 1
    return Tqdm(
        total=total,
        desc=f"LRFinderPlus [epoch {trainer.current_epoch}]",
        position=position,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
        bar_format=TQDMProgressBar.BAR_FORMAT,
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


def _end_fit_before_training(trainer: pl.Trainer) -> None:
    """End the running fit cleanly before its first training batch (the throwaway fit of :func:`lr_find`).

    Called from ``on_train_start``. ``should_stop`` alone would wait for ``min_epochs`` / ``min_steps``; a
    step limit already reached does not: Lightning's fit loop is done before its first epoch, as at
    ``max_steps``, so no epoch hook runs on an empty epoch (an ``EarlyStopping`` or a module's
    ``on_train_epoch_end`` would meet missing metrics or no outputs there), and every callback gets
    ``on_train_end`` as in any finished fit, never ``on_exception``.
    """
    trainer.should_stop = True
    trainer.fit_loop.epoch_loop.max_steps = trainer.global_step


def _configured(group: dict[str, Any]) -> float:
    """The LR a group was configured with, before a scheduler scaled it (OneCycleLR: its peak)."""
    for key in ("max_lr", "initial_lr"):
        value = group.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return float(group["lr"])


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

    for group in optimizer.param_groups:
        group["lr"] = scaled(float(group["lr"]))
        for key in _SCALED_GROUP_KEYS:
            if isinstance(group.get(key), (int, float)) and not isinstance(group.get(key), bool):
                group[key] = scaled(float(group[key]))
    todo = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
    while todo:  # SequentialLR / ChainedScheduler: their children keep base LRs of their own
        scheduler = todo.pop()
        todo.extend(getattr(scheduler, "_schedulers", []))
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [scaled(float(b)) for b in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [float(g["lr"]) for g in optimizer.param_groups]


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
        _set_lr_attr(model, attr_name, result.suggestion)
    return result


def _set_lr_attr(model: pl.LightningModule, attr_name: str, value: float) -> None:
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
