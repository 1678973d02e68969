r"""
GradientNormLogger
==================

Logs gradient norms (total and per layer), weight norms, the update/weight ratio and histograms,
measured where the numbers are true: in ``on_before_optimizer_step``, on accumulated, unscaled,
all-reduced and not yet clipped gradients. All values of a logging step go to the host in one transfer.
The measuring is :mod:`lightning_gradguard.monitors.gradients.measure`, the clipping statistics
:mod:`lightning_gradguard.functional.clipping`, the update-ratio watch
:mod:`lightning_gradguard.monitors.gradients.ratio`, the rules and their words
:mod:`lightning_gradguard.monitors.gradients.rules`; what is logged when, and when a verdict is due, are
here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step, optimizer_index
from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.lr import ClipSetting, adaptive_eps, clip_setting, orthogonalized_share
from lightning_gradguard.core.progress import LossProgress
from lightning_gradguard.core.runstate import RunField, restored
from lightning_gradguard.core.sharding import is_sharded, unsupported_reason
from lightning_gradguard.core.state import info_once, warn_once
from lightning_gradguard.core.stats import StepStats, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.clipping import clip_window_stats
from lightning_gradguard.monitors.gradients.measure import (
    ClipRing,
    NormReading,
    NormSample,
    NormSpec,
    parse_norm_type,
    select_reading,
)
from lightning_gradguard.monitors.gradients.noise_scale import NoiseScaleTracker
from lightning_gradguard.monitors.gradients.ratio import RatioWatch
from lightning_gradguard.monitors.gradients.rules import CLIP_RULES, RATIO_RULES, ClipWindow, RatioCheck
from lightning_gradguard.monitors.gradients.tags import CHARTS, GRAD_CLIP

#: with periodic logging off (``log_every_n_steps=0``), the clipping verdict is still reached this often
_CLIP_CHECK_EVERY = 100


#: said once when the update/weight ratio rule does not judge an optimizer
_ORTHOGONALIZED = (
    "GradientNormLogger: most of the update is orthogonalized (Muon): each step rewrites a few percent of "
    "every matrix by the optimizer's design, so update_ratio_high does not judge it (the ratio is logged)."
)


@dataclass
class _Logged:
    """A logging step's sample, until it is read after the step."""

    at: int  # log step
    suffix: str  # "_opt<i>" with several optimizers
    sample: NormSample
    optimizer: Any


