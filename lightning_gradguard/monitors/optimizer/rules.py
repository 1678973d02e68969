"""OptimizerMonitor's two rules in words: Adam's ``eps`` dominating its step, an update ratio far off.

Whether a layer is dominated by ``eps`` or an outlier is decided by
:func:`~lightning_gradguard.functional.optimizer_state.epsilon_dominated` and
:func:`~lightning_gradguard.functional.optimizer_state.ratio_outliers`; here a finding that persisted is
said, with the numbers and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OptimizerFinding", "epsilon_finding", "outlier_finding"]


@dataclass(frozen=True)
class OptimizerFinding:
    """A finding of :func:`epsilon_finding` or :func:`outlier_finding`, in words (always a warning)."""

    kind: Literal["adam_epsilon_dominates", "update_ratio_outlier"]
    layer: str
    message: str
    hint: str
    data: dict[str, float]


def epsilon_finding(layer: str, rms: float, eps: float, checks: int) -> OptimizerFinding:
    """``eps`` outweighs the typical ``sqrt(v_hat)`` of ``layer`` (RMS ``rms``) on ``checks`` checks."""
    return OptimizerFinding(
        "adam_epsilon_dominates",
        layer,
        f"In layer {layer} Adam's eps ({eps:.3g}) outweighs the typical sqrt(v_hat) (RMS {rms:.3g}, "
        f"{eps / rms:.3g}x smaller) on {checks} consecutive checks: the denominator sqrt(v_hat) + eps is "
        f"mostly eps, so the layer's steps are about {rms / (rms + eps):.2g} of Adam's normalised step "
        "and it trains like SGD with momentum at lr / eps.",
        "Its gradients are tiny (about the RMS above). Lower eps (1e-8 -> 1e-12 is safe with float32 "
        "optimizer states), or fix the gradient's scale: a loss that is divided down, a vanishing signal "
        "upstream (see grad_norm/<layer>).",
        {"rms_sqrt_v_hat": rms, "eps": eps, "checks": float(checks)},
    )


def outlier_finding(layer: str, ratio: float, median: float, factor: float, checks: int) -> OptimizerFinding:
    """``layer``'s update/weight ``ratio`` is beyond ``factor`` from the ``median`` layer's."""
    x = ratio / median
    far = f"{x:.3g}x" if x > 1 else "0 times" if x == 0 else f"1/{1 / x:.3g} of"
    hint = (
        "Its param group's learning rate (or an lr multiplier) is too high for it, or its weights are "
        "near 0 (a zero-initialised layer early on). Check that group's lr; a per-layer trust ratio "
        "(LARS/LAMB) keeps layers in step."
        if x > 1
        else "The layer barely moves: its param group has lr 0 or a tiny lr (frozen by mistake?), weight "
        "decay cancels its update, or it is sparse (an embedding whose batches touch few rows: leave it "
        "out with exclude=...)."
    )
    return OptimizerFinding(
        "update_ratio_outlier",
        layer,
        f"The update/weight ratio of layer {layer} is {ratio:.3g}, {far} the median layer's "
        f"({median:.3g}), beyond {factor:g}x on {checks} consecutive checks.",
        hint,
        {"update_ratio": ratio, "median": median, "checks": float(checks)},
    )
