"""The examples a user runs first: each one runs to the end in a fresh folder and says what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_quickstart_trains_and_prints_a_health_summary(tmp_path: Path) -> None:
    out = run_example("quickstart.py", tmp_path).stdout
    assert "=== gradguard health summary" in out
    acc = float(out.split("final val accuracy")[1].split()[0])
    assert acc > 0.9  # a real model learned real data
    assert "alerts by kind          none" in out
    assert list((tmp_path / "runs" / "quickstart").glob("version_0/events.out.tfevents.*"))


def test_nan_failfast_fails_reports_and_resumes(tmp_path: Path) -> None:
    out = run_example("nan_failfast.py", tmp_path).stdout
    assert "NonFiniteError: nonfinite_loss at step 3" in out
    assert "`standardize` (PerImageStandardize) produced" in out
    folder = tmp_path / "runs" / "nan_failfast" / "version_0" / "nan_report" / "step_3"
    report = json.loads((folder / "report.json").read_text())
    assert report["kind"] == "nonfinite_loss" and report["origin"]["module"] == "standardize"
    assert (folder / "batch.pt").exists() and (folder / "last_good.ckpt").exists()
    resumed = out.split("resumed at step 3 and finished at step ")[1]
    assert int(resumed.split()[0]) > 3


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_a_docstring_that_says_how_to_run_it(name: str) -> None:
    text = (EXAMPLES / name).read_text()
    assert text.startswith('"""') and "Run it" in text.split('"""')[1]
