"""DeadReLUMonitor's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

DEAD_RELU = Family("dead_relu", "DeadReLUMonitor")
SATURATED = Family("saturated", "DeadReLUMonitor")
ACTIVATION_RATE = Family("activation_rate", "DeadReLUMonitor", "histogram")

FAMILIES: tuple[Family, ...] = (
    DEAD_RELU,
    SATURATED,
    ACTIVATION_RATE,
)

CHARTS: tuple[Chart, ...] = (
    Chart("Dead ReLU fraction per layer", (DEAD_RELU.tag(".*"),), "DeadReLUMonitor"),
    Chart("Saturated sigmoid/tanh units per layer", (SATURATED.tag(".*"),), "DeadReLUMonitor", "saturation"),
)

#: a chart's ``only`` setting -> the argument that turns it on, in words (docs/tags.md's layout table)
SWITCHES: dict[str, str] = {"saturation": "`check_saturation=True`"}
