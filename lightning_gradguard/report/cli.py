"""``gradguard report RUN_DIR``: the command line (also ``python -m lightning_gradguard.report``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from lightning_gradguard.alerts import write_atomically
from lightning_gradguard.report.figures import matplotlib_or_exit
from lightning_gradguard.report.page import render_html, summary_lines
from lightning_gradguard.report.read import RunData, find_run, read_run


def build_report(
    run_dir: str, output: str | None = None, version: int | str | None = None, loss_tag: str | None = None
) -> str:
    """Write the HTML report of the run under ``run_dir``; return its path.

    Args:
        run_dir: a run's log directory (``.../version_3``), or a folder of versions (the newest is taken
            unless ``version`` says which).
        output: where to write the page (default ``<run>/gradguard_report.html``).
        version: which ``version_<n>`` to report on.
        loss_tag: the scalar tag of the training loss (default: the first tag with "loss" in its name,
            a training one first).
    """
    return _write(run_dir, output, version, loss_tag)[0]


def _write(
    run_dir: str, output: str | None, version: int | str | None, loss_tag: str | None
) -> tuple[str, RunData]:
    matplotlib_or_exit()
    run = read_run(find_run(run_dir, version), loss_tag)
    path = output or os.path.join(run.path, "gradguard_report.html")
    write_atomically(path, render_html(run))  # a link planted at the path is replaced, never written through
    return path, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradguard", description="lightning-gradguard tools")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="write a self-contained HTML health report of a run")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run's log directory, or a folder of versions")
    report.add_argument("-o", "--output", help="the HTML file (default: <run>/gradguard_report.html)")
    report.add_argument("--version", help="which version_<n> of RUN_DIR (default: the newest)")
    report.add_argument("--loss-tag", help="the scalar tag of the training loss (default: found by name)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        path, run = _write(args.run_dir, args.output, args.version, args.loss_tag)  # the run is read once
    except FileNotFoundError as err:
        print(f"gradguard report: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the page could not be written where asked (a folder there, no permission)
        print(f"gradguard report: could not write the report: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    for line in summary_lines(run, path):
        print(line)
    print(f"  made in {time.perf_counter() - started:.1f} s")
    return 0
