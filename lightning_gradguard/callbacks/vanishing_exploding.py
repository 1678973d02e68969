r"""
VanishingExplodingDetector
==========================

Watches the per-layer gradient norms every gradguard callback shares (no second pass over the
gradients) and says when they explode or vanish, where, and what to do about it. It also logs a
gradient-flow view, ``grad_flow/<layer>`` = ``log10(layer norm / largest layer norm)``, so a chart shows
where along the network the gradient dies.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step
from lightning_gradguard.core.stats import step_stats
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.health import depth_ratio, gradient_flow, growth_factor, spike_ratio
from lightning_gradguard.functional.stats import suggest_clip_value

__all__ = ["VanishingExplodingDetector"]

_MAX_NAMED = 5
#: a spike must also beat the largest recent norm by this factor (heavy-tailed healthy runs stay below)
_SPIKE_OVER_MAX = 2.0
#: a layer that started behind a zero-initialized weight is judged again once its gradient grew this much
_OPENED_FACTOR = 100.0

_EXPLODING_HINT = (
    "Clip gradients: Trainer(gradient_clip_val={clip:g}) ({clip_why}). Lower the learning rate (try 10x "
    "lower). Check the initialization (He/Kaiming for ReLU, Xavier for tanh/sigmoid). In deep or recurrent "
    "nets add normalization (BatchNorm/LayerNorm) and residual connections."
)
_VANISHING_HINT = (
    "Use non-saturating activations (ReLU/GELU instead of sigmoid/tanh), He/Xavier initialization, "
    "BatchNorm/LayerNorm between layers and residual connections in deep nets; raise the learning rate "
    "only after those fixes."
)


def _named(labels: list[str], values: list[float], fmt: str = "{:.3g}") -> str:
    shown = [f"{n} ({fmt.format(v)})" for n, v in zip(labels[:_MAX_NAMED], values[:_MAX_NAMED], strict=False)]
    more = f" and {len(labels) - _MAX_NAMED} more" if len(labels) > _MAX_NAMED else ""
    return ", ".join(shown) + more


def _where(labels: list[str]) -> str | None:
    if not labels:
        return None
    more = f",+{len(labels) - 3}" if len(labels) > 3 else ""
    return ",".join(labels[:3]) + more


class VanishingExplodingDetector(GradGuardCallback):
    r"""Alert on exploding and vanishing gradients, measured where the numbers are true.

    It reads the per-layer gradient norms of ``on_before_optimizer_step`` (accumulated, unscaled,
    all-reduced, not yet clipped) from the statistics every gradguard callback shares, and brings them
    to the host in one small transfer on the steps it checks: every step for the first ``dense_steps``
    steps (pathologies of the initialization show at once), then on the steps where
    ``(step + 1) % check_every_n_steps == 0``. Steps are counted the way Lightning counts them for
    logging (batches that stepped an optimizer: ``global_step`` in automatic optimization, one per batch
    in manual optimization), so with ``check_every_n_steps`` dividing the Trainer's ``log_every_n_steps``
    every ``grad_flow/*`` point lies at the x of the loss and the ``grad_norm/*`` points of the same batch,
    and with several optimizers each one is checked every ``check_every_n_steps`` of its own steps.

    **Exploding** (alert ``exploding_gradient``, severity error) when, on ``patience`` consecutive
    checks, at least one of:

    * the total norm exceeds ``max_norm`` (the usual red line is 100);
    * after ``warmup_checks`` checks, the total norm is more than ``spike_factor`` times this run's
      current level and more than twice the largest of its last ``history_size`` checked norms (healthy
      runs late in training are heavy-tailed: norms spread over two decades are normal). The level is the
      larger of the median of those norms and the median of the last ``warmup_checks`` of them: the long
      median alone lags a level that is still rising by design (a GAN's generator while its
      discriminator learns), which would make every sample of the rise look like a jump. A spike is kept
      out of the baseline until it has been reported;
    * over the last ``growth_window`` checks the norm rose steadily by more than ``growth_factor``.

    **Vanishing** (alert ``vanishing_gradient``, severity error) when, on ``patience`` consecutive checks,
    at least one of:

    * the first layer (in forward order, found once by watching the first training forward pass) has
      less than ``depth_ratio_floor`` of the last layer's norm *and* an absolute norm below
      ``first_layer_floor`` (AutoTrainer's rule: 1e-3 and 1e-4);
    * a layer's root-mean-square gradient is below ``min_rms`` (SageMaker's mean\|g\| < 1e-7; RMS is an
      upper bound of mean\|g\|, so this fires only when mean\|g\| is even smaller). Embedding tables
      (``nn.Embedding``, ``nn.EmbeddingBag``) are left out: the rows a batch did not touch have a gradient
      of exactly 0, so their RMS measures the vocabulary size;
    * a layer's norm is below ``relative_floor`` times the largest layer norm of the same step.

    Layers without a gradient this step (frozen, unused, or exactly zero behind a dead path) are never
    called vanishing. ``where`` names the layers, the hint says what to try (and a clip value, from the
    90th percentile of this run's healthy norms).

    A layer whose gradient is exactly 0 the first time it is checked, while other layers have one, sits
    behind a weight that starts at 0 (LoRA's ``B``, a zero-initialized residual gain or output layer,
    ReZero): its gradient grows from 0 by design. Until it has grown 100x past its first non-zero value
    such layers are compared only with each other (depth ratio, relative floor) and the absolute
    ``min_rms`` floor does not apply to them.

    A check whose total norm is NaN/inf gives no verdict: that is :class:`NaNSentinel`'s finding (under
    16-mixed, a step the GradScaler skips), so it is not reported here, and it neither counts towards
    ``patience`` nor resets it.

    Every check also computes ``grad_flow/<layer>`` (log10 of the layer norm over the largest one), logged
    on the checked steps Lightning logs on (``(step + 1) % log_every_n_steps == 0``, plus step 0).

    Args:
        check_every_n_steps: after the dense start, check the steps where ``(step + 1)`` is a multiple of
            this (Lightning's logging rule).
        dense_steps: check every step while the step (Lightning's logging step) is below this.
        max_norm: ceiling on the total gradient norm (``None``: off).
        spike_factor: a total norm this many times the run's median is a spike (``None``: off).
        growth_factor: a steady rise by more than this factor over ``growth_window`` checks (``None``: off).
        growth_window: checks the growth test looks at.
        warmup_checks: checks before the spike test has a baseline; also how many recent checks make
            the current level it is measured against.
        history_size: how many recent checked norms the baseline uses.
        depth_ratio_floor: first/last layer norm ratio below which gradients vanish (``None``: off).
        first_layer_floor: ... provided the first layer's norm is also below this.
        min_rms: RMS gradient floor per layer (``None``: off).
        relative_floor: per-layer floor relative to the largest layer norm (``None``: off).
        patience: consecutive checks a condition must hold before it is reported.
        log_every_n_steps: ``grad_flow/*`` points at ``(step + 1) % log_every_n_steps == 0`` (and step 0)
            when that step is checked (default: the Trainer's; ``0``, here or on the Trainer: no
            ``grad_flow/*`` points, while the checks and alerts go on).
        log_gradient_flow: log the ``grad_flow/*`` scalars.
        action: ``"warn"`` (default), ``"stop"`` or ``"raise"``; with ``"stop"``/``"raise"`` under DDP the
            flags are all-reduced before acting, so every rank acts at the same step.
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import VanishingExplodingDetector

        trainer = Trainer(callbacks=[VanishingExplodingDetector()])
        trainer.fit(model)
        # alerts: detector.alerts; chart: grad_flow/<layer> in the GradGuard custom-scalars section
    """

    state_key_args = ("check_every_n_steps", "action")

    def __init__(
        self,
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
        action: Literal["warn", "stop", "raise"] = "warn",
        cooldown_steps: int = 100,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.check_every_n_steps: int = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.dense_steps: int = check_int("dense_steps", dense_steps, 0)
        self.max_norm: float | None = check_float("max_norm", max_norm, 0.0, low_open=True, allow_none=True)
        self.spike_factor: float | None = check_float(
            "spike_factor", spike_factor, 1.0, low_open=True, allow_none=True
        )
        self.growth_factor: float | None = check_float(
            "growth_factor", growth_factor, 1.0, low_open=True, allow_none=True
        )
        self.growth_window: int = check_int("growth_window", growth_window, 3)
        self.warmup_checks: int = check_int("warmup_checks", warmup_checks, 1)
        self.history_size: int = check_int("history_size", history_size, 2)
        self.depth_ratio_floor: float | None = check_float(
            "depth_ratio_floor", depth_ratio_floor, 0.0, low_open=True, allow_none=True
        )
        self.first_layer_floor: float = check_float(
            "first_layer_floor", first_layer_floor, 0.0, low_open=True
        )
        self.min_rms: float | None = check_float("min_rms", min_rms, 0.0, low_open=True, allow_none=True)
        self.relative_floor: float | None = check_float(
            "relative_floor", relative_floor, 0.0, low_open=True, allow_none=True
        )
        self.patience: int = check_int("patience", patience, 1)
        self.log_every_n_steps: int | None = check_int(
            "log_every_n_steps", log_every_n_steps, 0, allow_none=True
        )
        self.log_gradient_flow = check_bool("log_gradient_flow", log_gradient_flow)
        #: per optimizer index: recent finite total norms of checked steps
        self.history: dict[int, list[float]] = {}
        #: per optimizer index and kind: consecutive checks with the condition
        self.strikes: dict[str, int] = {}
        #: forward order of the modules that own parameters (filled on the first training batch)
        self.forward_order: dict[str, int] = {}
        #: the last verdict, for inspection: step, flags, gradient flow
        self.last_check: dict[str, Any] = {}
        self._order_hooks: list[RemovableHandle] = []
        self._order_seen = False
        self._last_flow_at: dict[int, int] = {}
        self._numel_cache: dict[tuple[str, ...], list[int]] = {}
        #: layers whose gradient started at exactly 0 (behind a zero-initialized weight) and is still
        #: growing: layer -> its first non-zero norm (0.0 while it is still 0)
        self.opening: dict[str, float] = {}
        self._seen_layers: set[str] = set()
        #: embedding layers (their gradient has a row per token, most rows 0 on a batch)
        self._embedding_layers: set[str] | None = None

    # ------------------------------------------------------------------ layout
    @override
    def layout_charts(self) -> dict[str, list[str]]:
        return {"Gradient flow: log10(layer norm / largest layer norm)": ["grad_flow/.*"]}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):  # a new run (perhaps of a new model) is judged on its own numbers
            self.history, self.strikes, self.last_check = {}, {}, {}
            self.forward_order, self._order_seen = {}, False
            self._last_flow_at, self._numel_cache = {}, {}
            self.opening, self._seen_layers, self._embedding_layers = {}, set(), None

    # ------------------------------------------------------------------ forward order (once)
    @override
    @guarded
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._order_seen or self._order_hooks:
            return
        self._order_seen = True  # one training forward pass is watched, once per detector
        order = self.forward_order
        for name, module in pl_module.named_modules():
            if not any(True for _ in module.parameters(recurse=False)):
                continue

            def hook(mod: nn.Module, args: Any, _name: str = name) -> None:
                order.setdefault(_name, len(order))

            self._order_hooks.append(module.register_forward_pre_hook(hook))

    def _remove_order_hooks(self) -> None:
        for handle in self._order_hooks:
            handle.remove()
        self._order_hooks = []

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._order_hooks:
            self._remove_order_hooks()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._order_hooks:
            self._remove_order_hooks()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove_order_hooks()

    # ------------------------------------------------------------------ the check
    def due(self, step: int) -> bool:
        """Whether logging step ``step`` (:func:`~lightning_gradguard.core.cadence.log_step`) is checked."""
        return step < self.dense_steps or (step + 1) % self.check_every_n_steps == 0

    @override
    @guarded
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = int(trainer.global_step)
        if not self.due(log_step(trainer)):
            return
        stats = step_stats(trainer, pl_module, optimizer)
        labels, norms = stats.grad_groups(2.0)
        if not labels:
            return
        if self._embedding_layers is None:
            self._embedding_layers = {
                name
                for name, m in pl_module.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            }
        opt = getattr(optimizer, "optimizer", optimizer)
        ids = [id(o) for o in trainer.optimizers]
        opt_idx = ids.index(id(opt)) if id(opt) in ids else 0
        packed = torch.cat([norms.float().reshape(-1), stats.grad_total(2.0).float().reshape(1)])
        host = packed.cpu().double()  # the one device -> host transfer of this check
        numels = self._numels(stats, labels)
        verdict = self._evaluate(labels, host[:-1], float(host[-1]), numels, opt_idx)
        flags = [bool(verdict["exploding"]), bool(verdict["vanishing"])]
        # The gradients are all-reduced, so every rank computes the same verdict from the same numbers.
        # When the verdict can stop the run, make sure of it: one collective on the packed flags.
        if trainer.world_size > 1 and self.action != "warn":
            t = torch.tensor([float(f) for f in flags], device=packed.device)
            t = trainer.strategy.reduce(t, reduce_op="sum")
            flags = [bool(x > 0) for x in t.cpu().tolist()]
        self.last_check = {"step": step, "exploding": flags[0], "vanishing": flags[1], **verdict}
        if not math.isfinite(verdict["total"]):
            # No verdict on a NaN/inf norm: that is NaNSentinel's finding (or, under 16-mixed, a step the
            # GradScaler skips). It neither counts towards patience nor resets it, so finite evidence on
            # both sides of a skipped step still adds up, and nothing is reported twice. (The gradients
            # are all-reduced, so every rank takes this branch together.)
            return
        self._log_flow(trainer, labels, verdict["flow"], opt_idx)
        alerts = []
        for kind, flag in zip(("exploding_gradient", "vanishing_gradient"), flags, strict=True):
            key = f"{opt_idx}:{kind}"
            self.strikes[key] = self.strikes.get(key, 0) + 1 if flag else 0
            if self.strikes[key] < self.patience:
                continue
            alert = self._report(trainer, kind, verdict, step, opt_idx)
            if alert is not None:
                alerts.append(alert)
        # a spike does not move the baseline it is measured against, until it has been reported
        adopt = (
            not verdict.get("spike") or self.strikes.get(f"{opt_idx}:exploding_gradient", 0) >= self.patience
        )
        if adopt and math.isfinite(verdict["total"]) and verdict["total"] > 0:
            hist = self.history.setdefault(opt_idx, [])
            hist.append(verdict["total"])
            del hist[: -self.history_size]
        self.act(trainer, alerts)

    def _numels(self, stats: Any, labels: list[str]) -> list[int]:
        """Elements per layer (host ints, cached while the set of parameters with a gradient is the same)."""
        key = tuple(stats.grad_names)
        cached = self._numel_cache.get(key)
        if cached is not None and len(cached) == len(labels):
            return cached
        _, index = stats.groups(stats.grad_names, None, False)
        numels = [0] * len(labels)
        for i, g in zip(index, stats.grads, strict=True):
            numels[i] += g.numel()
        self._numel_cache = {key: numels}
        return numels

    def _opening(self, labels: list[str], values: list[float]) -> set[int]:
        """Positions of layers behind a zero-initialized weight whose gradient is still growing from zero.

        A layer whose gradient is exactly 0 the first time it is checked while other layers have one sits
        behind a weight that starts at zero (LoRA's ``B``, a zero-initialized residual gain or output
        layer, ReZero, ControlNet's zero convolutions): its gradient is proportional to that weight and
        grows from 0 by design. It is left out of the vanishing rules until its norm has grown
        ``_OPENED_FACTOR`` times past its first non-zero value; after that it is an ordinary layer.
        """
        finite = [v for v in values if math.isfinite(v)]
        others_live = any(v > 0 for v in finite)
        out: set[int] = set()
        for i, (name, v) in enumerate(zip(labels, values, strict=True)):
            if name not in self._seen_layers:
                self._seen_layers.add(name)
                if v == 0.0 and others_live:
                    self.opening[name] = 0.0
            start = self.opening.get(name)
            if start is None or not math.isfinite(v):
                continue
            if start == 0.0 and v > 0.0:
                self.opening[name] = start = v
            if start == 0.0 or v < _OPENED_FACTOR * start:
                out.add(i)
            else:
                del self.opening[name]
        return out

    def _evaluate(
        self, labels: list[str], norms: Tensor, total: float, numels: list[int], opt_idx: int
    ) -> dict[str, Any]:
        """The host-side verdict of one check (pure Python on a handful of numbers)."""
        values = norms.tolist()
        hist = self.history.get(opt_idx, [])
        exploding: list[str] = []
        data: dict[str, float] = {"total_norm": total}
        if not math.isfinite(total):  # NaN/inf gradients are NaNSentinel's business
            return {
                "exploding": [],
                "vanishing": [],
                "vanishing_layers": [],
                "total": total,
                "data": data,
                "flow": [math.nan] * len(labels),
                "top": [],
                "labels": labels,
                "values": values,
            }
        if self.max_norm is not None and total > self.max_norm:
            exploding.append(f"the total norm exceeds max_norm={self.max_norm:g}")
        spike = False
        if self.spike_factor is not None and len(hist) >= self.warmup_checks:
            ratio = spike_ratio(total, hist, recent=self.warmup_checks)
            record = total / max(hist)
            data["spike_ratio"] = ratio
            if ratio > self.spike_factor and record > _SPIKE_OVER_MAX:
                spike = True
                exploding.append(
                    f"it is {ratio:.3g}x the run's level (the larger median of the last {len(hist)} and of "
                    f"the last {min(len(hist), self.warmup_checks)} checked norms) and {record:.3g}x the "
                    f"largest of them (spike_factor={self.spike_factor:g})"
                )
        if self.growth_factor is not None and len(hist) + 1 >= self.growth_window:
            g = growth_factor([*hist[-(self.growth_window - 1) :], total])
            data["growth_factor"] = g
            if g > self.growth_factor:
                exploding.append(
                    f"it grew steadily {g:.3g}x over the last {self.growth_window} checks "
                    f"(growth_factor={self.growth_factor:g})"
                )
        order = sorted(range(len(labels)), key=lambda i: -values[i] if math.isfinite(values[i]) else 0.0)
        top = [i for i in order if values[i] > 0][:_MAX_NAMED]

        vanishing: list[str] = []
        low: set[int] = set()
        flow = gradient_flow(norms).tolist()
        # Layers behind a zero-initialized weight ("opening") are compared with each other, never with
        # the rest: their gradients are all scaled down by weights that start at 0 and grow together.
        opening = self._opening(labels, values)
        if opening:
            data["opening_layers"] = float(len(opening))
        positive = [i for i, v in enumerate(values) if math.isfinite(v) and v > 0]
        groups = [[i for i in positive if i not in opening], [i for i in positive if i in opening]]
        if self.min_rms is not None:
            # An absolute per-element floor: not for a gradient growing from 0 by design (opening), nor
            # for an embedding table, whose RMS is dominated by the rows this batch never touched (their
            # gradient is exactly 0): a 50k x 768 table has a 6000x lower RMS than the rows in use.
            tables = self._embedding_layers or set()
            live = [i for i in groups[0] if labels[i] not in tables]
            rms = {i: values[i] / math.sqrt(max(numels[i], 1)) for i in live}
            under = [i for i in live if rms[i] < self.min_rms]
            if under:
                low.update(under)
                vanishing.append(
                    f"RMS gradient below min_rms={self.min_rms:g} in "
                    + _named([labels[i] for i in under], [rms[i] for i in under], "RMS {:.2e}")
                )
        if self.relative_floor is not None:
            floor = math.log10(self.relative_floor)
            for live in groups:
                if not live:
                    continue
                top_of_group = max(flow[i] for i in live)
                rel = {i: flow[i] - top_of_group for i in live}
                under = [i for i in live if rel[i] < floor]
                if under:
                    low.update(under)
                    vanishing.append(
                        f"norm below relative_floor={self.relative_floor:g} of the largest layer's in "
                        + _named([labels[i] for i in under], [10 ** rel[i] for i in under], "{:.2e} of it")
                    )
        if self.depth_ratio_floor is not None:
            for g, live in enumerate(groups):
                idx = [
                    i
                    for _, i in sorted(
                        (self.forward_order[labels[i]], i) for i in live if labels[i] in self.forward_order
                    )
                ]
                ratio, a, b = depth_ratio([values[i] for i in idx]) if len(idx) >= 2 else (math.nan, -1, -1)
                if not math.isfinite(ratio):
                    continue
                first, last = idx[a], idx[b]
                if g == 0:
                    data["first_last_ratio"] = ratio
                    data["first_layer_norm"] = values[first]
                if ratio < self.depth_ratio_floor and values[first] < self.first_layer_floor:
                    low.add(first)
                    among = " (among the layers behind zero-initialized weights)" if g else ""
                    vanishing.append(
                        f"the first layer {labels[first]} has {ratio:.2e} of the last layer "
                        f"{labels[last]}'s norm{among} ({values[first]:.2e} vs {values[last]:.2e}; floors "
                        f"{self.depth_ratio_floor:g} and {self.first_layer_floor:g})"
                    )
        return {
            "spike": spike,
            "exploding": exploding,
            "vanishing": vanishing,
            "vanishing_layers": [labels[i] for i in sorted(low)],
            "total": total,
            "data": data,
            "flow": flow,
            "top": [labels[i] for i in top],
            "top_values": [values[i] for i in top],
            "labels": labels,
            "values": values,
        }

    def _report(
        self, trainer: pl.Trainer, kind: str, verdict: dict[str, Any], step: int, opt_idx: int
    ) -> Any:
        data = dict(verdict["data"])
        if kind == "exploding_gradient":
            hist = [h for h in self.history.get(opt_idx, []) if self.max_norm is None or h <= self.max_norm]
            clip = suggest_clip_value(hist) if len(hist) >= self.warmup_checks else None
            clip_why = "about the 90th percentile of this run's earlier norms"
            if clip is None:
                clip, clip_why = 1.0, "the usual starting point; tune it from grad_norm/total"
            data["suggested_clip_val"] = clip
            reasons = "; ".join(verdict["exploding"]) or "the condition held on another rank"
            message = (
                f"Gradient norm {verdict['total']:.3g} for {self.patience} consecutive checks: {reasons}. "
                f"Largest layers: {_named(verdict['top'], verdict.get('top_values', []))}."
            )
            hint = _EXPLODING_HINT.format(clip=clip, clip_why=clip_why)
            where = _where(verdict["top"][:1])
        else:
            reasons = "; ".join(verdict["vanishing"]) or "the condition held on another rank"
            message = f"Gradients vanish ({self.patience} consecutive checks): {reasons}."
            hint = _VANISHING_HINT
            where = _where(verdict["vanishing_layers"])
        # one cooldown per optimizer and kind: ``where`` (the top layers) moves from check to check
        return self.report(
            trainer, kind, "error", where, message, hint, data, step=step, cooldown_key=f"{opt_idx}:{kind}"
        )

    def _log_flow(self, trainer: pl.Trainer, labels: list[str], flow: list[float], opt_idx: int) -> None:
        if not self.log_gradient_flow:
            return
        at = log_step(trainer)
        every = logging_interval(trainer, self.log_every_n_steps)
        # Lightning's own rule (plus the first step, as GradientNormLogger): the loss of this batch is
        # logged at the same x. Once per optimizer and step (an optimizer may step twice in a batch).
        if not on_logging_step(at, every) or self._last_flow_at.get(opt_idx) == at:
            return
        self._last_flow_at[opt_idx] = at
        metrics = {f"grad_flow/{n}": v for n, v in zip(labels, flow, strict=True) if math.isfinite(v)}
        _emit.log_scalars(trainer, metrics, at)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            history={k: list(v) for k, v in self.history.items()},
            strikes=dict(self.strikes),
            forward_order=dict(self.forward_order),
            opening=dict(self.opening),
            seen_layers=sorted(self._seen_layers),
        )
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.history = {int(k): list(v) for k, v in state_dict.get("history", {}).items()}
        self.strikes = dict(state_dict.get("strikes", {}))
        self.forward_order = dict(state_dict.get("forward_order", {}))
        self._order_seen = bool(self.forward_order)
        self.opening = {str(k): float(v) for k, v in state_dict.get("opening", {}).items()}
        self._seen_layers = set(state_dict.get("seen_layers", []))
