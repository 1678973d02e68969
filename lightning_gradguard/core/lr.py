"""Changing a run's learning rate so that it sticks, and reading what the optimizer does with a gradient.

:func:`rescale_learning_rates` changes every param group and every scheduler's base LRs;
:func:`decoupled_decay_groups` says which param groups shrink their weights by ``lr * weight_decay`` a step
apart from the gradient (the monitors that judge a step's size must not read that as the LR's doing) and
:func:`decay_factors` that share for each parameter (the one place it is computed: GradientNormLogger's
ratio rule and StallDetector's probe read it);
:func:`adaptive_eps` says whether the step is normalised by the gradient's own running size (Adam and its
family): then the gradient's scale does not set the update, down to ``eps``; :func:`clip_setting` how the
Trainer clips the gradient before the step; :class:`ScheduleCopy` the run's schedulers copied onto a
stand-in optimizer, to read the LRs they will give without touching the run.

A PyTorch LR scheduler recomputes the LR on every step, either from its ``base_lrs`` (closed forms such as
``LambdaLR``) or from the group's current ``lr`` (chainable forms such as ``StepLR``), and keeps its
bookkeeping in the param groups (``initial_lr``, OneCycleLR's ``max_lr`` / ``min_lr``). Rescaling all of
them together changes the LR the schedule produces from now on, whatever kind of scheduler it is, and the
same rescaling with the inverse function puts it back.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor

from lightning_gradguard.functional.clipping import clipping_norm_type

#: scheduler bookkeeping kept in param groups, rescaled with ``lr``
_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr")


def group_lr(group: Mapping[str, Any]) -> float | None:
    """A param group's learning rate as a Python float, or ``None`` where the optimizer sets its own step
    size and holds no number (Adafactor's relative step keeps ``lr=None``): every rule about the LR then
    has nothing to judge. A tensor LR is read (a CPU scalar, as schedulers keep it: no device sync)."""
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        return float(lr.detach().reshape(()).cpu()) if lr.numel() == 1 else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        return float(lr)
    return None


def step_cap(optimizer: Any) -> float | None:
    """The largest learning rate group 0's next step can use, where the optimizer caps it; ``None`` where
    it does not (every optimizer but one).

    ``torch.optim.Adafactor`` steps by ``min(lr, 1 / sqrt(t))`` times the parameters' RMS at its ``t``-th
    step: above that cap every LR takes the same gradient step (only its weight decay, ``lr *
    weight_decay``, still grows with the LR). Its step count is read from the state of group 0's first
    parameter that has one (0 before the first step)."""
    adafactor = getattr(torch.optim, "Adafactor", None)  # torch 2.5 on
    if adafactor is None or not isinstance(optimizer, adafactor):
        return None
    done = 0.0
    for param in optimizer.param_groups[0]["params"]:
        state = optimizer.state.get(param)
        if state and "step" in state:
            done = float(state["step"])
            break
    return 1.0 / math.sqrt(done + 1.0)


def rescale_learning_rates(trainer: pl.Trainer, optimizer: Any, scaled: Callable[[float], float]) -> None:
    """Map every LR of ``optimizer`` (groups, their scheduler keys) and of the Trainer's schedulers
    (``base_lrs``, nested in SequentialLR / ChainedScheduler too) through ``scaled``."""
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:
        lr = group_lr(group)
        if lr is None:  # the optimizer sets its own step (Adafactor's relative step): nothing to scale
            continue
        group["lr"] = scaled(lr)
        for key in _GROUP_KEYS:
            if isinstance(group.get(key), (int, float)) and not isinstance(group.get(key), bool):
                group[key] = scaled(float(group[key]))
    todo = [
        cfg.scheduler
        for cfg in trainer.lr_scheduler_configs
        if getattr(cfg.scheduler, "optimizer", opt) is opt
    ]
    while todo:  # SequentialLR / ChainedScheduler: their children keep base LRs of their own
        scheduler = todo.pop()
        todo.extend(getattr(scheduler, "_schedulers", []))
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [scaled(float(b)) for b in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group_lr(g) or 0.0 for g in opt.param_groups]


def decoupled_decay_groups(optimizer: Any) -> list[dict[str, Any]]:
    """The param groups of ``optimizer`` whose weight decay removes ``lr * weight_decay`` of each weight per
    step as a term of its own: decoupled decay (AdamW; Adam, NAdam, RAdam with
    ``decoupled_weight_decay=True``) and plain SGD's (with momentum the term is spread over the next
    steps). Adam's L2 decay is folded into the gradient it normalizes: not listed. Groups with a
    ``weight_decay`` of 0, or a non-numeric one, are left out. A loop over the groups: read on measured
    steps only."""
    opt = getattr(optimizer, "optimizer", optimizer)
    always = isinstance(opt, (torch.optim.AdamW, torch.optim.SGD))
    return [
        group
        for group in getattr(opt, "param_groups", [])
        if isinstance(decay := group.get("weight_decay"), (int, float))
        and not isinstance(decay, bool)
        and decay > 0
        and (always or group.get("decoupled_weight_decay") is True)
    ]


@dataclass(frozen=True)
class DecayFactors:
    """``lr * weight_decay`` of each parameter of a step (model order, 0 where nothing decays it) and the
    ``(lr, weight_decay)`` of every param group that decays."""

    factors: list[float]
    groups: list[tuple[float, float]]

    @property
    def largest(self) -> tuple[float, float]:
        """``(lr * weight_decay, weight_decay)`` of the group whose decay removes the largest share."""
        return max((lr * wd, wd) for lr, wd in self.groups)


def decay_factors(optimizer: Any, params: Sequence[Tensor]) -> DecayFactors | None:
    """What the weight decay of ``optimizer`` removes from each of ``params`` this step, as a share of the
    weight: ``lr * weight_decay`` for decoupled decay (AdamW, any group with ``decoupled_weight_decay``)
    and for plain SGD, whose update holds ``lr * weight_decay * w`` as a term of its own (with momentum the
    term is spread over the next steps: its share is then underestimated). Other optimizers fold the decay
    into the gradient they normalize (Adam's L2): ``None``, as when no group decays. Read before the step,
    on a check step only (a loop over the param groups)."""
    by_id: dict[int, float] = {}
    groups: list[tuple[float, float]] = []
    for g in decoupled_decay_groups(optimizer):
        lr, wd = group_lr(g), float(g["weight_decay"])
        if lr is not None:
            groups.append((lr, wd))
            by_id.update(dict.fromkeys(map(id, g["params"]), lr * wd))
    if not by_id:
        return None
    return DecayFactors([by_id.get(id(p), 0.0) for p in params], groups)


def orthogonalized_share(optimizer: Any) -> float:
    """The share of ``optimizer``'s entries whose update is orthogonalized (Muon: torch's ``Muon`` groups
    hold its Newton-Schulz ``ns_steps``; the reference implementation's mixed groups say ``use_muon``).

    Such an update has a norm set by the optimizer's design, ``lr * sqrt(min(m, n))`` per matrix (times
    its shape adjustment), whatever the gradient's scale: every step rewrites a few percent of the weights
    by construction (0.1 of a 64-wide matrix at lr 0.02, 0.04 of a 768-wide one), and a rule that reads a
    large update/weight ratio as a too-high LR or a missing warm-up does not apply to it. A loop over the
    param groups: read it once per fit."""
    opt = getattr(optimizer, "optimizer", optimizer)
    groups = list(getattr(opt, "param_groups", []))
    sizes = [sum(p.numel() for p in g["params"]) for g in groups]
    ortho = sum(n for g, n in zip(groups, sizes, strict=True) if "ns_steps" in g or g.get("use_muon") is True)
    return ortho / max(sum(sizes), 1)


#: optimizers that divide each entry's step by a running RMS of its gradient, without Adam's ``betas``
_ADAPTIVE = (torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)


def adaptive_eps(optimizer: Any) -> float | None:
    """The ``eps`` of an optimizer whose step divides each entry by a running RMS of its own gradient
    (Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, Adagrad, Adadelta, and any optimizer whose groups hold
    Adam's ``betas`` and a numeric ``eps``); ``None`` for SGD-like optimizers, whose step is the gradient's
    scale. Under an adaptive optimizer a gradient 1000x smaller moves the weights as far, as long as its
    entries stay well above ``eps``: rules about the gradient's raw magnitude do not apply. The largest
    ``eps`` of the groups."""
    opt = getattr(optimizer, "optimizer", optimizer)
    eps = [
        float(g["eps"])
        for g in getattr(opt, "param_groups", [])
        if isinstance(g.get("eps"), (int, float)) and not isinstance(g.get("eps"), bool)
    ]
    adaptive = isinstance(opt, _ADAPTIVE) or any("betas" in g for g in getattr(opt, "param_groups", []))
    return max(eps) if adaptive and eps else None


@dataclass(frozen=True)
class ClipSetting:
    """How the Trainer clips gradients: ``gradient_clip_val`` and the norm that decides clipping."""

    value: float
    norm_type: float


def clip_setting(trainer: pl.Trainer) -> ClipSetting | None:
    """The Trainer's gradient clipping, or ``None`` when it does not clip.

    Lightning clips only in automatic optimization, and only for a ``gradient_clip_val`` above 0. Clipping
    by norm rescales the gradient when its total 2-norm exceeds the value; clipping by value changes it
    when some entry's magnitude does, which is when the infinity norm exceeds the value.
    """
    val = trainer.gradient_clip_val
    if val is None or float(val) <= 0 or not trainer.lightning_module.automatic_optimization:
        return None
    algorithm = GradClipAlgorithmType(getattr(trainer, "gradient_clip_algorithm", None) or "norm")
    return ClipSetting(value=float(val), norm_type=clipping_norm_type(algorithm.value))


class _Stand:
    """The stand-in optimizer of a scheduler's copy: copies of the param groups, without parameters."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = groups
        self.defaults: dict[str, Any] = {}

    def step(self) -> None:  # a scheduler checks that it exists
        return None


class ScheduleCopy:
    """The Trainer's schedulers of ``optimizer``, deep-copied onto a stand-in optimizer (copies of its
    param groups, without their parameters): stepped ahead, they give the LRs the run will get, and the
    run's optimizer, schedulers, model and random state are never touched. ``readable`` is False for a
    ``ReduceLROnPlateau`` (it follows a metric), a group without a numeric LR (Adafactor's relative
    step) or a scheduler that cannot be copied (it holds a lock, say). What a scheduler reads besides its
    own count (a ``LambdaLR`` reading ``trainer.global_step``) is read as it is now: the caller confirms
    against the LRs the run really used where it matters."""

    def __init__(self, trainer: pl.Trainer, optimizer: Any, module: Any = None) -> None:
        self.configs = [
            c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is optimizer
        ]
        groups = optimizer.param_groups
        plateau = any(c.reduce_on_plateau for c in self.configs)
        self.readable = not plateau and all(group_lr(g) is not None for g in groups)
        self.stand = _Stand([{k: v for k, v in g.items() if k != "params"} for g in groups])
        memo: dict[int, Any] = {id(optimizer): self.stand, id(trainer): trainer}
        module = module if module is not None else getattr(trainer, "lightning_module", None)
        if module is not None:  # a LambdaLR on a bound method of the module: the module is not copied
            memo[id(module)] = module
        memo.update({id(p): p for g in groups for p in g["params"]})
        self.schedulers: list[Any] = []
        if self.readable:
            try:
                self.schedulers = copy.deepcopy([c.scheduler for c in self.configs], memo)
            except Exception:  # a scheduler holding what cannot be copied (a lock, a generator): unread
                self.readable = False

    def lrs(self) -> list[float]:
        """Every param group's LR now (0 for a group without a numeric one)."""
        return [group_lr(g) or 0.0 for g in self.stand.param_groups]

    def step(self, which: Sequence[int] | None = None) -> bool:
        """Step the copies (those at the indices ``which`` of ``configs``, or all); False once one refuses
        (a ``OneCycleLR`` stepped past its ``total_steps``): the LRs read so far are all there is."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a copy's first step may say its optimizer did not step
            try:
                for i in range(len(self.schedulers)) if which is None else which:
                    self.schedulers[i].step()
            except Exception:
                return False
        return True
