"""Where LRFinderPlus lived before 0.2 (``lightning_gradguard.tuner`` now).

Kept so that imports, LightningCLI configs that name this path and pickled results still resolve;
new code imports from ``lightning_gradguard``.
"""

from lightning_gradguard.tuner import LRFinderPlus, LRFinderResult, lr_find

__all__ = ["LRFinderPlus", "LRFinderResult", "lr_find"]
