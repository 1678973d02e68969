"""The callbacks: the monitors live here, one module each; the pre-flight checks and the LR finder are
re-exported from ``preflight`` and ``tuner``."""

from lightning_gradguard.callbacks.activation_range import ActivationRangeMonitor
from lightning_gradguard.callbacks.dead_relu import DeadReLUMonitor
from lightning_gradguard.callbacks.gradient_norm_logger import GradientNormLogger
from lightning_gradguard.callbacks.loss_spike import LossSpikeGuard
from lightning_gradguard.callbacks.nan_sentinel import NaNSentinel
from lightning_gradguard.callbacks.optimizer_monitor import OptimizerMonitor
from lightning_gradguard.callbacks.stall import StallDetector
from lightning_gradguard.callbacks.vanishing_exploding import VanishingExplodingDetector
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.preflight import (
    GradientCheck,
    GradientCheckResult,
    OverfitBatchSanity,
    OverfitResult,
    gradient_check,
)
from lightning_gradguard.tuner import LRFinderPlus, LRFinderResult, lr_find

__all__ = [
    "ActivationRangeMonitor",
    "DeadReLUMonitor",
    "GradGuardCallback",
    "GradientCheck",
    "GradientCheckResult",
    "GradientNormLogger",
    "LRFinderPlus",
    "LRFinderResult",
    "LossSpikeGuard",
    "NaNSentinel",
    "OptimizerMonitor",
    "OverfitBatchSanity",
    "OverfitResult",
    "StallDetector",
    "VanishingExplodingDetector",
    "gradient_check",
    "lr_find",
]
