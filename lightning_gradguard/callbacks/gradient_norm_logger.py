r"""
GradientNormLogger
==================

Logs gradient norms (total and per layer), weight norms, the update/weight ratio and histograms,
measured where the numbers are true: in ``on_before_optimizer_step``, on accumulated, unscaled,
all-reduced and not yet clipped gradients. All values of a logging step go to the host in one transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step, logging_interval, on_logging_step
from lightning_gradguard.core.stats import StepStats, step_stats
from lightning_gradguard.core.validate import check_bool, check_int
from lightning_gradguard.functional.stats import (
    HistogramSpec,
    device_histograms,
    foreach_norms,
    nonfinite_counts,
    reduce_norms,
    suggest_clip_value,
)

__all__ = ["GradientNormLogger"]

_PERCENTILES = (50.0, 90.0, 99.0)
#: with periodic logging off (``log_every_n_steps=0``), the clipping verdict is still reached this often
_CLIP_CHECK_EVERY = 100


@dataclass
class _Pending:
    """Device tensors of one sampled optimizer step, waiting for the single host transfer."""

    step: int
    suffix: str
    stats: StepStats
    device: dict[str, Tensor] = field(default_factory=dict)
    grad_labels: list[str] = field(default_factory=list)
    weight_labels: list[str] = field(default_factory=list)
    weight_index: Tensor | None = None
    snapshot: list[Tensor] | None = None
    histograms: dict[str, tuple[list[str], HistogramSpec]] = field(default_factory=dict)


def _parse_norm_type(norm_type: Any) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (str, int, float)):
        raise TypeError(f"`norm_type` must be 2 or 'inf'; got {norm_type!r} ({type(norm_type).__name__})")
    try:
        value = float(norm_type)
    except ValueError:
        value = float("nan")
    if value not in (2.0, math.inf):
        raise ValueError(f"`norm_type` must be 2 or 'inf'; got {norm_type!r}")
    return value


def _fmt(value: float | None, spec: str = ".3g") -> str:
    """A number for a message; ``n/a`` where a statistic is missing (never a crash in a format string)."""
    return "n/a" if value is None else format(value, spec)


class GradientNormLogger(GradGuardCallback):
    r"""Log gradient and weight norms, update ratios and histograms to every attached logger.

    On a logging step it logs, per optimizer step:

    * ``grad_norm/total`` and ``grad_norm/<layer>``: gradient norms before clipping;
    * ``weight_norm/total`` and ``weight_norm/<layer>``: parameter norms before the update;
    * ``update_ratio/total`` and ``update_ratio/<layer>``: :math:`\|\Delta w\| / \|w\|` of the update the
      optimizer actually applied (healthy runs sit near 1e-3);
    * ``grad_nonfinite/total`` (and ``grad_nonfinite/<layer>`` where non-zero): NaN/inf gradient entries;
    * with ``gradient_clip_val`` set on the Trainer: ``grad_clip/fraction_clipped``,
      ``grad_clip/pre_clip_norm_p50|p90|p99`` and ``grad_clip/suggested_clip_val`` over the last
      ``clip_window`` steps. Under ``gradient_clip_algorithm="norm"`` the pre-clip norm is the total
      2-norm and a step counts as clipped when it exceeds ``gradient_clip_val``; under ``"value"`` it is
      the largest absolute gradient entry (the infinity norm), since clipping by value changes a step
      exactly when some ``|g|`` exceeds the value.

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
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import GradientNormLogger

        trainer = Trainer(callbacks=[GradientNormLogger()], gradient_clip_val=1.0)
        trainer.fit(model)
        # tensorboard --logdir lightning_logs  ->  Custom Scalars tab, "GradGuard" section
    """

    state_key_args = ("log_every_n_steps", "norm_type", "group_depth", "per_parameter")

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        histogram_every_n_steps: int | None = None,
        norm_type: float | Literal["inf"] = 2.0,
        group_depth: int | None = None,
        per_parameter: bool = False,
        log_weight_norms: bool = True,
        log_update_ratio: bool = True,
        histogram_bins: int = 64,
        clip_window: int = 1000,
        cooldown_steps: int = 1000,
    ) -> None:
        super().__init__(action="warn", cooldown_steps=cooldown_steps)
        self.log_every_n_steps: int | None = check_int(
            "log_every_n_steps", log_every_n_steps, 0, allow_none=True
        )
        self.histogram_every_n_steps: int | None = check_int(
            "histogram_every_n_steps", histogram_every_n_steps, 0, allow_none=True
        )
        self.norm_type = _parse_norm_type(norm_type)
        self.group_depth: int | None = check_int("group_depth", group_depth, 1, allow_none=True)
        self.per_parameter = check_bool("per_parameter", per_parameter)
        self.log_weight_norms = check_bool("log_weight_norms", log_weight_norms)
        self.log_update_ratio = check_bool("log_update_ratio", log_update_ratio)
        self.histogram_bins: int = check_int("histogram_bins", histogram_bins, 2)
        self.clip_window: int = check_int("clip_window", clip_window, 10)
        self._pending: list[_Pending] = []
        self._clip_check_due = False
        self._clip_check_step = 0  # global_step of the latest step measured for the clipping verdict
        # clipping statistics: a device ring buffer of pre-clip norms, filled every step without a sync
        self._clip_norms: Tensor | None = None
        self._clip_seen = 0
        self.last_logged: dict[str, float] = {}

    # ------------------------------------------------------------------ cadence
    def _log_interval(self, trainer: pl.Trainer) -> int:
        """Logging steps between two logged points; 0: periodic logging is off."""
        return logging_interval(trainer, self.log_every_n_steps)

    def _hist_interval(self, trainer: pl.Trainer) -> int:
        every = self._log_interval(trainer)
        if self.histogram_every_n_steps is not None:
            return self.histogram_every_n_steps if every else 0
        return 10 * every

    @staticmethod
    def _clip_setting(trainer: pl.Trainer) -> tuple[float, float] | None:
        """``(clip value, norm type that decides clipping)`` when the Trainer clips gradients.

        Clipping by norm rescales the gradient when its total 2-norm exceeds the value; clipping by value
        changes it when some entry's magnitude does, which is when the infinity norm exceeds the value.
        """
        val = trainer.gradient_clip_val
        if val is None or float(val) <= 0 or not trainer.lightning_module.automatic_optimization:
            return None
        algorithm = GradClipAlgorithmType(getattr(trainer, "gradient_clip_algorithm", None) or "norm")
        return float(val), (math.inf if algorithm == GradClipAlgorithmType.VALUE else 2.0)

    @override
    def layout_charts(self) -> dict[str, list[str]]:
        not_total = r"(?!total(_opt\d+)?$)"  # the per-layer charts leave the total out of their y range
        return {
            "Gradient norm: total": ["grad_norm/total.*"],
            "Gradient norm per layer": [f"grad_norm/{not_total}.*"],
            "Weight norm per layer": [f"weight_norm/{not_total}.*"],
            "Update / weight ratio per layer (healthy ~1e-3: use the log y axis)": [
                f"update_ratio/{not_total}.*"
            ],
            "Gradient clipping: fraction of steps clipped": ["grad_clip/fraction_clipped"],
            "Gradient clipping: pre-clip norm p50/p90/p99 and suggested clip value": [
                "grad_clip/pre_clip_norm_.*",
                "grad_clip/suggested_clip_val",
            ],
            "Non-finite gradient entries": ["grad_nonfinite/.*"],
        }

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):  # the clip window holds this run's steps only
            self._clip_norms, self._clip_seen = None, 0
            self._pending, self.last_logged = [], {}
            self._clip_check_due = False

    @override
    @guarded
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not trainer.is_global_zero:  # loggers are rank-zero only; gradients agree across ranks
            return
        at = log_step(trainer)
        every = self._log_interval(trainer)
        sampled = on_logging_step(at, every)
        clip = self._clip_setting(trainer)
        if not sampled and clip is None:
            return
        stats = step_stats(trainer, pl_module, optimizer)
        if clip is not None:
            self._record_clip_norm(stats.grad_total(clip[1]))
            # with logging off the verdict is still reached, on a cadence of its own
            if sampled or (every == 0 and self._clip_seen % _CLIP_CHECK_EVERY == 0):
                self._clip_check_due, self._clip_check_step = True, stats.step
        if not sampled:
            return
        suffix = ""
        if len(trainer.optimizers) > 1:
            opt = getattr(optimizer, "optimizer", optimizer)
            ids = [id(o) for o in trainer.optimizers]
            suffix = f"_opt{ids.index(id(opt))}" if id(opt) in ids else ""
        pending = _Pending(step=at, suffix=suffix, stats=stats)
        labels, layer_grad = stats.grad_groups(self.norm_type, self.group_depth, self.per_parameter)
        pending.grad_labels = labels
        pending.device["grad_layers"] = layer_grad
        pending.device["grad_params"] = stats.grad_norms(self.norm_type)
        pending.device["grad_total"] = stats.grad_total(self.norm_type).reshape(1)
        if self.log_weight_norms or self.log_update_ratio:
            wlabels, layer_w = stats.weight_groups(self.norm_type, self.group_depth, self.per_parameter)
            pending.weight_labels = wlabels
            pending.device["weight_layers"] = layer_w
            pending.device["weight_total"] = torch.linalg.vector_norm(
                stats.weight_norms(self.norm_type), ord=self.norm_type
            ).reshape(1)
            _, index = stats.groups(stats.names, self.group_depth, self.per_parameter)
            pending.weight_index = torch.tensor(index, dtype=torch.long, device=layer_w.device)
        if self.log_update_ratio and stats.params:
            pending.snapshot = list(torch._foreach_mul([p.detach() for p in stats.params], 1.0))
        hist_every = self._hist_interval(trainer)
        if on_logging_step(at, hist_every) and _emit.tensorboard_writers(trainer):
            pending.histograms = self._histograms(stats)
        self._pending.append(pending)

    def _histograms(self, stats: StepStats) -> dict[str, tuple[list[str], HistogramSpec]]:
        bins = self.histogram_bins
        grads = stats.grads
        if stats.grad_scale is not None:  # still-scaled (fused optimizer): show unscaled values
            inv = 1.0 / stats.grad_scale.float()
            grads = [g.float() * inv.to(g.device) for g in grads]
        return {
            "grad": (stats.grad_names, device_histograms(grads, bins)),
            "grad_log10": (stats.grad_names, device_histograms(grads, bins, log10=True)),
            "weight": (stats.names, device_histograms([p.detach() for p in stats.params], bins)),
        }

    def _record_clip_norm(self, norm: Tensor) -> None:
        if self._clip_norms is None or self._clip_norms.device != norm.device:
            self._clip_norms = torch.full((self.clip_window,), float("nan"), device=norm.device)
        self._clip_norms[self._clip_seen % self.clip_window] = norm.float()
        self._clip_seen += 1

    @override
    @guarded
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending or self._clip_check_due:
            self._flush(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending or self._clip_check_due:
            self._flush(trainer)

    # ------------------------------------------------------------------ the one transfer
    def _flush(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        clip_due, self._clip_check_due = self._clip_check_due, False
        parts: list[Tensor] = []
        layout: list[tuple[int, str, int, tuple[int, ...]]] = []  # (pending idx, key, numel, shape)

        def add(i: int, key: str, t: Tensor) -> None:
            layout.append((i, key, t.numel(), tuple(t.shape)))
            parts.append(t.detach().reshape(-1).float())

        for i, p in enumerate(pending):
            for key, t in p.device.items():
                add(i, key, t)
            if p.snapshot is not None and p.weight_index is not None:
                current = [w.detach() for w in p.stats.params]
                torch._foreach_sub_(p.snapshot, current)
                upd = foreach_norms(p.snapshot, self.norm_type)
                add(
                    i,
                    "update_layers",
                    reduce_norms(upd, p.weight_index, len(p.weight_labels), self.norm_type),
                )
                add(i, "update_total", torch.linalg.vector_norm(upd, ord=self.norm_type).reshape(1))
                p.snapshot = None
            for name, (_, spec) in p.histograms.items():
                for field_name in ("stats", "edges", "counts", "nonfinite"):
                    add(i, f"hist:{name}:{field_name}", getattr(spec, field_name))
        clip = self._clip_setting(trainer)
        if clip_due and clip is not None and self._clip_norms is not None and self._clip_seen:
            filled = self._clip_norms[: min(self._clip_seen, self.clip_window)]
            finite = torch.isfinite(filled)
            n_finite = finite.sum().clamp_min(1)
            clipped = ((filled > clip[0]) & finite).sum() / n_finite
            add(-1, "clip_fraction", clipped.reshape(1))
            add(-1, "clip_window", filled)
        if not parts:
            return
        host = torch.cat(parts).cpu()  # the single device -> host transfer of this logging step
        values: dict[tuple[int, str], Tensor] = {}
        offset = 0
        for i, key, n, shape in layout:
            values[(i, key)] = host[offset : offset + n].reshape(shape)
            offset += n
        for i, p in enumerate(pending):
            self._emit_step(trainer, p, {k: v for (j, k), v in values.items() if j == i})
        if (-1, "clip_fraction") in values and clip is not None:
            self._emit_clip(trainer, pending[-1] if pending else None, clip, values)

    def _emit_step(self, trainer: pl.Trainer, p: _Pending, v: dict[str, Tensor]) -> None:
        metrics: dict[str, float] = {f"grad_norm/total{p.suffix}": float(v["grad_total"][0])}
        for name, x in zip(p.grad_labels, v["grad_layers"].tolist(), strict=True):
            metrics[f"grad_norm/{name}"] = x
        if "weight_layers" in v and self.log_weight_norms:
            metrics[f"weight_norm/total{p.suffix}"] = float(v["weight_total"][0])
            for name, x in zip(p.weight_labels, v["weight_layers"].tolist(), strict=True):
                metrics[f"weight_norm/{name}"] = x
        if "update_layers" in v:
            w_total = float(v["weight_total"][0])
            metrics[f"update_ratio/total{p.suffix}"] = float(v["update_total"][0]) / max(w_total, 1e-30)
            for name, upd, w in zip(
                p.weight_labels, v["update_layers"].tolist(), v["weight_layers"].tolist(), strict=True
            ):
                metrics[f"update_ratio/{name}"] = upd / max(w, 1e-30)
        metrics.update(self._nonfinite_metrics(p, v["grad_params"]))
        self.last_logged = dict(metrics)
        _emit.log_scalars(trainer, metrics, p.step)
        for kind, (names, _) in p.histograms.items():
            stats, edges = v[f"hist:{kind}:stats"], v[f"hist:{kind}:edges"]
            counts, nonfinite = v[f"hist:{kind}:counts"], v[f"hist:{kind}:nonfinite"]
            for j, name in enumerate(names):
                _emit.log_histogram_raw(trainer, f"{kind}/{name}", stats[j], edges[j], counts[j], p.step)
            del nonfinite  # the same counts are logged as grad_nonfinite/* scalars

    def _nonfinite_metrics(self, p: _Pending, grad_params: Tensor) -> dict[str, float]:
        """``grad_nonfinite/*``: zero unless some norm came out non-finite; only then count entries."""
        bad = [i for i, x in enumerate(grad_params.tolist()) if not math.isfinite(x)]
        out = {f"grad_nonfinite/total{p.suffix}": 0.0}
        if not bad:
            return out
        counts = nonfinite_counts([p.stats.grads[i] for i in bad]).cpu().tolist()
        out[f"grad_nonfinite/total{p.suffix}"] = float(sum(counts))
        labels, index = p.stats.groups(p.stats.grad_names, self.group_depth, self.per_parameter)
        per_layer: dict[str, float] = {}
        for i, c in zip(bad, counts, strict=True):
            per_layer[labels[index[i]]] = per_layer.get(labels[index[i]], 0.0) + float(c)
        out.update({f"grad_nonfinite/{name}": c for name, c in per_layer.items()})
        return out

    def _emit_clip(
        self,
        trainer: pl.Trainer,
        last: _Pending | None,
        clip: tuple[float, float],
        values: dict[tuple[int, str], Tensor],
    ) -> None:
        """Clipping statistics over the window and their alerts; ``last`` is ``None`` with logging off."""
        window = values[(-1, "clip_window")]
        finite = window[torch.isfinite(window)].double()
        if finite.numel() == 0:
            return
        fraction = float(values[(-1, "clip_fraction")][0])
        qs = torch.quantile(finite, torch.tensor([q / 100 for q in _PERCENTILES], dtype=torch.float64))
        suggested = suggest_clip_value(finite)  # None when every norm in the window was 0
        metrics = {"grad_clip/fraction_clipped": fraction}
        for q, x in zip(_PERCENTILES, qs.tolist(), strict=True):
            metrics[f"grad_clip/pre_clip_norm_p{int(q)}"] = x
        if suggested is not None:
            metrics["grad_clip/suggested_clip_val"] = suggested
        self.last_logged.update(metrics)
        if last is not None:
            _emit.log_scalars(trainer, metrics, last.step)
        step = last.stats.step if last is not None else self._clip_check_step
        n = int(finite.numel())
        largest = float(finite.max())
        what = "norm" if clip[1] == 2.0 else "largest |g|"
        by = "" if clip[1] == 2.0 else " (clipping by value)"
        data = {"fraction_clipped": fraction, "clip_val": clip[0], "steps": float(n), **metrics}
        if n >= min(100, self.clip_window) and fraction >= 0.95 and suggested is not None:
            self.report(
                trainer,
                "clipping_always_active",
                "warning",
                None,
                f"gradient_clip_val={clip[0]:g}{by} clipped {fraction:.0%} of the last {n} steps "
                f"(median pre-clip {what} {_fmt(metrics['grad_clip/pre_clip_norm_p50'])}).",
                f"The threshold is below the typical gradient {what}, which slows learning. Clip only the "
                f"outliers: try gradient_clip_val={_fmt(suggested, 'g')} (90th percentile of recent values).",
                data,
                step=step,
            )
        elif n >= self.clip_window and fraction == 0.0 and largest < clip[0] / 10:
            if suggested is None:
                hint = (
                    f"Every pre-clip {what} of the window was exactly 0: no parameter of this optimizer got "
                    "a gradient, so nothing learns. Check that the loss depends on the parameters (a "
                    "`.detach()`, `torch.no_grad()`, a zero loss weight); OverfitBatchSanity names them."
                )
            else:
                hint = (
                    "Clipping guards nothing at this level. To catch spikes, use about "
                    f"{_fmt(suggested, 'g')}."
                )
            self.report(
                trainer,
                "clipping_never_active",
                "info",
                None,
                f"gradient_clip_val={clip[0]:g}{by} never fired in {n} steps; the largest pre-clip {what} "
                f"was {_fmt(largest)}.",
                hint,
                data,
                step=step,
            )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._clip_norms is not None:
            state["clip_norms"] = self._clip_norms.detach().cpu()
        state["clip_seen"] = self._clip_seen
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        norms = state_dict.get("clip_norms")
        if norms is not None and norms.numel() == self.clip_window:
            self._clip_norms = norms.clone()
        self._clip_seen = int(state_dict.get("clip_seen", 0))
