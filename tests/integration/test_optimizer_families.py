"""Optimizers whose step is their own design, on real Trainers with every monitor and the pre-flight checks:
Adafactor with relative steps keeps ``lr=None`` in its param groups (found by the sweep of every
``transformers`` architecture: five monitors and two checks read ``float(group["lr"])`` and failed on it).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from conftest import ROOT, make_trainer
from torch import nn

from lightning_gradguard import GradientCheck, LRFinderPlus, OverfitBatchSanity

sys.path.insert(0, str(ROOT / "examples"))
from zoo import ZooModule, digits, monitors


def _relative_step(params: Any) -> torch.optim.Optimizer:
    """``transformers``' Adafactor with its relative step: ``lr=None`` in every group."""
    from transformers.optimization import Adafactor

    optimizer: torch.optim.Optimizer = Adafactor(params, lr=None, relative_step=True, scale_parameter=True)
    return optimizer


def test_an_optimizer_without_a_numeric_lr_is_watched_not_crashed() -> None:
    """Under GRADGUARD_STRICT=1 (the tests' setting) a monitor that fails raises: every monitor reads the
    steps of an ``lr=None`` optimizer, the pre-flight checks pass, and the LR finder says there is no LR to
    sweep instead of failing inside."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    watching = monitors()
    overfit, gradcheck, finder = OverfitBatchSanity(), GradientCheck(), LRFinderPlus()
    model = ZooModule(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), _relative_step)
    trainer = make_trainer([overfit, gradcheck, finder, *watching], max_steps=40)
    trainer.fit(model, digits())
    assert trainer.global_step == 40 and model.losses[-1] < 0.9 * model.losses[0]  # it learns (0.74 here)
    assert overfit.result is not None and overfit.result.passed
    assert gradcheck.result is not None and gradcheck.result.passed
    assert finder.result is not None and finder.result.suggestion is None
    (said,) = finder.alerts
    assert "sets its own step size" in said.message and "relative_step=False" in said.hint
    loud = [a.format() for m in watching for a in m.alerts if a.severity != "info"]
    assert not loud, loud
    assert trainer.optimizers[0].param_groups[0]["lr"] is None  # nothing of ours wrote an LR into it


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="needs torch.optim.Muon (torch >= 2.9)")
def test_muon_groups_are_told_by_their_newton_schulz_steps() -> None:
    """torch's Muon keeps ``ns_steps`` in its groups (the reference implementation's mixed groups say
    ``use_muon``): the share of the entries whose update is orthogonalized, read from the groups."""
    from lightning_gradguard.core.lr import orthogonalized_share

    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    matrices = [net[0].weight, net[2].weight]
    rest = [net[0].bias, net[2].bias]
    assert orthogonalized_share(torch.optim.Muon(matrices, lr=0.02)) == 1.0
    assert orthogonalized_share(torch.optim.AdamW(net.parameters())) == 0.0
    mixed = torch.optim.AdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}])
    assert orthogonalized_share(mixed) == pytest.approx((64 * 64 + 640) / (64 * 64 + 640 + 74))
