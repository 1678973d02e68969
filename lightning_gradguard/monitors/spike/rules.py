"""LossSpikeGuard's rules and their wording: escalation, rollback points, the ``loss_spike`` alert.

:func:`escalated_action` is how a run of spikes climbs ``skip -> rollback -> raise``; :func:`snapshot_due`
says when a rollback point is taken; :func:`spike_alert` puts a spike into words (:class:`SpikeAlert`,
with :data:`SPIKE_HINTS`). Whether a value is a spike at all is the pure score of
:mod:`lightning_gradguard.functional.spikes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gradguard.alerts import Severity
from lightning_gradguard.functional.spikes import SpikeScore

__all__ = ["ESCALATION", "SPIKE_HINTS", "SpikeAlert", "escalated_action", "snapshot_due", "spike_alert"]


#: what a run of spikes escalates through, mildest first ("warn" never escalates)
ESCALATION = ("skip", "rollback", "raise")


def escalated_action(action: str, streak: int, patience: int, can_roll_back: bool) -> str:
    """What the ``streak``-th consecutive spike gets when the configured action is ``action``.

    Every ``patience`` consecutive spikes move one rung up ``skip -> rollback -> raise`` (``rollback`` is
    passed over when no snapshot can be restored), so a real divergence is not skipped forever: with
    ``patience=3`` and ``action="skip"`` spikes 1-3 are skipped, 4-6 rolled back, the 7th raises.
    """
    if action == "warn":
        return "warn"
    ladder = [a for a in ESCALATION if can_roll_back or a != "rollback"]
    start = ladder.index(action) if action in ladder else ladder.index("skip")
    return ladder[min(start + (max(streak, 1) - 1) // patience, len(ladder) - 1)]


def snapshot_due(
    judged: int, warmup: int, every: int, streak: int, calm: int, probation: bool, have: bool = True
) -> bool:
    """Whether a rollback point is taken after the ``judged``-th judged step (a calm one).

    At the end of the warm-up, then every ``every`` judged steps while no spike streak runs; at once when
    there is none (``have=False``: a resumed run, whose snapshot was not in the checkpoint). After a
    rollback (``probation``) the old point is kept until the run has had ``every`` healthy steps in a
    row (``calm``): the rollback held, and the streak of spikes behind it ends with the new point.
    """
    if not every or not judged:
        return False
    if probation:
        return calm >= every
    return not streak and (judged == warmup or judged % every == 0 or (not have and judged >= warmup))


SPIKE_HINTS = {
    "warn": "The update was applied. If spikes recur, use action='skip' or 'rollback'.",
    "skip": "The update of this step was dropped (optimizer state untouched); training goes on.",
    "rollback": "Weights, optimizer, scheduler and RNG went back to the last snapshot; the data moves on.",
    "raise": "Spikes kept coming past every recovery: lower the learning rate, clip gradients "
    "(gradient_clip_val), check the data around the recorded batches, or restart from an earlier checkpoint.",
}


@dataclass(frozen=True, kw_only=True)
class SpikeAlert:
    """The ``loss_spike`` alert of one spike (it names no place: the whole step spiked).

    Attributes:
        severity: ``"error"`` when the spike raises, else ``"warning"``.
        message: what was seen, with the numbers.
        hint: what was done, and what to try.
        data: each judged value's z-score (``<name>_zscore``) and the ``streak``.
    """

    severity: Severity
    message: str
    hint: str
    data: dict[str, float]


def spike_alert(
    *, step: int, action: str, values: dict[str, float], scores: dict[str, SpikeScore], streak: int
) -> SpikeAlert:
    """The alert of the ``streak``-th spike in a row, at ``step``, that got ``action``."""
    parts = [
        f"{k.replace('_', ' ')} {values[k]:.4g} is {s.ratio:.3g}x the recent median {s.level:.4g} "
        f"(robust z-score {s.zscore:.1f})"
        for k, s in scores.items()
    ]
    run = f"; {streak} spikes in a row" if streak > 1 else ""
    return SpikeAlert(
        severity="error" if action == "raise" else "warning",
        message=f"Spike at step {step}: " + "; ".join(parts) + f"{run}. Action: {action}.",
        hint=SPIKE_HINTS[action],
        data={f"{k}_zscore": s.zscore for k, s in scores.items()} | {"streak": float(streak)},
    )
