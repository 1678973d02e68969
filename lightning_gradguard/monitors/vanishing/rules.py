r"""The verdict on one check of per-layer gradient norms: exploding or vanishing, where, why, what to try.

Pure functions on host numbers (a handful of per-layer norms already brought to the host), no Trainer.
:func:`judge` applies the rules of :class:`VerdictRules` and returns a :class:`GradientVerdict`;
:func:`opening_layers` tracks the layers behind zero-initialized weights. Each rule is one declaration,
below: its kind, docs row, hint, the conditions that make it hold, and its check
(:func:`exploding_finding`, :func:`vanishing_finding`), which puts a verdict that held on ``patience``
checks (a :class:`Held`) into words (a :class:`~lightning_gradguard.alerts.Finding`: message, hint,
``where``). The rules:

What the optimizer does with the gradient decides which rules apply (:class:`StepContext`): under an
adaptive optimizer (Adam and its family: each entry's step is divided by its gradient's running RMS) the
gradient's scale does not set the update, so no rule judges a raw magnitude; under a configured gradient
clip the clip already bounds the update; and a run whose loss fell to a tenth of its start has fitted its
data: small gradients are then its success, not a fault.

**Exploding** when at least one of:

* the total norm exceeds ``max_norm`` (the usual red line is 100), unless the Trainer clips the gradient
  (then the clip is the user's own ceiling on every update: a healthy MobileNetV2 starts at a norm of
  876 under ``gradient_clip_val=1``). Without a clip it applies under an adaptive optimizer too: a norm
  that far out without a clip comes from a forward pass out of scale (a deep ReLU net initialised with
  std 1 starts at 1e9);
* after ``warmup_checks`` checks and without a gradient clip (a clip bounds the update a one-step spike
  makes: a healthy ELECTRA under ``gradient_clip_val=1`` had a 66x spike), the total norm is more than
  ``spike_factor`` times this run's
  current level and more than twice the largest of its last ``history_size`` checked norms (healthy
  runs late in training are heavy-tailed: norms spread over two decades are normal). The level is the
  larger of the median of those norms and the median of the last ``warmup_checks`` of them: the long
  median alone lags a level that is still rising by design (a GAN's generator while its
  discriminator learns), which would make every sample of the rise look like a jump. A spike is kept
  out of the baseline until it has been reported (the caller's history);
* over the last ``growth_window`` checks the norm rose steadily by more than ``growth_factor``.

**Vanishing** when at least one of:

* the first layer (in forward order) has less than ``depth_ratio_floor`` of the last layer's norm
  *and* an absolute norm below ``first_layer_floor`` (AutoTrainer's rule: 1e-3 and 1e-4);
* a layer's root-mean-square gradient is below ``min_rms`` (SageMaker's mean\|g\| < 1e-7; RMS is an
  upper bound of mean\|g\|, so this fires only when mean\|g\| is even smaller). Embedding tables
  (``nn.Embedding``, ``nn.EmbeddingBag``) are left out: the rows a batch did not touch have a gradient
  of exactly 0, so their RMS measures the vocabulary size;
* a layer's norm is below ``relative_floor`` times the largest layer norm of the same step.

Under an adaptive optimizer these three give way to one rule on what its step does: a layer vanishes
when its RMS gradient is under a tenth of the optimizer's ``eps`` (its steps are then at most 1/11 of
the learning rate, and shrink with the gradient), and such layers hold 5 % of the checked entries or
more (a state-space layer's ``A_log`` and ``dt_bias``, a router's gate, a forget gate have tiny gradients
by design and are a sliver of the model); LayerScale's branches at 1e-8 with Adam's 1e-8 are healthy.
None of the vanishing rules applies once the loss is at a tenth of its start or less.

Layers without a gradient this step (frozen, unused, or exactly zero behind a dead path) are never
called vanishing. A layer whose gradient is exactly 0 the first time it is checked, while other layers
have one, sits behind a weight that starts at 0 (LoRA's ``B``, a zero-initialized residual gain or
output layer, ReZero): its gradient grows from 0 by design. Until it has grown 100x past its first
non-zero value such layers are compared only with each other (depth ratio, relative floor) and the
absolute ``min_rms`` floor does not apply to them. A NaN/inf total norm gives no verdict (that is
NaN detection's finding).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.core.runstate import Streaks
from lightning_gradguard.functional.health import (
    depth_ratio,
    flow_values,
    growth_factor,
    sizeable_share,
    spike_ratio,
)
from lightning_gradguard.functional.stats import suggest_clip_value

_MAX_NAMED = 5
#: a spike must also beat the largest recent norm by this factor (heavy-tailed healthy runs stay below)
_SPIKE_OVER_MAX = 2.0
#: a layer that started behind a zero-initialized weight is judged again once its gradient grew this much
_OPENED_FACTOR = 100.0


@dataclass(frozen=True)
class VerdictRules:
    """The thresholds of :func:`judge` (``None`` turns a rule off); see the module docstring."""

    max_norm: float | None = 100.0
    spike_factor: float | None = 10.0
    growth_factor: float | None = 100.0
    growth_window: int = 10
    warmup_checks: int = 5
    depth_ratio_floor: float | None = 1e-3
    first_layer_floor: float = 1e-4
    min_rms: float | None = 1e-7
    relative_floor: float | None = 1e-5


#: under an adaptive optimizer a layer vanishes below this fraction of its ``eps`` (steps <= 1/11 of lr)
ADAPTIVE_FLOOR = 0.1
#: ... when the layers under the floor are a sizeable share of the checked entries
#: (``functional.health.SLIVER_SHARE``): a sliver whose gradient is tiny by design learns slowly while the
#: model learns


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What the optimizer does with this check's gradient, and where the loss stands.

    Attributes:
        eps: the ``eps`` of an adaptive optimizer (``core.lr.adaptive_eps``); ``None``: SGD-like.
        optimizer: the optimizer's class name, for the words.
        clip: the Trainer's ``gradient_clip_val`` when it clips the gradient's norm; ``None``: no clip.
        fitted: the loss is at a tenth of its start or below (``core.progress.LossProgress.fitted``).
    """

    eps: float | None = None
    optimizer: str = "the optimizer"
    clip: float | None = None
    fitted: bool = False


