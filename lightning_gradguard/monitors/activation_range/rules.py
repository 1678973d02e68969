"""ActivationRangeMonitor's rules, one declaration each (its kind, docs row, constant hint and its check,
right above it): fp16 headroom running out, attention logits growing, attention collapsing to one key.

The numbers they judge are :mod:`lightning_gradguard.functional.activation_range` (block output moments,
the headroom in bits, the largest attention logit, the attention entropy). A check returns the
:class:`~lightning_gradguard.alerts.Finding` that holds (always a warning, at the block or module named),
or ``None``. Each check reads one :class:`Sampled` (what a sampled step measured and what the rules
remember: the earlier logits of the window, each module's first entropy) and says itself when its rule
applies; the callback runs them from :data:`RULES` (``run_rules``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.functional.activation_range import AttentionEntropy, BlockRange


@dataclass(frozen=True, kw_only=True)
class Sampled:
    """What the rules read after a sampled step.

    Attributes:
        step: the optimizer step sampled.
        precision: the Trainer's precision; ``fp16``: it computes in float16 (its headroom is judged).
        ranges: each block's output range; ``min_bits``: the headroom threshold.
        attention: the attention rules judge this step (step 0, or a run that is not learning).
        grown: the step's largest logit per module, those without QK-norm; ``history``: the largest logits
            of the window's earlier sampled steps; ``max_logit`` and ``growth_factor``: the logit rule's.
        entropies, peaks: each module's attention entropy and largest logit; ``min_entropy``: the collapse
            threshold (``None``: off); ``starts``: each module's first sampled entropy; ``qk_normed``: the
            modules that normalize their queries and keys.
    """

    step: int
    precision: str
    fp16: bool
    ranges: Mapping[str, BlockRange]
    min_bits: float
    attention: bool
    grown: Mapping[str, float]
    history: Sequence[float]
    max_logit: float
    growth_factor: float | None
    entropies: Mapping[str, AttentionEntropy]
    peaks: Mapping[str, float]
    min_entropy: float | None
    starts: Mapping[str, EntropyStart]
    qk_normed: frozenset[str] = frozenset()


def _headroom(ev: Sampled) -> Finding | None:
    return headroom_verdict(ev.ranges, ev.min_bits, ev.precision) if ev.fp16 else None


def _logits(ev: Sampled) -> Finding | None:
    if not (ev.grown and ev.attention):
        return None
    return logit_verdict(ev.history, ev.grown, ev.max_logit, ev.growth_factor)


def _entropy(ev: Sampled) -> Finding | None:
    if not (ev.entropies and ev.min_entropy is not None and ev.attention):
        return None
    return entropy_verdict(ev.entropies, ev.peaks, ev.min_entropy, ev.step, ev.starts, ev.qk_normed)


def _nan_first(value: float) -> float:
    return math.inf if math.isnan(value) else value


# ------------------------------------------------------------------ fp16_headroom_low
def headroom_verdict(ranges: Mapping[str, BlockRange], min_bits: float, precision: str) -> Finding | None:
    """``fp16_headroom_low``: the block with the least headroom, when some block has less than ``min_bits``
    (a NaN output counts as none left). The caller asks only for float16 runs."""
    low = [k for k, r in ranges.items() if not r.headroom_bits >= min_bits]
    if not low:
        return None
    worst = min(low, key=lambda k: -_nan_first(-ranges[k].headroom_bits))
    r = ranges[worst]
    others = f" ({len(low) - 1} more blocks below it)" if len(low) > 1 else ""
    return Finding(
        FP16_HEADROOM_LOW,
        f"under {precision}, block {worst!r} output max |x| = {r.max_abs:.4g}: "
        f"{r.headroom_bits:.2f} bits of float16 headroom, below {min_bits:g}{others}",
        {"max_abs": r.max_abs, "headroom_bits": r.headroom_bits, "blocks_below": float(len(low))},
        where=worst,
    )


FP16_HEADROOM_LOW: Rule[Sampled] = Rule(
    kind="fp16_headroom_low",
    severity="warning",
    monitor="ActivationRangeMonitor",
    summary="under 16-mixed, a block's output came within a few bits of float16's overflow",
    when=(
        "under `16-mixed` / `16-true`, a block's output came within `min_headroom_bits` (2 bits, "
        "4x) of float16's largest number 65504; one alert for the block with the least headroom. "
        "See [activation range](activations.md)."
    ),
    hint=(
        "Train in bf16-mixed (float32's range), put a normalization where this output grows (pre-LN blocks, "
        "a final LayerNorm), lower the learning rate, or scale/clamp the residual stream: the next float16 "
        "matmul that reads this output overflows to inf."
    ),
    check=_headroom,
)


# ------------------------------------------------------------------ attention_logit_growth
def logit_verdict(
    history: Sequence[float], peaks: Mapping[str, float], max_logit: float, growth_factor: float | None
) -> Finding | None:
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
    return Finding(
        ATTENTION_LOGIT_GROWTH,
        f"largest attention logit {latest:.4g} in {where!r}: {why}",
        {"max_logit": latest, "reference": reference},
        where=where,
    )


ATTENTION_LOGIT_GROWTH: Rule[Sampled] = Rule(
    kind="attention_logit_growth",
    severity="warning",
    monitor="ActivationRangeMonitor",
    summary="the largest attention logit passed its ceiling or grew fast toward it",
    when=(
        "the largest attention logit (q·k/√d) passed `max_attention_logit` (100), or passed a "
        "quarter of it after growing `logit_growth_factor` (4) times within `growth_window` (10) "
        "sampled steps; judged at step 0 and while the run is not learning (as "
        "`attention_entropy_collapse`). Not for a module that normalizes its queries and keys "
        "(QK-norm, the rule's own remedy: its norms' gains hold its logits; Gemma 4's unscaled ones "
        "reach 290 in a healthy run). See [activation range](activations.md)."
    ),
    hint=(
        "Normalize queries and keys (QK-norm: a LayerNorm or RMSNorm on q and k before the dot product), "
        "soft-cap the logits (cap * tanh(logits / cap); Gemma 2 caps at 50), or lower the learning rate "
        "(that of the q/k projections at least): growing logits make the attention one-hot and then diverge."
    ),
    check=_logits,
)


# ------------------------------------------------------------------ attention_entropy_collapse
_INIT_COLLAPSE_HINT = (
    "At initialization attention should be close to uniform (entropy near ln of the keys): here the logits "
    "q.k/sqrt(d) are already large, so the query/key projections are initialized far too large (e.g. std 1 "
    "instead of nn.Linear's ~1/sqrt(3 d_model), or a gain on q or k), or their inputs are not normalized (no "
    "LayerNorm before the attention, scaled-up embeddings). Initialize q/k at the usual scale, normalize "
    "their inputs (pre-LN), or normalize queries and keys (QK-norm); a one-hot attention passes almost no "
    "gradient to the other keys, so it may never learn to spread."
)


#: ``attention_entropy_collapse`` needs the module's largest logit at least this large: a one-hot attention
#: made by the scale of its logits (too large an init, logits that grew), not a learned choice of one key
#: (a head that attends to the first token reaches a tenth of ln(keys) with logits below 4)
COLLAPSE_MIN_LOGIT = 25.0


@dataclass(frozen=True)
class EntropyStart:
    """An attention module's entropy at the first sampled step of the run: what a collapse fell from."""

    step: int
    entropy: float  # nats
    ratio: float  # fraction of ln(keys)


