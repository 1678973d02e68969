"""NaNSentinel's promise under a failing disk: the stop (or the skip) never depends on a forensic write.

Real Trainers whose run folder lies under a regular file (every write fails with ``NotADirectoryError``) or
whose ``torch.save`` / ``open`` report a full disk (``ENOSPC``). The NaN is planted at a known step; the
run must end in ``NonFiniteError`` at that step (or, with ``action="skip"``, go on without that update), with
one warning naming the path that could not be written, also under ``GRADGUARD_STRICT=1`` (the tests' mode).
"""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader

from lightning_gradguard import NaNSentinel, NonFiniteError


class NaNAt(RecordingMLP):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step
        self.stepped: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.nan_step else loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.stepped.append(int(self.global_step))


def _under_a_file(tmp_path: Path) -> Path:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return blocker / "run"


def test_a_run_folder_under_a_regular_file_still_stops_at_the_nan(tmp_path: Path) -> None:
    root = _under_a_file(tmp_path)
    trainer = make_trainer([NaNSentinel()], default_root_dir=str(root), max_steps=8)
    with pytest.warns(UserWarning, match="could not write") as caught, pytest.raises(NonFiniteError) as err:
        trainer.fit(NaNAt(5), random_loader())
    assert err.value.report["step"] == 5 and err.value.report["kind"] == "nonfinite_loss"
    assert trainer.global_step == 5
    said = " ".join(str(w.message) for w in caught)
    assert str(root) in said  # the warning names the path it could not write
    assert not root.exists()


def test_a_run_folder_under_a_regular_file_still_skips_the_nan_step(tmp_path: Path) -> None:
    root = _under_a_file(tmp_path)
    model = NaNAt(3)
    trainer = make_trainer([NaNSentinel(action="skip")], default_root_dir=str(root), max_steps=6)
    with pytest.warns(UserWarning, match="could not write"):
        trainer.fit(model, random_loader())
    assert trainer.global_step == 6  # the run went on to its end
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN update was dropped


@pytest.mark.parametrize("failing", ["torch.save", "open"])
def test_a_full_disk_does_not_replace_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    real_open, real_replace = builtins.open, os.replace

    def full(path: Any) -> bool:
        return "nan_report" in str(path) or "alerts" in str(path)

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+") and full(file):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    def full_replace(src: Any, dst: Any) -> None:
        if full(dst):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        real_replace(src, dst)

    def full_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")

    if failing == "torch.save":
        monkeypatch.setattr(torch, "save", full_save)
    else:
        monkeypatch.setattr(builtins, "open", full_open)
        monkeypatch.setattr(os, "replace", full_replace)
    trainer = make_trainer([NaNSentinel()], default_root_dir=str(tmp_path), max_steps=8)
    with pytest.warns(UserWarning, match="could not write"), pytest.raises(NonFiniteError) as err:
        trainer.fit(NaNAt(4), random_loader())
    assert err.value.report["step"] == 4
    report = tmp_path / "nan_report" / "step_4" / "report.json"
    if failing == "torch.save":  # report.json is written, and lists only the files that were
        files = json.loads(report.read_text(encoding="utf-8"))["files"]
        assert "batch" not in files and "checkpoint" not in files and "report" in files
    else:
        assert not report.exists()
