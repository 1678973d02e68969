"""What the loss says: the initial loss of a classifier, the chance level, and why a batch was not learned.

* :func:`labels_of`: the number of classes and the label tensor of a classification batch;
* :func:`chance_loss`: the loss a model reaches that ignores its inputs;
* :func:`initial_loss_finding`: the initial loss against ``ln C`` (and a loss summed over the batch);
* :func:`blow_up`: the loss rose far above its start (or was not finite): the LR overshoots;
* :func:`overshot`: the batch was learned, but on the way the loss blew up;
* :func:`not_shrinking`: the gradient norm did not shrink while the batch was learned to near its minimum;
* :func:`failed_finding`: the diagnosis of a batch not learned, from the curve's shape;
* :func:`missed_target`: that diagnosis as the check's verdict: an error, or a warning when the model
  learns after all (the fallback optimizer memorised the batch, or the loss kept falling) and the
  user's curve never rose above its start; a curve that blew up and stayed at chance or above its start
  is a too-high LR, an error whatever the fallback did.

Each finding's wording (message, hint, likely causes) is here, next to its rule.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradguard.alerts import Severity
from lightning_gradguard.core.batch import tensors_in
from lightning_gradguard.core.preflight import Finding
from lightning_gradguard.functional.overfit import oscillates, still_learning
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


#: why the initial loss is off ``ln C``, by the severity of the finding (``{n}``: the batch size)
_INITIAL_LOSS_WHY: dict[Severity, str] = {
    "error": (
        "The loss is {n}x the mean cross-entropy of the logits, the batch size: it is summed over "
        "the batch (reduction='sum') instead of averaged. Use reduction='mean' (or divide by the "
        "batch size), otherwise the effective learning rate grows with the batch size."
    ),
    "warning": (
        "The model is confidently wrong at the start: the logits are far from zero (scale down the "
        "last layer's initial weights), softmax is applied twice or before a loss that expects "
        "logits, or the loss is summed over more than the batch dimension. Expected when fine-tuning "
        "a model trained on other data or labels."
    ),
    "info": (
        "The loss starts below chance: expected when the model is pretrained (fine-tuning) or the "
        "loss is not a softmax cross-entropy over the C outputs (binary / multi-label BCE, focal "
        "loss); otherwise the labels leak into the inputs or the loss is averaged over more "
        "elements than samples."
    ),
}


def initial_loss_finding(
    batch: Any, logits: Tensor | None, initial: float, n: int, *, num_classes: int | None, tolerance: float
) -> list[Finding]:
    """``initial_loss_mismatch``: a classifier's initial loss far from ``ln C`` (or ``N`` times the
    cross-entropy of its logits: a summed loss)."""
    c, labels = labels_of(batch, logits, n, num_classes)
    if c is None or not math.isfinite(initial):
        return []
    expected = math.log(c)
    ratio = initial / expected
    # Is the loss the mean (or the sum) cross-entropy of the logits the model produced? Computed on the
    # logits the hook kept: when it is neither (binary / multi-label BCE on integer labels, focal loss,
    # label smoothing on a pretrained model, ...), ln C says nothing about it.
    ce: float | None = None
    if labels is not None and logits is not None and logits.dim() == 2 and logits.shape == (n, c):
        ce = float(torch.nn.functional.cross_entropy(logits.float(), labels.long()))
    summed = _summed(initial, ratio, n, ce)
    if summed is None or (not summed and abs(initial - expected) <= tolerance * expected):
        return []
    severity: Severity = "error" if summed else "warning" if ratio > 1 else "info"
    return [
        Finding(
            kind="initial_loss_mismatch",
            severity=severity,
            names=[],
            message=f"Initial loss {initial:.4g} is {ratio:.3g}x the ln({c}) = {expected:.4g} a fresh "
            f"{c}-class classifier scores by predicting the uniform distribution.",
            hint=_INITIAL_LOSS_WHY[severity].format(n=n)
            + " If this is not a classification loss, pass check_initial_loss=False.",
            data={"initial_loss": initial, "expected": expected, "ratio": ratio, "num_classes": float(c)},
        )
    ]


def _summed(initial: float, ratio: float, n: int, ce: float | None) -> bool | None:
    """Whether the loss is summed over the batch: ``N`` times the mean cross-entropy ``ce`` of the logits
    (without ``ce``: ``N`` times ``ln C``, ``ratio`` being ``initial / ln C``). ``None``: the loss is
    neither the mean nor the sum cross-entropy of the logits."""
    if ce is None:
        return n >= 4 and abs(ratio - n) <= 0.25 * n
    summed = n >= 2 and abs(initial - n * ce) <= 0.05 * n * ce
    if not summed and abs(initial - ce) > 0.05 * max(ce, 1e-3):
        return None
    return summed


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


def overshot(losses: list[float]) -> list[Finding]:
    """``overfit_unstable`` (warning): the batch was learned, but on the way the loss rose above
    :data:`BLOW_UP` times its start: the LR overshoots, and the trial landed on the target anyway."""
    jump = blow_up(losses)
    if jump is None:
        return []
    return [
        Finding(
            kind="overfit_unstable",
            severity="warning",
            names=[],
            message=f"The batch was learned ({losses[0]:.4g} -> {losses[-1]:.4g} in {len(losses) - 1} "
            f"steps), but on the way the loss rose to {jump.loss:.4g} ({jump.ratio:.3g}x its start) at step "
            f"{jump.step}: the optimizer overshoots and bounced into the target.",
            hint="Lower the learning rate (3-10x), or warm up to it: the check trains at the configured LR "
            "without warm-up or gradient clipping, on one batch. A run at this LR may blow up the same way "
            "(dead ReLUs, a loss stuck at chance).",
            data={"initial_loss": losses[0], "peak_loss": jump.loss, "peak_step": float(jump.step)},
        )
    ]


def not_shrinking(losses: list[float], grad_norms: list[float]) -> list[Finding]:
    """``gradient_not_shrinking``: the batch was learned to near its minimum, and the gradient norm did not
    shrink.

    Judged only where the last gradient was measured at a loss of at most :data:`NEAR_MINIMUM` times the
    initial one (``grad_norms[k]`` is the gradient at ``losses[k]``): before that, a cross-entropy's
    gradient legitimately grows as the logits sharpen. With the default relative target (0.1) the trial
    stops first, so the rule speaks only for targets of 1 % or less (or absolute ones near 0). Not
    shrinking: the last gradient norm is above where it started *and* above its typical value in the run.
    """
    k = len(grad_norms) - 1
    if k < 4 or k >= len(losses) or not (losses[0] > 0 and 0 <= losses[k] <= NEAR_MINIMUM * losses[0]):
        return []
    if grad_norms[-1] < max(grad_norms[0], statistics.median(grad_norms)):
        return []
    return [
        Finding(
            kind="gradient_not_shrinking",
            severity="warning",
            names=[],
            message=f"The gradient norm went from {grad_norms[0]:.3g} to {grad_norms[-1]:.3g} while the "
            f"loss fell from {losses[0]:.4g} to {losses[k]:.4g} ({losses[k] / losses[0]:.2%} of its start).",
            hint="Near its minimum the loss's gradient should be small: the loss may have a term that does "
            "not vanish (a regularisation term, label noise within the batch), or the LR is so high that the "
            "optimizer bounces around the minimum.",
            data={"initial_grad_norm": grad_norms[0], "final_grad_norm": grad_norms[-1]},
        )
    ]


#: the likely causes of a batch not learned, by the shape of its loss curve
_CAUSES: dict[str, list[str]] = {
    "diverged": [
        "learning rate too high (lower it 10x)",
        "log(0) or a division by zero in the loss (use cross_entropy on logits, add eps)",
    ],
    "chance": [
        "labels not matching their inputs (misaligned, or shuffled separately from the inputs): the "
        "model learned only how often each label occurs, nothing from the inputs",
        "the inputs do not reach the output (a `.detach()`, a constant input, inputs zeroed by a transform)",
        "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
    ],
    "flat": [
        "labels not matching their inputs (misaligned or shuffled labels)",
        "the loss is not connected to the parameters (a `.detach()`, `torch.no_grad()`, `.item()`)",
        "the optimizer is not connected to the model's parameters, or its LR is 0 / far too low",
        "the loss is computed on the wrong tensors or axis",
        "inputs not normalised (mean 0, std 1)",
    ],
    "blew_up": [
        "learning rate too high (lower it 10x): the first large steps threw the loss far above its start "
        "and it never recovered; overshooting kills ReLUs or saturates units, and a network with no working "
        "path left from its inputs predicts only how often each label occurs (chance level)",
        "a large LR without the warm-up or gradient clipping the run relies on (the check applies neither)",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "overshot": [
        "learning rate too high (lower it 3-10x, or warm up to it): the loss rose far above its start "
        "before it fell again",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "oscillating": [
        "learning rate too high (lower it 10x)",
        "loss scaled by the batch size (reduction='sum')",
    ],
    "slow": [
        "learning rate too low or too few steps (raise max_steps)",
        "the model is too small or too regularised (dropout, weight decay) to memorise a few samples",
        "identical inputs with different labels in the batch",
    ],
}

#: the first likely cause when ``training_step`` draws its targets at random (``randomness="targets"``)
_RANDOM_TARGETS = (
    "training_step draws its targets at random: called twice, the model's output was the same "
    "but the loss was not (labels shuffled or drawn on every call; sampled negatives, which "
    "are fine — then use action='warn')"
)


def _at_chance(result: OverfitResult) -> bool:
    """A classifier's final loss within 15 % of ``ln C`` of the entropy of its batch's label frequencies."""
    return (
        result.chance_loss is not None
        and result.num_classes is not None
        and abs(result.final_loss - result.chance_loss) <= 0.15 * math.log(result.num_classes)
    )


def _shape(result: OverfitResult) -> str:
    """The shape of a curve that missed the target: a key of :data:`_CAUSES`. A curve that blew up
    (:func:`blow_up`) and then sat at chance or near its start is ``"blew_up"``, one that came down
    from its peak further ``"overshot"``, whatever a small LR would also explain."""
    initial, final = result.initial_loss, result.final_loss
    if not math.isfinite(final):
        return "diverged"
    flat = math.isfinite(initial) and final >= 0.9 * initial
    if blow_up(result.losses) is not None:
        return "blew_up" if _at_chance(result) or flat else "overshot"
    if _at_chance(result):
        return "chance"
    if flat:
        return "flat"
    return "oscillating" if oscillates(result.losses) else "slow"


def _described(shape: str, result: OverfitResult) -> str:
    """How the message names the curve's ``shape``."""
    entropy = math.nan if result.chance_loss is None else result.chance_loss
    chance = f"stuck at chance level: the label-frequency entropy {entropy:.4g}"
    jump = blow_up(result.losses)
    if shape == "chance" or jump is None or shape not in ("blew_up", "overshot"):
        return chance if shape == "chance" else shape
    if shape == "overshot":
        end = "then fell again"
    else:
        end = chance if _at_chance(result) else "then stuck near or above its start"
    return f"blew up to {jump.loss:.4g} ({jump.ratio:.3g}x its start) at step {jump.step}, {end}"


