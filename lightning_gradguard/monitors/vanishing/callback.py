r"""
VanishingExplodingDetector
==========================

Says when the shared per-layer gradient norms explode or vanish, where, and what to do about it, and
logs ``grad_flow/<layer>`` = ``log10(layer norm / largest layer norm)``: where the gradient dies.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step, optimizer_index
from lightning_gradguard.core.layers import LayerSelection, user_name
from lightning_gradguard.core.lr import adaptive_eps, clip_setting
from lightning_gradguard.core.progress import LossProgress
from lightning_gradguard.core.runstate import RunField, Streaks, nothing
from lightning_gradguard.core.stats import step_stats
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.layers import log_distance_scores
from lightning_gradguard.monitors.vanishing.measure import LayerNorms, read_layer_norms, watched_norms
from lightning_gradguard.monitors.vanishing.order import ForwardOrder
from lightning_gradguard.monitors.vanishing.rules import (
    EXPLODING_GRADIENT,
    RULES,
    VANISHING_GRADIENT,
    Checked,
    GradientVerdict,
    Held,
    StepContext,
    VerdictRules,
    judge,
    opening_layers,
)
from lightning_gradguard.monitors.vanishing.tags import CHARTS, GRAD_FLOW

#: the detector's arguments that are :class:`VerdictRules`' thresholds (read once, not per check)
_RULE_NAMES = tuple(f.name for f in fields(VerdictRules))


def _history(_: Any, saved: dict[Any, list[float]]) -> dict[int, list[float]]:
    return {int(k): list(v) for k, v in saved.items()}


def _opening(_: Any, saved: dict[str, float]) -> dict[str, float]:
    return {str(k): float(v) for k, v in saved.items()}


class VanishingExplodingDetector(GradGuardCallback):
    r"""Alert on exploding and vanishing gradients, measured where the numbers are true.

    It reads the shared per-layer gradient norms of ``on_before_optimizer_step`` (accumulated, unscaled,
    all-reduced, not yet clipped) in one small transfer on the steps it checks: every step for the first
    ``dense_steps`` steps, then where ``(step + 1) % check_every_n_steps == 0``, counting steps as Lightning
    does for logging (so ``grad_flow/*`` points share the x of the loss; with several optimizers, each one's
    own steps).

    **Exploding** (alert ``exploding_gradient``, severity error) and **vanishing** (``vanishing_gradient``,
    severity error) when a rule of :mod:`lightning_gradguard.monitors.vanishing.rules` holds on
    ``patience`` consecutive checks; the first layer is the first in forward order, found once by watching
    the first training forward pass. ``where`` names the layers, the hint says what to try (and a clip
    value, from the 90th percentile of this run's healthy norms).

    A check whose total norm is NaN/inf gives no verdict (NaNSentinel's finding, or the GradScaler's skip)
    and neither counts towards ``patience`` nor resets it.

    Args:
        action: ``"warn"`` (default), ``"stop"`` or ``"raise"``; with ``"stop"``/``"raise"`` under DDP the
            flags are all-reduced before acting, so every rank acts at the same step.
        check_every_n_steps: after the dense start, check the steps where ``(step + 1)`` is a multiple of
            this (Lightning's logging rule).
        dense_steps: check every step while the step (Lightning's logging step) is below this.
        max_norm: ceiling on the total gradient norm (``None``: off).
        spike_factor: a total norm this many times the run's median is a spike (``None``: off).
        growth_factor: a steady rise by more than this factor over ``growth_window`` checks (``None``: off).
        growth_window: checks the growth test looks at.
        warmup_checks: checks before the spike test has a baseline (and the checks of its current level).
        history_size: how many recent checked norms the baseline uses.
        depth_ratio_floor: first/last layer norm ratio below which gradients vanish (``None``: off).
        first_layer_floor: ... provided the first layer's norm is also below this.
        min_rms: RMS gradient floor per layer (``None``: off).
        relative_floor: per-layer floor relative to the largest layer norm (``None``: off).
        patience: consecutive checks a condition must hold before it is reported.
        log_every_n_steps: ``grad_flow/*`` points on the checked steps Lightning logs on (default: the
            Trainer's; ``0``, here or on the Trainer: none, while the checks and alerts go on).
        log_gradient_flow: log the ``grad_flow/*`` scalars.
        include: the layers judged and charted (regular expressions on layer names; ``None``: all; the
            total norm rules see every layer): see :class:`~lightning_gradguard.core.layers.LayerSelection`.
        exclude: layers neither judged nor charted.
        max_layers: a cap on the ``grad_flow/*`` curves (``None``: no cap).
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import VanishingExplodingDetector

        Trainer(callbacks=[detector := VanishingExplodingDetector()]).fit(model)
        # alerts: detector.alerts; chart: grad_flow/<layer> in the GradGuard custom-scalars section
    """

    charts = CHARTS

    allowed_actions = ("warn", "stop", "raise")
    state_key_args = ("check_every_n_steps",)

    # what a run remembers (a new run, perhaps of a new model, is judged on its own numbers)
    #: per optimizer: recent finite total norms of checks
    history: RunField[dict[int, list[float]]] = RunField(dict, load=_history)
    #: per optimizer and kind: consecutive checks with the condition
    strikes: RunField[Streaks] = RunField(Streaks)
    #: layer label -> its place in the first training forward pass (the labels of the norms)
    forward_order: RunField[dict[str, int]] = RunField(dict)
    #: layers whose gradient started at exactly 0 (behind a zero-initialized weight) and is still growing:
    #: layer -> its first non-zero norm (0.0 while it is still 0)
    opening: RunField[dict[str, float]] = RunField(dict, load=_opening)
    _seen_layers: RunField[set[str]] = RunField(set)
    #: the checks' losses: a run that has fitted its data is not vanishing
    progress: RunField[LossProgress] = RunField(LossProgress)
    #: the last verdict, for inspection
    last_check: RunField[dict[str, Any]] = RunField(dict, key=None)
    _last_flow_at: RunField[dict[int, int]] = RunField(dict, key=None)
    #: the embedding tables' layers (their gradient rows are mostly 0 on a batch), found at the first check
    _embedding_layers: RunField[set[str] | None] = RunField(nothing, key=None)

    def __init__(
        self,
        *,
        action: Literal["warn", "stop", "raise"] = "warn",
        check_every_n_steps: int = 5,
        dense_steps: int = 20,
        max_norm: float | None = 100.0,
        spike_factor: float | None = 10.0,
        growth_factor: float | None = 100.0,
        growth_window: int = 10,
        warmup_checks: int = 5,
        history_size: int = 50,
        depth_ratio_floor: float | None = 1e-3,
        first_layer_floor: float = 1e-4,
        min_rms: float | None = 1e-7,
        relative_floor: float | None = 1e-5,
        patience: int = 2,
        log_every_n_steps: int | None = None,
        log_gradient_flow: bool = True,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
        max_layers: int | None = None,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.check_every_n_steps: int = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.dense_steps: int = check_int("dense_steps", dense_steps, 0)
        opt = {"low_open": True, "allow_none": True}  # a positive number, or None for "off"
        self.max_norm: float | None = check_float("max_norm", max_norm, 0.0, **opt)
        self.spike_factor: float | None = check_float("spike_factor", spike_factor, 1.0, **opt)
        self.growth_factor: float | None = check_float("growth_factor", growth_factor, 1.0, **opt)
        self.growth_window: int = check_int("growth_window", growth_window, 3)
        self.warmup_checks: int = check_int("warmup_checks", warmup_checks, 1)
        self.history_size: int = check_int("history_size", history_size, 2)
        self.depth_ratio_floor: float | None = check_float("depth_ratio_floor", depth_ratio_floor, 0.0, **opt)
        self.first_layer_floor: float = check_float("first_layer_floor", first_layer_floor, 0, low_open=True)
        self.min_rms: float | None = check_float("min_rms", min_rms, 0.0, **opt)
        self.relative_floor: float | None = check_float("relative_floor", relative_floor, 0.0, **opt)
        self.patience: int = check_int("patience", patience, 1)
        self.log_every_n_steps: int | None = check_int(
            "log_every_n_steps", log_every_n_steps, 0, allow_none=True
        )
        self.log_gradient_flow = check_bool("log_gradient_flow", log_gradient_flow)
        self.layers = LayerSelection(include, exclude, max_layers)
        self._watch: ForwardOrder | None = None
        self._next_check = 0
        self._order_seen = False

    @override
    def state_changed(self) -> None:
        """The forward order is watched once per run: again after a reset, or a checkpoint without it."""
        self._order_seen = bool(self.forward_order)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._next_check = 0  # the next check step (core.cadence.next_due), found again at the first step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._order_seen:
            self._watch_order(trainer, pl_module)

    @guarded
    def _watch_order(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._order_seen = True  # one training forward pass is watched (the forward order), once per detector
        self._watch = ForwardOrder(pl_module)
        self.forward_order = self._watch.order

    def _unwatch(self) -> None:
        """The watched forward pass is over: its hooks go (the order stays)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._watch is not None:
            self._unwatch()
        at = log_step(trainer)
        if at >= self._next_check and self.due(at):  # a check's step: its loss
            self.progress.add(loss)  # a scalar add on the device, read with the check's norms

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._watch is not None:
            self._unwatch()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unwatch()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        at = log_step(trainer)
        if at > self._next_check:  # past the last check (every optimizer of its step was checked)
            self._next_check = self.next_due(at)
        if at == self._next_check:
            self._check(trainer, pl_module, optimizer)
        else:  # the steps between two checks: one comparison, no call
            self.progress.clear()

    @guarded
    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """One check: the layer norms in one transfer, judged, alerts and the action."""
        loss = self.progress.take(trainer)
        norms = read_layer_norms(step_stats(trainer, pl_module, optimizer), loss)  # the check's one transfer
        if norms is not None and self.layers.filters:
            norms = watched_norms(norms, self.layers)
        if norms is None:
            return
        opt_idx, rules = optimizer_index(trainer, optimizer), self._rules()
        self.progress.note(norms.loss)
        context = StepContext(
            eps=adaptive_eps(optimizer),
            optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__,
            clip=None if (clip := clip_setting(trainer)) is None else clip.value,
            fitted=self.progress.fitted(),
        )
        verdict = self._judge(pl_module, norms, opt_idx, rules, context)
        flags = self._agreed_flags(trainer, verdict, norms.device)
        self.last_check = {"step": int(trainer.global_step), **vars(verdict)}  # its fields, in order
        if not math.isfinite(verdict.total):
            # No verdict on a NaN/inf norm: that is NaNSentinel's finding (or, under 16-mixed, a step the
            # GradScaler skips). It neither counts towards patience nor resets it, so finite evidence on
            # both sides of a skipped step still adds up, and nothing is reported twice. (The gradients
            # are all-reduced, so every rank takes this branch together.)
            return
        self._log_flow(trainer, norms, verdict.flow, opt_idx)
        self._strike(trainer, verdict, flags, opt_idx, rules, context)  # reports and acts
        # a spike does not move the baseline it is measured against, until it has been reported
        spiked = self.strikes.get(f"{opt_idx}:{EXPLODING_GRADIENT.kind}", 0) >= self.patience
        adopt = not verdict.spike or spiked
        if adopt and verdict.total > 0:
            hist = self.history.setdefault(opt_idx, [])
            hist.append(verdict.total)
            del hist[: -self.history_size]

    def _rules(self) -> VerdictRules:
        return VerdictRules(**{name: getattr(self, name) for name in _RULE_NAMES})

    def _judge(
        self,
        pl_module: pl.LightningModule,
        norms: LayerNorms,
        opt_idx: int,
        rules: VerdictRules,
        context: StepContext,
    ) -> GradientVerdict:
        """The check's verdict; notes which layers are opening from a zero-initialized weight."""
        if self._embedding_layers is None:
            tables = (nn.Embedding, nn.EmbeddingBag)
            self._embedding_layers = {
                user_name(name) for name, m in pl_module.named_modules() if isinstance(m, tables)
            }
        opening = opening_layers(norms.labels, norms.values, self.opening, self._seen_layers)  # from all-0
        finite = math.isfinite(norms.total)
        if finite:
            self.opening, self._seen_layers = opening.opening, opening.seen
        return judge(
            labels=norms.labels,
            values=norms.values,
            total=norms.total,
            numels=norms.numels,
            history=self.history.get(opt_idx, []),
            rules=rules,
            forward_order=self.forward_order,
            opening=opening.positions if finite else set(),
            embeddings=self._embedding_layers,
            context=context,
        )

    def _agreed_flags(
        self, trainer: pl.Trainer, verdict: GradientVerdict, device: torch.device
    ) -> dict[str, bool]:
        """Kind -> whether it holds (``exploding_gradient``, ``vanishing_gradient``). The gradients are
        all-reduced, so every rank computes the same verdict from the same numbers; when the verdict can stop
        the run, make sure of it: one collective on the packed flags."""
        flags = {
            EXPLODING_GRADIENT.kind: bool(verdict.exploding),
            VANISHING_GRADIENT.kind: bool(verdict.vanishing),
        }
        if trainer.world_size > 1 and self.action != "warn":
            packed = HostTransfer()
            packed.add("flags", torch.tensor([float(f) for f in flags.values()], device=device))
            agreed = packed.fetch(trainer, reduce_op="sum")["flags"].tolist()
            flags = {kind: bool(x > 0) for kind, x in zip(flags, agreed, strict=True)}
        return flags

    def _strike(
        self,
        trainer: pl.Trainer,
        verdict: GradientVerdict,
        flags: dict[str, bool],
        opt_idx: int,
        rules: VerdictRules,
        context: StepContext,
    ) -> None:
        """Count the consecutive checks each condition held; report those that reached ``patience``, then
        act (:meth:`run_rules`)."""
        history = self.history.get(opt_idx, [])
        held = Held(verdict=verdict, patience=self.patience, history=history, rules=rules, context=context)
        evidence = Checked(held=held, flags=flags, strikes=self.strikes, opt_idx=opt_idx)
        # one cooldown per optimizer and kind: ``where`` (the top layers) moves from check to check
        self.run_rules(trainer, RULES, evidence, cooldown=lambda f: f"{opt_idx}:{f.kind}")

    def _log_flow(self, trainer: pl.Trainer, norms: LayerNorms, flow: list[float], opt_idx: int) -> None:
        at, every = log_step(trainer), logging_interval(trainer, self.log_every_n_steps)
        # Lightning's own rule (plus the first step, as GradientNormLogger): the loss of this batch is
        # logged at the same x. Once per optimizer and step (an optimizer may step twice in a batch).
        if self.log_gradient_flow and on_logging_step(at, every) and self._last_flow_at.get(opt_idx) != at:
            self._last_flow_at[opt_idx] = at
            shown = self.layers.show(norms.labels, log_distance_scores(norms.values))
            metrics = {
                GRAD_FLOW.tag(n): v
                for n, v in zip(norms.labels, flow, strict=True)
                if math.isfinite(v) and n in shown
            }
            metrics.update(self.layers.aggregates(GRAD_FLOW.name, dict(zip(norms.labels, flow, strict=True))))
            _emit.log_scalars(trainer, metrics, at)
