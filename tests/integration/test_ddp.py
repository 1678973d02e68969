"""A real 2-process DDP run on CPU (gloo): rank 0 logs, and the numbers are the all-reduced ones."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import _launch, run_ddp_script


def test_ddp_two_processes_rank_zero_logs_all_reduced_norms(tmp_path: Path) -> None:
    proc = run_ddp_script("ddp_grad_norm.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == 6  # 96 samples / 2 ranks / batch 8
    for step in seen[0]:  # after the all-reduce both ranks hold the same gradient
        assert seen[0][step] == pytest.approx(seen[1][step], rel=1e-6)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("grad_norm/total")]
    logged = {int(r["step"]): float(r["grad_norm/total"]) for r in rows}
    assert sorted(logged) == [0, 1, 3, 5]
    for step, value in logged.items():
        assert value == pytest.approx(seen[0][str(step)], rel=1e-5)
    assert list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_ddp_a_skipped_nan_step_leaves_every_ranks_buffers_as_they_were(tmp_path: Path) -> None:
    """A NaN in rank 1's batch at step 3 of a BatchNorm CNN under NaNSentinel(action="skip"): both ranks
    drop the step, and on both the running statistics its forward wrote go back (rank 1's were NaN, rank
    0's had moved); every buffer is finite at the end. (SyncBatchNorm needs CUDA.)"""
    proc = run_ddp_script("ddp_buffers.py", tmp_path, timeout=120)
    results = [json.loads((tmp_path / "batchnorm" / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = {"restored": True, "finite": True, "alerts": [["nonfinite_loss", 3]]}
    assert results == [expected, expected], proc.stderr[-4000:]


def test_ddp_nan_on_one_rank_fails_every_rank_the_same_way(tmp_path: Path) -> None:
    proc = run_ddp_script("ddp_nan_one_rank.py", tmp_path, timeout=120)  # a hang would time out here
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["error"] for r in results] == ["NonFiniteError", "NonFiniteError"], proc.stderr[-4000:]
    assert results[0]["message"] == results[1]["message"]
    report = results[0]["report"]
    assert report["kind"] == "nonfinite_loss" and report["step"] == 3 and report["rank"] == 1
    assert report["origin"]["in_input"] is True  # rank 1 replayed its own bad batch
    assert abs(results[0]["time"] - results[1]["time"]) < 10
    folder = tmp_path / "nan_report" / "step_3"
    assert {"report.json", "batch.pt", "last_good.ckpt"} <= {p.name for p in folder.iterdir()}


ABORTS_ONCE = """
import os, sys
from pathlib import Path
out = Path(sys.argv[1])
marker = out.parent / "attempts"
first = not marker.exists()
marker.write_text("x")
(out / ("first.txt" if first else "second.txt")).write_text("written")
if first:  # gloo's shutdown race: the run finished, then the interpreter aborted at exit
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
"""


def test_a_launch_retried_after_gloos_abort_at_exit_leaves_only_the_second_runs_files(tmp_path: Path) -> None:
    """Regression: the retry ran into the same folder, so the first attempt's files stayed beside the
    second's; a scenario's TensorBoardLogger (version 0) then held two event files, and the test that
    expects one failed once in a full run. The folder's earlier contents stay."""
    script, out = tmp_path / "aborts_once.py", tmp_path / "out"
    script.write_text(ABORTS_ONCE)
    out.mkdir()
    (out / "launch.lock").write_text("")  # what was there before the launch (the suite's lock file)
    proc = _launch([str(script), str(out)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["launch.lock", "second.txt"]
