"""Which layers a monitor shows: name patterns, and a cap that keeps the most informative layers.

A model with a thousand layers gives a thousand curves per chart, which nobody can read. Two tools cut
that down, as pure functions on layer names and host numbers:

* :class:`LayerPatterns`: regular expressions (``re.search``) a layer's name must match (``include``)
  and must not match (``exclude``);
* :func:`choose_layers`: at most ``max_layers`` of the layers left, half of them *pinned* (spread evenly
  over the model from the first layer to the last, the same layers at every step, so their curves are
  continuous) and the rest the layers that score highest at this step (the outliers: see
  :func:`log_distance_scores`);
* :func:`spread`: the minimum, median and maximum over all the layers left, so what the cap hides is
  still summed up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerPatterns:
    """``include`` / ``exclude`` regular expressions on layer names (already compiled).

    A layer is kept when some ``include`` pattern is found in its name (or there is none) and no
    ``exclude`` pattern is.
    """

    include: tuple[re.Pattern[str], ...] = ()
    exclude: tuple[re.Pattern[str], ...] = ()

    def keeps(self, name: str) -> bool:
        if self.include and not any(p.search(name) for p in self.include):
            return False
        return not any(p.search(name) for p in self.exclude)


def pinned_positions(n: int, count: int) -> list[int]:
    """``count`` positions out of ``range(n)`` spread evenly, the first and the last among them."""
    count = min(count, n)
    if count <= 0:
        return []
    if count == 1:
        return [0]
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def log_distance_scores(values: Sequence[float]) -> list[float]:
    """How far each value lies from the median of the positive finite ones, in decades.

    ``|log10(value / median)|``; a value that is 0, negative, NaN or infinite scores ``inf`` (a layer whose
    gradient vanished outright, or blew up, is the first one to show). With no positive finite value every
    score is ``inf``.
    """
    good = sorted(v for v in values if math.isfinite(v) and v > 0)
    if not good:
        return [math.inf] * len(values)
    mid = len(good) // 2
    median = good[mid] if len(good) % 2 else math.sqrt(good[mid - 1] * good[mid])
    return [abs(math.log10(v / median)) if math.isfinite(v) and v > 0 else math.inf for v in values]


def choose_layers(scores: Sequence[float], max_layers: int | None) -> list[int]:
    """Positions (in model order) of at most ``max_layers`` layers out of ``len(scores)``.

    ``max_layers // 2`` pinned positions (:func:`pinned_positions`), then the highest scores among the rest
    (ties: the earlier layer). ``None``, or no more layers than the cap: every position.
    """
    n = len(scores)
    if max_layers is None or n <= max_layers:
        return list(range(n))
    pinned = pinned_positions(n, max_layers // 2)
    taken = set(pinned)
    rest = sorted((i for i in range(n) if i not in taken), key=lambda i: (-_sortable(scores[i]), i))
    return sorted(taken | set(rest[: max_layers - len(pinned)]))


def _sortable(score: float) -> float:
    return -1.0 if math.isnan(score) else score


def spread(values: Sequence[float]) -> dict[str, float]:
    """``min``, ``median`` and ``max`` of the finite values (an empty dict when there is none)."""
    good = sorted(v for v in values if math.isfinite(v))
    if not good:
        return {}
    mid = len(good) // 2
    median = good[mid] if len(good) % 2 else (good[mid - 1] + good[mid]) / 2
    return {"min": good[0], "median": median, "max": good[-1]}
