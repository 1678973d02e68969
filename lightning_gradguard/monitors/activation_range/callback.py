r"""
ActivationRangeMonitor
======================

Per block of the model: the range of its outputs (max \|x\|, RMS, kurtosis, fp16 headroom); per attention
module the largest attention logit and the attention entropy; on sampled training steps only; nothing is
attached on the other steps or during validation. The measuring is
:mod:`lightning_gradguard.monitors.activation_range.measure`, the math
:mod:`lightning_gradguard.functional.activation_range`, the rules (their declarations and checks)
:mod:`lightning_gradguard.monitors.activation_range.rules`; when to sample, what to log and which rules a
sampled step is judged on are here.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS
from lightning_gradguard.core.cadence import logging_interval, on_logging_step
from lightning_gradguard.core.layers import LayerSelection, cap_scalars
from lightning_gradguard.core.runstate import RunField
from lightning_gradguard.core.sampling import SamplingMonitor, ScopedHooks
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.activation_range import AttentionEntropy, BlockRange
from lightning_gradguard.monitors.activation_range.measure import (
    CaptureReading,
    RangeCapture,
    find_blocks,
    read_capture,
)
from lightning_gradguard.monitors.activation_range.rules import RULES, EntropyStart, Sampled
from lightning_gradguard.monitors.activation_range.tags import ACTIVATION, ATTENTION, CHARTS

#: with periodic logging off (``Trainer(log_every_n_steps=0)``) the alerts are still checked this often
_DETECT_EVERY = 50
#: ``trainer.precision`` values whose activations are float16
FP16_PRECISIONS = frozenset({"16-mixed", "16-true", "16"})
_STATS = ("max_abs", "rms", "kurtosis", "fp16_headroom")


def _entropy_starts_saved(_: Any, starts: dict[str, EntropyStart]) -> dict[str, dict[str, float]]:
    return {k: {"step": s.step, "entropy": s.entropy, "ratio": s.ratio} for k, s in starts.items()}


def _entropy_starts_loaded(_: Any, saved: dict[str, dict[str, float]]) -> dict[str, EntropyStart]:
    return {
        k: EntropyStart(step=int(v["step"]), entropy=float(v["entropy"]), ratio=float(v["ratio"]))
        for k, v in saved.items()
    }


class ActivationRangeMonitor(SamplingMonitor):
    r"""Watch the range of every block's output, the largest attention logit and the attention entropy, on
    sampled steps.

    On a sampled training step it measures, inside that step's ``training_step`` call only (global forward
    hooks and a ``TorchFunctionMode``, removed when the call returns; a compiled model runs eagerly there):

    * per block (a top-level child of the model, and each layer of an outermost ``nn.ModuleList`` /
      ``nn.Sequential``: see :func:`~lightning_gradguard.monitors.activation_range.measure.find_blocks`),
      over every entry of its output (the first floating-point tensor): ``activation/max_abs/<block>``,
      ``activation/rms/<block>``, ``activation/kurtosis/<block>`` (Pearson, :math:`E[(x-\mu)^4]/\sigma^4`:
      3 for a Gaussian) and ``activation/fp16_headroom/<block>``, :math:`\log_2(65504 / \max|x|)` in bits
      (0: float16 overflows), with ``activation/fp16_headroom/min`` over the blocks;
    * per module whose ``forward`` calls ``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``'s
      ``F.multi_head_attention_forward``: ``attention/max_logit/<module>``, the largest :math:`q \cdot k /
      \sqrt{d}` (plus an additive mask, masked positions left out), recomputed from that call's inputs, and
      ``attention/max_logit/total``; the entropy of its softmax in nats, averaged over the query rows that
      see two keys or more: ``attention/entropy/<module>`` (the mean over its heads) and
      ``attention/entropy_min_head/<module>`` (its lowest head). Uniform attention over ``n`` keys has
      :math:`\ln n`, one-hot attention 0.

    Reductions stay on the device; a sampled step costs one transfer (under DDP one collective first:
    every rank's numbers are pooled exactly, max for the maxima, moments for RMS and kurtosis, so every
    rank reaches the same verdict). Micro-batches of an accumulated step are pooled into one sample.

    Alerts (warnings): ``fp16_headroom_low`` when, under ``16-mixed`` / ``16-true``, a block's headroom
    drops below ``min_headroom_bits`` (bf16 and float32 runs log the headroom, never alert);
    ``attention_logit_growth`` when the largest logit passes ``max_attention_logit``, or is above
    ``max_attention_logit / logit_growth_factor`` and ``logit_growth_factor`` times the smallest of the
    last ``growth_window`` sampled steps; ``attention_entropy_collapse`` when a module's entropy (the mean
    over its heads) is below ``min_attention_entropy`` times :math:`\ln n` (the entropy of uniform attention
    over the keys each query sees) and its largest logit is at least 25 (a one-hot made by the logits'
    scale), named as an initialization fault at step 0 and as a collapse later.
    Near-uniform attention is logged, never judged: it is how attention starts.

    Args:
        sample_every_n_steps: sample every this many steps (Lightning's rule plus step 0); ``None``: the
            Trainer's ``log_every_n_steps``, so the points share the loss's x (with that at 0, nothing is
            logged and the alerts are checked every 50 steps).
        attention: measure attention logits.
        min_headroom_bits: the ``fp16_headroom_low`` threshold (2 bits: within 4x of overflow).
        max_attention_logit: the ``attention_logit_growth`` ceiling.
        logit_growth_factor: the growth rule's factor (``None``: the ceiling alone).
        growth_window: sampled steps the growth rule looks back over.
        min_attention_entropy: the ``attention_entropy_collapse`` threshold, as a fraction of the entropy of
            uniform attention (``None``: the entropy is logged, never judged).
        include: blocks and attention modules whose name matches one of these regular expressions are
            measured (``None``: all; see :class:`~lightning_gradguard.core.layers.LayerSelection`).
        exclude: blocks and attention modules whose name matches are not measured.
        max_layers: a cap on the curves per chart, the largest max abs first (``None``: no cap).
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import ActivationRangeMonitor

        Trainer(precision="16-mixed", callbacks=[monitor := ActivationRangeMonitor()]).fit(model)
        monitor.ranges["encoder.layers.3"].headroom_bits, monitor.max_logits
        monitor.entropies["encoder.layers.3.self_attn"].entropy   # nats
    """

    charts = CHARTS
    chart_switches = {"attention": "attention"}

    state_key_args = ("sample_every_n_steps",)

    #: the latest sampled step's numbers: per block, and the largest attention logit and the attention
    #: entropy per module
    ranges: RunField[dict[str, BlockRange]] = RunField(dict, key=None)
    max_logits: RunField[dict[str, float]] = RunField(dict, key=None)
    entropies: RunField[dict[str, AttentionEntropy]] = RunField(dict, key=None)
    sampled_steps: RunField[int] = RunField(int)
    #: the largest logit of recent sampled steps
    _history: RunField[list[float]] = RunField(
        list, key="logit_history", load=lambda _, s: [float(v) for v in s]
    )
    #: each attention module's first sampled entropy
    _entropy_starts: RunField[dict[str, EntropyStart]] = RunField(
        dict, save=_entropy_starts_saved, load=_entropy_starts_loaded
    )

    def __init__(
        self,
        *,
        sample_every_n_steps: int | None = None,
        attention: bool = True,
        min_headroom_bits: float = 2.0,
        max_attention_logit: float = 100.0,
        logit_growth_factor: float | None = 4.0,
        growth_window: int = 10,
        min_attention_entropy: float | None = 0.2,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
        max_layers: int | None = None,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action="warn", cooldown_steps=cooldown_steps)
        self.sample_every_n_steps: int | None = check_int(
            "sample_every_n_steps", sample_every_n_steps, 1, allow_none=True
        )
        self.attention = check_bool("attention", attention)
        self.min_headroom_bits: float = check_float("min_headroom_bits", min_headroom_bits, 0.0, 16.0)
        self.max_attention_logit: float = check_float(
            "max_attention_logit", max_attention_logit, 0.0, low_open=True
        )
        self.logit_growth_factor: float | None = check_float(
            "logit_growth_factor", logit_growth_factor, 1.0, low_open=True, allow_none=True
        )
        self.growth_window: int = check_int("growth_window", growth_window, 1)
        self.min_attention_entropy: float | None = check_float(
            "min_attention_entropy", min_attention_entropy, 0.0, 1.0, low_open=True, allow_none=True
        )
        self.layers = LayerSelection(include, exclude, max_layers)
        self._blocks: dict[str, nn.Module] | None = None
        self._every = _DETECT_EVERY  # sample every this many steps (set at fit start)

    def _cadence(self, trainer: pl.Trainer) -> tuple[int, bool]:
        """(sample every, whether the samples are logged)."""
        if self.sample_every_n_steps is not None:
            return self.sample_every_n_steps, True
        every = logging_interval(trainer)
        return (every, True) if every > 0 else (_DETECT_EVERY, False)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._blocks = None
        self._every = self._cadence(trainer)[0]  # the Trainer's logging interval is fixed for the fit

    # ------------------------------------------------------------------ the sampled step
    @override
    def sample_due(self, trainer: pl.Trainer, at: int) -> bool:
        return on_logging_step(at, self._every)  # Lightning's logging rule, plus step 0

    @override
    def new_capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RangeCapture:
        if self._blocks is None:
            self._blocks = {n: m for n, m in find_blocks(pl_module).items() if self.layers.watches(n)}
        watch = self.layers.watches if self.layers.filters else None
        return RangeCapture(pl_module, self._blocks, self.attention, watch)

    @override
    def end_sample(self, trainer: pl.Trainer, capture: ScopedHooks, sampled_at: tuple[int, int]) -> None:
        """One transfer (under DDP one signature check and one all-reduce first, on every rank alike)."""
        assert isinstance(capture, RangeCapture)
        if capture.error is not None:
            warn_once(
                trainer,
                "activation_range_error",
                f"ActivationRangeMonitor could not measure an output ({type(capture.error).__name__}: "
                f"{capture.error}); the sampled steps where that happens are skipped.",
            )
        reading = read_capture(trainer, capture, self.progress.take(trainer))  # on every rank alike
        if reading is None:
            warn_once(
                trainer,
                "activation_range_ranks_differ",
                "ActivationRangeMonitor: ranks saw different blocks or attention calls on a sampled step; "
                "that step is skipped on every rank.",
            )
        elif reading.ranges or reading.max_logits:
            self._judge(trainer, sampled_at, reading)

    def _judge(self, trainer: pl.Trainer, at: tuple[int, int], reading: CaptureReading) -> None:
        step, x = at
        ranges, peaks, entropies = reading.ranges, reading.max_logits, reading.entropies
        self.progress.note(reading.loss)
        # attention that sharpens in a run that learns is what it learned (a copy task's one-hot
        # cross-attention), not a collapse: the attention rules judge a run that is not learning, and
        # step 0, where a one-hot attention can only come from the initialization
        attention = step == 0 or not self.progress.learning()
        self.sampled_steps += 1
        self.ranges, self.max_logits, self.entropies = ranges, peaks, entropies
        if self._cadence(trainer)[1]:
            _emit.log_scalars(trainer, self._scalars(reading), x)
        # a module that normalizes its queries and keys holds its logits to its norms' gains (QK-norm is the
        # remedy the logit rule names): its logits are logged, not judged (Gemma 4's unscaled ones reach 290)
        grown = {k: v for k, v in peaks.items() if k not in reading.qk_normed}
        evidence = Sampled(
            step=step,
            precision=str(trainer.precision),
            fp16=str(trainer.precision) in FP16_PRECISIONS,  # bf16 and float32 have float32's range
            ranges=ranges,
            min_bits=self.min_headroom_bits,
            attention=attention,
            grown=grown,
            history=self._history,
            max_logit=self.max_attention_logit,
            growth_factor=self.logit_growth_factor,
            entropies=entropies,
            peaks=peaks,
            min_entropy=self.min_attention_entropy,
            starts=self._entropy_starts,
            qk_normed=reading.qk_normed,
        )
        self.run_rules(trainer, RULES, evidence, step=step, cooldown=lambda f: f.kind)  # one per kind
        if grown:
            self._history = [*self._history, max(grown.values(), key=_order)][-self.growth_window :]
        for name, e in entropies.items():
            self._entropy_starts.setdefault(name, EntropyStart(step=step, entropy=e.entropy, ratio=e.ratio))

    def _scalars(self, reading: CaptureReading) -> dict[str, float]:
        ranges, peaks = reading.ranges, reading.max_logits
        out: dict[str, float] = {}
        names = list(ranges)
        shown = set(names)
        if self.layers.max_layers is not None and names:
            shown = self.layers.show(names, [_order(ranges[n].max_abs) for n in names])
        for stat in _STATS:
            values = {n: r.scalars()[stat] for n, r in ranges.items()}
            out.update({ACTIVATION.tag(stat, n): v for n, v in values.items() if n in shown})
            out.update(self.layers.aggregates(ACTIVATION.tag(stat), values))
        if ranges:
            out[ACTIVATION.tag("fp16_headroom", "min")] = min(r.headroom_bits for r in ranges.values())
        if peaks:
            out.update(
                cap_scalars(
                    self.layers,
                    {ATTENTION.tag("max_logit", k): v for k, v in peaks.items()},
                    ATTENTION.tag("max_logit"),
                )
            )
            out[ATTENTION.tag("max_logit", "total")] = max(peaks.values(), key=_order)
        out.update(self._entropy_scalars(reading.entropies))
        return out

    def _entropy_scalars(self, entropies: dict[str, AttentionEntropy]) -> dict[str, float]:
        """``attention/entropy/<module>`` and ``attention/entropy_min_head/<module>``; under a cap the modules
        with the lowest entropy (as a fraction of uniform) are shown."""
        names = list(entropies)
        shown = set(names)
        if self.layers.max_layers is not None and names:
            shown = self.layers.show(names, [_order(-entropies[n].ratio) for n in names])
        out: dict[str, float] = {}
        for stat in ("entropy", "entropy_min_head"):
            values = {n: e.scalars()[stat] for n, e in entropies.items()}
            out.update({ATTENTION.tag(stat, n): v for n, v in values.items() if n in shown})
            out.update(self.layers.aggregates(ATTENTION.tag(stat), values))
        return out


def _order(value: float) -> float:
    """A sort key where NaN comes first among maxima (and last among headrooms): NaN as +inf."""
    return math.inf if math.isnan(value) else value