@dataclass(frozen=True)
class GradientVerdict:
    """The verdict of one check: the reasons each condition holds (empty: it does not), and the numbers.

    ``flow`` is ``log10(layer norm / largest layer norm)`` per layer; ``top`` / ``top_values`` the
    largest layers (at most five); ``data`` the numbers an alert carries (``total_norm``, ``spike_ratio``,
    ``growth_factor``, ``first_last_ratio``, ``first_layer_norm``, ``opening_layers``, where computed).
    """

    labels: list[str]
    values: list[float]
    total: float
    exploding: list[str] = field(default_factory=list)
    vanishing: list[str] = field(default_factory=list)
    vanishing_layers: list[str] = field(default_factory=list)
    spike: bool = False
    data: dict[str, float] = field(default_factory=dict)
    flow: list[float] = field(default_factory=list)
    top: list[str] = field(default_factory=list)
    top_values: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Opening:
    """The layers still opening (``positions`` in this check), and the updated bookkeeping.

    ``opening`` maps a layer behind a zero-initialized weight to its first non-zero norm (0.0 while it is
    still 0); ``seen`` holds every layer checked so far.
    """

    positions: set[int]
    opening: dict[str, float]
    seen: set[str]


def named(labels: Sequence[str], values: Sequence[float], fmt: str = "{:.3g}") -> str:
    """``"a (1.2), b (3.4)"`` for the first five layers, ``" and N more"`` for the rest."""
    shown = [f"{n} ({fmt.format(v)})" for n, v in zip(labels[:_MAX_NAMED], values[:_MAX_NAMED], strict=False)]
    more = f" and {len(labels) - _MAX_NAMED} more" if len(labels) > _MAX_NAMED else ""
    return ", ".join(shown) + more


def _where(labels: Sequence[str]) -> str | None:
    if not labels:
        return None
    more = f",+{len(labels) - 3}" if len(labels) > 3 else ""
    return ",".join(labels[:3]) + more


