"""When a callback measures and logs: Lightning's logging axis and rule, in one place.

Every gradguard chart is written at the step Lightning logs its own training metrics at
(:func:`log_step`), on Lightning's rule ``(step + 1) % every == 0`` plus the first step
(:func:`on_logging_step`), with ``every`` from :func:`logging_interval` (``0``: never, as in Lightning).
A detection rule checks on the same rule after a dense start (:func:`check_due`): a fault visible at step 0
is named within a few steps, not at the cadence's third check. A callback tests its cadence with these
functions only (or ``GradGuardCallback`` methods built on them), never with its own ``step % n``.
:func:`steps_per_epoch` is the optimizer steps an epoch holds (a schedule stepped per epoch, a share of
an epoch as a budget).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl

#: the steps every detection rule checks at the start of a run (``dense_steps``' default)
DENSE_STEPS = 5


def log_step(trainer: pl.Trainer) -> int:
    """The x-axis Lightning's own logger connector uses for training metrics.

    It counts batches that stepped an optimizer: one per optimizer step in automatic optimization
    (so it equals ``global_step`` there) and one per batch in manual optimization (where
    ``global_step`` counts every ``opt.step()``). Using it keeps our charts aligned with the loss.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if value is not None else int(trainer.global_step)


def logging_interval(trainer: pl.Trainer, override: int | None = None) -> int:
    """How often a callback logs its periodic scalars, in logging steps; ``0`` means never.

    ``override`` (the callback's own ``log_every_n_steps``) wins when given; otherwise the Trainer's
    ``log_every_n_steps``, where Lightning reads ``0`` as "log nothing" and so do we: detection still runs,
    only the periodic scalars and histograms stop.
    """
    if override is not None:
        return int(override)
    return max(int(getattr(trainer, "log_every_n_steps", 50) or 0), 0)


def on_logging_step(at: int, every: int) -> bool:
    """Lightning's logging rule (``(step + 1) % every == 0``) plus the very first step; never for ``every=0``.

    Matching Lightning puts our points at the same x as the loss it logs from the same batch; the extra
    first point shows whether the run starts in a healthy range.
    """
    return every > 0 and (at == 0 or (at + 1) % every == 0)


def check_due(at: int, every: int, dense: int) -> bool:
    """Whether logging step ``at`` is a detection check (or a sampled step): every step below ``dense``,
    then Lightning's rule (``(at + 1) % every == 0``) plus step 0; ``every=0`` leaves the dense start alone.

    The test of every monitor's hot path: one call, :func:`on_logging_step` written out.
    """
    return at < dense or (every > 0 and (at == 0 or (at + 1) % every == 0))


def next_due(at: int, every: int, dense: int) -> int:
    """The first logging step from ``at`` on that :func:`check_due` accepts (``sys.maxsize``: none).

    A hook that runs every step keeps it and tests ``at >= next`` (no call on the steps between), then
    asks :func:`check_due` and moves it on with ``next_due(at + 1, ...)`` once ``at`` reaches it.
    """
    if at < dense or (every > 0 and at == 0):
        return at
    if every <= 0:
        return sys.maxsize
    return at + (-(at + 1)) % every  # the smallest s >= at with (s + 1) % every == 0


def every_nth(done: int, every: int) -> bool:
    """Whether ``done`` (optimizer steps taken so far) completes one more period of ``every``: a positive
    multiple of it; never for ``every=0`` (a check "every N steps" that starts after the N-th step)."""
    return every > 0 and done > 0 and done % every == 0


def optimizer_index(trainer: pl.Trainer, optimizer: Any) -> int:
    """The position of ``optimizer`` (or the one a ``LightningOptimizer`` wraps) in ``trainer.optimizers``."""
    opt = getattr(optimizer, "optimizer", optimizer)
    for i, candidate in enumerate(trainer.optimizers):
        if candidate is opt or getattr(candidate, "optimizer", None) is opt:
            return i
    return 0


def steps_per_epoch(trainer: pl.Trainer) -> int | None:
    """The optimizer steps of one epoch: its micro-batches over ``accumulate_grad_batches``, a last partial
    accumulation counted as a step (Lightning steps it); ``None`` for an iterable of unknown length."""
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        return None
    return max(1, -(-batches // max(1, int(trainer.accumulate_grad_batches))))
