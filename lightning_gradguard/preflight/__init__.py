"""The pre-flight checks: thin callbacks over one engine each, run once at the start of ``fit``.

* ``overfit``: :class:`OverfitBatchSanity`, the callback, over ``overfit_check`` (the check on one
  batch), ``overfit_trial`` (the one training loop), ``findings`` and ``diagnosis`` (what it names);
* ``gradient_check``: :class:`GradientCheck` and :func:`gradient_check`, the faces over the gradient-check
  engine of :mod:`lightning_gradguard.functional.gradcheck_module`;
* ``verdict``: what both checks share: when a check runs, and one verdict reduced across ranks.
"""

from lightning_gradguard.alerts import SanityCheckError
from lightning_gradguard.functional.gradcheck_graph import find_custom_functions
from lightning_gradguard.functional.gradcheck_module import GradientCheckResult, ParameterCheck
from lightning_gradguard.preflight.findings import Finding, OverfitResult
from lightning_gradguard.preflight.gradient_check import GradientCheck, gradient_check
from lightning_gradguard.preflight.overfit import OverfitBatchSanity

__all__ = [
    "Finding",
    "GradientCheck",
    "GradientCheckResult",
    "OverfitBatchSanity",
    "OverfitResult",
    "ParameterCheck",
    "SanityCheckError",
    "find_custom_functions",
    "gradient_check",
]
