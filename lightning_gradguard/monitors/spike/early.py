"""Early divergence: a loss that climbs far above the run's own start while the spike windows warm up.

The spike score needs ``warmup_steps`` accepted steps of history; until then nothing compares a loss with
anything. A learning rate far too high shows in exactly that stretch: the loss climbs from the first
updates (SGD at 3 on a digits MLP: 2.4, 2.5, 4.6, 8.1, 11, 22, 49, ...). :class:`EarlyWatch` compares each
judged loss with the run's start (:func:`~lightning_gradguard.functional.spikes.start_level` of the first
:data:`START_STEPS` losses) and fires once when :data:`SUSTAIN_STEPS` judged losses in a row lie at
``factor`` starts or more. Its words (the start, the loss now, the step and the learning rate of group 0)
are the ``early_divergence`` rule's check, :func:`~lightning_gradguard.monitors.spike.rules.early_finding`.

The numbers, measured on real digits runs (docs/loss_spike.md, ``benchmarks/spike_healthy.py``, 3 seeds
each): over the first 50 steps of 10 healthy starts (warm-up, a catapult that rises 2.6x then falls,
batch-4 SGD, losses below zero and crossing it, fine-tunes of a trained model whose loss sits near zero)
five losses in a row never stood above 3.16 starts; all 6 runs with a far too high learning rate reached
6 starts, at steps 7-31 (SGD lr 3, whose loss climbs from step 1: step 9).
"""

from __future__ import annotations

import math
from typing import Any

from typing_extensions import override

from lightning_gradguard.core.runstate import RunField, Stateful, Streaks
from lightning_gradguard.functional.spikes import start_level

#: the first judged losses whose median is the run's start (one lucky or unlucky batch does not move it)
START_STEPS = 3
#: judged losses in a row that must lie at ``factor`` starts or more (a noisy batch or a brief catapult
#: does not; a climbing loss does)
SUSTAIN_STEPS = 5


def _first(_: Any, saved: list[float]) -> list[float]:
    return [float(v) for v in saved]


class EarlyWatch(Stateful):
    """The early-divergence rule's memory: the first losses, the run of high ones, whether it fired.

    Args:
        factor: how many starts a loss must lie at (``None``: the rule is off).
        horizon: how many judged losses it watches (the spike windows' warm-up); then it closes.

    ``active`` is ``True`` while it still watches: a plain attribute, so the hook pays one lookup per step.
    """

    first: RunField[list[float]] = RunField(list, load=_first)
    seen: RunField[int] = RunField(int)
    #: the judged losses in a row at ``factor`` starts or more (saved as ``above``, their count)
    _high: RunField[Streaks] = RunField(
        Streaks, key="above", save=lambda _, s: s.get("loss", 0), load=lambda _, n: Streaks({"loss": n})
    )
    fired: RunField[bool] = RunField(bool)

    def __init__(self, factor: float | None, horizon: int) -> None:
        self.factor, self.horizon = factor, horizon
        self.reset_run()

    @property
    def above(self) -> int:
        """The judged losses in a row at ``factor`` starts or more."""
        return self._high.get("loss", 0)

    @override
    def state_changed(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        self.active = self.factor is not None and not self.fired and self.seen < self.horizon
        ready = self.factor is not None and len(self.first) >= START_STEPS
        self.threshold = start_level(self.first).threshold(self.factor) if ready else math.inf  # type: ignore[arg-type]

    def observe(self, loss: float) -> bool:
        """One judged step's (finite) loss; ``True`` at the step the rule fires (once per run)."""
        if not self.active:
            return False
        self.seen += 1
        if len(self.first) < START_STEPS:
            self.first.append(loss)
            self._refresh()
            return False
        self.fired = self._high.update("loss", loss >= self.threshold) >= SUSTAIN_STEPS
        if self.fired or self.seen >= self.horizon:
            self._refresh()
        return self.fired
