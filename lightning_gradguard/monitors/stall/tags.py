"""The tags StallDetector writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

STALL = Family("stall", "StallDetector")

#: every tag family StallDetector writes
FAMILIES: tuple[Family, ...] = (STALL,)

#: its charts of the "GradGuard" custom-scalars layout
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
)
