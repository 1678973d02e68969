"""lightning_gradguard: PyTorch Lightning callbacks that watch the health of a training run."""

from lightning_gradguard.alerts import ALERT_KINDS, Alert, GradGuardError, NonFiniteError
from lightning_gradguard.callbacks import GradGuardCallback, GradientNormLogger, NaNSentinel

__version__ = "0.1.0"

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "GradGuardCallback",
    "GradGuardError",
    "GradientNormLogger",
    "NaNSentinel",
    "NonFiniteError",
    "__version__",
]
