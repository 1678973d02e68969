"""The tags OverfitBatchSanity writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

PREFLIGHT = Family("preflight", "OverfitBatchSanity")

#: every tag family OverfitBatchSanity writes
FAMILIES: tuple[Family, ...] = (PREFLIGHT,)

#: its charts of the "GradGuard" custom-scalars layout
CHARTS: tuple[Chart, ...] = (
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
)
