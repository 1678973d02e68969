"""StallDetector's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

STALL = Family("stall", "StallDetector")

FAMILIES: tuple[Family, ...] = (STALL,)

CHARTS: tuple[Chart, ...] = (
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
        "Stalled learning: the outputs' lean toward the labels while the loss is at chance, and its p",
        (STALL.tag("label_lean"), STALL.tag("label_lean_p")),
        "StallDetector",
    ),
)
