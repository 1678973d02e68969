"""The report's pictures, drawn with matplotlib (the ``[report]`` extra) and returned as PNG bytes.

Each function takes :class:`~lightning_gradguard.report.read.RunData` and returns ``None`` when the run
has nothing to draw for it. A series with one point is drawn as a marker, a chart whose points are all
gaps (NaN/inf, or 0 on a log axis) says so, and the step axis spans the run's steps. Colours: one
sequential map (``magma``: dark is small, bright is large) for the heatmap; alert markers coloured by
severity.
"""

from __future__ import annotations

import functools
import io
import math
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

import lightning_gradguard.report.gaps as gaps
from lightning_gradguard.report.damage import clip, terminal
from lightning_gradguard.report.read import RunData

_Draw = TypeVar("_Draw", bound=Callable[..., Any])
#: names are data: every text a picture draws is literal (``$...$`` is no formula, nothing goes to TeX)
PLAIN_TEXT: dict[Any, Any] = {"text.parse_math": False, "text.usetex": False}
#: the longest label a picture shows (a layer's name, a tag, an alert's kind), and the most lines it draws
_LABEL = 80
_MAX_LINES = 100
_MAX_ROWS = 300
_MAX_ALERT_MARKS = 200


def _label(name: Any) -> str:
    """A name as a picture shows it: control characters as text, at most :data:`_LABEL` characters."""
    return clip(terminal(str(name)), _LABEL)


def plain_text(draw: _Draw) -> _Draw:
    """``draw`` with every text it makes literal (:data:`PLAIN_TEXT`, for this picture only)."""

    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            import matplotlib
        except ImportError:  # ``draw`` says which extra to install
            return draw(*args, **kwargs)
        with matplotlib.rc_context(PLAIN_TEXT):
            return draw(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


SEVERITY_COLORS = {"info": "#4c72b0", "warning": "#dd8452", "error": "#c44e52", "critical": "#8b0000"}


def matplotlib_or_exit() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear ``SystemExit`` naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "gradguard report draws its pictures with matplotlib, which is not installed: "
            "pip install 'lightning-gradguard[report]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _series(ax: Any, steps: list[int], values: list[float], *, log: bool = False, **style: Any) -> int:
    """Draw one series on ``ax``; return how many of its points can be seen.

    NaN/inf points (and points at or below 0 on a log axis) are gaps. A series with a single visible point
    gets a marker: a one-point line draws nothing, and a short run logs single points.
    """
    ys = [v if math.isfinite(v) and (v > 0 or not log) else math.nan for v in values]
    visible = sum(not math.isnan(v) for v in ys)
    if visible == 1:
        style.setdefault("marker", "o")
        style.setdefault("ms", 5)
    if visible:
        ax.plot(steps, ys, **style)
    return visible


def _say_why(ax: Any, text: str) -> None:
    """Write why a chart holds nothing (or less than it should) across its middle."""
    ax.text(
        0.5,
        0.5,
        textwrap.fill(text, 95),
        transform=ax.transAxes,
        ha="center",
        va="center",
        color="#555555",
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "#cccccc", "alpha": 0.9},
    )


def _run_span(ax: Any, run: RunData) -> None:
    """Put the x axis over the run's steps, so a lone point or alert sits where it happened."""
    span = run.step_range()
    if span is not None:
        pad = max(0.5, 0.02 * (span[1] - span[0]))
        ax.set_xlim(span[0] - pad, span[1] + pad)


def _legend(fig: Any, ax: Any, **kwargs: Any) -> None:
    """One legend of every labelled line on the figure's axes (none when nothing is labelled)."""
    handles, labels = [], []
    for axis in fig.axes:
        h, lab = axis.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        ax.legend(handles, labels, **kwargs)


def _loss_line(ax: Any, tag: str, loss: Any) -> int:
    """The logged loss: log y when every finite value is positive, linear otherwise (a negative loss)."""
    log = all(v > 0 for v in loss.values if math.isfinite(v))
    drawn = _series(ax, loss.steps, loss.values, log=log, color="#333333", lw=1.2, label=_label(tag))
    if drawn and log:
        ax.set_yscale("log")
    ax.set_ylabel(_label(tag))
    return drawn


