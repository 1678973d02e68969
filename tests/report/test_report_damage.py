"""``gradguard report`` on the run folders that crashes, full disks and other people leave behind.

One real run (a ``Trainer.fit`` with a ``TensorBoardLogger``, NaNSentinel stopping it at step 5, and the
files the other monitors write beside it) is copied and damaged one way per test; the real command
(``lightning_gradguard.report.cli:main``) must read what parses, keep the NaN at step 5 it can still read,
and say what it skipped: on the page and in one terminal line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_gradguard import GradientNormLogger, NaNSentinel, NonFiniteError
from lightning_gradguard.monitors.spike.records import SpikeRecord, write_spikes
from lightning_gradguard.report import find_run, main, read_run

ALERTS = "gradguard_alerts.jsonl"


class NaNAt(RecordingMLP):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.nan_step else loss


def _fit(root: Path, model: nn.Module, name: str = "run", **kwargs: Any) -> Path:
    logger = TensorBoardLogger(str(root), name=name, default_hp_metric=False)
    callbacks = [NaNSentinel(), GradientNormLogger(log_every_n_steps=1)]
    trainer = make_trainer(callbacks, logger, default_root_dir=str(root), max_steps=8, **kwargs)
    with contextlib.suppress(NonFiniteError):
        trainer.fit(model, random_loader())
    logger.finalize("success")
    return Path(logger.log_dir)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped by a NaN at step 5, with a spikes.json, a range test's CSV and a LightningCLI config."""
    torch.manual_seed(0)
    run = _fit(tmp_path_factory.mktemp("nan"), NaNAt(5))
    write_spikes(
        str(run / "spikes.json"), [SpikeRecord(step=s, epoch=0, batch_idx=[s], loss=2.0) for s in (1, 2, 3)]
    )
    rows = "".join(
        f"{i},{10 ** (i / 4 - 4)},{2.0 - i / 40},{2.0 - i / 40},{2.0 - i / 40}\n" for i in range(20)
    )
    (run / "lr_finder.csv").write_text("step,lr,loss,smoothed_loss,curve\n" + rows, encoding="utf-8")
    (run / "config.yaml").write_text("trainer:\n  log_every_n_steps: 1\n", encoding="utf-8")
    return run


def _report(run: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    """The real command on ``run``: its page and its terminal output (it must succeed)."""
    assert main(["report", str(run), *args]) == 0
    out = capsys.readouterr().out
    page = Path(args[args.index("-o") + 1] if "-o" in args else run / "gradguard_report.html")
    return page.read_text(encoding="utf-8"), out


def _copy(nan_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(nan_run, tmp_path / "version_0"))


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def _rewrite_alert(path: Path, **fields: Any) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0]) | fields
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n", encoding="utf-8")


def _event_file(run: Path) -> Path:
    return next(p for p in run.iterdir() if p.name.startswith("events.out.tfevents."))


