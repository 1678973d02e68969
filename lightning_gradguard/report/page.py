"""The report itself: a verdict per monitor, the pictures, the tables; one self-contained HTML page.

Images are embedded as ``data:`` URIs and the style sheet is inline, so the file opens offline and can be
mailed or attached to a ticket as it is.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning_gradguard.report.damage as damage
import lightning_gradguard.report.figures as figures
import lightning_gradguard.report.gaps as gaps
from lightning_gradguard.registry import FAMILIES
from lightning_gradguard.report.read import RunData
from lightning_gradguard.tags import families_of

#: the monitors a report gives a verdict on, in its order
_ORDER = (
    "OverfitBatchSanity",
    "GradientCheck",
    "LRFinderPlus",
    "GradientNormLogger",
    "VanishingExplodingDetector",
    "DeadReLUMonitor",
    "NaNSentinel",
    "LossSpikeGuard",
    "OptimizerMonitor",
    "ActivationRangeMonitor",
    "StallDetector",
)
#: monitor -> the tag prefixes that show it was attached to the run (the tag registry's families)
MONITORS: dict[str, tuple[str, ...]] = {m: tuple(f.prefix for f in families_of(FAMILIES, m)) for m in _ORDER}
_RANK = {"info": 0, "warning": 1, "error": 2, "critical": 3}
#: the most NaN reports the terminal lists (the page: ten times as many)
_NAN_REPORTS = 20


@dataclass(frozen=True)
class Verdict:
    """A monitor's verdict: ``"healthy"``, ``"warning"`` or ``"failed"``, and the alert that decided it."""

    monitor: str
    status: str
    alerts: int
    first: dict[str, Any] | None


def _present(run: RunData, monitor: str, sources: set[str]) -> bool:
    if monitor in sources:
        return True
    if monitor == "NaNSentinel":
        return bool(run.nan_reports)
    if monitor == "LossSpikeGuard" and run.spikes:
        return True
    if monitor == "LRFinderPlus" and run.lr_curves:
        return True
    return any(tag.startswith(MONITORS[monitor]) for tag in run.scalars) if MONITORS[monitor] else False


def verdicts(run: RunData) -> list[Verdict]:
    """One verdict per monitor that left a trace (tags, files or alerts), in the order of :data:`MONITORS`."""
    sources = {str(a.get("source", "")) for a in run.alerts}
    out = []
    for monitor in MONITORS:
        if not _present(run, monitor, sources):
            continue
        mine = [a for a in run.alerts if a.get("source") == monitor]
        worst = max((_RANK.get(a.get("severity", "info"), 0) for a in mine), default=0)
        if monitor == "NaNSentinel" and run.nan_reports:
            worst = max(worst, 2)
        status = "failed" if worst >= 2 else "warning" if worst == 1 else "healthy"
        first = (
            next((a for a in mine if _RANK.get(a.get("severity", "info"), 0) == worst), None)
            if mine
            else None
        )
        out.append(Verdict(monitor, status, len(mine), first))
    return out


def _steps(run: RunData) -> str:
    """The run's step range (a range test's sweep and the overfit check's own steps are not the run's)."""
    span = run.step_range()
    return f"steps {span[0]}-{span[1]}" if span else "no step recorded"


