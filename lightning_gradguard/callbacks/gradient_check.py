"""Where GradientCheck lived before 0.2 (``lightning_gradguard.preflight.gradient_check`` now).

Kept so that imports, LightningCLI configs that name this path and pickled results still resolve;
new code imports from ``lightning_gradguard``.
"""

from lightning_gradguard.functional.gradcheck_graph import find_custom_functions
from lightning_gradguard.functional.gradcheck_module import GradientCheckResult, ParameterCheck
from lightning_gradguard.preflight.gradient_check import GradientCheck, gradient_check

__all__ = [
    "GradientCheck",
    "GradientCheckResult",
    "ParameterCheck",
    "find_custom_functions",
    "gradient_check",
]
