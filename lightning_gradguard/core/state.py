"""What the gradguard callbacks of one Trainer share, and how they talk to the user about themselves.

One :class:`TrainerState` per Trainer (held weakly: it goes with the Trainer) keeps what was logged, the
layout, alert counts, the updates callbacks dropped and the one-time messages. ``warn_once`` /
``info_once`` say a thing once per Trainer; ``strict_mode`` decides whether a monitor's own failure is
raised (tests) or turned into one warning (users' runs), and ``raised_by_us`` tells a failure of our own
code from one of the user's model or data.
"""

from __future__ import annotations

import logging
import os
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger("lightning_gradguard")


@dataclass
class TrainerState:
    """What the callbacks of one trainer share."""

    layout_written: set[int] = field(default_factory=set)
    layout_pruned: bool = False
    logged_tags: set[str] = field(default_factory=set)
    alert_counts: dict[str, int] = field(default_factory=dict)
    said_no_logger: bool = False
    warned: set[str] = field(default_factory=set)
    #: whether the run shards its parameters (``core.sharding.is_sharded``), once known
    sharded: bool | None = None
    #: updates a callback dropped, per cause (``core.skips.skip_update``): Python ints, no sync
    skipped_updates: dict[str, int] = field(default_factory=dict)
    #: the buffers as they were at the start of the step, when a callback keeps them (``core.buffers``)
    step_buffers: Any = None
    #: on a resumed fit, the alerts the run's alerts file already holds (their keys, counted): the alerts of
    #: the steps it replays are not written twice (``core.base``)
    alerts_on_file: Any = None


_STATES: weakref.WeakKeyDictionary[Any, TrainerState] = weakref.WeakKeyDictionary()


def trainer_state(trainer: pl.Trainer) -> TrainerState:
    state = _STATES.get(trainer)
    if state is None:
        state = _STATES[trainer] = TrainerState()
    return state


#: set to 1 (our test suite does) to let a monitor's own exceptions through instead of warning once
STRICT_ENV = "GRADGUARD_STRICT"


def strict_mode() -> bool:
    """Whether a monitor's own exceptions are raised (``GRADGUARD_STRICT=1``) instead of warned about."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def raised_in_strict(err: BaseException, environmental: tuple[type[BaseException], ...] = (OSError,)) -> bool:
    """Whether a guarded failure is raised: under ``GRADGUARD_STRICT=1``, unless the environment made it.

    A failure of our code (a ``TypeError``, a statistic we did not expect) is raised in strict mode, so the
    tests see it. A write the environment refused (``OSError``: a full disk, a path under a regular file, no
    permission; torch's serializer reports its own write failures as ``RuntimeError``, passed in
    ``environmental`` where a write goes through it) is a warning even then: it is not a bug to find, and
    the promise that follows it (a NaN's stop, a skip, an alert) must hold in the tests as in users' runs.
    """
    return strict_mode() and not isinstance(err, environmental)


#: the libraries our code drives: a frame of theirs belongs to whoever called into them
_DRIVEN = frozenset(
    {
        "torch",
        "lightning",
        "lightning_fabric",
        "pytorch_lightning",
        "lightning_utilities",
        "torchmetrics",
        "numpy",
    }
)


def raised_by_us(err: BaseException) -> bool:
    """Whether ``err`` is a failure of lightning_gradguard's own code rather than of what the user gave it.

    The innermost frame of its traceback that is not torch's, Lightning's, torchmetrics' or numpy's (the
    libraries we call, which raise for their caller) decides: ours (an API missing from the installed
    torch, a wrong call, a name that does not exist) or anyone else's (the user's model, loss or data,
    another library inside their model, the standard library copying or pickling their objects).
    """
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    for frame in reversed(frames):
        package = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if package == "lightning_gradguard":
            return True
        if package not in _DRIVEN:
            return False
    return False


def warn_once(trainer: pl.Trainer, key: str, message: str) -> None:
    """A one-time warning per trainer (a model shape we do not understand never crashes a run)."""
    state = trainer_state(trainer)
    if key in state.warned:
        return
    state.warned.add(key)
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(message, category=UserWarning)


def info_once(trainer: pl.Trainer, key: str, message: str) -> None:
    """One INFO line per trainer on the ``lightning_gradguard`` logger, from global rank zero."""
    state = trainer_state(trainer)
    if key in state.warned:
        return
    state.warned.add(key)
    if trainer.is_global_zero:
        log.info(message)


def skipped_for_fast_dev_run(trainer: pl.Trainer, name: str, what: str) -> bool:
    """True (after one INFO line) when ``fast_dev_run`` is on: a smoke test skips sweeps and trial runs.

    Lightning's own tuner does the same: ``fast_dev_run`` runs a batch or two to prove the code path,
    and a range test or a pre-flight trial of hundreds of steps would defeat it.
    """
    if not getattr(trainer, "fast_dev_run", False):
        return False
    info_once(trainer, f"fast_dev_run:{name}", f"{name}: skipping {what} since `fast_dev_run` is enabled.")
    return True