class GradientNormLogger(GradGuardCallback):
    r"""Log gradient and weight norms, update ratios and histograms to every attached logger.

    On a logging step it logs, per optimizer step:

    * ``grad_norm/total`` and ``grad_norm/<layer>``: gradient norms before clipping;
    * ``weight_norm/total`` and ``weight_norm/<layer>``: parameter norms before the update;
    * ``update_ratio/total`` and ``update_ratio/<layer>``: :math:`\|\Delta w\| / \|w\|` of the update the
      optimizer actually applied (about 1e-3 by the CS231n rule of thumb; small layers sit higher);
    * ``grad_nonfinite/total`` (and ``grad_nonfinite/<layer>`` where non-zero): NaN/inf gradient entries;
    * with ``gradient_clip_val`` set on the Trainer: ``grad_clip/fraction_clipped``,
      ``grad_clip/pre_clip_norm_p50|p90|p99`` and ``grad_clip/suggested_clip_val`` over the last
      ``clip_window`` steps. Under ``gradient_clip_algorithm="norm"`` the pre-clip norm is the total
      2-norm and a step counts as clipped when it exceeds ``gradient_clip_val``; under ``"value"`` it is
      the largest ``|g|`` (the infinity norm: clipping by value changes a step exactly when it is over);
    * with ``log_noise_scale=True``: ``noise_scale/*``, the critical batch size (McCandlish et al. 2018).

    Alerts: ``update_ratio_high`` (warning) when the total update/weight ratio stayed above
    ``max_update_ratio`` on 3 logging checks in a row spanning 20 steps or more, from step 20 on: it names
    the learning rate. With clipping, ``clipping_always_active`` / ``clipping_never_active``.

    Every ``histogram_every_n_steps`` it also writes TensorBoard histograms ``grad/<param>``,
    ``grad_log10/<param>`` (log10 of the non-zero magnitudes: vanishing gradients show as mass many
    decades down) and ``weight/<param>``. A "layer" is the module that owns a parameter; ``group_depth``
    merges deeper modules, ``per_parameter=True`` logs every parameter. Frozen parameters are skipped.
    With several optimizers (manual optimization) the tags get an ``_opt<i>`` suffix on ``total``.

    Logging follows Lightning's rule, ``(step + 1) % log_every_n_steps == 0``, plus the first step; a
    ``log_every_n_steps`` of 0 (here or, by default, on the Trainer) turns periodic logging off, as it does
    for Lightning: nothing is measured for the charts, while the clipping statistics are still gathered
    and their alerts still checked every 100 steps.

    Args:
        log_every_n_steps: log every this many optimizer steps (default: the Trainer's
            ``log_every_n_steps``, so our charts line up with the loss; ``0``: no periodic logging).
        histogram_every_n_steps: write histograms every this many steps; ``None`` (default) means ten
            times the logging interval, ``0`` turns histograms off.
        norm_type: ``2`` (Euclidean) or ``"inf"`` (largest absolute entry).
        group_depth: merge layers below this many module levels (``None``: the owning module).
        per_parameter: log every parameter instead of every layer.
        log_weight_norms: log ``weight_norm/*``.
        log_update_ratio: log ``update_ratio/*`` (keeps a copy of the weights during a logging step).
        histogram_bins: buckets per histogram.
        clip_window: how many recent steps the clipping statistics cover.
        include: regular expressions: matching layers get per-layer tags and histograms (``None``: all;
            totals cover every layer): see :class:`~lightning_gradguard.core.layers.LayerSelection`.
        exclude: layers whose name matches get none (applied after ``include``).
        max_layers: a cap on the layers per family, plus ``across_layers`` aggregates (``None``: no cap).
        cooldown_steps: minimum steps between two alerts of the same kind.
        log_noise_scale: log the gradient noise scale from the micro-batches and the ranks (one norm per
            parameter and micro-batch: :mod:`lightning_gradguard.monitors.gradients.noise_scale`).
        noise_scale_beta: the decay per optimizer step of the noise scale's two moving averages.
        max_update_ratio: ``update_ratio_high`` when the total :math:`\|\Delta w\| / \|w\|` stays above this
            (``None``: no verdict). Needs ``log_update_ratio``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import GradientNormLogger

        trainer = Trainer(callbacks=[GradientNormLogger()], gradient_clip_val=1.0)
        trainer.fit(model)
        # tensorboard --logdir lightning_logs  ->  Custom Scalars tab, "GradGuard" section
    """

    charts = CHARTS
    chart_switches = {"capped": "layers.capped", "noise_scale": "log_noise_scale"}

    state_key_args = ("log_every_n_steps", "norm_type", "group_depth", "per_parameter")

    #: the pre-clip norms of recent steps, on the device (the clip window holds this run's steps only)
    _clip: RunField[ClipRing] = RunField(from_settings=lambda g: ClipRing(g.clip_window), key="clip_window")
    #: the gradient noise scale: its hooks and settings outlive the runs, its average does not
    _noise: RunField[NoiseScaleTracker] = RunField(
        from_settings=lambda g: NoiseScaleTracker(g.noise_scale_beta, on=g.log_noise_scale),
        key="noise_scale",
        per_run=False,
    )
    #: per optimizer (tag suffix): the run of checks whose update ratio stayed high
    _ratio: RunField[dict[str, RatioWatch]] = RunField(
        dict, key="update_ratio", load=lambda _, s: {k: restored(RatioWatch(), v) for k, v in s.items()}
    )
    #: the logging steps' losses: a high update ratio the loss follows down is no LR too high
    progress: RunField[LossProgress] = RunField(LossProgress)
    _pending: RunField[list[_Logged]] = RunField(list, key=None)
    _clip_check_due: RunField[bool] = RunField(bool, key=None)
    last_logged: RunField[dict[str, float]] = RunField(dict, key=None)

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        histogram_every_n_steps: int | None = None,
        norm_type: float | Literal["inf"] = 2.0,
        group_depth: int | None = None,
        per_parameter: bool = False,
        log_weight_norms: bool = True,
        log_update_ratio: bool = True,
        histogram_bins: int = 64,
        clip_window: int = 1000,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
        max_layers: int | None = None,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
        log_noise_scale: bool = False,
        noise_scale_beta: float = 0.99,
        max_update_ratio: float | None = 0.03,
    ) -> None:
        super().__init__(action="warn", cooldown_steps=cooldown_steps)
        self.log_every_n_steps: int | None = check_int(
            "log_every_n_steps", log_every_n_steps, 0, allow_none=True
        )
        self.histogram_every_n_steps: int | None = check_int(
            "histogram_every_n_steps", histogram_every_n_steps, 0, allow_none=True
        )
        self.norm_type = parse_norm_type(norm_type)
        self.group_depth: int | None = check_int("group_depth", group_depth, 1, allow_none=True)
        self.per_parameter = check_bool("per_parameter", per_parameter)
        self.log_weight_norms = check_bool("log_weight_norms", log_weight_norms)
        self.log_update_ratio = check_bool("log_update_ratio", log_update_ratio)
        self.histogram_bins: int = check_int("histogram_bins", histogram_bins, 2)
        self.clip_window: int = check_int("clip_window", clip_window, 10)
        self.layers = LayerSelection(include, exclude, max_layers)
        self.log_noise_scale = check_bool("log_noise_scale", log_noise_scale)
        self.noise_scale_beta: float = check_float("noise_scale_beta", noise_scale_beta, 0, 1, high_open=True)
        self.max_update_ratio: float | None = check_float(
            "max_update_ratio", max_update_ratio, 0.0, low_open=True, allow_none=True
        )
        self._designed: dict[str, bool] = {}  # per optimizer: its update's size is its design (Muon)
        self._clip_check_step = 0  # global_step of the latest step measured for the clipping verdict
        # what a step's cadence test reads, fixed for a fit (set in on_train_start): the logging interval,
        # the Trainer's clipping, and whether this rank measures at all
        self._every = 0
        self._clip_setting: ClipSetting | None = None
        self._measures = True

    # ------------------------------------------------------------------ cadence
    def _hist_interval(self, trainer: pl.Trainer) -> int:
        every = logging_interval(trainer, self.log_every_n_steps)
        if self.histogram_every_n_steps is not None:
            return self.histogram_every_n_steps if every else 0
        return 10 * every

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._noise.start(fresh=False)  # a fresh run emptied its average in reset_run
        if (reason := unsupported_reason(trainer)) is not None:  # DeepSpeed: no number, not a wrong one
            warn_once(trainer, "sharding:unsupported", reason)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._designed = {}  # the optimizers of this fit
        """Fix what every step's cadence test reads (the Trainer's logging interval and clipping, and
        whether this rank measures: loggers are rank-zero only and DDP's gradients agree across ranks,
        while sharded norms need every rank), so a step that logs nothing costs one test."""
        self._every = logging_interval(trainer, self.log_every_n_steps)  # 0: periodic logging is off
        self._clip_setting = clip_setting(trainer)
        self._measures = trainer.is_global_zero or is_sharded(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.log_noise_scale:
            self._noise_batch(trainer, batch)

    @guarded
    def _noise_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        self._noise.on_batch(trainer, batch, self._every)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.log_noise_scale:  # every rank: each has its micro-batches
            self._noise_step(trainer, pl_module, optimizer)
        if not self._measures:
            return
        at, every = log_step(trainer), self._every
        logged = on_logging_step(at, every)  # Lightning's rule, plus step 0
        if logged or self._clip_setting is not None:
            self._measure(trainer, pl_module, optimizer, at, logged)

    @guarded
    def _noise_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._noise.on_step(trainer, pl_module, optimizer, self._every)

    @guarded
    def _measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, at: int, logged: bool
    ) -> None:
        """A logging step's norms (and, under clipping, every step's pre-clip norm), on the device."""
        stats = step_stats(trainer, pl_module, optimizer)
        if stats.unsupported is not None:  # DeepSpeed (said at fit start)
            return
        clip = self._clip_setting
        if clip is not None:
            self._clip.push(stats.grad_total(clip.norm_type))
            # with logging off the verdict is still reached, on a cadence of its own
            if logged or (self._every == 0 and self._clip.seen % _CLIP_CHECK_EVERY == 0):
                self._clip_check_due, self._clip_check_step = True, stats.step
        if not logged:
            return
        suffix = f"_opt{optimizer_index(trainer, optimizer)}" if len(trainer.optimizers) > 1 else ""
        histograms = on_logging_step(at, self._hist_interval(trainer)) and _emit.tensorboard_writers(trainer)
        spec = NormSpec(
            norm_type=self.norm_type,
            group_depth=self.group_depth,
            per_parameter=self.per_parameter,
            weights=self.log_weight_norms,
            update=self.log_update_ratio,
            histogram_bins=self.histogram_bins if histograms else None,
            histogram_layers=self._histogram_layers(stats) if histograms else None,
        )
        self._pending.append(_Logged(at, suffix, NormSample(stats, spec), optimizer))

    def _histogram_layers(self, stats: StepStats) -> Any:
        """The layers whose histograms a histogram step writes (the layer groups: on logging steps only)."""
        labels = stats.grad_groups(self.norm_type, self.group_depth, self.per_parameter)[0]  # cached
        return self.layers.histogram_layers(labels)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending or self._clip_check_due or self._noise.due is not None:
            self._flush(trainer, _step_loss(trainer, pl_module, outputs) if self._pending else None)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)

    # ------------------------------------------------------------------ the one transfer
    @guarded
    def _flush(self, trainer: pl.Trainer, loss: Tensor | None = None) -> None:
        if not (self._pending or self._clip_check_due or self._noise.due is not None):
            return
        pending, self._pending = self._pending, []
        clip_due, self._clip_check_due = self._clip_check_due, False
        transfer = HostTransfer()  # keys: (index in pending, name); -1 for the clip window
        for i, p in enumerate(pending):
            p.sample.queue(transfer, i)
        clip = clip_setting(trainer)
        if clip_due and clip is not None:
            self._clip.queue(transfer, (-1, "clip_window"))
        self._noise.queue(transfer)  # on its logging steps, on every rank: averaged in the collective
        if loss is not None and self.max_update_ratio is not None:
            transfer.add((-2, "loss"), loss)
        if not len(transfer):
            return
        host = transfer.fetch()  # the one device -> host transfer (and collective, if any) of this step
        if (-2, "loss") in host:
            self.progress.note(float(host[(-2, "loss")][0]))
        for i, p in enumerate(pending):  # written from rank zero only
            reading = p.sample.read(host, i)
            self._emit_step(trainer, p.at, p.suffix, reading)
            if p.sample.stats.dropped is None:  # a dropped or rolled-back update is no step to judge
                self._judge_ratio(trainer, p, reading)
        if (-1, "clip_window") in host and clip is not None:
            last = (pending[-1].at, pending[-1].sample.stats.step) if pending else None
            self._emit_clip(trainer, last, clip, self._clip.read(host[(-1, "clip_window")]))
        self.last_logged.update(self._noise.emit(trainer, host))

    def _emit_step(self, trainer: pl.Trainer, at: int, suffix: str, reading: NormReading) -> None:
        metrics = select_reading(reading, self.layers, suffix)
        self.last_logged = dict(metrics)
        _emit.log_scalars(trainer, metrics, at)
        for h in reading.histograms:
            for j, name in enumerate(h.names):
                _emit.log_histogram_raw(trainer, f"{h.kind}/{name}", h.stats[j], h.edges[j], h.counts[j], at)

    def _judge_ratio(self, trainer: pl.Trainer, p: _Logged, reading: NormReading) -> None:
        """The update-ratio rule on a logging step's total ratio (``monitors.gradients.rules``)."""
        if self.max_update_ratio is None or reading.update_ratio_total is None:
            return
        if p.suffix not in self._designed:  # once per optimizer and fit: a loop over its param groups
            self._designed[p.suffix] = orthogonalized_share(p.optimizer) >= 0.5
            if self._designed[p.suffix]:
                info_once(trainer, f"update_ratio:orthogonalized{p.suffix}", _ORTHOGONALIZED)
        if self._designed[p.suffix]:  # Muon rewrites a few percent of each matrix a step by design
            return
        evidence = RatioCheck(
            watch=self._ratio.setdefault(p.suffix, RatioWatch()),
            step=p.sample.stats.step,
            ratio=reading.update_ratio_total,
            ceiling=self.max_update_ratio,
            optimizer=p.optimizer,
            progress=self.progress,
        )
        # one cooldown per optimizer
        self.run_rules(
            trainer, RATIO_RULES, evidence, step=evidence.step, cooldown=lambda f: f"{f.kind}{p.suffix}"
        )

    def _emit_clip(
        self, trainer: pl.Trainer, last: tuple[int, int] | None, clip: ClipSetting, window: Tensor
    ) -> None:
        """Clipping statistics over the window and their alerts; ``last`` (the latest logged step's log step
        and global step) is ``None`` with logging off."""
        s = clip_window_stats(window, clip.value)
        if s is None:
            return
        metrics = {GRAD_CLIP.tag(name): x for name, x in s.metrics().items()}
        self.last_logged.update(metrics)
        if last is not None:
            _emit.log_scalars(trainer, metrics, last[0])
        step = last[1] if last is not None else self._clip_check_step
        optimizer = trainer.optimizers[0] if trainer.optimizers else None  # clipping: automatic optimization
        adaptive = adaptive_eps(optimizer) is not None
        name = type(getattr(optimizer, "optimizer", optimizer)).__name__ if adaptive else None
        w = ClipWindow(
            stats=s, clip_val=clip.value, norm_type=clip.norm_type, window=self.clip_window, adaptive=name
        )
        self.run_rules(trainer, CLIP_RULES, w, step=step)

    # ------------------------------------------------------------------ state
    _clip_norms = property(lambda self: self._clip.values)  # the ring as it is on the device
    _clip_seen = property(lambda self: self._clip.seen)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._noise.detach()  # the noise scale's hooks go with the fit


def _step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> Tensor | None:
    """The step's training loss from what ``training_step`` returned (a tensor or a dict's ``"loss"``),
    as one detached float on its device; Lightning divided it by ``accumulate_grad_batches``: undone."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        return None
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return (loss.detach().float() * scale).reshape(1)
