"""``gradguard report`` on real runs: what it reads is what the run logged, its verdicts are the run's story.

Each run is a real ``Trainer.fit`` with a ``TensorBoardLogger``; the numbers the report reads back from the
event files are checked against the gradients the model recorded itself (``RecordingMLP``), the NaN step
against the step where the NaN was injected, the vanishing picture against the zoo's 12-sigmoid network.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, RecordingMLP, make_trainer, random_loader
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_gradguard import (
    GradientNormLogger,
    LRFinderPlus,
    NaNSentinel,
    NonFiniteError,
    VanishingExplodingDetector,
)
from lightning_gradguard.report import build_report, find_run, main, read_run, summary_lines, verdicts
from lightning_gradguard.report.figures import gradient_flow_matrix

sys.path.insert(0, str(ROOT / "examples"))


def _fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[Any], loader: Any, **kwargs: Any) -> str:
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer = make_trainer(callbacks, logger, default_root_dir=str(tmp_path), **kwargs)
    with contextlib.suppress(NonFiniteError):  # the NaN run ends at its NaN: its logs are what is read
        trainer.fit(model, loader)
    logger.finalize("success")
    return str(logger.log_dir)


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, RecordingMLP]:
    tmp = tmp_path_factory.mktemp("healthy")
    torch.manual_seed(0)
    model = RecordingMLP()
    callbacks = [LRFinderPlus(num_training=40, progress=False), GradientNormLogger(log_every_n_steps=1)]
    return _fit(tmp, model, callbacks, random_loader(n=512), max_epochs=2), model


def test_the_report_reads_what_the_run_logged(healthy_run: tuple[str, RecordingMLP]) -> None:
    """The heatmap's cells are log10 of the true per-layer gradient norms the model recorded; the loss is
    the run's ``train_loss``; the LR range test and its applied LR are found."""
    log_dir, model = healthy_run
    run = read_run(find_run(log_dir))
    assert run.loss_tag == "train_loss"
    names, steps, rows = gradient_flow_matrix(run)
    assert names == ["net.0", "net.2"]  # model order
    trained = sorted(model.true_layers)[-len(steps) :]  # the range test's steps come first, unlogged
    assert steps == list(range(len(steps))) and len(steps) == 128
    for name, row in zip(names, rows, strict=True):
        expected = [math.log10(model.true_layers[s][name]) for s in trained]
        assert row == pytest.approx(expected, abs=1e-5)
    assert list(run.lr_curves) == ["lr_finder"] and len(run.lr_curves["lr_finder"]["lr"]) > 10
    assert float(run.hparams["lr_finder/applied_lr"]) > 0


def test_the_html_page_is_self_contained_and_tells_the_healthy_story(
    healthy_run: tuple[str, RecordingMLP], tmp_path: Path
) -> None:
    log_dir, _ = healthy_run
    out = build_report(log_dir, output=str(tmp_path / "r.html"))
    page = Path(out).read_text(encoding="utf-8")
    for section in ("Verdict per monitor", "Loss and alerts", "Gradient flow", "Update / weight ratio"):
        assert f"<h2>{section}</h2>" in page
    assert "LR range test" in page
    assert page.count('src="data:image/png;base64,') == 4  # loss, gradient flow, update ratio, LR test
    assert "http://" not in page and "https://" not in page  # opens offline
    assert {v.monitor: v.status for v in verdicts(read_run(log_dir))} == {
        "LRFinderPlus": "healthy",
        "GradientNormLogger": "healthy",
    }


class NaNAt(RecordingMLP):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.nan_step else loss


def test_a_nan_run_is_a_failed_verdict_with_its_report(tmp_path: Path) -> None:
    torch.manual_seed(0)
    log_dir = _fit(
        tmp_path, NaNAt(7), [NaNSentinel(), GradientNormLogger(log_every_n_steps=1)], random_loader()
    )
    run = read_run(find_run(log_dir))
    (sentinel,) = [v for v in verdicts(run) if v.monitor == "NaNSentinel"]
    assert sentinel.status == "failed" and sentinel.first is not None
    assert (sentinel.first["kind"], sentinel.first["step"]) == ("nonfinite_loss", 7)
    assert [r["step"] for r in run.nan_reports] == [7]
    assert any("NaN report: nonfinite_loss at step 7" in line for line in summary_lines(run))
    page = Path(build_report(log_dir)).read_text(encoding="utf-8")
    assert "<h2>NaN report</h2>" in page and "class='failed'" in page


