"""The callbacks: one module each, thin policy on top of ``functional`` and the shared statistics."""

from lightning_gradguard.callbacks._base import GradGuardCallback
from lightning_gradguard.callbacks.gradient_norm_logger import GradientNormLogger
from lightning_gradguard.callbacks.nan_sentinel import NaNSentinel

__all__ = ["GradGuardCallback", "GradientNormLogger", "NaNSentinel"]
