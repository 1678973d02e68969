"""Frozen parameters are said at fit start: one INFO line per Trainer, with their share and the modules
frozen whole (a fine-tune frozen by mistake passes the pre-flight: the head alone memorises one batch)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from conftest import RecordingMLP, make_trainer, random_loader
from torch import nn

from lightning_gradguard import GradientNormLogger, NaNSentinel


def _frozen_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "are frozen" in r.getMessage()]


def test_a_frozen_backbone_is_said_once_at_fit_start_with_its_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = RecordingMLP(features=8, hidden=16, classes=4)
    model.net.insert(0, nn.Linear(8, 8))  # a backbone of two layers, then the head
    model.net.insert(1, nn.Tanh())
    for p in [*model.net[0].parameters(), *model.net[2].parameters()]:
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([GradientNormLogger(), NaNSentinel()], max_steps=2).fit(model, random_loader())
    (line,) = _frozen_lines(caplog)  # two callbacks, one line
    assert f"{frozen / total:.1%}" in line and f"({frozen:,} of {total:,})" in line
    assert "net.0 (72)" in line and "net.2 (144)" in line and "net.4" not in line


def test_a_model_that_trains_whole_says_nothing(caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([GradientNormLogger()], max_steps=2).fit(RecordingMLP(), random_loader())
    assert _frozen_lines(caplog) == []
