"""The range test's online smoothing and stop rule (:class:`DivergenceMonitor`), one loss at a time."""

from __future__ import annotations

import math

import numpy as np

#: a rise smaller than this share of the loss's level (``|reference|``) never stops a sweep. The noise read
#: from the first losses is zero where every batch gives the same loss (a zero-initialised output layer:
#: exactly ``ln(classes)`` until the weights move), and a first ten that happen to agree underestimate it;
#: either way a flat curve wandering by a few thousandths of its level read as divergence. On the 258
#: first sweeps of ``make bench-lr-hard`` (43 tasks, six seeds) the stops this removes rose by 1e-5 to
#: 0.64 % of the level, every other stop by at least 4 %.
MATERIAL_RISE = 0.01


class DivergenceMonitor:
    """Online smoothing and stop rule of a range test.

    Every :meth:`update` takes one raw loss and returns ``True`` once the sweep should stop. The rule
    looks at differences only, so a loss that is negative, near zero or shifted by a constant behaves
    exactly like any other, but for one guard on the loss's level (the floor below):

    * a reference level and a noise level are taken from the first ``warmup`` raw losses (at the tiny
      starting LR the loss barely moves, so their spread is the batch-to-batch noise);
    * afterwards the sweep has diverged when ``smoothed - best > threshold * max(reference - best,
      noise_factor * noise, floor)``: with ``threshold = 1`` the smoothed loss has climbed back as far above
      its best as the best ever got below the start; the noise term keeps an early flat curve from stopping on
      one unlucky batch, and the floor (:data:`MATERIAL_RISE` of ``|reference|``) keeps a flat curve whose
      first losses showed no noise from stopping on a rise that does not matter. The best counts from the
      ``warmup``-th smoothed value on: the first few averages are hardly smoothed (the very first is one raw
      loss), and one low batch among them would otherwise set a best that the flat start then seems to climb
      away from.

    A non-finite loss stops the sweep at once (and is not recorded by the callers).

    Args:
        beta: EMA factor of the smoothing (bias corrected, counted by this monitor's own updates).
        threshold: how far, in units of the descent achieved so far, the smoothed loss may rise above its
            best before the sweep stops. ``None`` never stops on divergence.
        warmup: raw losses used for the reference and noise levels; no stop before that.
        noise_factor: the smallest rise that counts, in standard deviations of the warm-up losses.
    """

    def __init__(
        self, beta: float = 0.98, threshold: float | None = 1.0, warmup: int = 10, noise_factor: float = 3.0
    ) -> None:
        self.beta = beta
        self.noise_factor = noise_factor
        self.threshold = threshold
        self.warmup = max(1, int(warmup))
        self.count = 0
        self._avg = 0.0
        self.smoothed: list[float] = []
        self.best = math.inf
        self._first: list[float] = []
        self.reference: float | None = None
        self.noise = 0.0
        self.reason = ""

    def update(self, loss: float) -> bool:
        loss = float(loss)
        if not math.isfinite(loss):
            self.reason = "non-finite loss"
            return True
        self.count += 1
        self._avg = self.beta * self._avg + (1.0 - self.beta) * loss
        smooth = self._avg / (1.0 - self.beta**self.count) if self.beta > 0 else self._avg
        self.smoothed.append(smooth)
        if self.count >= self.warmup:  # before that the average has seen too few losses to be a best
            self.best = min(self.best, smooth)
        if len(self._first) < self.warmup:
            self._first.append(loss)
            if len(self._first) == self.warmup:
                self.reference = float(np.mean(self._first))
                self.noise = float(np.std(self._first)) if len(self._first) > 1 else 0.0
            return False
        if self.threshold is None or self.reference is None:
            return False
        floor = max(1e-6 * (1.0 + abs(self.reference)), MATERIAL_RISE * abs(self.reference))
        scale = max(self.reference - self.best, self.noise_factor * self.noise, floor)
        if smooth - self.best > self.threshold * scale:
            self.reason = "diverged"
            return True
        return False
