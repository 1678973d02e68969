"""OverfitBatchSanity's verdict never contradicts its findings: a loss that is NaN from the first forward
fails the check, even where the curve's shape alone would only warn (a scheduler that warms up to the LR)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, random_loader
from torch import nn

from lightning_gradguard import OverfitBatchSanity, SanityCheckError


class Overflowing(pl.LightningModule):
    """Raw, unnormalised inputs so large that the first forward overflows to inf, and the loss is NaN; its
    optimizer warms up to its LR (the case where a missed target is only a warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x * 1e38 * 1e38), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        warm_up = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm_up, "interval": "step"}}


def test_a_nan_loss_from_the_first_forward_fails_the_check() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(action="warn")
    make_trainer([check], max_steps=1).fit(Overflowing(), random_loader())
    result = check.result
    assert result is not None and not math.isfinite(result.initial_loss)
    assert result.passed is False
    (failed,) = [f for f in result.findings if f.kind == "overfit_failed"]
    assert failed.severity == "error" and "not finite" in failed.message
    assert [a.severity for a in check.alerts if a.kind == "overfit_failed"] == ["error"]


def test_a_nan_loss_from_the_first_forward_stops_the_run_before_its_first_step() -> None:
    torch.manual_seed(0)
    trainer = make_trainer([OverfitBatchSanity(action="raise")], max_steps=3)
    with pytest.raises(SanityCheckError, match="not finite"):
        trainer.fit(Overflowing(), random_loader())
    assert trainer.global_step == 0
