"""When a picture is missing or thin: why, in words, and what the run left that can stand in for it.

A short run at Lightning's default ``log_every_n_steps=50`` that dies at step 20 never reaches a logging
step, so the loss it ``self.log``-s every step never reaches the event file. The report then says so
(:func:`loss_gap`) and draws what the run does have (:func:`stand_ins`): StallDetector's checked loss,
the losses recorded with spikes and alerts, the recent losses and gradient norms of a NaN report, or
GradientNormLogger's total norm.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lightning_gradguard.monitors.gradients.tags import GRAD_NORM, UPDATE_RATIO, WEIGHT_NORM
from lightning_gradguard.monitors.optimizer.tags import OPTIMIZER
from lightning_gradguard.monitors.stall.tags import STALL
from lightning_gradguard.report.damage import whole_step
from lightning_gradguard.report.read import LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS, RunData

#: the families written on Lightning's logging steps (step 0, then ``(step + 1) % every == 0``)
_ON_LOGGING_STEPS = tuple(f.prefix for f in (GRAD_NORM, WEIGHT_NORM, UPDATE_RATIO, OPTIMIZER))
#: where :func:`logging_interval` found the interval when the run recorded none
FROM_CHARTS = "read from the steps of GradGuard's charts"
_ADVICE = (
    "Lightning writes self.log values only on its logging steps ((step + 1) % log_every_n_steps == 0) and "
    "at epoch end; for short runs pass Trainer(log_every_n_steps=1)."
)


@dataclass(frozen=True)
class Interval:
    """What the run says about its logging interval: ``every`` when known (``source`` says how), else
    ``above``: a bound it must exceed (the charts hold only step 0 although the run went on)."""

    every: int | None = None
    above: int | None = None
    source: str = ""


@dataclass
class StandIn:
    """A series the run has in place of the logged loss: ``axis`` is ``"loss"`` or ``"grad_norm"``;
    ``markers`` draws points only (scattered records, not a curve)."""

    label: str
    axis: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    markers: bool = False


def logging_interval(run: RunData) -> Interval:
    """The Trainer's ``log_every_n_steps`` where the run recorded it, else read from the steps of
    GradGuard's per-logging-step charts (the gap between two logged steps after step 0)."""
    if run.log_every_n_steps is not None:
        return Interval(every=run.log_every_n_steps, source="recorded in the run's config")
    seen: Counter[int] = Counter()
    only_first = False
    for tag, series in run.scalars.items():
        if not tag.startswith(_ON_LOGGING_STEPS):
            continue
        later = sorted({s for s in series.steps if s > 0})
        if len(later) >= 2:
            seen[later[1] - later[0]] += 1
        elif later:
            seen[later[0] + 1] += 1
        elif series.steps:
            only_first = True
    if seen:
        return Interval(every=seen.most_common(1)[0][0], source=FROM_CHARTS)
    span = run.step_range()
    if only_first and span is not None and span[1] > 0:
        return Interval(above=span[1] + 1, source="GradGuard's charts hold only step 0")
    return Interval()


def loss_gap(run: RunData) -> str | None:
    """Why the run has no training loss to draw (``None`` when it has one)."""
    if run.loss_tag is not None and run.scalars.get(run.loss_tag):
        return None
    span = run.step_range()
    if span is None:
        return "No training loss logged, and no step of the run was recorded."
    last, interval = span[1], logging_interval(run)
    if interval.every is not None and last < interval.every - 1:
        return (
            f"No training loss logged: the run ended at step {last}, before Lightning's first logging step "
            f"(step {interval.every - 1} at log_every_n_steps={interval.every}, {interval.source}). {_ADVICE}"
        )
    if interval.above is not None:
        return (
            f"No training loss logged: the run ended at step {last} and {interval.source}, so "
            f"log_every_n_steps was above {interval.above} (Lightning's default is "
            f"{LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS}): Lightning never reached a logging step. {_ADVICE}"
        )
    if interval.every is None and last < LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS - 1:
        return (
            f"No training loss logged: the run ended at step {last}, before step "
            f"{LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS - 1}, Lightning's first logging step at its default "
            f"log_every_n_steps={LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS} (the run's own setting is not "
            f"recorded). {_ADVICE}"
        )
    told = (
        "No training loss in the event files: self.log a tag with 'loss' in its name from training_step, "
        "or pass --loss-tag."
    )
    if interval.source == FROM_CHARTS and last < LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS - 1:
        # a monitor's own log_every_n_steps (GradientNormLogger, OptimizerMonitor) also makes those steps
        told += (
            f" Or, if {interval.every} steps is a monitor's own log_every_n_steps and the Trainer kept "
            f"Lightning's default of {LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS}, the run (last step {last}) never "
            f"reached the Trainer's first logging step ({LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS - 1}). {_ADVICE}"
        )
    return told


