"""What a run's settings say before its first step (read once, at the start of training).

* :func:`lr_ahead`: the LR of every param group at each of the next optimizer steps, from a copy of the
  run's schedulers (:class:`~lightning_gradguard.core.lr.ScheduleCopy`: nothing of the run is touched)
  stepped as Lightning steps them (``"interval": "step"`` every ``frequency`` optimizer steps, ``"epoch"``
  at each epoch's end), so a schedule in the wrong unit is seen before it acts.
* :func:`decay_rates`: what a decoupled weight decay will remove from the weights a step at the schedule's
  highest LR (``lr * weight_decay``), per param group, with the group's size.
* :func:`dropout_rates`: every dropout the model holds: its dropout modules' rates (``nn.Dropout`` and its
  family, and modules named ``*Drop*`` with a ``p`` / ``drop_prob`` / ``drop_rate``, such as a DropPath)
  and a Hugging Face config's ``*drop*`` rates (models that call ``F.dropout`` with them).

:class:`Ahead` holds them for the rules (:mod:`~lightning_gradguard.monitors.stall.rules`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_gradguard.core.cadence import steps_per_epoch
from lightning_gradguard.core.lr import ScheduleCopy, decoupled_decay_groups, group_lr

#: the most optimizer steps a schedule is read ahead (a few hundred microseconds per step: a copy of the
#: schedulers is stepped once at the start of training)
HORIZON = 2000
#: attributes that hold a dropout module's rate, in the order they are read
_RATE_NAMES = ("p", "drop_prob", "drop_rate")


@dataclass(frozen=True)
class Ahead:
    """What the settings say before the first step.

    Attributes:
        lrs: the largest LR over the param groups of the (first) optimizer at each optimizer step read
            ahead, from step 0; empty when the schedule could not be read ahead (a ``ReduceLROnPlateau``,
            which follows the loss; manual optimization; an optimizer that sets its own step).
        planned: the run's planned optimizer steps (``None``: unknown).
        decay: ``(the group's highest LR over the schedule, its weight_decay, its entries)`` of every
            param group whose weight decay is decoupled from the gradient (AdamW, SGD).
        trainable: the entries of every trainable parameter in the optimizer.
        dropouts: ``(where, rate)`` of every dropout with a rate above 0: a module's name, or a config's
            attribute (``config.hidden_dropout_prob``).
    """

    lrs: Sequence[float] = ()
    planned: int | None = None
    decay: Sequence[tuple[float, float, int]] = ()
    trainable: int = 0
    dropouts: Sequence[tuple[str, float]] = field(default_factory=list)

    @property
    def span(self) -> int:
        """The steps the rules judge the schedule over: the planned run, or the steps read ahead when the
        plan is longer or unknown."""
        return min(self.planned, len(self.lrs)) if self.planned is not None else len(self.lrs)


def lr_ahead(trainer: pl.Trainer, module: nn.Module, optimizer: Any, steps: int) -> list[float]:
    """The largest LR of ``optimizer``'s param groups at each of the next ``steps`` optimizer steps, its
    schedulers stepped on copies as Lightning steps them (empty: not readable ahead, see :class:`Ahead`)."""
    schedule = ScheduleCopy(trainer, optimizer, module)
    if not schedule.readable:
        return []
    per_epoch = steps_per_epoch(trainer)
    lrs: list[float] = []
    for s in range(steps):
        lrs.append(max(schedule.lrs(), default=0.0))
        due = [i for i, c in enumerate(schedule.configs) if _due(c, s + 1, per_epoch)]
        if due and not schedule.step(due):
            break  # stepped past its end (OneCycleLR's total_steps): what was read
    return lrs


def _due(config: Any, done: int, per_epoch: int | None) -> bool:
    """Whether Lightning steps ``config``'s scheduler after ``done`` optimizer steps."""
    if config.interval == "step":
        return done % max(1, config.frequency) == 0
    epoch = done // per_epoch if per_epoch is not None and done % per_epoch == 0 else 0
    return epoch > 0 and epoch % max(1, config.frequency) == 0


def decay_rates(optimizer: Any, lrs: Sequence[float]) -> list[tuple[float, float, int]]:
    """``(highest LR, weight_decay, entries)`` of each decoupled-decay group: each group's LR now, scaled
    by the peak of ``lrs`` over their first value (a schedule scales every group alike: a layer-wise
    decay keeps its ratios)."""
    scale = max(lrs) / lrs[0] if lrs and lrs[0] > 0 else 1.0
    out = []
    for g in decoupled_decay_groups(optimizer):
        lr = group_lr(g)
        if lr is not None:
            out.append((lr * scale, float(g["weight_decay"]), sum(p.numel() for p in g["params"])))
    return out


def dropout_rates(module: nn.Module) -> list[tuple[str, float]]:
    """``(where, rate)`` of every dropout of ``module`` with a rate above 0 (see the module docstring)."""
    found: list[tuple[str, float]] = []
    configs: dict[int, tuple[str, Any]] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) or "drop" in type(m).__name__.lower():
            rate = next((getattr(m, k) for k in _RATE_NAMES if _is_rate(getattr(m, k, None))), None)
            if rate is not None and rate > 0:
                found.append((name or type(m).__name__, float(rate)))
        config = getattr(m, "config", None)
        if config is not None and not isinstance(config, (dict, str)) and id(config) not in configs:
            configs[id(config)] = (name, config)
    for name, config in configs.values():
        for key, value in sorted(getattr(config, "__dict__", {}).items()):
            if "drop" in key.lower() and "keep" not in key.lower() and _is_rate(value) and value > 0:
                found.append((f"{name + '.' if name else ''}config.{key}", float(value)))
    return found


def _is_rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
