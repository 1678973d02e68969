"""ActivationRangeMonitor's two rules and their wording: fp16 headroom running out, attention logits growing.

The numbers they judge are :mod:`lightning_gradguard.functional.activation_range` (block output moments,
the headroom in bits, the largest attention logit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_gradguard.functional.activation_range import BlockRange

__all__ = ["HEADROOM_HINT", "LOGIT_HINT", "RangeFinding", "headroom_verdict", "logit_verdict"]


# ---------------------------------------------------------------------------------------------- the rules
HEADROOM_HINT = (
    "Train in bf16-mixed (float32's range), put a normalization where this output grows (pre-LN blocks, a "
    "final LayerNorm), lower the learning rate, or scale/clamp the residual stream: the next float16 "
    "matmul that reads this output overflows to inf."
)


LOGIT_HINT = (
    "Normalize queries and keys (QK-norm: a LayerNorm or RMSNorm on q and k before the dot product), "
    "soft-cap the logits (cap * tanh(logits / cap); Gemma 2 caps at 50), or lower the learning rate (that "
    "of the q/k projections at least): growing logits make the attention one-hot and then diverge."
)


@dataclass(frozen=True)
class RangeFinding:
    """One finding of ActivationRangeMonitor, ready for its alert."""

    kind: str
    where: str
    message: str
    hint: str
    data: dict[str, float]


def _nan_first(value: float) -> float:
    return math.inf if math.isnan(value) else value


def headroom_verdict(
    ranges: Mapping[str, BlockRange], min_bits: float, precision: str
) -> RangeFinding | None:
    """``fp16_headroom_low``: the block with the least headroom, when some block has less than ``min_bits``
    (a NaN output counts as none left). The caller asks only for float16 runs."""
    low = [k for k, r in ranges.items() if not r.headroom_bits >= min_bits]
    if not low:
        return None
    worst = min(low, key=lambda k: -_nan_first(-ranges[k].headroom_bits))
    r = ranges[worst]
    others = f" ({len(low) - 1} more blocks below it)" if len(low) > 1 else ""
    return RangeFinding(
        kind="fp16_headroom_low",
        where=worst,
        message=f"under {precision}, block {worst!r} output max |x| = {r.max_abs:.4g}: "
        f"{r.headroom_bits:.2f} bits of float16 headroom, below {min_bits:g}{others}",
        hint=HEADROOM_HINT,
        data={"max_abs": r.max_abs, "headroom_bits": r.headroom_bits, "blocks_below": float(len(low))},
    )


def logit_verdict(
    history: Sequence[float], peaks: Mapping[str, float], max_logit: float, growth_factor: float | None
) -> RangeFinding | None:
    """``attention_logit_growth`` on the largest of ``peaks`` (the step's largest logit per module).

    * ceiling: it is above ``max_logit``;
    * growth (with ``growth_factor``): it is above ``max_logit / growth_factor`` and at least
      ``growth_factor`` times the smallest value of ``history`` (the largest logits of the earlier sampled
      steps of the window): at that pace the next window passes the ceiling. Below that floor logits grow
      freely (a model learns to attend, from near 0 at initialization to the tens).

    A NaN/inf logit is no finding here (NaNSentinel's).
    """
    if not peaks:
        return None
    where = max(peaks, key=lambda k: _nan_first(peaks[k]))
    latest = peaks[where]
    if not math.isfinite(latest):
        return None
    earlier = [h for h in history if math.isfinite(h) and h > 0]
    if latest > max_logit:
        why, reference = f"above the ceiling {max_logit:g}", max_logit
    elif growth_factor is not None and latest > max_logit / growth_factor and earlier:
        reference = min(earlier)
        if latest < growth_factor * reference:
            return None
        why = f"{latest / reference:.1f}x the {reference:.4g} of the last {len(history)} sampled steps"
    else:
        return None
    return RangeFinding(
        kind="attention_logit_growth",
        where=where,
        message=f"largest attention logit {latest:.4g} in {where!r}: {why}",
        hint=LOGIT_HINT,
        data={"max_logit": latest, "reference": reference},
    )