def _collapse_history(step: int, start: EntropyStart | None, min_ratio: float) -> tuple[bool, str, str]:
    """(whether the attention was born one-hot, when, since when) for :func:`entropy_verdict`'s wording."""
    if step == 0:
        return True, "at initialization (step 0)", ""
    when = f"at step {step}"
    if start is None:
        return False, when, ""
    if start.step == 0 and not start.ratio >= min_ratio:
        return True, when, f", as at step 0 ({start.entropy:.3g} nats): it never spread"
    return False, when, f", down from {start.entropy:.3g} nats at step {start.step}"


def entropy_verdict(
    entropies: Mapping[str, AttentionEntropy],
    peaks: Mapping[str, float],
    min_ratio: float,
    step: int,
    starts: Mapping[str, EntropyStart],
    qk_normed: frozenset[str] = frozenset(),
) -> Finding | None:
    """``attention_entropy_collapse``: the module whose mean attention entropy (over its heads and query
    rows) is the smallest fraction of ``ln(keys)``, when that fraction is below ``min_ratio`` and the
    module's largest logit (``peaks``) is at least :data:`COLLAPSE_MIN_LOGIT`.

    ``starts`` holds each module's first sampled entropy of the run. At step 0, or later when the module
    was already below ``min_ratio`` at step 0, the cause named is the initialization; otherwise a collapse
    during training, from the module's first sampled entropy. A NaN entropy is no finding (NaNSentinel's); a
    near-uniform attention is never one (normal at initialization; logged only). A module in ``qk_normed``
    (it normalizes its queries and keys) is judged only for a collapse during training: one-hot at step 0
    and since is the scale its norms start at (Gemma 4's unscaled QK-normed logits), which training sets,
    never an initialization too large.
    """
    low = [
        k
        for k, e in entropies.items()
        if e.ratio < min_ratio
        and peaks.get(k, math.nan) >= COLLAPSE_MIN_LOGIT
        and not (k in qk_normed and _collapse_history(step, starts.get(k), min_ratio)[0])
    ]
    if not low:
        return None
    where = min(low, key=lambda k: entropies[k].ratio)
    e = entropies[where]
    born_low, when, since = _collapse_history(step, starts.get(where), min_ratio)
    more = len(low) - 1
    others = f"; {more} more module{'s' if more > 1 else ''} below it" if more else ""
    peak = peaks.get(where, math.nan)
    return Finding(
        ATTENTION_ENTROPY_COLLAPSE,
        f"attention in {where!r} is near one-hot {when}: mean entropy {e.entropy:.3g} nats over "
        f"{e.heads} head{'s' if e.heads > 1 else ''} (uniform attention: {e.log_keys:.3g} nats, ln of the "
        f"keys each query sees; {e.ratio:.2f} of it, below {min_ratio:g}){since}; lowest head "
        f"{e.min_head_entropy:.3g} nats; largest logit {peak:.4g}{others}",
        {
            "entropy": e.entropy,
            "log_keys": e.log_keys,
            "ratio": e.ratio,
            "min_head_entropy": e.min_head_entropy,
            "max_logit": peak,
            "threshold": min_ratio,
            "at_init": float(born_low),
            "modules_below": float(len(low)),
        },
        hint=_INIT_COLLAPSE_HINT if born_low else "",  # else the rule's: a collapse during training
        where=where,
    )