def _stand_in_lines(ax: Any, found: list[gaps.StandIn]) -> int:
    """What the run has in place of the loss: losses on ``ax``, gradient norms on a right axis (or on
    ``ax`` when there is no loss at all)."""
    losses = [s for s in found if s.axis == "loss"]
    log = all(v > 0 for s in losses for v in s.values if math.isfinite(v))
    drawn = 0
    for i, s in enumerate(losses):
        style = {"ls": "none", "marker": "D", "ms": 5} if s.markers else {"lw": 1.2}
        drawn += _series(ax, s.steps, s.values, log=log, color=f"C{i}", label=_label(s.label), **style)
    if drawn and log:
        ax.set_yscale("log")
    ax.set_ylabel("loss" if drawn else "total gradient norm")
    norms = [s for s in found if s.axis == "grad_norm"]
    if norms:
        other = ax.twinx() if drawn else ax
        shown = sum(
            _series(
                other, s.steps, s.values, log=True, color="#777777", ls="--", lw=1.2, label=_label(s.label)
            )
            for s in norms
        )
        if shown:
            other.set_yscale("log")
            other.set_ylabel("total gradient norm")
        drawn += shown
    return drawn


def _alert_lines(ax: Any, alerts: list[dict[str, Any]]) -> None:
    """Every alert as a vertical line at its step, coloured by severity and labelled with its kind (one line
    per step and severity, one label per step and kind, the first :data:`_MAX_ALERT_MARKS` of each)."""
    seen: set[str] = set()
    lines: set[tuple[Any, Any]] = set()
    marks: set[tuple[Any, Any]] = set()
    for alert in alerts:
        sev, step, kind = alert.get("severity", "info"), alert.get("step", 0), alert.get("kind", "")
        color = SEVERITY_COLORS.get(sev, "grey")
        if (step, sev) not in lines and len(lines) < _MAX_ALERT_MARKS:
            lines.add((step, sev))
            label = None if sev in seen else _label(sev)
            seen.add(sev)
            ax.axvline(step, color=color, lw=1.5, alpha=0.8, label=label)
        if (step, kind) not in marks and len(marks) < _MAX_ALERT_MARKS:
            marks.add((step, kind))
            ax.annotate(
                _label(kind),
                (step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )


@plain_text
def alert_timeline(run: RunData) -> bytes | None:
    """The training loss with every alert as a vertical line at its step, coloured by severity.

    Without a logged loss it draws what the run has instead (``gaps.stand_ins``) and says why the loss
    is missing; the x axis spans the run's steps.
    """
    loss = run.scalars.get(run.loss_tag) if run.loss_tag else None
    loss = loss if loss is not None and loss.steps else None
    found = gaps.stand_ins(run)[:_MAX_LINES] if loss is None else []
    if loss is None and not run.alerts and not found:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if loss is not None:
        drawn = _loss_line(ax, run.loss_tag or "loss", loss)
        why = f"The loss tag {run.loss_tag} holds no finite value ({len(loss.values)} point(s), all NaN/inf)."
    else:
        drawn = _stand_in_lines(ax, found)
        why = gaps.loss_gap(run) or "No training loss logged."
    if not drawn:
        ax.set_yticks([])
        _say_why(ax, why)
    _alert_lines(ax, run.alerts)
    _run_span(ax, run)
    ax.set_xlabel("step")
    if loss is not None:
        ax.set_title("Training loss and alerts")
    else:
        ax.set_title(f"No training loss logged: {'what the run has, and ' if drawn else ''}the alerts")
    _legend(fig, ax, loc="upper left", fontsize=8)
    return _png(fig)


def gradient_flow_matrix(run: RunData) -> tuple[list[str], list[int], list[list[float]]]:
    """Layers (model order), steps, and log10 of each layer's gradient norm (NaN where not logged)."""
    layers = run.family("grad_norm/")
    steps = sorted({s for series in layers.values() for s in series.steps})
    index = {s: i for i, s in enumerate(steps)}
    rows = []
    for series in layers.values():
        row = [math.nan] * len(steps)
        for s, v in zip(series.steps, series.values, strict=True):
            row[index[s]] = math.log10(v) if v > 0 and math.isfinite(v) else math.nan
        rows.append(row)
    return list(layers), steps, rows


@plain_text
def gradient_flow(run: RunData) -> bytes | None:
    """Heatmap: layers top to bottom in model order (input first) x logged steps; colour = log10 norm."""
    names, steps, rows = gradient_flow_matrix(run)
    if not names or not steps:
        return None
    shown = f" (the first {_MAX_ROWS} of {len(names)} layers)" if len(names) > _MAX_ROWS else ""
    names, rows = [_label(n) for n in names[:_MAX_ROWS]], rows[:_MAX_ROWS]
    plt = matplotlib_or_exit()
    import numpy as np

    matrix = np.ma.masked_invalid(np.array(rows, dtype=float))
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.28 * len(names) + 1.2)))
    image = ax.imshow(
        matrix,
        aspect="auto",
        cmap="magma",
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5),
    )
    if matrix.mask.all():
        _say_why(ax, "Every logged layer norm is 0 or NaN/inf: no colour to show.")
    if len(steps) <= 12:  # few columns: name each column's step (they are spread evenly over the extent)
        width = (steps[-1] - steps[0] + 1) / len(steps)
        ax.set_xticks(
            [steps[0] - 0.5 + (i + 0.5) * width for i in range(len(steps))], [str(s) for s in steps]
        )
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("step")
    ax.set_title(f"Gradient flow: log10 gradient norm per layer (first layer at the top){shown}")
    fig.colorbar(image, ax=ax, label="log10 ||grad||")
    return _png(fig)


