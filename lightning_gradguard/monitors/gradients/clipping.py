"""GradientNormLogger's clipping verdict in words: a clip value that clips every step, or never.

The statistics of the recent pre-clip norms are
:func:`~lightning_gradguard.functional.clipping.clip_window_stats`; :func:`clip_verdict` says when the
setting does not do its job, and which value to try.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_gradguard.functional.clipping import ClipWindowStats
from lightning_gradguard.monitors.gradients.tags import GRAD_CLIP


@dataclass(frozen=True)
class ClipFinding:
    """A clipping setting that does not do its job, in words."""

    kind: Literal["clipping_always_active", "clipping_never_active"]
    severity: Literal["warning", "info"]
    message: str
    hint: str
    data: dict[str, float]


def clip_verdict(
    s: ClipWindowStats, clip_val: float, norm_type: float, window: int, adaptive: str | None = None
) -> ClipFinding | None:
    """Whether ``gradient_clip_val`` clips nearly every step (it slows learning) or never comes near a
    norm of a full window (it guards nothing); ``None`` when it does its job.

    ``adaptive``: the name of an adaptive optimizer (Adam and its family) the clipped gradient goes to.
    Its step does not scale with the gradient, so a clip on every step does not slow it down: the usual
    ``gradient_clip_val=1.0`` of transformer recipes clips nearly every step of a small model, and that is
    an INFO line, not a warning."""
    n, fraction, suggested = s.steps, s.fraction_clipped, s.suggested
    what, by = ("norm", "") if norm_type == 2.0 else ("largest |g|", " (clipping by value)")
    setting = f"gradient_clip_val={clip_val:g}{by}"
    data = {"fraction_clipped": fraction, "clip_val": clip_val, "steps": float(n)}
    data.update({GRAD_CLIP.tag(name): x for name, x in s.metrics().items()})
    if n >= min(100, window) and fraction >= 0.95 and suggested is not None:
        message = (
            f"{setting} clipped {fraction:.0%} of the last {n} steps (median pre-clip {what} "
            f"{s.percentiles[50]:.3g})."
        )
        hint = (
            f"The threshold is below the typical gradient {what}, which slows learning. Clip only the "
            f"outliers: try gradient_clip_val={suggested:g} (90th percentile of recent values)."
        )
        if adaptive is not None:
            hint = (
                f"{adaptive} divides each step by the gradient's running size, so clipping every step does "
                "not slow it: it normalises the gradient and weighs the steps alike. To clip only the "
                f"outliers, try gradient_clip_val={suggested:g} (90th percentile of recent values)."
            )
            return ClipFinding("clipping_always_active", "info", message, hint, data)
        return ClipFinding("clipping_always_active", "warning", message, hint, data)
    if n >= window and fraction == 0.0 and s.largest < clip_val / 10:
        message = f"{setting} never fired in {n} steps; the largest pre-clip {what} was {s.largest:.3g}."
        if suggested is None:
            hint = (
                f"Every pre-clip {what} of the window was exactly 0: no parameter of this optimizer got a "
                "gradient, so nothing learns. Check that the loss depends on the parameters (a "
                "`.detach()`, `torch.no_grad()`, a zero loss weight); OverfitBatchSanity names them."
            )
        else:
            hint = f"Clipping guards nothing at this level. To catch spikes, use about {suggested:g}."
        return ClipFinding("clipping_never_active", "info", message, hint, data)
    return None
