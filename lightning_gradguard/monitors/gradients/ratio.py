"""GradientNormLogger's update-ratio verdict: a learning rate far too high, named with the numbers.

``||delta w|| / ||w||`` near 1e-3 is the rule of thumb for a healthy layer (Karpathy, CS231n): far above
it every step rewrites a sizeable part of the weights and the learning rate is the usual cause. The
total ratio (over every trainable parameter of the optimizer: dominated by the large matrices, so the
naturally larger ratios of biases and LayerNorm gains hardly count) is read on each logging step;
:class:`RatioWatch` keeps the run of consecutive checks above the ceiling and says when it was
sustained: ``SUSTAIN_CHECKS`` checks spanning ``SUSTAIN_STEPS`` steps, none before ``SETTLE_STEPS``
(Adam's first steps move every entry by about ``lr``, and a freshly initialised head moves fast for its
first 20 steps). :func:`ratio_finding` says it, naming the optimizer's learning rate, or its weight decay
when ``lr * weight_decay`` alone is half the ratio or more (AdamW with a decay far too strong: the update
is mostly the decay's shrinking, and lowering the LR would not be the fix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_gradguard.core.lr import decay_factors

#: checks before this step are not judged (Adam's bias correction, fresh layers' first moves)
SETTLE_STEPS = 20
#: a ratio above the ceiling must hold on this many consecutive checks ...
SUSTAIN_CHECKS = 3
#: ... spanning at least this many steps
SUSTAIN_STEPS = 20
#: the top of the band the healthy runs sat in after their first 20 steps: what a suggested lr aims at
_HEALTHY_TOP = 1e-2
#: the weight decay is named instead of the LR when ``lr * weight_decay`` is at least this share of the
#: lowest ratio seen (a decay that removes half of what moves is the cause, not a side effect)
DECAY_SHARE = 0.5


@dataclass(frozen=True)
class RatioFinding:
    """A sustained update/weight ratio far above the healthy band, in words (a warning)."""

    kind: Literal["update_ratio_high"]
    message: str
    hint: str
    data: dict[str, float]


class RatioWatch:
    """The current run of consecutive checks whose total update ratio stayed above the ceiling."""

    def __init__(self) -> None:
        self.first: int | None = None  # the step of the run's first check
        self.count = 0
        self.lowest = math.inf
        self.last = 0.0

    def check(self, step: int, ratio: float | None, ceiling: float) -> bool:
        """Note the check of ``step``; ``True`` when the ratio has now stayed above ``ceiling`` long enough.

        A check below the ceiling (or without a finite ratio) ends the run; checks before
        ``SETTLE_STEPS`` are not counted."""
        if step < SETTLE_STEPS:
            return False
        if ratio is None or not ratio > ceiling or not math.isfinite(ratio):
            self.first, self.count, self.lowest = None, 0, math.inf
            return False
        if self.first is None:
            self.first = step
        self.count += 1
        self.lowest, self.last = min(self.lowest, ratio), ratio
        return self.count >= SUSTAIN_CHECKS and step - self.first >= SUSTAIN_STEPS

    def state_dict(self) -> dict[str, Any]:
        return {"first": self.first, "count": self.count, "lowest": self.lowest, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first = state.get("first")
        self.count = int(state.get("count", 0))
        self.lowest, self.last = float(state.get("lowest", math.inf)), float(state.get("last", 0.0))


@dataclass(frozen=True)
class _Setting:
    """What the optimizer runs with: its name, its param groups' learning rates, betas or momentum."""

    name: str
    lrs: list[float]
    betas: tuple[float, float] | None
    momentum: float
    decay: float = 0.0  # the largest share of a weight its weight decay removes per step (lr * weight_decay)
    weight_decay: float = 0.0  # that group's weight_decay

    def __str__(self) -> str:
        lr = f"lr={self.lrs[0]:g}" if len(self.lrs) == 1 else "lr " + ", ".join(f"{x:g}" for x in self.lrs)
        if self.betas is not None:
            lr += f", betas=({self.betas[0]:g}, {self.betas[1]:g})"
        elif self.momentum > 0:
            lr += f", momentum={self.momentum:g}"
        return f"{self.name}({lr})"


