"""``gradguard report`` on real runs: what it reads is what the run logged, its verdicts are the run's story.

Each run is a real ``Trainer.fit`` with a ``TensorBoardLogger``; the numbers the report reads back from the
event files are checked against the gradients the model recorded itself (``RecordingMLP``), the NaN step
against the step where the NaN was injected, the vanishing picture against the zoo's 12-sigmoid network.
"""

from __future__ import annotations

import contextlib
import html
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
from torch import nn

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


def learnable_loader(n: int = 512, features: int = 8, classes: int = 4, batch_size: int = 8) -> Any:
    """Labels a fixed linear map of the inputs decides: a task the model learns, so a range test's loss
    falls clearly (random labels give a curve of noise, which LRFinderPlus rightly declines to read)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, RecordingMLP]:
    tmp = tmp_path_factory.mktemp("healthy")
    torch.manual_seed(0)
    model = RecordingMLP()
    callbacks = [
        # the search picks 0.36 here (held-out loss 0.31 against 1.0 at the valley's 0.03 in its trials):
        # this 128-step run's update/weight ratio is 0.03 to 0.08 while its loss falls from 1.0 to 0.29,
        # a fast learner, which update_ratio_high names no more (it did before issue 39's merge)
        LRFinderPlus(num_training=40, method="valley", progress=False),
        GradientNormLogger(log_every_n_steps=1),
    ]
    return _fit(tmp, model, callbacks, learnable_loader(), max_epochs=2), model


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
    """A folder of versions: the newest by default, ``--version`` picks one, a missing one is exit 2. The
    command imports neither torch nor Lightning (the package imports its names on first use)."""
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
    proc = subprocess.run(  # -X importtime: every module the command imported, on stderr
        [sys.executable, "-X", "importtime", "-m", "lightning_gradguard.report", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "version_1" / "gradguard_report.html").exists()
    assert "GradientNormLogger" in proc.stdout and "HTML report:" in proc.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "lightning", "pytorch_lightning"}  # a report needs neither: seconds
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


def _drawn(monkeypatch: pytest.MonkeyPatch, draw: Any, run: Any) -> Any:
    """The matplotlib figure ``draw(run)`` made (kept open instead of turned into PNG bytes)."""
    import lightning_gradguard.report.figures as figures

    made: list[Any] = []
    monkeypatch.setattr(figures, "_png", lambda fig: made.append(fig) or b"png")
    assert draw(run) == b"png"
    return made[0]


def _visible(fig: Any) -> dict[str, tuple[list[float], list[float], str]]:
    """label -> (x, y, marker) of every line of ``fig`` with a finite point (alert lines left out)."""
    out = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            xs, ys = list(map(float, line.get_xdata())), list(map(float, line.get_ydata()))
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
            if (pts and len(set(xs)) > 1) or (pts and line.get_marker() not in ("None", None, "")):
                out[str(line.get_label())] = (
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    str(line.get_marker()),
                )
    return out


@pytest.fixture(scope="module")
def short_nan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, RecordingMLP]:
    """Issue 25's run: 20 steps at Lightning's default ``log_every_n_steps=50``, then a NaN loss.
    ``training_step`` logs ``train_loss`` every step, yet Lightning never reaches a logging step."""
    tmp = tmp_path_factory.mktemp("short_nan")
    torch.manual_seed(0)
    model = NaNAt(20)
    callbacks = [NaNSentinel(), GradientNormLogger()]
    log_dir = _fit(tmp, model, callbacks, random_loader(n=512), log_every_n_steps=50, max_epochs=3)
    return log_dir, model


def test_a_run_that_dies_before_lightnings_first_logging_step_says_why_and_shows_what_it_has(
    short_nan_run: tuple[str, RecordingMLP], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No loss reached the event file: the report says why (the run ended at step 20, before a logging
    step), draws the total gradient norm NaNSentinel's report kept for every step (equal to the norms the
    model recorded itself), gives the NaN report an origin and the run its true step range."""
    from lightning_gradguard.report import figures, gaps

    log_dir, model = short_nan_run
    run = read_run(find_run(log_dir))
    assert run.loss_tag is None  # Lightning logged no train_loss: the premise of the issue
    gap = gaps.loss_gap(run)
    assert gap is not None and "the run ended at step 20" in gap and "never reached a logging step" in gap
    lines = summary_lines(run)
    assert lines[0].endswith("(steps 0-20, 1 alert(s))")
    assert any(
        line.startswith("  training loss: No training loss logged: the run ended at step 20")
        for line in lines
    )
    shown = _visible(_drawn(monkeypatch, figures.alert_timeline, run))
    (label,) = shown
    assert label == "total gradient norm (NaN report, step 20)"
    steps, norms, _ = shown[label]
    assert steps == list(range(20))
    assert norms == pytest.approx([model.true_total[s] for s in range(20)], rel=1e-5)
    page = Path(build_report(log_dir)).read_text(encoding="utf-8")
    assert "Drawn instead: total gradient norm (NaN report, step 20)." in page
    assert "No training loss logged: the run ended at step 20" in page
    (report,) = run.nan_reports
    origin = gaps.nan_origin(report)  # what the replay found, or why it found nothing: never blank
    assert origin and f"<td>{html.escape(origin)}</td>" in page


