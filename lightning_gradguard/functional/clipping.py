"""Gradient clipping statistics: which norm decides clipping, and how a window of pre-clip norms looks.

Pure functions, no Trainer. A caller keeps the recent pre-clip norms (on the device, without a sync),
brings the window to the host once, and reads here how often clipping was active, the percentiles of
the pre-clip norm and a suggested ``gradient_clip_val``. Usable from a plain PyTorch loop that clips
with ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradguard.functional.stats import suggest_clip_value

#: the percentiles of the pre-clip norm reported over a window
CLIP_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def clipping_norm_type(algorithm: str) -> float:
    """The norm that decides whether clipping changes a step: ``2.0`` for ``"norm"``, inf for ``"value"``.

    Clipping by norm rescales the gradient when its total 2-norm exceeds the value; clipping by value
    changes it when some entry's magnitude does, which is when the infinity norm exceeds the value.
    """
    if algorithm not in ("norm", "value"):
        raise ValueError(f"`algorithm` must be 'norm' or 'value'; got {algorithm!r}")
    return math.inf if algorithm == "value" else 2.0


def push_norm(window: Tensor | None, seen: int, norm: Tensor, size: int) -> Tensor:
    """Write ``norm`` into slot ``seen % size`` of a ring buffer of pre-clip norms, on its device (no sync).

    The buffer (NaN: an empty slot) is made on first use, and again when ``norm`` is on another device.
    """
    if window is None or window.device != norm.device:
        window = torch.full((size,), float("nan"), device=norm.device)
    window[seen % size] = norm.float()
    return window


@dataclass(frozen=True)
class ClipWindowStats:
    """Clipping statistics over a window of pre-clip norms (host numbers).

    Attributes:
        fraction_clipped: the fraction of the finite norms above the clip value.
        percentiles: ``{50: p50, 90: p90, 99: p99}`` of the finite norms (see :data:`CLIP_PERCENTILES`).
        suggested: a ``gradient_clip_val`` that clips only the outliers (the 90th percentile rounded up
            to two significant digits); ``None`` when every norm of the window was 0.
        steps: how many finite norms the window holds.
        largest: the largest finite norm.
    """

    fraction_clipped: float
    percentiles: dict[int, float]
    suggested: float | None
    steps: int
    largest: float

    def metrics(self) -> dict[str, float]:
        """``fraction_clipped``, ``pre_clip_norm_p50|p90|p99`` and ``suggested_clip_val`` (if any)."""
        out = {"fraction_clipped": self.fraction_clipped}
        out.update({f"pre_clip_norm_p{q}": x for q, x in self.percentiles.items()})
        if self.suggested is not None:
            out["suggested_clip_val"] = self.suggested
        return out


def clip_window_stats(window: Tensor, clip_val: float) -> ClipWindowStats | None:
    """Statistics of the pre-clip norms in ``window`` (NaN: an empty slot); ``None`` if none is finite.

    The fraction is computed in ``window``'s dtype (as clipping compares it); the percentiles in float64.
    """
    finite_mask = torch.isfinite(window)
    clipped = ((window > clip_val) & finite_mask).sum() / finite_mask.sum().clamp_min(1)
    finite = window[finite_mask].double()
    if finite.numel() == 0:
        return None
    qs = torch.quantile(finite, torch.tensor([q / 100 for q in CLIP_PERCENTILES], dtype=torch.float64))
    return ClipWindowStats(
        fraction_clipped=float(clipped),
        percentiles={int(q): x for q, x in zip(CLIP_PERCENTILES, qs.tolist(), strict=True)},
        suggested=suggest_clip_value(finite),  # None when every norm in the window was 0
        steps=int(finite.numel()),
        largest=float(finite.max()),
    )
