r"""
OptimizerMonitor
================

What the optimizer did with the gradient, and what it keeps: the effective step size and the cosine
between the update and the negative gradient per layer, Adam's moments (``exp_avg`` norm, RMS of
``sqrt(v_hat)``) or SGD's momentum buffer, and a count of the updates that were skipped, by cause.
Measured on Lightning's logging steps only; all values of a step reach the host in one transfer. The
measuring is :mod:`lightning_gradguard.monitors.optimizer.measure`, the math
:mod:`lightning_gradguard.functional.optimizer_state`, the rules (their
declarations and checks) :mod:`lightning_gradguard.monitors.optimizer.rules`; the cadence, the tags and the
consecutive checks a finding must persist are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback, guarded
from lightning_gradguard.core.cadence import (
    DENSE_STEPS,
    log_step,
    logging_interval,
    on_logging_step,
    optimizer_index,
)
from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.core.runstate import RunField, Streaks, nothing
from lightning_gradguard.core.sharding import is_sharded, unsupported_reason
from lightning_gradguard.core.skips import SKIP_CAUSES
from lightning_gradguard.core.state import info_once, trainer_state, warn_once
from lightning_gradguard.core.stats import active_scaler, step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.validate import check_float, check_int
from lightning_gradguard.monitors.optimizer.measure import (
    OptimizerReading,
    OptimizerSample,
    ScaleWatch,
    reading_scalars,
)
from lightning_gradguard.monitors.optimizer.rules import (
    ADAM_STEP_TOO_LARGE,
    HELD_RULES,
    STEP_RULES,
    Measured,
    Orphans,
)
from lightning_gradguard.monitors.optimizer.tags import CHARTS, OPTIMIZER

#: with periodic logging off (``log_every_n_steps=0``), the rules are still checked this often
_CHECK_EVERY = 100

_SHARDED = (
    "OptimizerMonitor: the optimizer state of a sharded run (FSDP) is split over the ranks, so its "
    "step sizes, cosines and moments are not measured; only the skipped-update counters are logged."
)


@dataclass
class _Pending:
    at: int  # log step
    suffix: str  # "_opt<i>" with several optimizers
    sample: OptimizerSample
    logged: bool  # a logging step (else a check only, with logging off)


def _strikes_saved(_: Any, strikes: dict[str, Streaks]) -> dict[str, dict[str, int]]:
    return {k: dict(v) for k, v in strikes.items()}


def _strikes_loaded(_: Any, saved: dict[str, dict[str, int]]) -> dict[str, Streaks]:
    return {k: Streaks(v) for k, v in saved.items()}


def _born_zero(_: Any, saved: dict[str, list[str]]) -> dict[str, set[str]]:
    return {k: set(v) for k, v in saved.items()}


def _skips_base(_: Any, saved: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in saved.items()}


class OptimizerMonitor(GradGuardCallback):
    r"""Log what the optimizer does with the gradient and what it keeps; warn where the literature has a rule.

    On a logging step it logs, per optimizer step (``<family>/total`` over every parameter of the
    optimizer, ``<family>/<layer>`` per layer, ``optimizer/`` before each):

    * ``step_size``: :math:`\|\Delta w\| / lr`, each parameter's update divided by its own param
      group's ``lr`` (plain SGD: the gradient norm; Adam: about ``sqrt(numel)``);
    * ``update_cosine``: :math:`\cos(\Delta w, -g)` with the accumulated, pre-clip gradient (1 for
      plain SGD; momentum, Adam's scaling and weight decay turn it away);
    * Adam family (state ``exp_avg`` / ``exp_avg_sq``: Adam, AdamW, RAdam, NAdam, fused or foreach):
      ``exp_avg_norm`` and ``exp_avg_sq_rms``, the RMS of ``sqrt(v_hat)`` (bias-corrected), compared
      with ``eps``; SGD with momentum: ``momentum_norm``. Other optimizers: one note, the two above only;
    * ``skipped_updates/grad_scaler``, ``/nan_sentinel``, ``/loss_spike``: updates dropped so far (the
      GradScaler found inf/NaN; NaNSentinel's ``skip``/``stop``; LossSpikeGuard's skip or rollback),
      counted on every step without a sync.

    Alerts (warnings): ``adam_epsilon_dominates`` when a layer's RMS of ``sqrt(v_hat)`` stays below
    ``epsilon_ratio * eps``; ``update_ratio_outlier`` when a layer's :math:`\|\Delta w\|/\|w\|` stays more
    than ``outlier_factor`` times above or below the median layer's (above: not for a layer whose weights
    were exactly 0 at a check, e.g. a zero-initialised bias, which moves by about ``1/t`` of its norm at
    step ``t`` whatever its lr). Each on ``patience`` consecutive checks; the first, and the second below
    the median for a layer that still moves, only when such layers hold
    :data:`~lightning_gradguard.functional.health.SLIVER_SHARE` of the entries the rule compared (a
    state-space layer's ``A_log``, a router's gate are small by design). ``adam_step_too_large`` on the
    first check where an Adam-family optimizer (Adam, AdamW, NAdam, RAdam) moved an entry by more than
    ``max_adam_step`` times its lr and more than Adam can move one with its betas (``beta2 <= beta1**2``
    leaves the step unbounded); it names ``beta2`` and ``eps``. A step another callback dropped or rolled
    back is not judged. Tensors above 65 536 entries are measured on a strided sample (see
    :mod:`lightning_gradguard.functional.optimizer_state`). Not under FSDP (one warning).

    Args:
        log_every_n_steps: log every this many optimizer steps (default: the Trainer's; ``0``: no
            logging, the rules are still checked every 100 steps). The rules are checked on these steps
            and, at the start, on every step below ``dense_steps``.
        dense_steps: check every step while the step is below this (an ``eps`` that dominates from
            step 0 is named within a few steps, not at the third logging step).
        epsilon_ratio: ``adam_epsilon_dominates`` when the RMS of ``sqrt(v_hat)`` is below this times
            ``eps``.
        outlier_factor: ``update_ratio_outlier`` beyond this factor from the median layer's ratio.
        max_adam_step: ``adam_step_too_large`` when an entry's Adam step exceeds this many times its lr
            (and Adam's own bound for its betas).
        patience: consecutive checks a finding must persist before it is reported.
        include: layers whose name matches one of these regular expressions get per-layer tags and are
            judged (``None``: all; totals cover every layer): see
            :class:`~lightning_gradguard.core.layers.LayerSelection`.
        exclude: layers whose name matches are neither shown nor judged.
        max_layers: a cap on the layers per family, plus ``across_layers`` aggregates (``None``: no cap).
        cooldown_steps: minimum steps between two alerts of the same kind and layer.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import OptimizerMonitor

        trainer = Trainer(callbacks=[OptimizerMonitor()])
        trainer.fit(model)   # TensorBoard: Custom Scalars, "GradGuard": the optimizer charts
    """

    charts = CHARTS
    chart_switches = {"capped": "layers.capped"}

    state_key_args = ("log_every_n_steps",)
    #: checked on the logging steps (every 100 steps with logging off), and every step below ``dense_steps``
    cadence_every = "_check_every"

    #: "<rule><suffix>" -> layer -> consecutive checks (a layer not found again starts over)
    _strikes: RunField[dict[str, Streaks]] = RunField(
        dict, key="strikes", save=_strikes_saved, load=_strikes_loaded
    )
    #: suffix -> layers seen with weights exactly 0
    _born_zero: RunField[dict[str, set[str]]] = RunField(dict, load=_born_zero)
    #: the skipped-update counts of earlier fits of this run (saved as the run's counts so far)
    _skips_base: RunField[dict[str, float]] = RunField(
        dict, key="skipped_updates", save=lambda m, _: m.skip_counts_now(), load=_skips_base
    )
    _pending: RunField[list[_Pending]] = RunField(list, key=None)
    _counters_at: RunField[int | None] = RunField(nothing, key=None)  # the log step the counters are due at
    _scale: RunField[ScaleWatch] = RunField(ScaleWatch, key=None)
    last_logged: RunField[dict[str, float]] = RunField(dict, key=None)

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        dense_steps: int = DENSE_STEPS,
        epsilon_ratio: float = 1.0,
        outlier_factor: float = 300.0,
        max_adam_step: float = 10.0,
        patience: int = 3,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
        max_layers: int | None = None,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action="warn", cooldown_steps=cooldown_steps)
        self.log_every_n_steps: int | None = check_int(
            "log_every_n_steps", log_every_n_steps, 0, allow_none=True
        )
        self.dense_steps: int = check_int("dense_steps", dense_steps, 0)
        self.epsilon_ratio: float = check_float("epsilon_ratio", epsilon_ratio, 0.0, low_open=True)
        self.outlier_factor: float = check_float("outlier_factor", outlier_factor, 1.0, low_open=True)
        self.max_adam_step: float = check_float("max_adam_step", max_adam_step, 1.0, low_open=True)
        self.patience: int = check_int("patience", patience, 1)
        self.layers = LayerSelection(include, exclude, max_layers)
        self._skips_start: dict[str, int] = {}  # the Trainer's shared counts when this fit started
        self._shared: dict[str, int] = {}  # the Trainer's shared counts (``core.state``), live
        self._rank_zero, self._every, self._scaler_on = True, 0, False  # fixed per fit (on_train_start)
        self._check_every = _CHECK_EVERY  # the logging interval, or _CHECK_EVERY with logging off
        self._held_checked = False  # the parameters an optimizer holds were checked in this fit

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._shared = trainer_state(trainer).skipped_updates
        self._skips_start = dict(self._shared)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fix what every step's cadence test reads: whether this rank measures (loggers are rank-zero only;
        DDP's gradients agree across ranks), the logging interval, whether a GradScaler can skip steps."""
        self._rank_zero = trainer.is_global_zero
        self._held_checked = False
        self._every = logging_interval(trainer, self.log_every_n_steps)
        self._check_every = self._every or _CHECK_EVERY  # logging off: the checks go on
        self._scaler_on = active_scaler(trainer) is not None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._rank_zero:
            return
        if self._scaler_on:
            self._scale.before_step(step_stats(trainer, pl_module, optimizer))
        at = log_step(trainer)
        if self.due(at):
            logged = on_logging_step(at, self._every)  # Lightning's rule, plus step 0
            if logged:
                self._counters_at = at
            self._measure(trainer, pl_module, optimizer, at, logged)

    @guarded
    def _measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, at: int, logged: bool
    ) -> None:
        """A measured step: the update sample and the optimizer's state, read after the step."""
        if is_sharded(trainer) or unsupported_reason(trainer) is not None:
            warn_once(trainer, "optimizer_monitor:sharded", _SHARDED)
            return
        stats = step_stats(trainer, pl_module, optimizer)
        if not stats.params:
            return
        if not self._held_checked:  # the first measured step of the fit: every parameter has its gradient
            self._held_checked = True
            self._check_held(trainer, pl_module)
        suffix = f"_opt{optimizer_index(trainer, optimizer)}" if len(trainer.optimizers) > 1 else ""
        self._pending.append(_Pending(at, suffix, OptimizerSample(stats, optimizer), logged))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._rank_zero:
            return
        if self._scaler_on:
            self._scale.settle()
        if self._pending or self._counters_at is not None:
            self._flush(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rank_zero and (self._pending or self._counters_at is not None):
            self._flush(trainer)

    # ------------------------------------------------------------------ the one transfer
    @guarded
    def _flush(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        counters_at, self._counters_at = self._counters_at, None
        transfer = HostTransfer()
        for i, p in enumerate(pending):
            p.sample.queue(transfer, i)
        if counters_at is not None and self._scale.count is not None:
            transfer.add("grad_scaler", self._scale.count)
        host = transfer.fetch() if len(transfer) else {}  # the one device -> host transfer of this step
        metrics: dict[str, float] = {}
        for i, p in enumerate(pending):
            reading = p.sample.read(host, i)
            self._note_moments(trainer, p.sample, reading)
            if p.logged:
                metrics.update(reading_scalars(reading, self.layers, p.suffix))
            if p.sample.stats.dropped is None:  # a dropped or rolled-back update is no step to judge
                # the dense start judges the optimizer's settings (eps, Adam's step bound), visible from
                # step 0; how layers' update ratios compare settles only after the first steps
                self._judge(trainer, reading, p.suffix, layers=p.logged or p.at >= self.dense_steps)
        if counters_at is not None:
            scaler = host.get("grad_scaler")
            counts = self._skip_counts(float(scaler[0]) if scaler is not None else 0.0)
            metrics.update({OPTIMIZER.tag("skipped_updates", c): n for c, n in counts.items()})
            self.last_logged = dict(metrics)
            _emit.log_scalars(trainer, metrics, counters_at)

    def skip_counts_now(self) -> dict[str, float]:
        """The updates skipped in this run so far, per cause (a checkpoint's sync reads the GradScaler's)."""
        scaler = self._scale.count
        return self._skip_counts(float(scaler.sum()) if scaler is not None else 0.0)

    def _skip_counts(self, grad_scaler: float) -> dict[str, float]:
        """Updates skipped in this run so far, per cause (earlier fits of a resumed run included)."""
        counts = {c: float(self._shared.get(c, 0) - self._skips_start.get(c, 0)) for c in SKIP_CAUSES}
        counts["grad_scaler"] = grad_scaler
        return {c: self._skips_base.get(c, 0.0) + n for c, n in counts.items()}

    def _note_moments(self, trainer: pl.Trainer, sample: OptimizerSample, reading: OptimizerReading) -> None:
        if reading.keeps:
            return
        name = type(sample.opt).__name__
        info_once(
            trainer,
            f"optimizer_monitor:no_moments:{name}",
            f"OptimizerMonitor: {name} keeps no moment it reads (Adam's exp_avg / exp_avg_sq, SGD's "
            "momentum_buffer; plain SGD has none): its step size and update cosine are logged, no moments.",
        )

    # ------------------------------------------------------------------ rules
    def _judge(self, trainer: pl.Trainer, reading: OptimizerReading, suffix: str, layers: bool) -> None:
        """Run the rules of a check on ``reading`` (:data:`STEP_RULES`), report and act."""
        evidence = Measured(
            reading=reading,
            suffix=suffix,
            layers=layers,
            selection=self.layers,
            epsilon_ratio=self.epsilon_ratio,
            outlier_factor=self.outlier_factor,
            max_adam_step=self.max_adam_step,
            patience=self.patience,
            strikes=self._strikes,
            born_zero=self._born_zero,
        )
        # the Adam step is the optimizer's setting: one cooldown whichever layer went furthest
        self.run_rules(
            trainer,
            STEP_RULES,
            evidence,
            step=reading.step,
            cooldown=lambda f: f"{f.kind}{suffix}" if f.rule is ADAM_STEP_TOO_LARGE else None,
        )

    def _check_held(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``parameters_not_in_optimizer``: trainable parameters that got a gradient but that no optimizer
        holds (a head replaced after ``configure_optimizers``, a module added in a hook): they never
        train. One loop over the parameters, once per fit."""
        held = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]}
        orphans = {
            n: p.numel()
            for n, p in pl_module.named_parameters()
            if p.requires_grad and p.grad is not None and id(p) not in held
        }
        if orphans:
            evidence = Orphans(orphans=orphans, total=sum(p.numel() for p in pl_module.parameters()))
            self.run_rules(trainer, HELD_RULES, evidence, step=log_step(trainer))