def summary_lines(run: RunData, out_path: str | None = None) -> list[str]:
    """The short terminal summary: one line per monitor, the NaN reports and spikes, where the page is."""
    lines = [f"gradguard report: {run.path} ({_steps(run)}, {len(run.alerts)} alert(s))"]
    for v in verdicts(run):
        first = v.first
        detail = (
            f"  first: [{first.get('severity')}] {first.get('kind')} at step {first.get('step')}"
            if first
            else ""
        )
        lines.append(f"  {v.monitor:<28} {v.status:<8}{detail}")
    for report in run.nan_reports[:_NAN_REPORTS]:
        lines.append(
            f"  NaN report: {report.get('kind')} at step {report.get('step')} ({report.get('folder')})"
        )
    if len(run.nan_reports) > _NAN_REPORTS:
        lines.append(f"  and {len(run.nan_reports) - _NAN_REPORTS} more NaN reports (on the page)")
    if run.spikes:
        lines.append(f"  loss spikes recorded: {len(run.spikes)}")
    gap = gaps.loss_gap(run)
    if gap is not None:
        lines.append(f"  training loss: {gap}")
    if out_path:
        lines.append(f"  HTML report: {out_path}")
    skipped = damage.summary(run.skipped)
    if skipped:
        lines.append(skipped)
    return [damage.terminal(line) for line in lines]  # names are data: no control character reaches it


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;
color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top;font-size:0.9em}th{background:#f4f4f4}.healthy{color:#1a7f37;font-weight:600}
.warning{color:#b35900;font-weight:600}.failed{color:#c0392b;font-weight:600}img{max-width:100%}
.caption{color:#555;font-size:0.9em}code{background:#f4f4f4;padding:0 3px}
.note{background:#fff8e6;border-left:3px solid #dd8452;padding:4px 8px;font-size:0.9em}
"""


def _img(png: bytes | None, alt: str, caption: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    image = f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    return f'<figure>{image}<figcaption class="caption">{html.escape(caption)}</figcaption></figure>'


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


#: (section title, figure, how to read it)
_SECTIONS: list[tuple[str, Callable[[RunData], bytes | None], str]] = [
    (
        "Loss and alerts",
        figures.alert_timeline,
        "Each vertical line is an alert at its step, coloured by severity.",
    ),
    (
        "Gradient flow",
        figures.gradient_flow,
        "Layers in model order, first at the top. A dark band in the first layers is vanishing gradients; a "
        "bright band or bright columns are exploding ones. A healthy run is an even colour from top to "
        "bottom.",
    ),
    (
        "Update / weight ratio",
        figures.update_ratios,
        "How far each step moves each layer's weights, relative to their size. About 1e-3 (dashed) is "
        "healthy; far below, the layer barely learns; far above, the step is too large.",
    ),
    (
        "Dead and saturated units",
        figures.unit_health,
        "Fraction of units that never fire (ReLU) or sit in the flat tails (sigmoid/tanh).",
    ),
    (
        "Gradient clipping",
        figures.clipping,
        "Put gradient_clip_val near the p90 of the pre-clip norm; the suggested value is dashed.",
    ),
    (
        "Loss spikes",
        figures.spikes,
        "Robust z-scores of the loss and the gradient norm; orange lines are recorded spikes.",
    ),
]


#: the most range tests the page draws
_RANGE_TESTS = 20
#: the columns of the spike and alert tables (the first 200 spikes, the first 500 alerts)
_SPIKE_KEYS = ["step", "epoch", "batch_idx", "loss", "loss_zscore", "grad_norm", "grad_norm_zscore", "action"]
_ALERT_KEYS = ["step", "severity", "kind", "source", "where", "message", "hint"]


def render_html(run: RunData) -> str:
    """The whole page."""
    parts = [
        *_head(run),
        _verdict_table(run),
        *_nan_reports(run),
        *_figures(run),
        *_records(run),
        *_skipped(run),
        "</body></html>",
    ]
    return "\n".join(parts)


def _head(run: RunData) -> list[str]:
    """The document head, the title and the line that says which run this is."""
    return [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>gradguard report: {html.escape(os.path.basename(run.path) or run.path)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>gradguard health report</h1><p>Run <code>{html.escape(run.path)}</code>, {_steps(run)}, "
        f"{len(run.alerts)} alert(s). Made {datetime.datetime.now():%Y-%m-%d %H:%M}.</p>",
        "<h2>Verdict per monitor</h2>",
    ]


def _first_alert(first: dict[str, Any]) -> str:
    """The verdict table's "first alert" cell: severity, kind, place, step and message."""
    if not first:
        return ""
    where = f" ({first['where']})" if first.get("where") else ""
    head = f"[{first.get('severity')}] {first.get('kind')}{where} at step {first.get('step')}"
    return f"{head}: {first.get('message')}"


def _verdict_table(run: RunData) -> str:
    """One row per monitor that left a trace: its verdict, alert count, first alert and that alert's hint."""
    rows = [
        f"<tr><td>{html.escape(v.monitor)}</td><td class='{v.status}'>{v.status}</td><td>{v.alerts}</td>"
        f"<td>{html.escape(_first_alert(v.first or {}))}</td>"
        f"<td>{html.escape((v.first or {}).get('hint', ''))}</td></tr>"
        for v in verdicts(run)
    ]
    if not rows:
        return "<p>No GradGuard monitor left a trace in this run.</p>"
    return (
        "<table><tr><th>monitor</th><th>verdict</th><th>alerts</th><th>first alert</th><th>hint</th></tr>"
        f"{''.join(rows)}</table>"
    )


def _nan_reports(run: RunData) -> list[str]:
    """A heading and a one-row table per NaN report."""
    parts = []
    for report in run.nan_reports[: _NAN_REPORTS * 10]:
        origin = report.get("origin") or {}
        row = [
            report.get("kind"),
            report.get("step"),
            report.get("epoch"),
            report.get("batch_idx"),
            gaps.nan_origin(report),
            origin.get("op", ""),
            report.get("folder"),
        ]
        parts.append("<h2>NaN report</h2>")
        parts.append(_table(["kind", "step", "epoch", "batch", "origin", "op", "folder"], [row]))
    return parts


def _figures(run: RunData) -> list[str]:
    """The sections of :data:`_SECTIONS` that have a picture, then one LR range test per recorded curve."""
    parts = []
    for title, draw, caption in _SECTIONS:
        image = draw(run)
        if image is not None:
            note = gaps.loss_note(run) if draw is figures.alert_timeline else None
            shown = f"<p class='note'>{html.escape(note)}</p>" if note else ""
            parts.append(f"<h2>{html.escape(title)}</h2>{shown}{_img(image, title, caption)}")
    for name in list(run.lr_curves)[:_RANGE_TESTS]:  # one per milestone epoch: a few
        image = figures.lr_range_test(run, name)
        caption = "Dotted: every suggestion; green: the LR the run trained with."
        if name in run.lr_searches:
            caption += (
                " Purple (right axis): the loss each candidate of the search reached, filled in its last "
                "round; the star: the winner (the suggestion sits a little below it: short trials favour "
                "large LRs)."
            )
        parts.append(f"<h2>LR range test</h2>{_img(image, name, caption)}")
    return parts


def _records(run: RunData) -> list[str]:
    """The tables of recorded spikes and of alerts, where there are any."""
    parts = []
    if run.spikes:
        parts.append("<h2>Spikes recorded</h2>")
        parts.append(_table(_SPIKE_KEYS, [[s.get(k) for k in _SPIKE_KEYS] for s in run.spikes[:200]]))
    if run.alerts:
        parts.append("<h2>Alerts</h2>")
        parts.append(_table(_ALERT_KEYS, [[a.get(k) for k in _ALERT_KEYS] for a in run.alerts[:500]]))
    return parts


#: the most skipped entries the page lists one by one
_SKIPPED_ROWS = 200


def _skipped(run: RunData) -> list[str]:
    """What the readers could not read (a torn line, a corrupt record, a malformed row), and why."""
    if not run.skipped:
        return []
    rows = [[s.file, s.where, s.reason] for s in run.skipped[:_SKIPPED_ROWS]]
    more = len(run.skipped) - len(rows)
    note = f"<p class='note'>and {more} more not listed</p>" if more > 0 else ""
    return [
        "<h2>Skipped: damaged input</h2>",
        f"<p>{len(run.skipped)} entr{'y' if len(run.skipped) == 1 else 'ies'} of the run folder could not be "
        "read and are left out of this page; everything else is shown.</p>",
        _table(["file", "where", "why"], rows) + note,
    ]
