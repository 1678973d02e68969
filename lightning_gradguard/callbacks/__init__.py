"""The callbacks: the monitors live here, one module each; the pre-flight checks and the LR finder are
re-exported from ``preflight`` and ``tuner``."""

from lightning_gradguard.callbacks.dead_relu import DeadReLUMonitor
from lightning_gradguard.callbacks.gradient_check import GradientCheck, GradientCheckResult, gradient_check
from lightning_gradguard.callbacks.gradient_norm_logger import GradientNormLogger
from lightning_gradguard.callbacks.lr_finder import LRFinderPlus, LRFinderResult, lr_find
from lightning_gradguard.callbacks.nan_sentinel import NaNSentinel
from lightning_gradguard.callbacks.overfit_batch import OverfitBatchSanity, OverfitResult
from lightning_gradguard.callbacks.vanishing_exploding import VanishingExplodingDetector
from lightning_gradguard.core.base import GradGuardCallback

__all__ = [
    "DeadReLUMonitor",
    "GradGuardCallback",
    "GradientCheck",
    "GradientCheckResult",
    "GradientNormLogger",
    "LRFinderPlus",
    "LRFinderResult",
    "NaNSentinel",
    "OverfitBatchSanity",
    "OverfitResult",
    "VanishingExplodingDetector",
    "gradient_check",
    "lr_find",
]
