"""What the benchmark scripts share: the digits models and optimizers, and the environment they record."""

from __future__ import annotations

import os
import platform
from typing import Any

import lightning
import torch
from torch import nn


def digits_mlp() -> nn.Module:
    """64-128-64-10 ReLU MLP for the 8x8 digits."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def digits_cnn() -> nn.Module:
    """A two-convolution CNN with BatchNorm for the 8x8 digits (flat 64-pixel input)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def sgd(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def adam(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def environment(threads: int | None = None) -> dict[str, Any]:
    """Versions and machine, for the results JSON."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if threads is None else threads,
    }
