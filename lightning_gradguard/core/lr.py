"""Changing a run's learning rate so that it sticks, and reading the weight decay it applies.

:func:`rescale_learning_rates` changes every param group and every scheduler's base LRs;
:func:`decoupled_decay_groups` says which param groups shrink their weights by ``lr * weight_decay`` a step
apart from the gradient (the monitors that judge a step's size must not read that as the LR's doing).

A PyTorch LR scheduler recomputes the LR on every step, either from its ``base_lrs`` (closed forms such as
``LambdaLR``) or from the group's current ``lr`` (chainable forms such as ``StepLR``), and keeps its
bookkeeping in the param groups (``initial_lr``, OneCycleLR's ``max_lr`` / ``min_lr``). Rescaling all of
them together changes the LR the schedule produces from now on, whatever kind of scheduler it is, and the
same rescaling with the inverse function puts it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["decoupled_decay_groups", "rescale_learning_rates"]

#: scheduler bookkeeping kept in param groups, rescaled with ``lr``
_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr")


def rescale_learning_rates(trainer: pl.Trainer, optimizer: Any, scaled: Callable[[float], float]) -> None:
    """Map every LR of ``optimizer`` (groups, their scheduler keys) and of the Trainer's schedulers
    (``base_lrs``, nested in SequentialLR / ChainedScheduler too) through ``scaled``."""
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:
        group["lr"] = scaled(float(group["lr"]))
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
            scheduler._last_lr = [float(g["lr"]) for g in opt.param_groups]


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