def _setting(optimizer: Any) -> _Setting:
    opt = getattr(optimizer, "optimizer", optimizer)
    groups = list(getattr(opt, "param_groups", []))
    first = groups[0] if groups else {}
    betas = (float(first["betas"][0]), float(first["betas"][1])) if "betas" in first else None
    factors = decay_factors(opt, ())
    decay, weight_decay = factors.largest if factors is not None else (0.0, 0.0)
    return _Setting(
        name=type(opt).__name__,
        lrs=sorted({float(g["lr"]) for g in groups if "lr" in g}),
        betas=betas,
        momentum=float(first.get("momentum", 0.0) or 0.0),
        decay=decay,
        weight_decay=weight_decay,
    )


def _decay_dominates(setting: _Setting, watch: RatioWatch) -> bool:
    """The weight decay alone removes at least half the update ratio seen: it, not the LR, is the cause."""
    return setting.decay >= DECAY_SHARE * watch.lowest


def ratio_finding(watch: RatioWatch, step: int, ceiling: float, optimizer: Any) -> RatioFinding:
    """The learning rate of ``optimizer`` named for a ratio that stayed above ``ceiling`` (``watch``); its
    weight decay instead when the decay alone removes most of that ratio each step."""
    setting = _setting(optimizer)
    if _decay_dominates(setting, watch):
        return _decay_finding(watch, step, ceiling, setting)
    unbounded = setting.betas is not None and setting.betas[1] <= setting.betas[0] ** 2
    cause = (
        "Adam's beta2 is far too small (beta2 <= beta1^2: its step has no bound), or the lr too high"
        if unbounded
        else "The learning rate is likely too high"
    )
    message = (
        f"The update/weight ratio ||delta w|| / ||w|| over all trainable parameters stayed above {ceiling:g} "
        f"on {watch.count} checks in a row (steps {watch.first}-{step}; latest {watch.last:.3g}, lowest "
        f"{watch.lowest:.3g}): {watch.lowest / 1e-3:.0f}x the ~1e-3 of a healthy layer (CS231n), so every "
        f"step rewrites about {watch.lowest:.1%} of the weights. {cause}: {setting}."
    )
    factor = watch.lowest / _HEALTHY_TOP
    lr = max(setting.lrs) if setting.lrs else math.nan
    hint = (
        f"Lower the learning rate about {factor:.2g}x (the ratio grows with it: try lr={lr / factor:.2g}), "
        "or warm it up; LRFinderPlus measures a good one. Healthy runs sat at 2e-3 to 2e-2 after their "
        "first 20 steps."
    )
    if unbounded:
        hint += (
            " Here beta2 <= beta1^2: Adam's own step has no bound, so raise beta2 first (OptimizerMonitor "
            "reports it as adam_step_too_large)."
        )
    return RatioFinding("update_ratio_high", message, hint, {**_data(watch, ceiling), "lr": lr})


def _decay_finding(watch: RatioWatch, step: int, ceiling: float, setting: _Setting) -> RatioFinding:
    """The ratio is the weight decay's doing: it removes ``lr * weight_decay`` of every weight a step."""
    message = (
        f"The update/weight ratio ||delta w|| / ||w|| over all trainable parameters stayed above {ceiling:g} "
        f"on {watch.count} checks in a row (steps {watch.first}-{step}; latest {watch.last:.3g}, lowest "
        f"{watch.lowest:.3g}), and the weight decay alone accounts for most of it: {setting} removes "
        f"lr * weight_decay = {setting.decay:.3g} of every weight each step (weight_decay="
        f"{setting.weight_decay:g}). The weight decay is far too strong for this learning rate."
    )
    usual = (
        "SGD's usual values are 1e-4 to 5e-4"
        if setting.name == "SGD"
        else f"{setting.name}'s usual values are 0.01-0.1 (1e-4 to 5e-4 is SGD's L2 scale)"
    )
    hint = (
        f"Lower weight_decay: {usual}, so that lr * weight_decay stays near 1e-4 or below. "
        "StallDetector's weight_decay_collapse says when the weights have shrunk."
    )
    return RatioFinding(
        "update_ratio_high", message, hint, {**_data(watch, ceiling), "decay_share": setting.decay}
    )


def _data(watch: RatioWatch, ceiling: float) -> dict[str, float]:
    return {
        "update_ratio": watch.last,
        "lowest": watch.lowest,
        "ceiling": ceiling,
        "checks": float(watch.count),
    }