def _records_with_loss(label: str, records: list[dict[str, Any]], key: str) -> StandIn | None:
    """The finite ``key`` values of ``records`` (spikes, alerts' data), as markers at their steps."""
    found = StandIn(label, "loss", markers=True)
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and isinstance(record.get("step"), int):
            found.steps.append(record["step"])
            found.values.append(float(value))
    return found if found.steps else None


def _nan_report_series(run: RunData) -> list[StandIn]:
    """The recent losses (when the report holds them) and total gradient norms of every NaN report."""
    out = []
    for report in run.nan_reports:
        where = f"NaN report, step {report.get('step')}"
        for key, value_key, axis, what in (
            ("recent_losses", "loss", "loss", "loss"),
            ("recent_total_grad_norms", "total_grad_norm", "grad_norm", "total gradient norm"),
        ):
            rows = report.get(key)
            points: list[tuple[int, float]] = []
            for r in rows if isinstance(rows, list) else []:
                step = whole_step(r.get("step")) if isinstance(r, dict) else None
                if step is not None and isinstance(r.get(value_key), int | float):
                    points.append((step, float(r[value_key])))
            if points:
                out.append(
                    StandIn(f"{what} ({where})", axis, [s for s, _ in points], [float(v) for _, v in points])
                )
    return out


def stand_ins(run: RunData) -> list[StandIn]:
    """What the run has in place of a logged training loss, losses first, then gradient norms."""
    found: list[StandIn] = []
    stall = run.scalars.get(STALL.tag("loss"))
    if stall is not None and stall.steps:
        found.append(StandIn("StallDetector's mean loss per check", "loss", stall.steps, stall.values))
    found += _nan_report_series(run)
    for label, records, key in (
        ("loss at a recorded spike", run.spikes, "loss"),
        ("loss in an alert", [a | {"loss": (a.get("data") or {}).get("loss")} for a in run.alerts], "loss"),
    ):
        markers = _records_with_loss(label, records, key)
        if markers is not None:
            found.append(markers)
    total = run.scalars.get(GRAD_NORM.tag("total"))
    if total is not None and total.steps and not any(s.axis == "grad_norm" for s in found):
        found.append(
            StandIn("total gradient norm (GradientNormLogger)", "grad_norm", total.steps, total.values)
        )
    found.sort(key=lambda s: s.axis != "loss")
    return found


def loss_note(run: RunData) -> str | None:
    """The loss section's note: why the loss is missing and what is drawn instead (``None``: it is not)."""
    gap = loss_gap(run)
    if gap is None:
        return None
    shown = [s.label for s in stand_ins(run)]
    instead = (
        f" Drawn instead: {'; '.join(shown)}." if shown else " The run left nothing to draw in its place."
    )
    return gap + instead


def nan_origin(report: dict[str, Any]) -> str:
    """Where a NaN report says the value was born, never blank: the module (forward replay), the backward
    op, the replay's own words, or why there is no origin and the first non-finite tensor instead."""
    origin = report.get("origin") or {}
    if origin.get("phase") == "forward" and origin.get("module") is not None:
        name = origin["module"] or "<root module>"
        return f"{name} (its input was already non-finite)" if origin.get("in_input") else name
    if origin.get("phase") == "backward" and origin.get("op"):
        return f"backward of {origin['op']}"
    if origin.get("description"):
        return str(origin["description"])
    bad = [p.get("name") for p in report.get("nonfinite_parameters") or [] if isinstance(p, dict)]
    first = f"; first non-finite tensor: {bad[0]}" if bad else ""
    return (
        "not located: NaNSentinel's replay of the batch did not find where the value was born (a value made "
        f"outside every module, e.g. in training_step's own code, or the replay was off){first}"
    )
