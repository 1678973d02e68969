"""The alert kinds NaNSentinel reports, declared once (their words: ``step``, ``report``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

NONFINITE_LOSS = Rule(
    kind="nonfinite_loss",
    severity="critical",
    monitor="NaNSentinel",
    summary="the loss was NaN/inf before backward (NaNSentinel)",
    when=(
        "the loss of a micro-batch was NaN/inf before backward. The run fails before the optimizer "
        "step (see [NaNSentinel](nan_sentinel.md))."
    ),
)

NONFINITE_GRADIENT = Rule(
    kind="nonfinite_gradient",
    severity="critical",
    monitor="NaNSentinel",
    summary="a gradient held NaN/inf before the optimizer step (NaNSentinel)",
    when=(
        "a gradient held NaN/inf before the optimizer step while the loss was finite "
        "(and no GradScaler was active)."
    ),
)

NONFINITE_PARAMETER = Rule(
    kind="nonfinite_parameter",
    severity="critical",
    monitor="NaNSentinel",
    summary="a parameter held NaN/inf after an optimizer step (NaNSentinel)",
    when="with `check_parameters_every_n_steps`, a weight held NaN/inf after the update.",
)

LOSS_SCALE_COLLAPSE = Rule(
    kind="loss_scale_collapse",
    severity="error",
    monitor="NaNSentinel",
    summary="the 16-mixed GradScaler scale fell below its floor or kept skipping",
    when=(
        "16-mixed: the GradScaler scale fell below `loss_scale_floor` or `max_consecutive_skips` "
        "steps in a row were skipped."
    ),
)

#: every kind this monitor reports
RULES = declare(NONFINITE_LOSS, NONFINITE_GRADIENT, NONFINITE_PARAMETER, LOSS_SCALE_COLLAPSE)
