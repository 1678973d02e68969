"""The rule GradientCheck reports, declared once: its kind, its docs row, its hint and its check.

The check, :func:`mismatch_findings`, sits above the declaration (the callback runs it from :data:`RULES`
on the check's result): one ``gradient_mismatch`` error per parameter that failed, in the words of
:mod:`~lightning_gradguard.monitors.gradcheck.findings` (the
parameter and its two gradient values, a known pattern added to the hint).
"""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare
from lightning_gradguard.core.preflight import PreflightFinding
from lightning_gradguard.monitors.gradcheck.engine import GradientCheckResult
from lightning_gradguard.monitors.gradcheck.findings import describe, pattern


# ------------------------------------------------------------------ gradient_mismatch
def mismatch_findings(result: GradientCheckResult) -> list[PreflightFinding]:
    """One ``gradient_mismatch`` error per parameter whose gradient failed the gradient check."""
    return [
        PreflightFinding(
            GRADIENT_MISMATCH,
            "Autograd and finite differences disagree: " + describe(check) + ".",
            {
                "relative_error": check.max_rel_error,
                "analytic": check.analytic,
                "numeric": check.numeric,
                "taylor_order": check.taylor_order,
                "taylor_linear_error": check.taylor_linear_error,
                "directional_error": check.directional_error,
            },
            hint=GRADIENT_MISMATCH.hint + pattern(check),
            names=[check.name],
        )
        for check in result.failures
    ]


GRADIENT_MISMATCH: Rule[GradientCheckResult] = Rule(
    kind="gradient_mismatch",
    severity="error",
    monitor="GradientCheck",
    summary="GradientCheck: autograd and finite differences disagree for a parameter",
    when=(
        "autograd and finite differences (and the Taylor test) disagree for a named parameter; the "
        "message gives the relative error and both values."
    ),
    hint=(
        "The backward pass of this parameter disagrees with the loss it differentiates. In a custom "
        "autograd.Function check: a missing factor (chain rule, a constant, the 1/N of a mean), a missing "
        "transpose (grad_input = grad_output @ W, grad_W = grad_output.T @ x), the wrong saved tensor, a "
        "missing sum over a broadcast dimension, or a sign. A backward hook must return a gradient of the "
        "same meaning, not a rescaled one."
    ),
    check=mismatch_findings,
)

#: every kind this monitor reports
RULES: tuple[Rule[GradientCheckResult], ...] = declare(GRADIENT_MISMATCH)
