"""lightning_gradguard: PyTorch Lightning callbacks that watch the health of a training run."""

from lightning_gradguard.alerts import (
    ALERT_KINDS,
    Alert,
    GradGuardError,
    LossSpikeError,
    NonFiniteError,
    SanityCheckError,
)
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.monitors.activation_range.callback import ActivationRangeMonitor
from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor
from lightning_gradguard.monitors.gradients.callback import GradientNormLogger
from lightning_gradguard.monitors.lr_finder.callback import LRFinderPlus, lr_find
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult
from lightning_gradguard.monitors.nan.callback import NaNSentinel
from lightning_gradguard.monitors.optimizer.callback import OptimizerMonitor
from lightning_gradguard.monitors.preflight.findings import OverfitResult
from lightning_gradguard.monitors.preflight.gradcheck_graph import find_custom_functions
from lightning_gradguard.monitors.preflight.gradcheck_module import GradientCheckResult, ParameterCheck
from lightning_gradguard.monitors.preflight.gradient_check import GradientCheck, gradient_check
from lightning_gradguard.monitors.preflight.overfit import OverfitBatchSanity
from lightning_gradguard.monitors.spike.callback import LossSpikeGuard
from lightning_gradguard.monitors.stall.callback import StallDetector
from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector

__version__ = "0.1.0"

__all__ = [
    "ALERT_KINDS",
    "ActivationRangeMonitor",
    "Alert",
    "DeadReLUMonitor",
    "GradGuardCallback",
    "GradGuardError",
    "GradientCheck",
    "GradientCheckResult",
    "GradientNormLogger",
    "LRFinderPlus",
    "LRFinderResult",
    "LossSpikeError",
    "LossSpikeGuard",
    "NaNSentinel",
    "NonFiniteError",
    "OptimizerMonitor",
    "OverfitBatchSanity",
    "OverfitResult",
    "ParameterCheck",
    "SanityCheckError",
    "StallDetector",
    "VanishingExplodingDetector",
    "__version__",
    "find_custom_functions",
    "gradient_check",
    "lr_find",
]