def failed_finding(result: OverfitResult) -> Finding:
    """``overfit_failed``: the batch was not learned, with the likely causes from the curve's shape."""
    shape = _shape(result)
    causes = [_RANDOM_TARGETS] if result.randomness == "targets" else []
    causes += _CAUSES[shape]
    initial, final = result.initial_loss, result.final_loss
    return Finding(
        kind="overfit_failed",
        severity="error",
        names=[],
        message=f"Could not overfit one batch of {result.num_samples} samples with {result.optimizer}: "
        f"the loss went from {initial:.4g} to {final:.4g} in {result.steps} steps "
        f"(target {result.target_loss:.4g}; curve {_described(shape, result)}).",
        hint="Likely causes: " + "; ".join(causes) + ".",
        data={
            "initial_loss": initial,
            "final_loss": final,
            "target_loss": result.target_loss,
            "steps": float(result.steps),
        },
    )


def missed_target(result: OverfitResult, fallback_lr: float) -> Finding:
    """``overfit_failed`` for a batch not learned: :func:`failed_finding`, an error, or a warning when the
    model learns after all: ``Adam(fallback_lr)`` from the same weights memorised the batch
    (``result.fallback_reached``), or the loss was still falling steadily and had at least halved (a slow
    objective). The user's LR is called slow only when the user's curve never rose above its start; a
    curve that diverged, or blew up and sat at chance or near its start, is a too-high LR: an error
    whatever the fallback did (a warning when a scheduler warms up to that LR, which the check skips)."""
    failed = failed_finding(result)
    shape = _shape(result)
    if shape in ("diverged", "blew_up"):
        return _too_high(failed, result, fallback_lr)
    rose = shape == "overshot" or result.final_loss > result.initial_loss
    if result.fallback_reached:
        failed.severity = "warning"
        failed.message += (
            f" Adam(lr={fallback_lr:g}) from the same weights did memorise it: the model, loss and data can "
            "learn; "
        )
        if rose:
            failed.message += "your optimizer's loss rose above its start instead: its LR is too high."
            failed.hint = (
                "Lower the LR (3-10x; an LR range test tells how far) or warm up to it. " + failed.hint
            )
            return failed
        failed.message += "your optimizer's LR is slow for memorising one batch."
        failed.hint = (
            "Fine for a small fine-tuning LR or a run that relies on warm-up; otherwise raise the LR "
            "(an LR range test tells how far) or max_steps."
        )
    elif not rose and still_learning(result.losses, result.chance_loss, result.num_classes):
        failed.severity = "warning"
        failed.message += (
            " The loss was still falling steadily and had at least halved: the model learns from its "
            "inputs, more slowly than the check's budget."
        )
        failed.hint = (
            "Objectives such as a VAE's ELBO or a regression on unnormalised targets take longer "
            "to memorise a batch; raise max_steps (or the LR) to see the target reached."
        )
    return failed


def _too_high(failed: Finding, result: OverfitResult, fallback_lr: float) -> Finding:
    """The verdict on a curve that diverged or blew up and never recovered: the LR is too high."""
    if result.fallback_reached:
        failed.message += (
            f" Adam(lr={fallback_lr:g}) from the same weights did memorise it: the model, loss and data can "
            "learn; your optimizer's LR is too high for them."
        )
    failed.hint = "Lower the learning rate (10x; an LR range test tells how far). " + failed.hint
    if result.warm_up:  # the run may reach this LR gently; the check jumped to it
        failed.severity = "warning"
        failed.message += (
            " Your LR scheduler warms up to this LR, and the check trained at it from the first step: "
            "the warm-up may carry the run through."
        )
    return failed