ATTENTION_ENTROPY_COLLAPSE: Rule[Sampled] = Rule(
    kind="attention_entropy_collapse",
    severity="warning",
    monitor="ActivationRangeMonitor",
    summary="an attention module's entropy fell near 0: each query attends to ~one key",
    when=(
        "an attention module's entropy (the mean over its heads and query rows) fell below "
        "`min_attention_entropy` (0.2) of ln(keys), the entropy of uniform attention, while its "
        "largest logit is 25 or more: the attention is near one-hot by the scale of its logits. At "
        "step 0 the cause named is the initialization (q/k projections too large, no QK-norm), "
        "later a collapse (no warm-up, too high an LR). Entropy collapse: Zhai et al. 2023; "
        "measured margins (digits transformers): faults 0.07-0.18 at logits 60-180, healthy "
        "multi-head runs 0.31-0.99 (a learned one-key head reached 0.197 with logits below 4: hence"
        " the logit condition). Judged at step 0 (the initialization) and while the run is not "
        "learning (the median of its last three sampled losses above half its start): attention "
        "that sharpens in a run that learns is what it learned (a BART copying its input: one-hot "
        "cross-attention). A module that normalizes its queries and keys (QK-norm) is judged only "
        "for a collapse during training: one-hot from step 0 is the scale its norms start at (Gemma "
        "4's unscaled logits), which training sets. See [activation "
        "range](activations.md#attention-entropy)."
    ),
    hint=(
        "Attention entropy collapse (Zhai et al. 2023): the logits grew until each query attends to about "
        "one key; loss spikes and divergence usually follow. Add or lengthen the learning-rate warm-up, "
        "lower the learning rate (at least of the q/k projections), normalize queries and keys (QK-norm, "
        "Dehghani et al. 2023), or reparametrize the projections (sigma-reparam, Zhai et al. 2023)."
    ),
    check=_entropy,
)

#: every kind this monitor reports, in the order they are judged
RULES: tuple[Rule[Sampled], ...] = declare(
    FP16_HEADROOM_LOW, ATTENTION_LOGIT_GROWTH, ATTENTION_ENTROPY_COLLAPSE
)
