"""The alert kind GradientCheck reports, declared once (its words: ``gradcheck_report``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

GRADIENT_MISMATCH = Rule(
    kind="gradient_mismatch",
    severity="error",
    monitor="GradientCheck",
    summary="GradientCheck: autograd and finite differences disagree for a parameter",
    when=(
        "autograd and finite differences (and the Taylor test) disagree for a named parameter; the "
        "message gives the relative error and both values."
    ),
)

#: every kind this monitor reports
RULES = declare(GRADIENT_MISMATCH)
