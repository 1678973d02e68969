"""Where OverfitBatchSanity lived before 0.2 (``lightning_gradguard.preflight.overfit`` now).

Kept so that imports, LightningCLI configs that name this path and pickled results still resolve;
new code imports from ``lightning_gradguard``.
"""

from lightning_gradguard.alerts import SanityCheckError
from lightning_gradguard.preflight.findings import Finding, OverfitResult
from lightning_gradguard.preflight.overfit import OverfitBatchSanity

__all__ = ["Finding", "OverfitBatchSanity", "OverfitResult", "SanityCheckError"]