def test_a_nan_report_without_an_origin_says_why_and_names_the_first_bad_tensor(
    short_nan_run: tuple[str, RecordingMLP], tmp_path: Path
) -> None:
    """``report.json`` as NaNSentinel(find_origin=False) writes it (``"origin": null``): the origin cell
    says it was not located and names the first non-finite gradient instead of staying blank."""
    import json
    import shutil

    from lightning_gradguard.report import gaps

    copy = tmp_path / "run"
    shutil.copytree(short_nan_run[0], copy)
    (path,) = copy.glob("nan_report/step_20/report.json")
    path.write_text(json.dumps(json.loads(path.read_text()) | {"origin": None}))
    (report,) = read_run(str(copy)).nan_reports
    origin = gaps.nan_origin(report)
    assert origin.startswith("not located:") and origin.endswith("first non-finite tensor: net.0.weight")
    page = Path(build_report(str(copy))).read_text(encoding="utf-8")
    assert f"<td>{html.escape(origin)}</td>" in page


def test_single_point_charts_are_drawn_as_markers(
    short_nan_run: tuple[str, RecordingMLP], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GradientNormLogger logged step 0 only: each layer's update ratio is one marker at step 0, and the
    x axis spans the run's steps 0-20."""
    from lightning_gradguard.report import figures

    run = read_run(find_run(short_nan_run[0]))
    fig = _drawn(monkeypatch, figures.update_ratios, run)
    shown = _visible(fig)
    assert set(shown) >= {"total", "net.0", "net.2"}
    for name in ("total", "net.0", "net.2"):
        steps, values, marker = shown[name]
        assert steps == [0.0] and marker == "o"
        assert values == pytest.approx(run.scalars[f"update_ratio/{name}"].values)
    low, high = fig.axes[0].get_xlim()
    assert low < 0 < 20 < high


def test_the_recorded_log_every_n_steps_is_read_from_lightningclis_config(
    short_nan_run: tuple[str, RecordingMLP], tmp_path: Path
) -> None:
    import shutil

    from lightning_gradguard.report import gaps

    copy = tmp_path / "run"
    shutil.copytree(short_nan_run[0], copy)
    (copy / "config.yaml").write_text(
        "seed_everything: 0\ntrainer:\n  max_epochs: 3\n  log_every_n_steps: null\n"
    )
    run = read_run(str(copy))
    assert run.log_every_n_steps == 50  # null: Lightning's default
    gap = gaps.loss_gap(run)
    assert gap is not None
    assert (
        "before Lightning's first logging step (step 49 at log_every_n_steps=50, recorded in the run's" in gap
    )


class QuietMLP(RecordingMLP):
    """Logs no loss at all."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def test_a_run_that_logs_no_loss_is_not_blamed_on_the_logging_interval(tmp_path: Path) -> None:
    """Past its logging steps (every 5, read from GradGuard's charts) a run without a loss tag is told to
    log one; nothing claims it ended too early."""
    from lightning_gradguard.report import gaps

    torch.manual_seed(0)
    log_dir = _fit(
        tmp_path, QuietMLP(), [GradientNormLogger()], random_loader(), max_steps=12, log_every_n_steps=5
    )
    run = read_run(find_run(log_dir))
    assert gaps.logging_interval(run).every == 5
    gap = gaps.loss_gap(run)
    assert gap is not None and gap.startswith("No training loss in the event files") and "ended" not in gap
    # the charts' interval could be a monitor's own: before step 49 the report names that case too
    assert "a monitor's own log_every_n_steps" in gap and "first logging step (49)" in gap


def test_a_monitors_own_logging_interval_is_not_taken_for_the_trainers(tmp_path: Path) -> None:
    """Regression: GradientNormLogger(log_every_n_steps=5) under the Trainer's default 50, a 20-step run
    without a loss on the charts: the report told the user to log a loss they had logged (Lightning never
    reached step 49); it now names that case."""
    from lightning_gradguard.report import gaps

    torch.manual_seed(0)
    logger = GradientNormLogger(log_every_n_steps=5)
    log_dir = _fit(
        tmp_path, RecordingMLP(), [logger], random_loader(n=160), max_steps=20, log_every_n_steps=50
    )
    run = read_run(find_run(log_dir))
    assert run.loss_tag is None or not run.scalars.get(run.loss_tag)  # training_step's loss never written
    gap = gaps.loss_gap(run)
    assert gap is not None and "never reached the Trainer's first logging step (49)" in gap, gap


class ShiftedLoss(RecordingMLP):
    """Logs a loss below zero (a cross entropy minus 10), then a NaN one at ``nan_step`` (no sentinel)."""

    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.nan_from = nan_from

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y) - 10.0
        shown = loss.detach() * float("nan") if self.global_step >= self.nan_from else loss.detach()
        self.log("train_loss", shown)
        return loss


def test_a_negative_loss_is_drawn_and_an_all_nan_loss_chart_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_gradguard.report import figures

    torch.manual_seed(0)
    negative = read_run(find_run(_fit(tmp_path / "neg", ShiftedLoss(99), [], random_loader(), max_steps=6)))
    shown = _visible(_drawn(monkeypatch, figures.alert_timeline, negative))
    assert shown["train_loss"][0] == [0, 1, 2, 3, 4, 5]
    assert shown["train_loss"][1] == pytest.approx(negative.scalars["train_loss"].values)
    assert all(v < 0 for v in shown["train_loss"][1])
    nan = read_run(find_run(_fit(tmp_path / "nan", ShiftedLoss(0), [], random_loader(), max_steps=3)))
    fig = _drawn(monkeypatch, figures.alert_timeline, nan)
    assert not _visible(fig)
    assert any("holds no finite value (3 point(s)" in t.get_text() for t in fig.axes[0].texts)


def test_the_step_range_is_the_runs_not_the_range_tests_sweep(tmp_path: Path) -> None:
    """A 40-point LR range test and a 30-step overfit check write their curves at their own steps 0..39 and
    0..30, and the range test's search (blind: this sweep is refused) its candidates at their index; the
    run itself has 10 steps: the report says steps 0-9. (Regression: the search's candidate index was read
    as the run's step, so a search of more candidates than the run has steps stretched the range.)"""
    from lightning_gradguard import OverfitBatchSanity

    torch.manual_seed(0)
    callbacks = [
        OverfitBatchSanity(max_steps=30, target_mode="absolute", target=0.0, action="warn"),
        LRFinderPlus(num_training=40, progress=False),
        GradientNormLogger(),
    ]
    log_dir = _fit(tmp_path, RecordingMLP(), callbacks, random_loader(n=512), max_steps=10)
    run = read_run(find_run(log_dir))
    assert max(run.scalars["lr_finder/loss"].steps) == 39  # the sweep is in the event file
    assert max(run.scalars["lr_finder/search_loss"].steps) > 9  # and the search's candidates
    assert max(run.scalars["preflight/overfit_loss"].steps) == 30  # its initial loss, then 30 steps
    assert max(run.scalars["train_loss"].steps) == 9
    assert run.step_range() == (0, 9)
    assert f"(steps 0-9, {len(run.alerts)} alert(s))" in summary_lines(run)[0]
    page = Path(build_report(log_dir)).read_text(encoding="utf-8")
    assert f"</code>, steps 0-9, {len(run.alerts)} alert(s)." in page


def test_the_range_test_chart_marks_no_suggestion_the_finder_rejected_as_noise() -> None:
    """Regression: the report recomputed every method's suggestion from the smoothed curve alone and drew
    four of them on a curve of pure noise, beside the finder's lr_finder_failed alert saying there was none.
    It now asks the same noise check as LRFinderPlus (the raw losses in the CSV)."""
    import numpy as np

    from lightning_gradguard.functional.lr_suggest import centered_smooth, descent_check, sweep_lrs
    from lightning_gradguard.report.figures import range_test_suggestions

    lrs = sweep_lrs(1e-6, 1.0, 100)
    noise = list(2.3 + 0.05 * np.random.default_rng(0).standard_normal(100))
    falling = [2.3 - 2.0 / (1.0 + math.exp(-(i - 60) / 6.0)) + n - 2.3 for i, n in enumerate(noise)]
    for losses, stands_out in ((noise, False), (falling, True)):
        smooth = centered_smooth(losses)
        assert descent_check(losses, smooth).stands_out is stands_out
        columns = {"lr": lrs, "loss": losses, "smoothed_loss": smooth, "curve": smooth}
        drawn = range_test_suggestions(columns)
        assert any(drawn.values()) is stands_out, drawn
    assert range_test_suggestions({"lr": lrs, "loss": noise}) == {}  # no smoothed curve: nothing drawn


def test_the_search_marks_star_the_winner_in_new_and_old_run_folders() -> None:
    """The search's CSV marks its winning candidate as ``won``; folders written before the suggestion sat
    below the winner marked it ``chosen``. Both draw that candidate, and only it, as the star."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from lightning_gradguard.report.figures import _search_marks

    base = {"lr": [0.01, 0.1, 0.05], "loss": [0.9, 0.4, 0.3], "round": [0.0, 0.0, 1.0]}
    for column in ("won", "chosen"):
        ax = Figure().add_subplot(1, 1, 1)
        _search_marks(ax, {**base, column: [0.0, 0.0, 1.0]})
        right = ax.figure.axes[-1]
        stars = [line.get_xdata()[0] for line in right.get_lines() if line.get_marker() == "*"]
        assert stars == [0.05], column
