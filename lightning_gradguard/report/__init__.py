"""``gradguard report``: one self-contained HTML health report of a run from its logs.

:func:`build_report` writes it; :func:`read_run` reads what a run left (TensorBoard event files,
``gradguard_alerts.jsonl``, NaN reports, ``spikes.json``, LR range tests); ``render_html`` and
``summary_lines`` turn that into the page and the terminal summary.
"""

from lightning_gradguard.report.cli import build_report, main
from lightning_gradguard.report.page import render_html, summary_lines, verdicts
from lightning_gradguard.report.read import RunData, find_run, read_run

__all__ = [
    "RunData",
    "build_report",
    "find_run",
    "main",
    "read_run",
    "render_html",
    "summary_lines",
    "verdicts",
]