def opening_layers(
    labels: Sequence[str], values: Sequence[float], opening: Mapping[str, float], seen: Collection[str]
) -> Opening:
    """Positions of layers behind a zero-initialized weight whose gradient is still growing from zero.

    A layer whose gradient is exactly 0 the first time it is checked while other layers have one sits
    behind a weight that starts at zero (LoRA's ``B``, a zero-initialized residual gain or output
    layer, ReZero, ControlNet's zero convolutions): its gradient is proportional to that weight and
    grows from 0 by design. It is left out of the vanishing rules until its norm has grown
    ``_OPENED_FACTOR`` times past its first non-zero value; after that it is an ordinary layer.
    ``opening`` and ``seen`` are the bookkeeping of the earlier checks (not modified).
    """
    opening, seen = dict(opening), set(seen)
    finite = [v for v in values if math.isfinite(v)]
    others_live = any(v > 0 for v in finite)
    out: set[int] = set()
    for i, (name, v) in enumerate(zip(labels, values, strict=True)):
        if name not in seen:
            seen.add(name)
            if v == 0.0 and others_live:
                opening[name] = 0.0
        start = opening.get(name)
        if start is None or not math.isfinite(v):
            continue
        if start == 0.0 and v > 0.0:
            opening[name] = start = v
        if start == 0.0 or v < _OPENED_FACTOR * start:
            out.add(i)
        else:
            del opening[name]
    return Opening(positions=out, opening=opening, seen=seen)


def judge(
    *,
    labels: Sequence[str],
    values: Sequence[float],
    total: float,
    numels: Sequence[int],
    history: Sequence[float],
    rules: VerdictRules,
    forward_order: Mapping[str, int],
    opening: Collection[int] = (),
    embeddings: Collection[str] = (),
    context: StepContext | None = None,
) -> GradientVerdict:
    """The verdict of one check (pure Python on a handful of numbers).

    Args:
        labels: the layers, ``values`` their gradient norms and ``numels`` their element counts.
        total: the total gradient norm; a NaN/inf total gives no verdict (empty reasons, NaN flow).
        history: this run's recent finite total norms of checked steps (the spike and growth baseline).
        rules: the thresholds.
        forward_order: layer -> position in the forward pass (the first and last layer).
        opening: positions of layers behind zero-initialized weights (:func:`opening_layers`).
        embeddings: embedding layers (left out of the ``min_rms`` floor).
        context: what the optimizer does with the gradient and where the loss stands (default: an
            SGD-like optimizer, no clip, no loss).
    """
    ctx = context if context is not None else StepContext()
    labels, values = list(labels), list(values)
    data: dict[str, float] = {"total_norm": total}
    if not math.isfinite(total):  # NaN/inf gradients are NaNSentinel's business
        return GradientVerdict(
            labels=labels, values=values, total=total, data=data, flow=[math.nan] * len(labels)
        )
    exploding, spike = _exploding(total, list(history), rules, data, ctx)
    largest_first = [-v if math.isfinite(v) else 0.0 for v in values]
    order = sorted(range(len(labels)), key=largest_first.__getitem__)
    top = [i for i in order if values[i] > 0][:_MAX_NAMED]
    if opening:
        data["opening_layers"] = float(len(opening))
    check = _checked_layers(labels, values, numels, opening)
    flow = check.flow
    # A layer is not judged small against one that is exploding: while the exploding rules hold, the rules
    # that measure a layer against the largest or the last one (relative floor, depth ratio) would read
    # the explosion as vanishing everywhere else (a recurrent layer at 9e4 puts a healthy head at 1e-5 of
    # it). The absolute RMS floor still applies.
    relative = rules if not exploding else replace(rules, relative_floor=None, depth_ratio_floor=None)
    vanishing, low = _vanishing(check, relative, forward_order, embeddings, data, ctx)
    return GradientVerdict(
        labels=labels,
        values=values,
        total=total,
        exploding=exploding,
        vanishing=vanishing,
        vanishing_layers=[labels[i] for i in sorted(low)],
        spike=spike,
        data=data,
        flow=flow,
        top=[labels[i] for i in top],
        top_values=[values[i] for i in top],
    )


# ------------------------------------------------------------------ exploding_gradient
EXPLODING_HINT = (
    "Clip gradients: Trainer(gradient_clip_val={clip:g}) ({clip_why}). Lower the learning rate (try 10x "
    "lower). Check the initialization (He/Kaiming for ReLU, Xavier for tanh/sigmoid). In deep or recurrent "
    "nets add normalization (BatchNorm/LayerNorm) and residual connections."
)
CLIPPED_HINT = (
    "The gradient is already clipped (gradient_clip_val={clip:g}), so each update stays bounded; a norm "
    "that spikes or keeps growing over the run's own level means the loss surface is getting steeper: "
    "lower the learning rate (try 10x lower) or lengthen the warm-up, and look at the data of these steps."
)