@plain_text
def _per_layer(
    run: RunData, prefix: str, title: str, ylabel: str, guide: float | None, log: bool
) -> bytes | None:
    layers = run.family(prefix, total=True)
    if not layers:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    drawn = 0
    if len(layers) > _MAX_LINES:
        title += f" (the first {_MAX_LINES} of {len(layers)})"
        layers = dict(list(layers.items())[:_MAX_LINES])
    for name, series in layers.items():  # a step the optimizer skipped logs 0: a gap on the log axis
        style = {"lw": 2.2, "color": "black"} if name == "total" else {"lw": 1.0}
        drawn += _series(ax, series.steps, series.values, log=log, label=_label(name), **style)
    if guide is not None:
        ax.axhline(guide, color="#2ca02c", ls="--", lw=1.2, label=f"guide {guide:g}")
    if log and drawn:
        ax.set_yscale("log", nonpositive="mask")
    if not drawn:
        points = sum(len(series.values) for series in layers.values())
        zero = "0 or " if log else ""
        _say_why(ax, f"Nothing to draw: all {points} logged value(s) are {zero}NaN/inf.")
    _run_span(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(
        fig, ax, fontsize=7, ncol=2 if len(layers) > 8 else 1, loc="center left", bbox_to_anchor=(1.01, 0.5)
    )
    return _png(fig)


def update_ratios(run: RunData) -> bytes | None:
    """||update|| / ||weight|| per layer against the 1e-3 guide line."""
    return _per_layer(run, "update_ratio/", "Update / weight ratio per layer", "update ratio", 1e-3, True)


@plain_text
def unit_health(run: RunData) -> bytes | None:
    """Dead ReLU and saturated unit fractions per layer over the sampled steps."""
    dead, sat = run.family("dead_relu/", total=True), run.family("saturated/", total=True)
    if not dead and not sat:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    drawn = 0
    for prefix, family in (("dead", dead), ("saturated", sat)):
        for name, series in list(family.items())[:_MAX_LINES]:
            drawn += _series(
                ax, series.steps, series.values, marker="o", ms=3, lw=1, label=_label(f"{prefix}: {name}")
            )
    if not drawn:
        _say_why(ax, "Nothing to draw: every sampled fraction is NaN/inf.")
    ax.set_ylim(-0.02, 1.02)
    _run_span(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of units")
    ax.set_title("Dead and saturated units per layer")
    _legend(fig, ax, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(fig)


@plain_text
def clipping(run: RunData) -> bytes | None:
    """The pre-clip norm percentiles and the suggested clip value over the run, with the fraction clipped."""
    clip = run.family("grad_clip/", total=True)
    if not clip:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    drawn = 0
    for key in ("pre_clip_norm_p50", "pre_clip_norm_p90", "pre_clip_norm_p99", "suggested_clip_val"):
        if key in clip:
            style = "--" if key == "suggested_clip_val" else "-"
            drawn += _series(
                ax, clip[key].steps, clip[key].values, log=True, ls=style, label=key.replace("_", " ")
            )
    if drawn:
        ax.set_yscale("log")
    else:
        _say_why(ax, "No pre-clip norm percentile to draw: none logged, or all 0 or NaN/inf.")
    _run_span(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    if "fraction_clipped" in clip:
        twin = ax.twinx()
        fraction = clip["fraction_clipped"]
        _series(twin, fraction.steps, fraction.values, color="grey", lw=1, alpha=0.7)
        twin.set_ylim(0, 1)
        twin.set_ylabel("fraction of steps clipped (grey)")
    ax.set_title("Gradient clipping: pre-clip norm percentiles and the suggested gradient_clip_val")
    _legend(fig, ax, fontsize=8, loc="upper left")
    return _png(fig)


def range_test_suggestions(curve: dict[str, list[float]]) -> dict[str, float | None]:
    """What each method suggests on a range test's CSV columns, as LRFinderPlus decides: the raw losses
    read by :func:`~lightning_gradguard.functional.lr_suggest.read_curve` (the descent judged without the
    diverging tail; nothing from a curve whose fall does not stand out of its noise). A CSV keeps the mean
    of averaged sweeps, not each sweep, so their spread is not there to floor the noise."""
    # here, not at the top: lightning_gradguard.functional imports torch, which a report without a range
    # test never needs (``gradguard report`` starts without torch and Lightning)
    from lightning_gradguard.functional.lr_suggest import read_curve, suggest_all

    smooth = curve.get("curve") or curve.get("smoothed_loss") or []
    if not smooth:
        return {}
    lrs, raw = curve["lr"][: len(smooth)], curve.get("loss") or []
    if len(raw) == len(smooth):
        return read_curve(lrs, raw).suggestions
    return suggest_all(lrs, smooth)


@plain_text
def lr_range_test(run: RunData, name: str) -> bytes | None:
    """One range test's loss against the LR (log x), every suggestion marked, the applied LR in green."""
    curve = run.lr_curves.get(name)
    if not curve or not curve.get("lr"):
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    lrs = curve["lr"]
    raw = curve.get("loss") or []
    if len(raw) == len(lrs):
        ax.plot(lrs, raw, color="#bbbbbb", lw=1, label="loss")
    smooth = curve.get("curve") or curve.get("smoothed_loss") or []
    ax.plot(lrs[: len(smooth)], smooth, color="#333333", lw=1.8, label="smoothed")
    finite = [v for v in smooth if math.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        ax.set_ylim(low - 0.1 * (high - low), high + 0.3 * (high - low) + 1e-12)
    suggestions = range_test_suggestions(curve)
    for i, (method, lr) in enumerate(suggestions.items()):
        if lr is not None:
            ax.axvline(lr, color=f"C{i}", ls=":", lw=1.4, label=f"{method} {lr:.2e}")
    if smooth and not any(suggestions.values()):
        ax.text(
            0.5,
            0.5,
            "no suggestion: the descent does not stand out of the curve's noise",
            transform=ax.transAxes,
            ha="center",
            color="#c0392b",
        )
    _search_marks(ax, run.lr_searches.get(name))
    suffix = name.removeprefix("lr_finder")
    applied = _number(run.hparams.get(f"lr_finder/applied_lr{suffix}"))
    if applied is not None:
        ax.axvline(applied, color="#2ca02c", lw=2.2, label=f"applied {applied:.2e}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title(f"LR range test ({_label(name)})")
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def _search_marks(ax: Any, search: dict[str, list[float]] | None) -> None:
    """The search after the range test: each candidate's loss against its LR on a right-hand axis
    (triangles; the last round filled), the winner as a star (``won``; ``chosen`` in folders written before
    the search suggested the winner's LR over ``SHORT_HORIZON``)."""
    if not search or not search.get("lr") or not search.get("loss"):
        return
    lrs, losses = search["lr"], search["loss"]
    rounds = search.get("round") or [0.0] * len(lrs)
    won = search.get("won") or search.get("chosen") or [0.0] * len(lrs)
    points = [
        (lr, v, r, w) for lr, v, r, w in zip(lrs, losses, rounds, won, strict=False) if math.isfinite(v)
    ]
    if not points:
        return
    right = ax.twinx()
    last = max(p[2] for p in points)
    for lr, loss, round_, was_won in points:
        face = "#7b3294" if round_ == last else "none"
        right.plot(
            [lr],
            [loss],
            marker="*" if was_won else "^",
            ms=11 if was_won else 6,
            color="#7b3294",
            mfc=face,
            ls="none",
        )
    right.set_ylabel("loss reached by the search's trainings", color="#7b3294", fontsize=8)
    right.tick_params(axis="y", labelsize=7, colors="#7b3294")


@plain_text
def spikes(run: RunData) -> bytes | None:
    """LossSpikeGuard's z-scores over the run, with every spike it recorded."""
    zs = {k: v for k, v in run.family("spike/", total=True).items() if k.endswith("zscore")}
    if not zs and not run.spikes:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    drawn = sum(_series(ax, s.steps, s.values, lw=1, label=_label(name)) for name, s in zs.items())
    for step in sorted({entry.get("step", 0) for entry in run.spikes})[: _MAX_ALERT_MARKS * 5]:
        ax.axvline(step, color=SEVERITY_COLORS["warning"], lw=1, alpha=0.7)
    if not drawn:
        _say_why(
            ax, "No z-score logged: LossSpikeGuard logs them on Lightning's logging steps and at a spike."
        )
    _run_span(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel("robust z-score")
    ax.set_title(f"Loss spikes: z-scores; {len(run.spikes)} spike(s) recorded (orange lines)")
    _legend(fig, ax, fontsize=8)
    return _png(fig)


def _number(text: str | None) -> float | None:
    """``text`` as a finite positive number, or ``None`` (a damaged hyperparameter is not drawn)."""
    try:
        value = float(text) if text else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
