"""The tags VanishingExplodingDetector writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

GRAD_FLOW = Family("grad_flow", "VanishingExplodingDetector")

#: every tag family VanishingExplodingDetector writes
FAMILIES: tuple[Family, ...] = (GRAD_FLOW,)

#: its charts of the "GradGuard" custom-scalars layout
CHARTS: tuple[Chart, ...] = (
    Chart(
        "Gradient flow: log10(layer norm / largest layer norm)",
        (GRAD_FLOW.tag(".*"),),
        "VanishingExplodingDetector",
    ),
)