def _exploding(
    total: float, hist: list[float], rules: VerdictRules, data: dict[str, float], ctx: StepContext
) -> tuple[list[str], bool]:
    """The exploding rules: their reasons, and whether the spike rule fired (``data`` gets the numbers)."""
    reasons: list[str] = []
    spike = False
    if ctx.clip is None and rules.max_norm is not None and total > rules.max_norm:
        reasons.append(f"the total norm exceeds max_norm={rules.max_norm:g}")
    if ctx.clip is None and rules.spike_factor is not None and len(hist) >= rules.warmup_checks:
        ratio = spike_ratio(total, hist, recent=rules.warmup_checks)
        record = total / max(hist)
        data["spike_ratio"] = ratio
        if ratio > rules.spike_factor and record > _SPIKE_OVER_MAX:
            spike = True
            reasons.append(
                f"it is {ratio:.3g}x the run's level (the larger median of the last {len(hist)} and of "
                f"the last {min(len(hist), rules.warmup_checks)} checked norms) and {record:.3g}x the "
                f"largest of them (spike_factor={rules.spike_factor:g})"
            )
    if rules.growth_factor is not None and len(hist) + 1 >= rules.growth_window:
        g = growth_factor([*hist[-(rules.growth_window - 1) :], total])
        data["growth_factor"] = g
        if g > rules.growth_factor:
            reasons.append(
                f"it grew steadily {g:.3g}x over the last {rules.growth_window} checks "
                f"(growth_factor={rules.growth_factor:g})"
            )
    return reasons, spike


@dataclass(frozen=True, kw_only=True)
class Held:
    """A condition that held on ``patience`` consecutive checks: what its rule's check puts into words.

    Attributes:
        verdict: the check's verdict (:func:`judge`); its reasons may be empty when the condition held on
            another rank.
        patience: the consecutive checks it held.
        history: this run's recent finite total norms of checked steps.
        rules: the thresholds (``max_norm``, ``warmup_checks``).
        context: the check's :class:`StepContext` (``clip``: the Trainer clips the gradient).
    """

    verdict: GradientVerdict
    patience: int
    history: Sequence[float] = ()
    rules: VerdictRules = field(default_factory=VerdictRules)
    context: StepContext = field(default_factory=StepContext)


@dataclass(frozen=True)
class Checked:
    """What the rules read on a check: the conditions it found (``flags``: kind -> held, agreed across
    ranks), the streaks they remember (``strikes``, keyed ``"<optimizer>:<kind>"``) and, for the words,
    :class:`Held`. A rule's check counts its condition once and words it when it held ``patience``
    checks in a row."""

    held: Held
    flags: Mapping[str, bool]
    strikes: Streaks
    opt_idx: int

    def reached(self, rule: Rule[Checked]) -> bool:
        """Count ``rule``'s condition on this check; whether it has held ``patience`` checks in a row."""
        return self.strikes.update(f"{self.opt_idx}:{rule.kind}", self.flags[rule.kind]) >= self.held.patience


def exploding_finding(held: Held) -> Finding:
    """``exploding_gradient`` in words: message, hint, ``where`` (the largest layer) and data.

    The hint suggests a ``gradient_clip_val``: about the 90th percentile of this run's earlier norms
    (``held.history``, those under ``max_norm``) once there are ``warmup_checks`` of them, else 1.0; when
    the run clips already (``held.context.clip``) it says so and suggests the learning rate instead.
    """
    verdict, rules = held.verdict, held.rules
    data = dict(verdict.data)
    reasons = "; ".join(verdict.exploding) or "the condition held on another rank"
    message = (
        f"Gradient norm {verdict.total:.3g} for {held.patience} consecutive checks: {reasons}. "
        f"Largest layers: {named(verdict.top, verdict.top_values)}."
    )
    if held.context.clip is not None:
        hint = CLIPPED_HINT.format(clip=held.context.clip)
    else:
        hist = [h for h in held.history if rules.max_norm is None or h <= rules.max_norm]
        clip = suggest_clip_value(hist) if len(hist) >= rules.warmup_checks else None
        clip_why = "about the 90th percentile of this run's earlier norms"
        if clip is None:
            clip, clip_why = 1.0, "the usual starting point; tune it from grad_norm/total"
        data["suggested_clip_val"] = clip
        hint = EXPLODING_HINT.format(clip=clip, clip_why=clip_why)
    return Finding(EXPLODING_GRADIENT, message, data, hint=hint, where=_where(verdict.top[:1]))


def _exploding_held(ev: Checked) -> Finding | None:
    return exploding_finding(ev.held) if ev.reached(EXPLODING_GRADIENT) else None


