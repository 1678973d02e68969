"""lightning_gradguard: PyTorch Lightning callbacks that watch the health of a training run."""

from lightning_gradguard.alerts import (
    ALERT_KINDS,
    Alert,
    GradGuardError,
    LossSpikeError,
    NonFiniteError,
    SanityCheckError,
)
from lightning_gradguard.callbacks import (
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradGuardCallback,
    GradientCheck,
    GradientCheckResult,
    GradientNormLogger,
    LossSpikeGuard,
    LRFinderPlus,
    LRFinderResult,
    NaNSentinel,
    OptimizerMonitor,
    OverfitBatchSanity,
    OverfitResult,
    StallDetector,
    VanishingExplodingDetector,
    gradient_check,
    lr_find,
)

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
    "SanityCheckError",
    "StallDetector",
    "VanishingExplodingDetector",
    "__version__",
    "gradient_check",
    "lr_find",
]
