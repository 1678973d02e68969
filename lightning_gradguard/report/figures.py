"""The report's pictures, drawn with matplotlib (the ``[report]`` extra) and returned as PNG bytes.

Each function takes :class:`~lightning_gradguard.report.read.RunData` and returns ``None`` when the run
has nothing to draw for it. Colours: one sequential map (``magma``: dark is small, bright is large) for
the heatmap; alert markers coloured by severity.
"""

from __future__ import annotations

import io
import math
from typing import Any

from lightning_gradguard.functional.lr_suggest import suggest_all
from lightning_gradguard.report.read import RunData

__all__ = [
    "SEVERITY_COLORS",
    "alert_timeline",
    "clipping",
    "gradient_flow",
    "lr_range_test",
    "matplotlib_or_exit",
    "spikes",
    "unit_health",
    "update_ratios",
]

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


def alert_timeline(run: RunData) -> bytes | None:
    """The training loss (log y) with every alert as a vertical line at its step, coloured by severity."""
    loss = run.scalars.get(run.loss_tag) if run.loss_tag else None
    if loss is None and not run.alerts:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if loss is not None:
        finite = [(s, v) for s, v in zip(loss.steps, loss.values, strict=True) if math.isfinite(v) and v > 0]
        if finite:
            ax.plot(*zip(*finite, strict=True), color="#333333", lw=1.2, label=run.loss_tag)
            ax.set_yscale("log")
    else:
        ax.set_yticks([])
        ax.text(
            0.5,
            0.5,
            "no training loss logged (self.log a tag with 'loss' in its name, or pass --loss-tag)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="grey",
        )
    seen: set[str] = set()
    for alert in run.alerts:
        sev = alert.get("severity", "info")
        label = None if sev in seen else sev
        seen.add(sev)
        ax.axvline(
            alert.get("step", 0), color=SEVERITY_COLORS.get(sev, "grey"), lw=1.5, alpha=0.8, label=label
        )
        ax.annotate(
            alert.get("kind", ""),
            (alert.get("step", 0), 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=SEVERITY_COLORS.get(sev, "grey"),
        )
    ax.set_xlabel("step")
    ax.set_ylabel(run.loss_tag or "")
    ax.set_title("Training loss and alerts")
    ax.legend(loc="upper right", fontsize=8)
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


def gradient_flow(run: RunData) -> bytes | None:
    """Heatmap: layers top to bottom in model order (input first) x logged steps; colour = log10 norm."""
    names, steps, rows = gradient_flow_matrix(run)
    if not names or not steps:
        return None
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
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("step")
    ax.set_title("Gradient flow: log10 gradient norm per layer (first layer at the top)")
    fig.colorbar(image, ax=ax, label="log10 ||grad||")
    return _png(fig)


def _per_layer(
    run: RunData, prefix: str, title: str, ylabel: str, guide: float | None, log: bool
) -> bytes | None:
    layers = run.family(prefix, total=True)
    if not layers:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for name, series in layers.items():
        width = 2.2 if name == "total" else 1.0
        ax.plot(series.steps, series.values, lw=width, label=name, color="black" if name == "total" else None)
    if guide is not None:
        ax.axhline(guide, color="#2ca02c", ls="--", lw=1.2, label=f"guide {guide:g}")
    if log:  # a step the optimizer skipped logs 0: masked on the log axis
        ax.set_yscale("log", nonpositive="mask")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2 if len(layers) > 8 else 1, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(fig)


def update_ratios(run: RunData) -> bytes | None:
    """||update|| / ||weight|| per layer against the 1e-3 guide line."""
    return _per_layer(run, "update_ratio/", "Update / weight ratio per layer", "update ratio", 1e-3, True)


def unit_health(run: RunData) -> bytes | None:
    """Dead ReLU and saturated unit fractions per layer over the sampled steps."""
    dead, sat = run.family("dead_relu/", total=True), run.family("saturated/", total=True)
    if not dead and not sat:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for prefix, family in (("dead", dead), ("saturated", sat)):
        for name, series in family.items():
            ax.plot(series.steps, series.values, marker="o", ms=3, lw=1, label=f"{prefix}: {name}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of units")
    ax.set_title("Dead and saturated units per layer")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(fig)


def clipping(run: RunData) -> bytes | None:
    """The pre-clip norm percentiles and the suggested clip value over the run, with the fraction clipped."""
    clip = run.family("grad_clip/", total=True)
    if not clip:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for key in ("pre_clip_norm_p50", "pre_clip_norm_p90", "pre_clip_norm_p99", "suggested_clip_val"):
        if key in clip:
            style = "--" if key == "suggested_clip_val" else "-"
            ax.plot(clip[key].steps, clip[key].values, ls=style, label=key.replace("_", " "))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    if "fraction_clipped" in clip:
        twin = ax.twinx()
        twin.plot(
            clip["fraction_clipped"].steps, clip["fraction_clipped"].values, color="grey", lw=1, alpha=0.7
        )
        twin.set_ylim(0, 1)
        twin.set_ylabel("fraction of steps clipped (grey)")
    ax.set_title("Gradient clipping: pre-clip norm percentiles and the suggested gradient_clip_val")
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def lr_range_test(run: RunData, name: str) -> bytes | None:
    """One range test's loss against the LR (log x), every suggestion marked, the applied LR in green."""
    curve = run.lr_curves.get(name)
    if not curve or not curve.get("lr"):
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    lrs = curve["lr"]
    ax.plot(lrs, curve.get("loss", []), color="#bbbbbb", lw=1, label="loss")
    smooth = curve.get("curve") or curve.get("smoothed_loss") or []
    ax.plot(lrs[: len(smooth)], smooth, color="#333333", lw=1.8, label="smoothed")
    finite = [v for v in smooth if math.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        ax.set_ylim(low - 0.1 * (high - low), high + 0.3 * (high - low) + 1e-12)
    for i, (method, lr) in enumerate(suggest_all(lrs, smooth).items() if smooth else []):
        if lr is not None:
            ax.axvline(lr, color=f"C{i}", ls=":", lw=1.4, label=f"{method} {lr:.2e}")
    suffix = name.removeprefix("lr_finder")
    applied = run.hparams.get(f"lr_finder/applied_lr{suffix}")
    if applied:
        ax.axvline(float(applied), color="#2ca02c", lw=2.2, label=f"applied {float(applied):.2e}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title(f"LR range test ({name})")
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def spikes(run: RunData) -> bytes | None:
    """LossSpikeGuard's z-scores over the run, with every spike it recorded."""
    zs = {k: v for k, v in run.family("spike/", total=True).items() if k.endswith("zscore")}
    if not zs and not run.spikes:
        return None
    plt = matplotlib_or_exit()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for name, series in zs.items():
        ax.plot(series.steps, series.values, lw=1, label=name)
    for entry in run.spikes:
        ax.axvline(entry.get("step", 0), color=SEVERITY_COLORS["warning"], lw=1, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("robust z-score")
    ax.set_title(f"Loss spikes: z-scores; {len(run.spikes)} spike(s) recorded (orange lines)")
    if zs:
        ax.legend(fontsize=8)
    return _png(fig)
