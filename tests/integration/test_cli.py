"""LightningCLI builds GradientNormLogger from YAML through its type hints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import RecordingMLP
from lightning.pytorch.cli import LightningCLI

from lightning_gradguard import GradientNormLogger

CONFIG = """
trainer:
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_gradguard.GradientNormLogger
      init_args:
        log_every_n_steps: 7
        histogram_every_n_steps: 0
        norm_type: inf
        group_depth: 2
        per_parameter: false
        clip_window: 50
"""


def test_lightning_cli_builds_the_callback_from_yaml(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = LightningCLI(RecordingMLP, run=False, args=["--config", str(config)], save_config_callback=None)
    found = [cb for cb in cli.trainer.callbacks if isinstance(cb, GradientNormLogger)]
    assert len(found) == 1
    cb = found[0]
    assert (cb.log_every_n_steps, cb.histogram_every_n_steps, cb.group_depth, cb.clip_window) == (7, 0, 2, 50)
    assert cb.norm_type == float("inf")


def test_lightning_cli_reports_a_bad_value(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("norm_type: inf", "norm_type: 3"))
    with pytest.raises((SystemExit, ValueError)):
        LightningCLI(RecordingMLP, run=False, args=["--config", str(config)], save_config_callback=None)
