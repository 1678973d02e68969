"""The tags LRFinderPlus writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

LR_FINDER = Family("lr_finder", "LRFinderPlus")
LR_FINDER_CURVE = Family("lr_finder", "LRFinderPlus", "image")

#: every tag family LRFinderPlus writes
FAMILIES: tuple[Family, ...] = (
    LR_FINDER,
    LR_FINDER_CURVE,
)

#: its charts of the "GradGuard" custom-scalars layout
CHARTS: tuple[Chart, ...] = (
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
)
