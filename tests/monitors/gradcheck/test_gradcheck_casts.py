"""GradientCheck on a healthy model whose loss code casts to float32: no false mismatch.

A ``training_step`` that computes its loss on ``logits.float()`` (the usual way to keep a loss in
float32 under mixed precision) used to round the float64 check's logits to float32: finite differences at
``eps = 1e-6`` then measured rounding noise, and a healthy MLP failed with relative errors of 1-88 %.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, random_loader
from torch import nn

from lightning_gradguard import GradientCheck, gradient_check


class CastingMLP(pl.LightningModule):
    def __init__(self, cast: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.cast = cast

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        if self.cast == "float":
            logits = logits.float()
        elif self.cast == "to":
            logits = logits.to(torch.float32)
        elif self.cast == "half_round_trip":
            logits = logits.half().float()
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("cast", ["float", "to", "half_round_trip"])
def test_a_float32_cast_in_the_loss_is_no_mismatch(cast: str) -> None:
    torch.manual_seed(0)
    check = GradientCheck()
    make_trainer([check], max_steps=1).fit(CastingMLP(cast), random_loader(n=32))
    assert check.result is not None and check.result.passed, [p for p in check.result.parameters]
    assert check.result.promoted  # the check says the loss code asked for less than float64


def test_the_function_keeps_the_loss_in_float64_too() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    batch = (torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2]))
    result = gradient_check(net, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]))
    assert result.passed and max(p.max_rel_error for p in result.parameters) < 1e-6
