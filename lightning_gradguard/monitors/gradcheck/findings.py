"""What a gradient check's result says, in words: a failing parameter, the known patterns, the passed line.

The words of the ``gradient_mismatch`` findings, which its rule's check
(:func:`~lightning_gradguard.monitors.gradcheck.rules.mismatch_findings`) puts together:
:func:`describe` (the parameter, its two gradient values and its Taylor order) and :func:`pattern` (a
straight-through estimator, a gradient-reversal layer, a constant factor: added to the rule's hint);
:func:`passed_line` is the INFO line of a check that passed.
"""

from __future__ import annotations

import math

from lightning_gradguard.monitors.gradcheck.engine import GradientCheckResult, ParameterCheck


def describe(check: ParameterCheck) -> str:
    """One line: the parameter, its largest relative error with the two values, the Taylor order and,
    when a Taylor miss was arbitrated, the finite difference along the Taylor direction."""
    at = f"[{', '.join(map(str, check.worst_index))}]" if check.worst_index else ""
    order = "n/a" if math.isnan(check.taylor_order) else f"{check.taylor_order:.2f}"
    along = (
        ""
        if math.isnan(check.directional_error)
        else f"; along the Taylor direction finite differences give a relative error of "
        f"{check.directional_error:.2e}"
    )
    return (
        f"`{check.name}`{at}: relative error {check.max_rel_error:.2e} (autograd {check.analytic:.6g}, "
        f"finite differences {check.numeric:.6g}; {len(check.checked)} coordinates checked), Taylor order "
        f"{order} (2 expected), linear Taylor remainder {check.taylor_linear_error:.2e} of the directional "
        f"derivative{along}"
    )


def pattern(check: ParameterCheck) -> str:
    """A sentence on what the two gradient values look like, when they match a known pattern, else ``""``.

    Some backwards differ from the derivative on purpose: a straight-through estimator (forward rounds,
    backward passes the gradient through; finite differences see no dependence), a gradient-reversal
    layer (the sign flipped). Those are reported too — they are mismatches — but the hint says so.
    """
    a, n = check.analytic, check.numeric
    if not (math.isfinite(a) and math.isfinite(n)) or a == 0:
        return ""
    if abs(n) <= 1e-3 * abs(a):
        return (
            " Finite differences see almost no dependence where autograd sees one: a straight-through "
            "estimator (or an `x + (q - x).detach()` trick) does this on purpose — if so, leave that module "
            "out of `modules`."
        )
    if abs(a + n) <= 1e-2 * abs(a):
        return (
            " The two agree up to the sign: a gradient-reversal layer does this on purpose — if so, leave "
            "that module out of `modules`; otherwise a sign is lost in the backward."
        )
    ratio = a / n if n else math.inf
    if abs(ratio) < 1e3 and abs(ratio - round(ratio)) <= 1e-2 * abs(ratio) and round(ratio) not in (0, 1):
        return f" Autograd is {round(ratio)}x the true gradient: a constant factor is wrong."
    inverse = n / a
    if (
        abs(inverse) < 1e3
        and abs(inverse - round(inverse)) <= 1e-2 * abs(inverse)
        and round(inverse) not in (0, 1)
    ):
        return f" Autograd is 1/{round(inverse)} of the true gradient: a constant factor is missing."
    return ""


def passed_line(result: GradientCheckResult) -> str:
    """One line on a check that passed: how many tensors, of what, the largest relative error, the time."""
    n = len(result.parameters)
    whole = result.targets in ([""], [])
    where = "of the whole model" if whole else f"(targets {', '.join(repr(t) for t in result.targets)})"
    if n == 0 and result.skipped:  # not a pass: the budget left everything unchecked
        return (
            f"GradientCheck: nothing checked - the budget (max_evaluations, max_seconds) left all "
            f"{len(result.skipped)} parameter tensors {where} unchecked ({result.seconds:.1f} s)."
        )
    if n == 0:
        return f"GradientCheck: passed - no parameter tensor {where} to check ({result.seconds:.1f} s)."
    worst = max(p.max_rel_error for p in result.parameters)
    line = (
        f"GradientCheck: passed - {n} parameter tensor{'s' if n != 1 else ''} {where} checked against "
        f"finite differences in float64, largest relative error {worst:.1e} ({result.seconds:.1f} s)"
    )
    unsure = result.inconclusive
    if unsure:
        names = ", ".join(f"`{p.name}`" for p in unsure[:3]) + (", ..." if len(unsure) > 3 else "")
        line += (
            f"; Taylor test inconclusive for {len(unsure)} ({names}): its steps kept crossing kinks, "
            "finite differences along its direction agree"
        )
    return line + "."
