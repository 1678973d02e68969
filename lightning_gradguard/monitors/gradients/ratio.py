"""GradientNormLogger's update-ratio watch: how long the total update/weight ratio has stayed too high.

``||delta w|| / ||w||`` near 1e-3 is the rule of thumb for a healthy layer (Karpathy, CS231n): far above
it every step rewrites a sizeable part of the weights and the learning rate is the usual cause. The
total ratio (over every trainable parameter of the optimizer: dominated by the large matrices, so the
naturally larger ratios of biases and LayerNorm gains hardly count) is read on each logging step;
:class:`RatioWatch` keeps the run of consecutive checks above the ceiling and says when it was
sustained: ``SUSTAIN_CHECKS`` checks spanning ``SUSTAIN_STEPS`` steps, none before ``SETTLE_STEPS``
(Adam's first steps move every entry by about ``lr``, and a freshly initialised head moves fast for its
first 20 steps). :func:`optimizer_setting` is what the optimizer runs with, as the rule names it. The
rule itself, ``update_ratio_high``, and its words are
:func:`~lightning_gradguard.monitors.gradients.rules.ratio_finding`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_gradguard.core.lr import decay_factors, group_lr
from lightning_gradguard.core.progress import LossProgress
from lightning_gradguard.core.runstate import RunField, Stateful, nothing

#: checks before this step are not judged (Adam's bias correction, fresh layers' first moves)
SETTLE_STEPS = 20
#: a ratio above the ceiling must hold on this many consecutive checks ...
SUSTAIN_CHECKS = 3
#: ... spanning at least this many steps
SUSTAIN_STEPS = 20
#: a run of high ratios while the loss is this share below its first is a learner's, not an LR too high (a
#: BatchNorm CNN at SGD 0.5 sits at 4-6 % a step while its loss falls faster than at 0.05)
PRODUCTIVE_FALL = 0.1


class RatioWatch(Stateful):
    """The current run of consecutive checks whose total update ratio stayed above the ceiling."""

    first: RunField[int | None] = RunField(nothing)  # the step of the run's first check
    count: RunField[int] = RunField(int)
    lowest: RunField[float] = RunField(lambda: math.inf)
    last: RunField[float] = RunField(float)

    def __init__(self) -> None:
        self.reset_run()

    def check(
        self, step: int, ratio: float | None, ceiling: float, progress: LossProgress | None = None
    ) -> bool:
        """Note the check of ``step`` (and the loss's level then); ``True`` when the ratio has now stayed
        above ``ceiling`` long enough, unless the loss is ``PRODUCTIVE_FALL`` below the run's first
        (:meth:`_learning`)."""
        # A check below the ceiling (or without a finite ratio) ends the run; checks before SETTLE_STEPS
        # are not counted
        if step < SETTLE_STEPS:
            return False
        if ratio is None or not ratio > ceiling or not math.isfinite(ratio):
            self.first, self.count, self.lowest = None, 0, math.inf
            return False
        if self.first is None:
            self.first = step
        self.count += 1
        self.lowest, self.last = min(self.lowest, ratio), ratio
        sustained = self.count >= SUSTAIN_CHECKS and step - self.first >= SUSTAIN_STEPS
        return sustained and not (progress is not None and self._learning(progress.level, progress.first))

    @staticmethod
    def _learning(loss: float | None, first: float | None) -> bool:
        """The loss (the median of the last three logging steps') is ``PRODUCTIVE_FALL`` below the run's
        first: the run learns at that ratio (an LR too high sends the loss back up, or never down).
        Compared with the loss at the run of checks' first, the median of three single losses of a
        batch of 8 scatters by 3x: the run's first is the steadier reference."""
        if loss is None or first is None or not loss > 0:
            return False
        return loss <= (1 - PRODUCTIVE_FALL) * first


@dataclass(frozen=True)
class OptimizerSetting:
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


def optimizer_setting(optimizer: Any) -> OptimizerSetting:
    """What ``optimizer`` runs with (a Lightning wrapper's optimizer is read)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    groups = list(getattr(opt, "param_groups", []))
    first = groups[0] if groups else {}
    betas = (float(first["betas"][0]), float(first["betas"][1])) if "betas" in first else None
    factors = decay_factors(opt, ())
    decay, weight_decay = factors.largest if factors is not None else (0.0, 0.0)
    return OptimizerSetting(
        name=type(opt).__name__,
        lrs=sorted({lr for g in groups if (lr := group_lr(g)) is not None}),
        betas=betas,
        momentum=float(first.get("momentum", 0.0) or 0.0),
        decay=decay,
        weight_decay=weight_decay,
    )
