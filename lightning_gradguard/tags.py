"""Every tag lightning_gradguard writes, in one registry: the tag families and the "GradGuard" charts.

A :class:`Family` is the first part of a tag (``grad_norm`` in ``grad_norm/net.0``) with the callback that
writes it and what kind of record it is; the emitters build their tags from it (:meth:`Family.tag`). A
:class:`Chart` is one chart of the custom-scalars layout: each callback's
:meth:`~lightning_gradguard.core.base.GradGuardCallback.layout_charts` is :func:`charts_of` its own,
``gradguard report`` tells which monitors a run had by their families (:func:`families_of`), and the docs
test holds docs/tags.md to both tables. Nothing here imports the rest of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: the tag part of the aggregates over all watched layers under a cap: ``grad_norm/across_layers/median``
ACROSS_LAYERS = "across_layers"
#: the text tag every alert is written to (TensorBoard's Text tab)
ALERT_TEXT = "gradguard/alerts"
#: a per-layer chart's regex tail: every tag of the family but the totals and the aggregates
_PER_LAYER = rf"(?!total(_opt\d+)?$|{ACROSS_LAYERS}/).*"


@dataclass(frozen=True)
class Family:
    """A tag family: ``<name>/...`` tags written by ``owner`` as ``kind`` records."""

    name: str
    owner: str
    kind: Literal["scalar", "histogram", "image", "text"] = "scalar"

    @property
    def prefix(self) -> str:
        return f"{self.name}/"

    def tag(self, *parts: str) -> str:
        """``<name>/<part>/<part>...``."""
        return "/".join((self.name, *parts))


GRAD_NORM = Family("grad_norm", "GradientNormLogger")
WEIGHT_NORM = Family("weight_norm", "GradientNormLogger")
UPDATE_RATIO = Family("update_ratio", "GradientNormLogger")
GRAD_NONFINITE = Family("grad_nonfinite", "GradientNormLogger")
GRAD_CLIP = Family("grad_clip", "GradientNormLogger")
NOISE_SCALE = Family("noise_scale", "GradientNormLogger")
GRAD_HISTOGRAM = Family("grad", "GradientNormLogger", "histogram")
GRAD_LOG10_HISTOGRAM = Family("grad_log10", "GradientNormLogger", "histogram")
WEIGHT_HISTOGRAM = Family("weight", "GradientNormLogger", "histogram")
GRAD_FLOW = Family("grad_flow", "VanishingExplodingDetector")
DEAD_RELU = Family("dead_relu", "DeadReLUMonitor")
SATURATED = Family("saturated", "DeadReLUMonitor")
ACTIVATION_RATE = Family("activation_rate", "DeadReLUMonitor", "histogram")
ACTIVATION = Family("activation", "ActivationRangeMonitor")
ATTENTION = Family("attention", "ActivationRangeMonitor")
OPTIMIZER = Family("optimizer", "OptimizerMonitor")
SPIKE = Family("spike", "LossSpikeGuard")
STALL = Family("stall", "StallDetector")
LR_FINDER = Family("lr_finder", "LRFinderPlus")
LR_FINDER_CURVE = Family("lr_finder", "LRFinderPlus", "image")
PREFLIGHT = Family("preflight", "OverfitBatchSanity")
ALERTS = Family("alerts", "GradGuardCallback")

FAMILIES: tuple[Family, ...] = (
    GRAD_NORM,
    WEIGHT_NORM,
    UPDATE_RATIO,
    GRAD_NONFINITE,
    GRAD_CLIP,
    NOISE_SCALE,
    GRAD_HISTOGRAM,
    GRAD_LOG10_HISTOGRAM,
    WEIGHT_HISTOGRAM,
    GRAD_FLOW,
    DEAD_RELU,
    SATURATED,
    ACTIVATION_RATE,
    ACTIVATION,
    ATTENTION,
    OPTIMIZER,
    SPIKE,
    STALL,
    LR_FINDER,
    LR_FINDER_CURVE,
    PREFLIGHT,
    ALERTS,
)
#: the scalar families, as tag prefixes (``"grad_norm/"``, ...)
SCALAR_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(f.prefix for f in FAMILIES if f.kind == "scalar"))


@dataclass(frozen=True)
class Chart:
    """One chart of the "GradGuard" layout: its title, the tag regexes it draws, who draws it and when.

    ``only`` names the callback setting the chart depends on (``"capped"``: ``max_layers`` is set;
    ``"saturation"``, ``"attention"``, ``"noise_scale"``: that option is on); ``None``: always.
    """

    title: str
    regexes: tuple[str, ...]
    owner: str
    only: str | None = None


_OPTIMIZER_CHARTS: tuple[Chart, ...] = (
    Chart(
        "Optimizer step size across all layers: min / median / max",
        (OPTIMIZER.tag("step_size", ACROSS_LAYERS, ".*"),),
        "OptimizerMonitor",
        "capped",
    ),
    Chart(
        "Optimizer cos(update, -gradient) across all layers: min / median / max",
        (OPTIMIZER.tag("update_cosine", ACROSS_LAYERS, ".*"),),
        "OptimizerMonitor",
        "capped",
    ),
    Chart(
        "Optimizer step size (update norm / lr): total",
        (OPTIMIZER.tag("step_size", "total.*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "Optimizer step size (update norm / lr) per layer",
        (OPTIMIZER.tag("step_size", _PER_LAYER),),
        "OptimizerMonitor",
    ),
    Chart(
        "cos(update, -gradient) per layer and total (1 = plain SGD)",
        (OPTIMIZER.tag("update_cosine", ".*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "Optimizer moments: total exp_avg and momentum_buffer norms",
        (OPTIMIZER.tag("exp_avg_norm", "total.*"), OPTIMIZER.tag("momentum_norm", "total.*")),
        "OptimizerMonitor",
    ),
    Chart("Adam exp_avg norm per layer", (OPTIMIZER.tag("exp_avg_norm", _PER_LAYER),), "OptimizerMonitor"),
    Chart(
        "Adam RMS of sqrt(v_hat) per layer, to compare with eps (use the log y axis)",
        (OPTIMIZER.tag("exp_avg_sq_rms", ".*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "SGD momentum_buffer norm per layer",
        (OPTIMIZER.tag("momentum_norm", _PER_LAYER),),
        "OptimizerMonitor",
    ),
    Chart(
        "Skipped optimizer updates by cause (cumulative)",
        (OPTIMIZER.tag("skipped_updates", ".*"),),
        "OptimizerMonitor",
    ),
)


_GRADIENT_CHARTS: tuple[Chart, ...] = (
    Chart(
        "Gradient norm across all layers: min / median / max",
        (GRAD_NORM.tag(ACROSS_LAYERS, ".*"),),
        "GradientNormLogger",
        "capped",
    ),
    Chart(
        "Update / weight ratio across all layers: min / median / max",
        (UPDATE_RATIO.tag(ACROSS_LAYERS, ".*"),),
        "GradientNormLogger",
        "capped",
    ),
    Chart("Gradient norm: total", (GRAD_NORM.tag("total.*"),), "GradientNormLogger"),
    Chart("Gradient norm per layer", (GRAD_NORM.tag(_PER_LAYER),), "GradientNormLogger"),
    Chart("Weight norm per layer", (WEIGHT_NORM.tag(_PER_LAYER),), "GradientNormLogger"),
    Chart(
        "Update / weight ratio per layer (healthy ~1e-3: use the log y axis)",
        (UPDATE_RATIO.tag(_PER_LAYER),),
        "GradientNormLogger",
    ),
    Chart(
        "Gradient clipping: fraction of steps clipped",
        (GRAD_CLIP.tag("fraction_clipped"),),
        "GradientNormLogger",
    ),
    Chart(
        "Gradient clipping: pre-clip norm p50/p90/p99 and suggested clip value",
        (GRAD_CLIP.tag("pre_clip_norm_.*"), GRAD_CLIP.tag("suggested_clip_val")),
        "GradientNormLogger",
    ),
    Chart("Non-finite gradient entries", (GRAD_NONFINITE.tag(".*"),), "GradientNormLogger"),
    Chart(
        "Critical batch size (B_simple) vs the batch in use",
        (NOISE_SCALE.tag("b_simple"), NOISE_SCALE.tag("batch_size")),
        "GradientNormLogger",
        "noise_scale",
    ),
    Chart(
        "Gradient noise scale terms: smoothed norm(G)^2 and tr(Sigma) (use the log y axis)",
        (NOISE_SCALE.tag("grad_sq"), NOISE_SCALE.tag("trace_sigma")),
        "GradientNormLogger",
        "noise_scale",
    ),
)


_OTHER_CHARTS: tuple[Chart, ...] = (
    Chart(
        "Gradient flow: log10(layer norm / largest layer norm)",
        (GRAD_FLOW.tag(".*"),),
        "VanishingExplodingDetector",
    ),
    Chart("Dead ReLU fraction per layer", (DEAD_RELU.tag(".*"),), "DeadReLUMonitor"),
    Chart("Saturated sigmoid/tanh units per layer", (SATURATED.tag(".*"),), "DeadReLUMonitor", "saturation"),
    Chart(
        "Activations: max abs per block (use the log y axis)",
        (ACTIVATION.tag("max_abs", ".*"),),
        "ActivationRangeMonitor",
    ),
    Chart("Activations: RMS per block", (ACTIVATION.tag("rms", ".*"),), "ActivationRangeMonitor"),
    Chart(
        "Activations: kurtosis per block (Gaussian = 3)",
        (ACTIVATION.tag("kurtosis", ".*"),),
        "ActivationRangeMonitor",
    ),
    Chart(
        "Activations: fp16 headroom per block in bits (0 = overflow)",
        (ACTIVATION.tag("fp16_headroom", ".*"),),
        "ActivationRangeMonitor",
    ),
    Chart(
        "Attention: largest logit per attention module",
        (ATTENTION.tag("max_logit", ".*"),),
        "ActivationRangeMonitor",
        "attention",
    ),
    Chart(
        "Attention: entropy per attention module in nats (ln of the keys = uniform, 0 = one-hot)",
        (ATTENTION.tag("entropy", ".*"),),
        "ActivationRangeMonitor",
        "attention",
    ),
    Chart(
        "Loss spikes: robust z-score of the loss and the gradient norm",
        (SPIKE.tag(".*zscore"),),
        "LossSpikeGuard",
    ),
    Chart(
        "Loss spikes: skipped steps and rollbacks",
        (SPIKE.tag("skipped_steps"), SPIKE.tag("rollbacks")),
        "LossSpikeGuard",
    ),
    Chart(
        "Stalled learning: training loss vs the chance level",
        (STALL.tag("loss"), STALL.tag("chance_level")),
        "StallDetector",
    ),
    Chart(
        "Stalled learning: median update/weight ratio and clip ratio (use the log y axis)",
        (STALL.tag("update_ratio_median"), STALL.tag("clip_ratio")),
        "StallDetector",
    ),
    Chart(
        "LR finder: loss per sweep step",
        (LR_FINDER.tag("loss.*"), LR_FINDER.tag("smoothed_loss.*")),
        "LRFinderPlus",
    ),
    Chart(
        "LR finder: learning rate per sweep step (use the log y axis)",
        (LR_FINDER.tag("lr.*"),),
        "LRFinderPlus",
    ),
    Chart(
        "Pre-flight: overfit-one-batch loss (x = check step)",
        (PREFLIGHT.tag("overfit_loss"),),
        "OverfitBatchSanity",
    ),
    Chart(
        "Pre-flight: overfit-one-batch gradient norm (x = check step)",
        (PREFLIGHT.tag("overfit_grad_norm"),),
        "OverfitBatchSanity",
    ),
    Chart("Alerts (cumulative count per kind)", (ALERTS.tag(".*"),), "GradGuardCallback"),
)


CHARTS: tuple[Chart, ...] = (*_GRADIENT_CHARTS, *_OPTIMIZER_CHARTS, *_OTHER_CHARTS)


def charts_of(owner: str, **settings: bool) -> dict[str, list[str]]:
    """``owner``'s charts, title -> regexes, those whose ``only`` setting is on in ``settings``."""
    return {
        c.title: list(c.regexes)
        for c in CHARTS
        if c.owner == owner and (c.only is None or settings.get(c.only, False))
    }


def families_of(owner: str, kind: str = "scalar") -> tuple[Family, ...]:
    """The families ``owner`` writes (of one ``kind``)."""
    return tuple(f for f in FAMILIES if f.owner == owner and f.kind == kind)