def _corrupt_middle_record(run: Path) -> None:
    events = _event_file(run)
    data = bytearray(events.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    events.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "torn last alert line": (lambda r: _append(r / ALERTS, b'{"kind": "nonfinite_gr'), ALERTS),
    "non-UTF-8 alert line": (lambda r: _append(r / ALERTS, b'{"kind": "\xff\xfe", "step": 1}\n'), ALERTS),
    "a JSON array on a line": (lambda r: _append(r / ALERTS, b"[1, 2, 3]\n"), ALERTS),
    "a non-finite step": (lambda r: _append(r / ALERTS, b'{"kind": "x", "step": NaN}\n'), ALERTS),
    "an infinite step": (lambda r: _append(r / ALERTS, b'{"kind": "x", "step": Infinity}\n'), ALERTS),
    "a step too large to draw": (
        lambda r: _append(r / ALERTS, b'{"kind": "x", "step": ' + b"9" * 400 + b"}\n"),
        ALERTS,
    ),
    "a fractional step": (lambda r: _append(r / ALERTS, b'{"kind": "x", "step": 2.5}\n'), ALERTS),
    "a deeply nested line": (lambda r: _append(r / ALERTS, b"[" * 100_000 + b"\n"), ALERTS),
    "a half-written spikes.json": (
        lambda r: (r / "spikes.json").write_bytes((r / "spikes.json").read_bytes()[:-60]),
        "spikes.json",
    ),
    "a spike entry without a step": (
        lambda r: (r / "spikes.json").write_text('{"spikes": [{"step": 1}, {"loss": 2}]}', encoding="utf-8"),
        "spikes.json",
    ),
    "a malformed CSV row": (lambda r: _append(r / "lr_finder.csv", b"20,abc,1.0\n"), "lr_finder.csv"),
    "a non-integer log_every_n_steps": (
        lambda r: (r / "config.yaml").write_text("trainer:\n  log_every_n_steps: often\n", encoding="utf-8"),
        "config.yaml",
    ),
    "a NUL byte in a CSV row": (
        lambda r: _append(r / "lr_finder.csv", b"21,0.1\x00,1,1,1\n"),
        "lr_finder.csv",
    ),
    "a report.json that is a JSON array": (
        lambda r: (r / "nan_report" / "step_5" / "report.json").write_text("[5]", encoding="utf-8"),
        "nan_report",
    ),
    "a corrupt event record": (_corrupt_middle_record, "events.out.tfevents."),
    "a truncated event file": (
        lambda r: _event_file(r).write_bytes(_event_file(r).read_bytes()[:-7]),
        "events.out.tfevents.",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_the_report_reads_what_parses_and_says_what_it_skipped(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    run = _copy(nan_run, tmp_path)
    damage, file = DAMAGE[case]
    damage(run)
    page, out = _report(run, capsys)
    data = read_run(str(run))
    assert data.skipped and all(s.file.startswith(file) for s in data.skipped), data.skipped
    skipped_line = [line for line in out.splitlines() if line.startswith("gradguard report: skipped")]
    assert len(skipped_line) == 1 and file in skipped_line[0]
    assert "Skipped: damaged input" in page
    # what parses is kept: the NaN at step 5 (alert, and report unless that is the damaged file)
    kept = [(a["kind"], a["step"]) for a in data.alerts if a["source"] == "NaNSentinel"]
    assert kept == [("nonfinite_loss", 5)]
    if file != "nan_report":
        assert [r["step"] for r in data.nan_reports] == [5]
        assert "<h2>NaN report</h2>" in page


def test_a_half_written_spikes_json_keeps_its_whole_entries(nan_run: Path, tmp_path: Path) -> None:
    run = _copy(nan_run, tmp_path)
    DAMAGE["a half-written spikes.json"][0](run)
    assert [s["step"] for s in read_run(str(run)).spikes] == [1, 2]


def test_a_nan_report_json_with_a_nan_step_is_skipped_not_fatal(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    report = run / "nan_report" / "step_5" / "report.json"
    report.write_text(
        report.read_text(encoding="utf-8").replace('"step": 5', '"step": NaN'), encoding="utf-8"
    )
    page, out = _report(run, capsys)
    assert read_run(str(run)).nan_reports == []
    assert "skipped 1 damaged entries" in out and "report.json" in out
    assert "report.json" in page


def test_a_torn_alert_line_does_not_swallow_the_next_alert_of_a_resumed_run(tmp_path: Path) -> None:
    """The alert written after a torn line (a kill mid-write, then a resume) starts on its own line."""
    root = tmp_path / "root"
    root.mkdir()
    (root / ALERTS).write_bytes(b'{"kind": "nonfinite_loss", "step": 2, "sev')  # what a kill left
    trainer = make_trainer([NaNSentinel()], default_root_dir=str(root), max_steps=8)
    with pytest.raises(NonFiniteError):
        trainer.fit(NaNAt(3), random_loader())
    data = read_run(str(root))
    assert [(a["kind"], a["step"]) for a in data.alerts] == [("nonfinite_loss", 3)]
    assert [(s.file, s.where) for s in data.skipped] == [(ALERTS, "line 1")]


# ------------------------------------------------------------------ names are data


class PoisonLinear(nn.Linear):
    """A linear layer whose output is NaN while ``poison`` is set: the NaN is born in it."""

    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * float("nan") if self.poison else out


class Named(RecordingMLP):
    """A model whose first layer carries a hostile name (``nn.Module`` allows any name without a dot) and
    makes a NaN at ``nan_step``."""

    def __init__(self, name: str, nan_step: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential()
        self.net.add_module(name, PoisonLinear(8, 16))
        self.net.add_module("act", nn.Tanh())
        self.net.add_module("out", nn.Linear(16, 4))
        self.nan_step = nan_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.net[0].poison = self.global_step == self.nan_step
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", ["$\\frac{1}{$", "a$b", "$x^{2$_1"])
def test_a_layer_named_with_tex_is_drawn_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    torch.manual_seed(0)
    run = _fit(tmp_path, Named(name, nan_step=4))
    page, _ = _report(run, capsys)
    assert f"grad_norm/net.{name}" in read_run(str(run)).scalars
    assert "Gradient flow" in page


def test_a_logger_name_with_brackets_is_a_name_not_a_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    run = _fit(tmp_path, NaNAt(5), name="mlp[lr=0.1]")
    assert "[" in str(run)
    page, _ = _report(run.parent, capsys, "-o", str(tmp_path / "page.html"))
    assert find_run(str(run.parent)) == str(run)
    data = read_run(str(run))
    assert "grad_norm/total" in data.scalars
    assert [r["step"] for r in data.nan_reports] == [5]
    assert "<h2>NaN report</h2>" in page


def test_alerts_in_tensorboards_text_tab_are_escaped_markdown(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugin_util import markdown_to_safe_html

    hostile = "x`<img src=x onerror=alert(1)>`*[click](http://e)*"
    torch.manual_seed(0)
    run = _fit(tmp_path, Named(hostile, nan_step=3))
    acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("gradguard/alerts")
    rendered = markdown_to_safe_html(event.tensor_proto.string_val[0])
    assert "nonfinite_loss" in rendered and "&lt;img src=x" in rendered  # the name is there, as text
    assert "<img" not in rendered and "<a " not in rendered and "<em>[click]" not in rendered


def test_names_reach_the_html_page_escaped(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    _rewrite_alert(run / ALERTS, kind="<script>alert(1)</script>", where="<img src=x>", hint="<b>h</b>")
    page, _ = _report(run, capsys)
    assert "<script>alert" not in page and "<img src=x>" not in page and "<b>h</b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_names_reach_the_terminal_without_control_characters(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    _rewrite_alert(run / ALERTS, kind="\x1b[2J\x1b]0;owned\x07nonfinite_loss")
    _, out = _report(run, capsys)
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J" in out  # shown, as text


# ------------------------------------------------------------------ the run folder is not trusted


@pytest.mark.timeout(60)  # before: the NaN-report search followed the links round and round
def test_links_to_the_run_folder_itself_do_not_hang_the_report(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    os.symlink(".", run / "loop_a")
    os.symlink(".", run / "loop_b")
    started = time.perf_counter()
    page, _ = _report(run, capsys)
    assert time.perf_counter() - started < 30
    assert [r["step"] for r in read_run(str(run)).nan_reports] == [5]  # found once, not through the links
    assert page.count("<h2>NaN report</h2>") == 1


def test_a_planted_link_at_the_output_is_replaced_not_written_through(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious", encoding="utf-8")
    os.symlink(victim, run / "gradguard_report.html")
    page, _ = _report(run, capsys)
    assert victim.read_text(encoding="utf-8") == "precious"
    assert not (run / "gradguard_report.html").is_symlink() and "<h2>NaN report</h2>" in page


def test_a_file_read_through_a_link_out_of_the_run_is_not_followed(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(
        json.dumps({"kind": "planted", "step": 1, "source": "NaNSentinel"}) + "\n", encoding="utf-8"
    )
    (run / ALERTS).unlink()
    os.symlink(outside, run / ALERTS)
    _, out = _report(run, capsys)
    data = read_run(str(run))
    assert data.alerts == [] and [(s.file, s.where) for s in data.skipped] == [(ALERTS, "file")]
    assert "link out of the run folder" in out


def test_versions_are_directories_only(nan_run: Path, tmp_path: Path) -> None:
    run = _copy(nan_run, tmp_path)
    (tmp_path / "version_1.tar.gz").write_bytes(b"\x1f\x8b not a run")
    (tmp_path / "version_7").write_text("a file named like a version", encoding="utf-8")
    assert find_run(str(tmp_path)) == str(run)


def test_a_ten_megabyte_kind_is_bounded_on_the_page_and_in_time(
    nan_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(nan_run, tmp_path)
    _rewrite_alert(run / ALERTS, kind="k" * 10_000_000, message="m" * 5_000_000)
    started = time.perf_counter()
    page, _ = _report(run, capsys)
    assert time.perf_counter() - started < 15  # a minute and 1.6 GB before
    assert len(page) < 2_000_000
    (alert,) = [a for a in read_run(str(run)).alerts if a["kind"].startswith("kkk")]
    assert len(alert["kind"]) <= 200 and len(alert["message"]) <= 4000
