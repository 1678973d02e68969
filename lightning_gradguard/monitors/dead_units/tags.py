"""The tags DeadReLUMonitor writes, declared once: its tag families and its GradGuard charts.

Only declarations (no torch): the callback and its modules tag what they log from them, ``gradguard report``
and the docs test read them through :mod:`lightning_gradguard.registry`.
"""

from __future__ import annotations

from lightning_gradguard.tags import Chart, Family

DEAD_RELU = Family("dead_relu", "DeadReLUMonitor")
SATURATED = Family("saturated", "DeadReLUMonitor")
ACTIVATION_RATE = Family("activation_rate", "DeadReLUMonitor", "histogram")

#: every tag family DeadReLUMonitor writes
FAMILIES: tuple[Family, ...] = (
    DEAD_RELU,
    SATURATED,
    ACTIVATION_RATE,
)

#: its charts of the "GradGuard" custom-scalars layout
CHARTS: tuple[Chart, ...] = (
    Chart("Dead ReLU fraction per layer", (DEAD_RELU.tag(".*"),), "DeadReLUMonitor"),
    Chart("Saturated sigmoid/tanh units per layer", (SATURATED.tag(".*"),), "DeadReLUMonitor", "saturation"),
)
