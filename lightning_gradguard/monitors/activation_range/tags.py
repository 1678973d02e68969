"""ActivationRangeMonitor's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

ACTIVATION = Family("activation", "ActivationRangeMonitor")
ATTENTION = Family("attention", "ActivationRangeMonitor")

FAMILIES: tuple[Family, ...] = (
    ACTIVATION,
    ATTENTION,
)

CHARTS: tuple[Chart, ...] = (
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
)

#: a chart's ``only`` setting -> the argument that turns it on, in words (docs/tags.md's layout table)
SWITCHES: dict[str, str] = {"attention": "`attention=True`"}
