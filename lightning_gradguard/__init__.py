"""lightning_gradguard: PyTorch Lightning callbacks that watch the health of a training run."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# A public name is registered here, in two lines: its typed import below (``X as X``: an explicit export
# for type checkers and linters) and its module in ``_WHERE``; ``__all__`` follows from ``_WHERE``
# (tests/integration/test_architecture.py checks that the two agree).
if TYPE_CHECKING:  # at run time each name is imported on first use (see ``__getattr__``)
    from lightning_gradguard.alerts import Alert as Alert
    from lightning_gradguard.alerts import GradGuardError as GradGuardError
    from lightning_gradguard.alerts import LossSpikeError as LossSpikeError
    from lightning_gradguard.alerts import NonFiniteError as NonFiniteError
    from lightning_gradguard.alerts import SanityCheckError as SanityCheckError
    from lightning_gradguard.core.base import GradGuardCallback as GradGuardCallback
    from lightning_gradguard.monitors.activation_range.callback import (
        ActivationRangeMonitor as ActivationRangeMonitor,
    )
    from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor as DeadReLUMonitor
    from lightning_gradguard.monitors.gradcheck.callback import GradientCheck as GradientCheck
    from lightning_gradguard.monitors.gradcheck.callback import gradient_check as gradient_check
    from lightning_gradguard.monitors.gradcheck.engine import GradientCheckResult as GradientCheckResult
    from lightning_gradguard.monitors.gradcheck.engine import ParameterCheck as ParameterCheck
    from lightning_gradguard.monitors.gradcheck.graph import find_custom_functions as find_custom_functions
    from lightning_gradguard.monitors.gradients.callback import GradientNormLogger as GradientNormLogger
    from lightning_gradguard.monitors.lr_finder.callback import LRFinderPlus as LRFinderPlus
    from lightning_gradguard.monitors.lr_finder.callback import lr_find as lr_find
    from lightning_gradguard.monitors.lr_finder.result import LRFinderResult as LRFinderResult
    from lightning_gradguard.monitors.nan.callback import NaNSentinel as NaNSentinel
    from lightning_gradguard.monitors.optimizer.callback import OptimizerMonitor as OptimizerMonitor
    from lightning_gradguard.monitors.overfit.callback import OverfitBatchSanity as OverfitBatchSanity
    from lightning_gradguard.monitors.overfit.findings import OverfitResult as OverfitResult
    from lightning_gradguard.monitors.spike.callback import LossSpikeGuard as LossSpikeGuard
    from lightning_gradguard.monitors.stall.callback import StallDetector as StallDetector
    from lightning_gradguard.monitors.vanishing.callback import (
        VanishingExplodingDetector as VanishingExplodingDetector,
    )
    from lightning_gradguard.registry import ALERT_KINDS as ALERT_KINDS

__version__ = "0.1.0"

#: the module of each public name: ``import lightning_gradguard`` imports neither torch nor Lightning until
#: a name is used, so ``gradguard report`` (which needs neither) starts without them
_WHERE = {
    "ALERT_KINDS": "lightning_gradguard.registry",  # built from what the monitors declare
    "Alert": "lightning_gradguard.alerts",
    "GradGuardError": "lightning_gradguard.alerts",
    "LossSpikeError": "lightning_gradguard.alerts",
    "NonFiniteError": "lightning_gradguard.alerts",
    "SanityCheckError": "lightning_gradguard.alerts",
    "GradGuardCallback": "lightning_gradguard.core.base",
    "ActivationRangeMonitor": "lightning_gradguard.monitors.activation_range.callback",
    "DeadReLUMonitor": "lightning_gradguard.monitors.dead_units.callback",
    "GradientNormLogger": "lightning_gradguard.monitors.gradients.callback",
    "LRFinderPlus": "lightning_gradguard.monitors.lr_finder.callback",
    "lr_find": "lightning_gradguard.monitors.lr_finder.callback",
    "LRFinderResult": "lightning_gradguard.monitors.lr_finder.result",
    "NaNSentinel": "lightning_gradguard.monitors.nan.callback",
    "OptimizerMonitor": "lightning_gradguard.monitors.optimizer.callback",
    "OverfitResult": "lightning_gradguard.monitors.overfit.findings",
    "find_custom_functions": "lightning_gradguard.monitors.gradcheck.graph",
    "GradientCheckResult": "lightning_gradguard.monitors.gradcheck.engine",
    "ParameterCheck": "lightning_gradguard.monitors.gradcheck.engine",
    "GradientCheck": "lightning_gradguard.monitors.gradcheck.callback",
    "gradient_check": "lightning_gradguard.monitors.gradcheck.callback",
    "OverfitBatchSanity": "lightning_gradguard.monitors.overfit.callback",
    "LossSpikeGuard": "lightning_gradguard.monitors.spike.callback",
    "StallDetector": "lightning_gradguard.monitors.stall.callback",
    "VanishingExplodingDetector": "lightning_gradguard.monitors.vanishing.callback",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


#: the public names: every name of ``_WHERE`` (one entry per export: the typed import above goes with it)
__all__ = sorted([*_WHERE, "__version__"])