def test_a_vanishing_run_shows_dark_first_layers_and_a_detector_verdict(tmp_path: Path) -> None:
    from zoo import deep_sigmoid

    torch.manual_seed(0)
    model, loader = deep_sigmoid()
    callbacks = [VanishingExplodingDetector(), GradientNormLogger(log_every_n_steps=1)]
    log_dir = _fit(tmp_path, model, callbacks, loader, max_steps=30)
    run = read_run(find_run(log_dir))
    (detector,) = [v for v in verdicts(run) if v.monitor == "VanishingExplodingDetector"]
    assert detector.status in ("warning", "failed") and detector.first is not None
    assert detector.first["kind"] == "vanishing_gradient"
    names, _, rows = gradient_flow_matrix(run)
    first, last = (sum(r) / len(r) for r in (rows[0], rows[-1]))
    assert len(names) == 12 and last - first > 2  # over 100x: a dark band at the top of the heatmap


def test_versions_cli_and_module_entry_point(healthy_run: tuple[str, RecordingMLP], tmp_path: Path) -> None:
    """A folder of versions: the newest by default, ``--version`` picks one, a missing one is exit 2."""
    root = tmp_path / "logs"
    for version in (0, 1):
        os.makedirs(root / f"version_{version}")
        for f in os.listdir(healthy_run[0]):
            if f.startswith("events.out"):
                (root / f"version_{version}" / f).write_bytes((Path(healthy_run[0]) / f).read_bytes())
    assert find_run(str(root)) == str(root / "version_1")
    assert main(["report", str(root), "--version", "0", "-o", str(tmp_path / "v0.html")]) == 0
    assert (tmp_path / "v0.html").exists() and not (root / "version_0" / "gradguard_report.html").exists()
    assert main(["report", str(root), "--version", "7"]) == 2
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_gradguard.report", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (root / "version_1" / "gradguard_report.html").exists()
    assert "GradientNormLogger" in proc.stdout and "HTML report:" in proc.stdout
    script = Path(sys.executable).with_name("gradguard")
    if script.exists():  # the console script of an installed package
        proc = subprocess.run([str(script), "report", str(root / "missing")], capture_output=True, text=True)
        assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_without_matplotlib_the_message_names_the_extra(
    healthy_run: tuple[str, RecordingMLP], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"lightning-gradguard\[report\]"):
        build_report(healthy_run[0])


def test_the_newer_monitors_get_verdicts_and_their_tags_are_not_taken_for_the_loss(tmp_path: Path) -> None:
    """A run that never learns (labels drawn at random, plain SGD at a far too small LR) with
    StallDetector, OptimizerMonitor and ActivationRangeMonitor: each has a verdict line, StallDetector's
    names its first finding, and the loss line is the model's ``train_loss``, not ``stall/loss``."""
    from lightning_gradguard import ActivationRangeMonitor, OptimizerMonitor, StallDetector

    torch.manual_seed(0)
    model = RecordingMLP(lr=1e-4)
    callbacks = [StallDetector(num_classes=4), OptimizerMonitor(), ActivationRangeMonitor()]
    log_dir = _fit(tmp_path, model, callbacks, random_loader(n=1600), max_steps=120, log_every_n_steps=5)
    stall = callbacks[0]
    assert stall.alerts, "the stalled run must be flagged for this test to mean anything"
    run = read_run(find_run(log_dir))
    found = {v.monitor: v for v in verdicts(run)}
    assert {"StallDetector", "OptimizerMonitor", "ActivationRangeMonitor"} <= set(found)
    first = found["StallDetector"].first
    assert found["StallDetector"].status == "warning" and first is not None
    assert (first["kind"], first["step"]) == (stall.alerts[0].kind, stall.alerts[0].step)
    assert run.loss_tag == "train_loss"
    assert any(line.split()[:2] == ["StallDetector", "warning"] for line in summary_lines(run))
