"""LossSpikeGuard's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

SPIKE = Family("spike", "LossSpikeGuard")

FAMILIES: tuple[Family, ...] = (SPIKE,)

CHARTS: tuple[Chart, ...] = (
    Chart(
        "Loss spikes: robust z-score of the loss and the gradient norm",
        (SPIKE.tag(".*zscore"),),
        "LossSpikeGuard",
    ),
    Chart(
        "Loss spikes: skipped steps and rollbacks",
        (SPIKE.tag("skipped_steps"), SPIKE.tag("rollbacks")),
        "LossSpikeGuard",
    ),
)
