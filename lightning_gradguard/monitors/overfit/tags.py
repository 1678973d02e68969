"""OverfitBatchSanity's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

PREFLIGHT = Family("preflight", "OverfitBatchSanity")

FAMILIES: tuple[Family, ...] = (PREFLIGHT,)

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
