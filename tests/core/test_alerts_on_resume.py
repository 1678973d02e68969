"""A run resumed from a checkpoint replays the steps between the checkpoint and the kill: their alerts are
recorded once. The alerts file and the callback's ``alerts`` read as those of a run that was never killed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from conftest import RecordingMLP, make_trainer, random_loader

from lightning_gradguard import NaNSentinel

NAN_STEPS = (1, 4, 6)


class NaNAtSteps(RecordingMLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in NAN_STEPS else loss


class SaveAt(pl.Callback):
    """Saves a checkpoint once ``trainer.global_step`` reaches ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(str(self.path))


def _fit(root: Path, callbacks: list[Any], ckpt_path: str | None = None) -> NaNSentinel:
    torch.manual_seed(0)
    sentinel = NaNSentinel(action="skip", cooldown_steps=0, save_checkpoint=False, save_batch=False)
    trainer = make_trainer([sentinel, *callbacks], default_root_dir=str(root), max_steps=8)
    trainer.fit(NaNAtSteps(), random_loader(), ckpt_path=ckpt_path)
    return sentinel


def _lines(root: Path) -> list[tuple[Any, ...]]:
    text = (root / "gradguard_alerts.jsonl").read_text(encoding="utf-8")
    return [(r["step"], r["kind"], r["source"]) for r in map(json.loads, text.splitlines())]


def test_a_resumed_run_records_the_alerts_of_its_replayed_steps_once(tmp_path: Path) -> None:
    never_killed = _fit(tmp_path / "whole", [])
    expected = [(s, "nonfinite_loss", "NaNSentinel") for s in NAN_STEPS]
    assert _lines(tmp_path / "whole") == expected
    # the run that was killed at step 8 after a checkpoint at step 3, then resumed from it to step 8
    killed = tmp_path / "killed"
    checkpoint = tmp_path / "step3.ckpt"
    _fit(killed, [SaveAt(3, checkpoint)])
    resumed = _fit(killed, [], ckpt_path=str(checkpoint))
    assert _lines(killed) == expected  # steps 4 and 6 were replayed: written once
    assert [(a.step, a.kind) for a in resumed.alerts] == [(a.step, a.kind) for a in never_killed.alerts]


def test_the_same_callback_resumed_in_the_same_process_keeps_one_copy(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step3.ckpt"
    torch.manual_seed(0)
    sentinel = NaNSentinel(action="skip", cooldown_steps=0, save_checkpoint=False, save_batch=False)
    for ckpt_path in (None, str(checkpoint)):
        trainer = make_trainer([sentinel, SaveAt(3, checkpoint)], default_root_dir=str(tmp_path), max_steps=8)
        trainer.fit(NaNAtSteps(), random_loader(), ckpt_path=ckpt_path)
    assert [a.step for a in sentinel.alerts] == list(NAN_STEPS)
    assert [line[0] for line in _lines(tmp_path)] == list(NAN_STEPS)
