"""The alert kinds DeadReLUMonitor reports, declared once (their words: ``windows``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

DEAD_RELU = Rule(
    kind="dead_relu",
    severity="error",
    monitor="DeadReLUMonitor",
    summary="most units of a ReLU layer output 0 for every sample over a window of sampled batches",
    when=(
        "more than `threshold` (0.5) of a ReLU layer's units gave 0 for every sample of the last "
        "`window` (4) sampled optimizer steps, on `patience` (2) consecutive full-window checks, "
        "while the run is not learning (the median of its last three sampled losses above half its "
        "start): units that stopped firing in a run that learns cost it nothing it needed. Units "
        "dead from the start (the first verdict, step 4) are always named."
    ),
)

SATURATED_ACTIVATION = Rule(
    kind="saturated_activation",
    severity="warning",
    monitor="DeadReLUMonitor",
    summary="most units of a sigmoid/tanh layer sit where the derivative is numerically 0",
    when=(
        "more than `saturation_threshold` (0.5) of the units of a sigmoid/tanh layer sit in the "
        "flat zone (with `check_saturation=True`, the default)."
    ),
)

#: every kind this monitor reports
RULES = declare(DEAD_RELU, SATURATED_ACTIVATION)
