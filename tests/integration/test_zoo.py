"""The zoo: every broken network raises its alert within a few steps, no healthy one raises anything.

Real Lightning runs (examples/zoo.py holds the catalogue, shared with examples/broken_networks.py),
the gradient detector, DeadReLUMonitor and StallDetector at their DEFAULT arguments.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from zoo import CASES, Case, detect


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_zoo_case(case: Case, tmp_path: Path) -> None:
    result = detect(case, root_dir=str(tmp_path))
    said = [a.format() for a in result.serious]
    if case.healthy:
        assert result.serious == [], said
        first, last = statistics.fmean(result.losses[:10]), statistics.fmean(result.losses[-10:])
        assert last < 0.7 * first, "a healthy control must actually learn"
        return
    assert result.false_alerts == [], said
    for kind in case.expected:
        step = result.first_step(kind)
        assert step is not None, f"{kind} not raised: {said}"
        assert case.onset <= step <= case.onset + case.max_delay, said
        alert = next(a for a in result.serious if a.kind == kind)
        assert alert.where and alert.hint


def test_zoo_covers_the_catalogue_of_the_issue() -> None:
    names = {c.name for c in CASES}
    broken = {"sgd_lr10", "dead_relu_init", "deep_sigmoid", "too_large_init", "rnn_spectral_radius"}
    assert all(c.max_delay <= 5 for c in CASES if c.onset == 0)  # "within a few steps of onset"
    healthy = {
        "relu_mlp",
        "cnn_batchnorm",
        "gelu_transformer",
        "lstm_clipped",
        "deep_preln_residual",
        "frozen_backbone",
        "bf16_mixed",
    }
    assert broken | healthy <= names
    assert {c.name for c in CASES if c.healthy} == healthy
