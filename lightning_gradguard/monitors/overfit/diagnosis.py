"""What the loss says: the number of classes, the chance level, a loss summed over the batch, and the shape
of a curve that missed its target.

* :func:`labels_of`: the number of classes and the label tensor of a classification batch;
* :func:`chance_loss`: the loss a model reaches that ignores its inputs;
* :func:`summed`: whether an initial loss is ``N`` times the cross-entropy of the logits;
* :func:`blow_up`: the loss rose far above its start (or was not finite): the LR overshoots;
* :func:`at_chance`: a classifier's final loss at the chance level;
* :func:`curve_shape`: the shape of a curve that missed the target (diverged, blew up, at chance, flat,
  oscillating, slow).

The rules that read them (``initial_loss_mismatch``, ``overfit_unstable``, ``gradient_not_shrinking``,
``overfit_failed``), their wording and likely causes, are in
:mod:`~lightning_gradguard.monitors.overfit.rules`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradguard.core.batch import tensors_in
from lightning_gradguard.functional.overfit import oscillates
from lightning_gradguard.monitors.overfit.findings import OverfitResult

#: a trial loss above this multiple of the initial one overshot: the LR is too high for the batch. 72 healthy
#: digits trials (CNNs and a ReLU MLP; SGD and Adam; 3 seeds) stayed at or below 1.08x their first loss;
#: 10x-too-high LRs rose 1.7-115x (a ReLU MLP at SGD 0.5), Adam at lr 1 on a tanh MLP 4.6x
BLOW_UP = 1.5

#: the gradient norm says something about a cross-entropy loss only near its minimum: at most this
#: fraction of the initial loss. The gradient w.r.t. the logits is p - y, which shrinks only as the loss
#: does, while the logits' Jacobian grows as they sharpen: at 10 % of the initial loss (where the default
#: target stops the trial) healthy digits runs measured 0.16-1.17x their first gradient norm, at 1 %
#: 0.03-0.28x
NEAR_MINIMUM = 0.01


def labels_of(
    batch: Any, logits: Tensor | None, n: int, num_classes: int | None
) -> tuple[int | None, Tensor | None]:
    """(number of classes, the label tensor): ``num_classes`` or inferred from logits and labels."""
    c = num_classes
    if c is None and logits is not None and logits.dim() == 2 and logits.shape[1] >= 2:
        c = int(logits.shape[1])
    if c is None:
        return None, None
    for t in tensors_in(batch):
        labels = t.dtype in (torch.int64, torch.int32) and t.dim() == 1 and t.shape[0] == n and n > 0
        if labels and int(t.min()) >= 0 and int(t.max()) < c:
            return c, t
    return (c, None) if num_classes is not None else (None, None)


def chance_loss(labels: Tensor, num_classes: int) -> float:
    """The entropy of the label frequencies: the loss of a model that ignores its inputs and predicts
    how often each label occurs."""
    freq = torch.bincount(labels.detach().long().cpu(), minlength=num_classes).double() / labels.shape[0]
    freq = freq[freq > 0]
    return float(-(freq * freq.log()).sum())


def summed(initial: float, ratio: float, n: int, ce: float | None) -> bool | None:
    """Whether the loss is summed over the batch: ``N`` times the mean cross-entropy ``ce`` of the logits
    (without ``ce``: ``N`` times ``ln C``, ``ratio`` being ``initial / ln C``). ``None``: the loss is
    neither the mean nor the sum cross-entropy of the logits."""
    if ce is None:
        return n >= 4 and abs(ratio - n) <= 0.25 * n
    is_sum = n >= 2 and abs(initial - n * ce) <= 0.05 * n * ce
    if not is_sum and abs(initial - ce) > 0.05 * max(ce, 1e-3):
        return None
    return is_sum


@dataclass(frozen=True, kw_only=True)
class BlowUp:
    """Where a trial's loss rose highest above its start.

    Attributes:
        step: the evaluation with the highest loss (the first non-finite one, if any).
        loss: that loss.
        ratio: that loss over the initial one (``inf`` for a non-finite loss).
    """

    step: int
    loss: float
    ratio: float


def blow_up(losses: list[float]) -> BlowUp | None:
    """The highest loss of a trial that rose above :data:`BLOW_UP` times its (positive, finite) start or
    was not finite, else ``None``. At a small enough LR, gradient descent on one fixed batch does not
    raise the loss: a trial that does overshoots."""
    if len(losses) < 2 or not (math.isfinite(losses[0]) and losses[0] > 0):
        return None
    bad = next((k for k, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        return BlowUp(step=bad, loss=losses[bad], ratio=math.inf)
    k = max(range(len(losses)), key=losses.__getitem__)
    if losses[k] <= BLOW_UP * losses[0]:
        return None
    return BlowUp(step=k, loss=losses[k], ratio=losses[k] / losses[0])


def at_chance(result: OverfitResult) -> bool:
    """A classifier's final loss within 15 % of ``ln C`` of the entropy of its batch's label frequencies."""
    return (
        result.chance_loss is not None
        and result.num_classes is not None
        and abs(result.final_loss - result.chance_loss) <= 0.15 * math.log(result.num_classes)
    )


def curve_shape(result: OverfitResult) -> str:
    """The shape of a curve that missed the target: a key of the likely causes of ``overfit_failed``
    (:mod:`~lightning_gradguard.monitors.overfit.rules`). A curve that blew up
    (:func:`blow_up`) and then sat at chance or near its start is ``"blew_up"``, one that came down
    from its peak further ``"overshot"``, whatever a small LR would also explain."""
    initial, final = result.initial_loss, result.final_loss
    if not math.isfinite(final):
        return "diverged"
    flat = math.isfinite(initial) and final >= 0.9 * initial
    if blow_up(result.losses) is not None:
        return "blew_up" if at_chance(result) or flat else "overshot"
    if at_chance(result):
        return "chance"
    if flat:
        return "flat"
    return "oscillating" if oscillates(result.losses) else "slow"
