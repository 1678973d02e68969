"""LossSpikeGuard's skip never depends on a write: a run folder under a regular file loses spikes.json and
the alerts file (one warning naming each path), never the dropped update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_trainer, random_loader
from test_loss_spike import THRESHOLDS, Recorder, SpikeModel

from lightning_gradguard import LossSpikeGuard


def test_a_spike_is_skipped_when_its_record_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder", encoding="utf-8")
    torch.manual_seed(0)
    guard, recorder = LossSpikeGuard(action="skip", **THRESHOLDS), Recorder()
    trainer = make_trainer([guard, recorder], default_root_dir=str(blocker / "run"), max_steps=16)
    with pytest.warns(UserWarning, match="could not write") as caught:
        trainer.fit(SpikeModel({12}), random_loader(n=256))
    assert trainer.global_step == 16 and recorder.dropped() == {12}
    assert [(r.step, r.action) for r in guard.records] == [(12, "skip")]
    said = " ".join(str(w.message) for w in caught)
    assert str(blocker / "run" / "spikes.json") in said