EXPLODING_GRADIENT: Rule[Checked] = Rule(
    kind="exploding_gradient",
    severity="error",
    monitor="VanishingExplodingDetector",
    summary="grad norm over its ceiling, a spike over the run's baseline, or a sustained rise",
    when=(
        "the total or a layer norm above `max_norm` (default 100), a spike of 10x over the run's "
        "own median that also tops the recent maximum, or a sustained rise, on `patience` "
        "consecutive checks. Under a `gradient_clip_val` the ceiling and the spike rule are off "
        "(the clip already bounds every update); the sustained rise stays. The hint suggests a "
        "`gradient_clip_val`, or under one a lower LR. See [detectors](detectors.md)."
    ),
    check=_exploding_held,
)


# ------------------------------------------------------------------ vanishing_gradient
@dataclass(frozen=True)
class _Check:
    """One check's layers, as the vanishing rules read them."""

    labels: Sequence[str]
    values: list[float]
    flow: list[float]
    numels: Sequence[int]
    #: the positions of the live ordinary layers, and of the live opening layers
    groups: list[list[int]]


def _checked_layers(
    labels: list[str], values: list[float], numels: Sequence[int], opening: Collection[int]
) -> _Check:
    """The layers as the vanishing rules read them. Layers behind a zero-initialized weight ("opening")
    are compared with each other, never with the rest: their gradients are all scaled down by weights
    that start at 0 and grow together."""
    positive = [i for i, v in enumerate(values) if math.isfinite(v) and v > 0]
    groups = [[i for i in positive if i not in opening], [i for i in positive if i in opening]]
    flow = flow_values(values)
    return _Check(labels=labels, values=values, flow=flow, numels=numels, groups=groups)


def _rms_floor(c: _Check, rules: VerdictRules, embeddings: Collection[str]) -> tuple[list[str], set[int]]:
    """An absolute per-element floor: not for a gradient growing from 0 by design (opening), nor for an
    embedding table, whose RMS is dominated by the rows this batch never touched (their gradient is
    exactly 0): a 50k x 768 table has a 6000x lower RMS than the rows in use."""
    if rules.min_rms is None:
        return [], set()
    live = [i for i in c.groups[0] if c.labels[i] not in embeddings]
    rms = {i: c.values[i] / math.sqrt(max(c.numels[i], 1)) for i in live}
    under = [i for i in live if rms[i] < rules.min_rms]
    if not under:
        return [], set()
    reason = f"RMS gradient below min_rms={rules.min_rms:g} in " + named(
        [c.labels[i] for i in under], [rms[i] for i in under], "RMS {:.2e}"
    )
    return [reason], set(under)


def _relative_floor(c: _Check, rules: VerdictRules) -> tuple[list[str], set[int]]:
    """A layer far below the largest layer of its group (log10 gradient flow)."""
    reasons: list[str] = []
    low: set[int] = set()
    if rules.relative_floor is None:
        return reasons, low
    floor = math.log10(rules.relative_floor)
    for live in (g for g in c.groups if g):
        top_of_group = max(c.flow[i] for i in live)
        rel = {i: c.flow[i] - top_of_group for i in live}
        under = [i for i in live if rel[i] < floor]
        if under:
            low.update(under)
            reasons.append(
                f"norm below relative_floor={rules.relative_floor:g} of the largest layer's in "
                + named([c.labels[i] for i in under], [10 ** rel[i] for i in under], "{:.2e} of it")
            )
    return reasons, low


def _depth_ratio(
    c: _Check, rules: VerdictRules, forward_order: Mapping[str, int], data: dict[str, float]
) -> tuple[list[str], set[int]]:
    """The first layer in forward order far below the last one, and small itself (AutoTrainer's rule)."""
    reasons: list[str] = []
    low: set[int] = set()
    if rules.depth_ratio_floor is None:
        return reasons, low
    for g, live in enumerate(c.groups):
        in_order = sorted((forward_order[c.labels[i]], i) for i in live if c.labels[i] in forward_order)
        idx = [i for _, i in in_order]
        ratio, a, b = depth_ratio([c.values[i] for i in idx]) if len(idx) >= 2 else (math.nan, -1, -1)
        if not math.isfinite(ratio):
            continue
        first, last = idx[a], idx[b]
        if g == 0:
            data["first_last_ratio"] = ratio
            data["first_layer_norm"] = c.values[first]
        if ratio < rules.depth_ratio_floor and c.values[first] < rules.first_layer_floor:
            low.add(first)
            among = " (among the layers behind zero-initialized weights)" if g else ""
            reasons.append(
                f"the first layer {c.labels[first]} has {ratio:.2e} of the last layer "
                f"{c.labels[last]}'s norm{among} ({c.values[first]:.2e} vs {c.values[last]:.2e}; floors "
                f"{rules.depth_ratio_floor:g} and {rules.first_layer_floor:g})"
            )
    return reasons, low


