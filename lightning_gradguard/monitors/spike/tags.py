"""The tags LossSpikeGuard writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

SPIKE = Family("spike", "LossSpikeGuard")

#: every tag family LossSpikeGuard writes
FAMILIES: tuple[Family, ...] = (SPIKE,)

#: its charts of the "GradGuard" custom-scalars layout
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
