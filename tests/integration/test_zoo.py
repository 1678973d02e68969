"""The zoo: every broken network raises its alert within its allowed delay of the onset and names the
cause; no healthy one raises anything.

Real Lightning runs (examples/zoo.py holds the catalogue, shared with examples/broken_networks.py),
every training monitor at its DEFAULT arguments.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from zoo import CASES, Case, detect

#: alert kinds about the whole run: they name no layer
RUN_WIDE = {"early_divergence", "update_ratio_high"}


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
        assert alert.hint and (alert.where or kind in RUN_WIDE), alert.format()
    first = next(a for a in result.serious if a.kind == case.expected[0])
    assert case.cause in first.message + " " + first.hint, first.format()


def test_zoo_covers_the_catalogue_of_the_issue() -> None:
    names = {c.name for c in CASES}
    broken = {"sgd_lr10", "dead_relu_init", "deep_sigmoid", "too_large_init", "rnn_spectral_radius"}
    assert all(c.max_delay <= 5 for c in CASES if c.name in broken)  # "within a few steps of onset"
    # issue 24: each named at its onset by its cause, beside a healthy twin
    at_onset = {"sgd_lr_climb", "adam_small_beta2", "attention_one_hot", "weight_decay_too_strong"}
    at_onset |= {"bf16_true_small_lr"}
    assert all(c.cause for c in CASES if c.name in at_onset | {"input_ignored"})
    healthy = {
        "relu_mlp",
        "sgd_mlp",
        "cnn_batchnorm",
        "gelu_transformer",
        "lstm_clipped",
        "deep_preln_residual",
        "frozen_backbone",
        "bf16_mixed",
    }
    assert broken | at_onset | healthy <= names
    assert {c.name for c in CASES if c.healthy} == healthy
