"""The overfit-one-batch check's reading of a loss curve: plain lists of floats in, a verdict out.

* :func:`at_floor`: the loss converged to a floor above the target after learning from the inputs;
* :func:`oscillates`: late in the run the loss rose well above the best value before it;
* :func:`still_learning`: the target was missed, but the curve shows a model that learns, slowly.
"""

from __future__ import annotations

import math


def at_floor(
    losses: list[float], grad_norms: list[float], chance_loss: float | None, num_classes: int | None
) -> bool:
    """Did training converge to a loss floor above the target, after learning from the inputs?

    True when the gradient norm fell to 5 % of its first value or less (a minimum of the fixed objective,
    e.g. mixup's soft targets or label smoothing, whose entropy the loss cannot go below), the loss fell
    to half its initial value or less, and, for a classifier, clearly below the entropy of the batch's
    label frequencies (a model that ignores its inputs converges there too).
    """
    if len(grad_norms) < 5 or not losses:
        return False
    initial, final = losses[0], losses[-1]
    if not (math.isfinite(final) and initial > 0 and final <= 0.5 * initial):
        return False
    if not (grad_norms[0] > 0 and grad_norms[-1] <= 0.05 * grad_norms[0]):
        return False
    return chance_loss is None or num_classes is None or final < chance_loss - 0.15 * math.log(num_classes)


def oscillates(losses: list[float]) -> bool:
    """Late in the run (second half) the loss rose 50 % above the best value before it."""
    return len(losses) > 4 and any(
        losses[k] > 1.5 * min(losses[:k]) for k in range(len(losses) // 2, len(losses))
    )


def still_learning(losses: list[float], chance_loss: float | None, num_classes: int | None) -> bool:
    """The target was missed, but the model demonstrably learns from its inputs, only slowly.

    The loss is finite, at most half its initial value, did not oscillate, and, for a classifier, is
    clearly below the entropy of the batch's label frequencies (what a model ignoring its inputs reaches).
    """
    if len(losses) < 5:
        return False
    initial, final = losses[0], losses[-1]
    if not (math.isfinite(final) and initial > 0 and final <= 0.5 * initial) or oscillates(losses):
        return False
    return chance_loss is None or num_classes is None or final < chance_loss - 0.15 * math.log(num_classes)
