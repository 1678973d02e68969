"""VanishingExplodingDetector's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

GRAD_FLOW = Family("grad_flow", "VanishingExplodingDetector")

FAMILIES: tuple[Family, ...] = (GRAD_FLOW,)

CHARTS: tuple[Chart, ...] = (
    Chart(
        "Gradient flow: log10(layer norm / largest layer norm)",
        (GRAD_FLOW.tag(".*"),),
        "VanishingExplodingDetector",
    ),
)
