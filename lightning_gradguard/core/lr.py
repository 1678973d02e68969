"""Changing a run's learning rate so that it sticks: every param group and every scheduler's base LRs.

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

__all__ = ["rescale_learning_rates"]

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