def _adaptive_floor(c: _Check, ctx: StepContext, embeddings: Collection[str]) -> tuple[list[str], set[int]]:
    """Under an adaptive optimizer: the layers whose RMS gradient is under :data:`ADAPTIVE_FLOOR` of its
    ``eps`` (not an opening layer, not an embedding table), when they hold
    :data:`~lightning_gradguard.functional.health.SLIVER_SHARE` of the checked entries or more."""
    assert ctx.eps is not None
    floor = ADAPTIVE_FLOOR * ctx.eps
    live = [i for i in c.groups[0] if c.labels[i] not in embeddings]
    rms = {i: c.values[i] / math.sqrt(max(c.numels[i], 1)) for i in live}
    under = [i for i in live if rms[i] < floor]
    if not sizeable_share(sum(c.numels[i] for i in under), sum(c.numels[i] for i in live)):
        return [], set()  # none, or a few parameters small by design
    reason = (
        f"RMS gradient under {ADAPTIVE_FLOOR:g} x eps = {floor:.2g} of {ctx.optimizer}, whose steps on these "
        "layers are then at most 1/11 of the learning rate and shrink with the gradient, in "
        + named([c.labels[i] for i in under], [rms[i] for i in under], "RMS {:.2e}")
    )
    return [reason], set(under)


def _vanishing(
    c: _Check,
    rules: VerdictRules,
    forward_order: Mapping[str, int],
    embeddings: Collection[str],
    data: dict[str, float],
    ctx: StepContext,
) -> tuple[list[str], set[int]]:
    """The vanishing rules: their reasons and the positions of the low layers (``data`` gets the numbers)."""
    reasons: list[str] = []
    low: set[int] = set()
    if ctx.fitted:  # small gradients of a model that has fitted its data are its success
        return reasons, low
    if ctx.eps is not None:
        return _adaptive_floor(c, ctx, embeddings)
    for found, layers in (
        _rms_floor(c, rules, embeddings),
        _relative_floor(c, rules),
        _depth_ratio(c, rules, forward_order, data),
    ):
        reasons += found
        low |= layers
    return reasons, low


def vanishing_finding(held: Held) -> Finding:
    """``vanishing_gradient`` in words: message, ``where`` (the low layers) and data; the hint is the
    rule's."""
    reasons = "; ".join(held.verdict.vanishing) or "the condition held on another rank"
    return Finding(
        VANISHING_GRADIENT,
        f"Gradients vanish ({held.patience} consecutive checks): {reasons}.",
        dict(held.verdict.data),
        where=_where(held.verdict.vanishing_layers),
    )


def _vanishing_held(ev: Checked) -> Finding | None:
    return vanishing_finding(ev.held) if ev.reached(VANISHING_GRADIENT) else None


VANISHING_GRADIENT: Rule[Checked] = Rule(
    kind="vanishing_gradient",
    severity="error",
    monitor="VanishingExplodingDetector",
    summary="gradients vanish: first/last layer ratio under a floor, or a layer far below",
    when=(
        "the first/last layer norm ratio (by depth in the graph) below 1e-3 with a first-layer norm"
        " below 1e-4, a layer's RMS gradient below 1e-7, or a layer 1e5x below the largest; under "
        "an adaptive optimizer (Adam and its family) instead a layer's RMS gradient below a tenth "
        "of its `eps` (where its steps shrink with the gradient), when such layers hold 5 % of the "
        "checked entries or more (a state-space layer's A_log, a router's gate are small by "
        "design). Never once the loss is at a tenth"
        " of its start. Layers without a gradient this step are never counted."
    ),
    hint=(
        "Use non-saturating activations (ReLU/GELU instead of sigmoid/tanh), He/Xavier initialization, "
        "BatchNorm/LayerNorm between layers and residual connections in deep nets; raise the learning rate "
        "only after those fixes."
    ),
    check=_vanishing_held,
)


#: every kind this monitor reports, in the order they are judged
RULES: tuple[Rule[Checked], ...] = declare(EXPLODING_GRADIENT, VANISHING_GRADIENT)
