"""What one check of a stalled-learning detector measured, the thresholds its rules use, and a finding.

Plain data and two helpers on host numbers, no Trainer: :class:`StallCheck` is one check's
measurements, :class:`StallRules` the thresholds of :mod:`lightning_gradguard.monitors.stall.rules`'s rules,
:class:`StallFinding` a rule that holds, in words; :func:`label_entropy` is the loss of a classifier that
learned only the class frequencies, :func:`batch_purity` how much of a batch its one or two largest
classes hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "HINTS",
    "WHERE",
    "StallCheck",
    "StallFinding",
    "StallRules",
    "batch_purity",
    "label_entropy",
    "spread",
]


@dataclass(frozen=True)
class StallRules:
    """The thresholds of the rules (see :mod:`lightning_gradguard.monitors.stall.rules`).

    Attributes:
        patience: consecutive checks a condition must hold.
        warmup_steps: no ``chance_level`` / ``loss_plateau`` verdict before this step.
        collapse_factor: an update ratio this many times below its highest level has collapsed; an LR
            this many times below its highest has fallen.
        collapse_layers: the share of the layers that must have collapsed.
        collapse_share: a collapse must have lasted this share of the steps so far.
        final_phase: the last share of the planned run, where a schedule may decay the LR to ~0.
        early_phase: an LR that fell ``collapse_factor`` times within this first share of the planned run
            fell early (a schedule in the wrong unit gets there within a few percent of the run).
        clip_factor: a used gradient this many times smaller than the raw one is clipped to nothing.
        chance_margin: the loss is at chance when it is at least ``1 - chance_margin`` times the chance
            level (and at most ``chance_ceiling`` times it).
        chance_ceiling: see ``chance_margin``; also, the chance rule is armed only when the first check's
            loss is within this factor of the chance level (a classifier's first loss is about ln C).
        plateau_checks: checks without a new best smoothed loss before ``loss_plateau``.
        plateau_factor: ``loss_plateau`` when the smoothed loss is this many times its best...
        improvement: ...or a new best is this relative improvement.
        lr_jump_factor: an LR this many times the configured maximum is a jump.
        warmup_lr_fraction: a warm-up that never ends keeps the LR under this share of the configured.
        warmup_lr_steps: with the planned run unknown, the warm-up is judged at this step.
        warmup_min_steps: the earliest step the warm-up is extrapolated from.
        sorted_purity: a batch is (almost) one class when its largest class holds this share of it (its
            two largest, for a batch on a class boundary).
        sorted_minority: ...and that class is at most this share of the labels seen so far.
    """

    patience: int = 3
    warmup_steps: int = 40
    collapse_factor: float = 100.0
    collapse_layers: float = 0.5
    collapse_share: float = 0.1
    final_phase: float = 0.1
    early_phase: float = 0.25
    clip_factor: float = 100.0
    chance_margin: float = 0.03
    chance_ceiling: float = 1.5
    plateau_checks: int = 30
    plateau_factor: float = 2.0
    improvement: float = 0.01
    lr_jump_factor: float = 10.0
    warmup_lr_fraction: float = 0.05
    warmup_lr_steps: int = 100
    warmup_min_steps: int = 19
    sorted_purity: float = 0.9
    sorted_minority: float = 0.5


@dataclass(frozen=True)
class StallCheck:
    """What one check measured. ``None`` / empty: not measured (that rule skips the check).

    ``lr``: the LR the checked step used (the largest over the param groups); ``lr_max``: the largest
    LR any step used so far; ``lr_configured``: the largest LR the optimizer was configured to reach.
    ``loss``: the mean training loss since the previous check. ``update_ratios``: ``||delta w|| / ||w||``
    per layer for this check's step; ``update_total``: ``||delta w||`` over every parameter.
    ``clip_ratio``: the norm of the gradient the optimizer used over its norm before clipping.
    ``labels``: class counts of the check's batch. ``planned_steps``: the run's planned optimizer steps
    (``None``: unknown).
    """

    step: int
    lr: float
    lr_max: float
    lr_configured: float
    loss: float | None = None
    update_ratios: Mapping[str, float] = field(default_factory=dict)
    update_total: float | None = None
    clip_ratio: float | None = None
    labels: Sequence[float] | None = None
    planned_steps: int | None = None


@dataclass(frozen=True)
class StallFinding:
    """A rule that holds, in words; ``where`` names what to look at (its :data:`WHERE` entry)."""

    kind: str
    message: str
    hint: str
    data: dict[str, float]

    @property
    def where(self) -> str:
        return WHERE.get(self.kind, "training")


#: what each finding points at: the alert's ``where``
WHERE: dict[str, str] = {
    "no_update": "optimizer step",
    "clipped_updates": "gradient clipping",
    "lr_decayed": "lr_scheduler",
    "updates_collapsed": "updates",
    "chance_level": "training loss",
    "loss_plateau": "training loss",
    "lr_jump": "lr_scheduler",
    "warmup_never_ends": "lr_scheduler",
    "sorted_labels": "train_dataloader",
}


def label_entropy(counts: Sequence[float]) -> float:
    """The entropy (nats) of a class distribution given by counts: the loss of a classifier that learned
    nothing but the class frequencies (``log C`` for balanced classes). NaN without any count."""
    total = sum(counts)
    if total <= 0:
        return math.nan
    return -sum(c / total * math.log(c / total) for c in counts if c > 0)


def batch_purity(counts: Sequence[float]) -> tuple[float, float]:
    """The shares of a batch held by its largest class and by its two largest classes."""
    total = sum(counts)
    if total <= 0:
        return 0.0, 0.0
    top = sorted(counts, reverse=True)[:2]
    return top[0] / total, sum(top) / total


def spread(history: Sequence[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    """About ``n`` entries of ``history``, from the first to the last."""
    if len(history) <= n:
        return list(history)
    picks = sorted({round(i * (len(history) - 1) / (n - 1)) for i in range(n)})
    return [history[i] for i in picks]


#: the hint of each finding: the likely cause and the fix
HINTS: dict[str, str] = {
    "clipped_updates": (
        "Something clips far below the gradient norm: a custom `configure_gradient_clipping`, a "
        "`clip_grad_norm_` in the model, or `Trainer(gradient_clip_val=...)`. Clip at about the 90th "
        "percentile of the pre-clip norm (GradientNormLogger's `grad_clip/suggested_clip_val`)."
    ),
    "updates_collapsed": (
        "The updates shrank while the LR did not: clipping far below the gradient norm, weight decay or a"
        " constraint pulling every step back, or gradients that vanished. Compare grad_norm/* and "
        "update_ratio/* (GradientNormLogger)."
    ),
    "lr_jump": (
        "A schedule bug multiplies the LR: a LambdaLR factor that is not a fraction, a warm-up that "
        "multiplies instead of interpolating, two schedulers on one optimizer, or an LR set by hand in a "
        "hook. Print `optimizer.param_groups[i]['lr']` around the jump."
    ),
    "warmup_never_ends": (
        "The warm-up is far longer than meant: its length may be in samples or epochs where the scheduler"
        " counts optimizer steps (or the reverse). Give warm-up steps in optimizer steps "
        "(`trainer.estimated_stepping_batches` is the run's total)."
    ),
    "sorted_labels": (
        "The loader feeds the classes one after the other: shuffle the training data "
        "(`DataLoader(shuffle=True)` or a sampler that shuffles); the model forgets each class while it "
        "learns the next."
    ),
    "loss_plateau": (
        "Training stalled: look at the LR history (a jump or a collapse), the update ratios and the data "
        "order; a loss stuck far above its best after a jump usually means the LR is too high."
    ),
    "lr_decayed": (
        'A scheduler meant to step per epoch may be stepping per batch (`"interval": "step"` in '
        "`configure_optimizers`), or its step_size / T_max / gamma is in the wrong unit. Make the decay "
        "span the run (`trainer.estimated_stepping_batches` optimizer steps)."
    ),
}
