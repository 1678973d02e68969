"""LRFinderPlus's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

LR_FINDER = Family("lr_finder", "LRFinderPlus")
LR_FINDER_CURVE = Family("lr_finder", "LRFinderPlus", "image")

FAMILIES: tuple[Family, ...] = (
    LR_FINDER,
    LR_FINDER_CURVE,
)

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
    Chart(
        "LR finder: the search, loss each candidate reached (x: the candidate's index)",
        (LR_FINDER.tag("search_loss.*"),),
        "LRFinderPlus",
    ),
    Chart(
        "LR finder: the search, each candidate's LR and round (use the log y axis)",
        (LR_FINDER.tag("search_lr.*"), LR_FINDER.tag("search_round.*")),
        "LRFinderPlus",
    ),
)
