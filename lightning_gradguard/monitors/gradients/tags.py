"""GradientNormLogger's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import ACROSS_LAYERS, PER_LAYER, Chart, Family

GRAD_NORM = Family("grad_norm", "GradientNormLogger")
WEIGHT_NORM = Family("weight_norm", "GradientNormLogger")
UPDATE_RATIO = Family("update_ratio", "GradientNormLogger")
GRAD_NONFINITE = Family("grad_nonfinite", "GradientNormLogger")
GRAD_CLIP = Family("grad_clip", "GradientNormLogger")
NOISE_SCALE = Family("noise_scale", "GradientNormLogger")
GRAD_HISTOGRAM = Family("grad", "GradientNormLogger", "histogram")
GRAD_LOG10_HISTOGRAM = Family("grad_log10", "GradientNormLogger", "histogram")
WEIGHT_HISTOGRAM = Family("weight", "GradientNormLogger", "histogram")

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
)

CHARTS: tuple[Chart, ...] = (
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
    Chart("Gradient norm per layer", (GRAD_NORM.tag(PER_LAYER),), "GradientNormLogger"),
    Chart("Weight norm per layer", (WEIGHT_NORM.tag(PER_LAYER),), "GradientNormLogger"),
    Chart(
        "Update / weight ratio per layer (healthy ~1e-3: use the log y axis)",
        (UPDATE_RATIO.tag(PER_LAYER),),
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

#: a chart's ``only`` setting -> the argument that turns it on, in words (docs/tags.md's layout table)
SWITCHES: dict[str, str] = {"capped": "`max_layers`", "noise_scale": "`log_noise_scale=True`"}
