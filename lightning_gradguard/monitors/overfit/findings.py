"""What the overfit-one-batch check finds besides the loss curve: :class:`OverfitResult`, and the
findings about the parameters and the data.

* :func:`parameter_findings`: parameters that get no gradient (an info line when only another step
  uses their module), or never move although they have one (from a :class:`ParameterRecord` of the
  trial): not updated at all, or updated by less than their dtype resolves (bf16 weights near 1.0);
* :func:`label_stability`: the same samples drawn twice, with the same inputs but other labels;
* :func:`batch_mixing`: one sample's output depends on another sample's input.

Each finding's hint is in :data:`HINTS`, under its kind. The findings about the loss curve (initial loss,
chance level, why the batch was not learned) are in :mod:`~lightning_gradguard.monitors.overfit.diagnosis`;
:class:`~lightning_gradguard.core.preflight.Finding` itself is shared with the gradient check.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_gradguard.core.batch import batch_size_of, tensors_in
from lightning_gradguard.core.preflight import MAX_LISTED, Finding
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.trial import quiet_logging, training_step_of
from lightning_gradguard.functional.updates import dtype_spacing
from lightning_gradguard.monitors.overfit.modules import LeafOutputs


@dataclass
class OverfitResult:
    """What :class:`OverfitBatchSanity` saw.

    Attributes:
        passed: the loss reached the target (or the batch was memorised) and no error finding was made.
        reached_target: the loss reached the target.
        memorised: the target was not reached in ``max_steps``, but at the last step a classifier
            classified every sample of the batch correctly (argmax of the logits equals the label) with
            a loss below the initial one: the check passes then too, since a loss with a floor (label
            smoothing) may never reach a relative target.
        steps: optimizer steps taken (the check stops at the first loss at or below the target).
        initial_loss: loss before the first step.
        final_loss: the last loss measured.
        target_loss: the loss the check had to reach.
        losses: the loss curve, one value per evaluation (``steps + 1`` values).
        grad_norms: the total gradient 2-norm at each step (``grad_norms[k]`` is the gradient at
            ``losses[k]``).
        seconds: wall time of the whole check, restore included.
        num_samples: samples in the batch trained on.
        optimizer: the optimizer class used (the user's, or the fallback ``Adam``).
        converged: the target was missed, but the loss converged to a floor (see
            :func:`~lightning_gradguard.functional.overfit.at_floor`): the gradient norm fell to 5 % of
            its first value, the loss to half its initial value and below chance level. Soft targets
            (mixup, distillation) and label smoothing have such floors; the check passes.
        randomness: what random draws inside ``training_step`` change, found by calling it under two
            seeds: ``"none"``; ``"inputs"`` (the model's output: input noise, a diffusion timestep,
            mixup, augmentation, dropout), then every step of the check is re-seeded with one fixed seed
            so the batch and the objective stay the same; ``"targets"`` (the same output, another loss:
            labels drawn at random), then nothing is frozen (random labels cannot be memorised).
        findings: every specific problem found.
        fallback_reached: when the user's optimizer missed the target, whether ``Adam(fallback_lr)``,
            started again from the same weights, reached it or memorised the batch (then the check passes
            with a warning: the pipeline learns, the LR is slow); ``None`` when not tried.
        num_classes: for a classifier, the number of classes (given or inferred), else ``None``.
        chance_loss: for a classifier, the entropy of the batch's label frequencies: the loss of a model
            that ignores its inputs and predicts how often each label occurs.
        warm_up: an LR scheduler had scaled some param group's LR below the LR it was configured with (a
            warm-up): the check trained at the configured LR from its first step.
    """

    passed: bool
    reached_target: bool
    memorised: bool
    steps: int
    initial_loss: float
    final_loss: float
    target_loss: float
    losses: list[float]
    grad_norms: list[float]
    seconds: float
    num_samples: int
    optimizer: str
    findings: list[Finding] = field(default_factory=list)
    randomness: str = "none"
    converged: bool = False
    fallback_reached: bool | None = None
    num_classes: int | None = None
    chance_loss: float | None = None
    warm_up: bool = False


def listed(names: list[str]) -> str:
    """The first ``MAX_LISTED`` names in backticks, and how many more."""
    shown = ", ".join(f"`{n}`" for n in names[:MAX_LISTED])
    more = len(names) - MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


HINTS = {
    "unused_parameter": (
        "These parameters are not in the graph that produced the loss: look for a `.detach()`, "
        "`torch.no_grad()`, `.item()`/`.numpy()` or `.data` on the way from them to the loss, a layer that "
        "forward() never calls, or a branch that is never taken. If they are unused on purpose, freeze "
        "them (requires_grad=False) or list them in `ignore_parameters`."
    ),
    "parameter_not_updated": (
        "The optimizer never changes these parameters: add them to configure_optimizers() (e.g. "
        "`self.parameters()` instead of one sub-module's), and check each param group's learning rate."
    ),
    "update_below_precision": (
        "Nothing is disconnected: the optimizer does compute these updates, and the weights' dtype cannot "
        "hold them, so every step rounds back to the old value and the parameters keep their initial "
        'values. Keep float32 master weights: precision="bf16-mixed" (or "16-mixed") computes in half '
        "precision and updates float32 weights; or keep these parameters (typically normalisation weights "
        "near 1) in float32. With float32 weights, the LR is tiny for the parameters' scale."
    ),
    "batch_mixing": (
        "A reshape/view/permute mixes the batch dimension (e.g. `x.view(features, batch)` where "
        "`x.view(batch, features)` was meant, or a transpose before a flatten), or an op reduces over "
        "dim 0. Every sample's output must depend only on that sample's input."
    ),
    "labels_unstable": (
        "Labels must be tied to their inputs: look for a dataset that draws or shuffles labels separately "
        "from the inputs (an index into the label array that is not the sample's index, a shuffle applied "
        "to one array only, a random label transform). A model cannot learn labels that change under it."
    ),
}


#: the hint of ``unused_parameter`` (info): parameters of a module only another step uses
_OTHER_STEPS_HINT = (
    "Nothing to do when that is the design (an auxiliary head read in validation). If they should learn, "
    "add their loss to training_step's; if not, freeze them (requires_grad=False: the optimizer then holds "
    "no state for them) or list them in `ignore_parameters` to drop this line."
)


def label_stability(first: Any, second: Any) -> list[Finding]:
    """Compare two draws of the same samples: identical inputs with different labels is a pipeline bug.

    Only judged when every floating tensor came back identical (no random augmentation): then any
    per-sample difference in a one-dimensional integer tensor means the labels are not tied to their
    inputs.
    """
    a, b = list(tensors_in(first)), list(tensors_in(second))
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b, strict=True)):
        return []
    floats = [(x, y) for x, y in zip(a, b, strict=True) if x.is_floating_point()]
    # labels are one integer per sample: [N, k] integers are often drawn at random on purpose (sampled
    # negatives, random masks), a per-sample label is not
    ints = [(x, y) for x, y in zip(a, b, strict=True) if not x.is_floating_point() and x.dim() == 1]
    if not floats or not ints or not all(torch.equal(x, y) for x, y in floats):
        return []
    for x, y in ints:
        differ = (x != y).reshape(x.shape[0], -1).any(dim=1)
        count = int(differ.sum())
        if count:
            n = int(x.shape[0])
            return [
                Finding(
                    kind="labels_unstable",
                    severity="error",
                    names=[],
                    message="Fetching the first batch's samples twice gave identical inputs but different "
                    f"labels for {count} of {n} samples.",
                    hint=HINTS["labels_unstable"],
                    data={"samples_changed": float(count), "samples": float(n)},
                )
            ]
    return []


@dataclass(frozen=True, kw_only=True)
class ParameterRecord:
    """What the trial saw of the trainable parameters, one entry per parameter in each list.

    Attributes:
        names: their qualified names.
        params: the parameters, after the trial.
        start: their values before the first step.
        got_grad: whether each received a gradient at some step.
        nonzero_grad: whether each had a non-zero gradient at some step.
        called: the modules that ran in the first ``training_step``.
        probe: the update the optimizer makes to each of the parameters given, measured where rounding
            does not hide it (``None`` for one it could not measure); ``None``: not available.
        elsewhere: the sub-modules that only ``validation_step``, ``test_step`` or ``predict_step`` use,
            each with that step (see
            :func:`~lightning_gradguard.monitors.overfit.modules.used_outside_training`); called only
            when a parameter without a gradient sits in a module that never ran; ``None``: not known.
    """

    names: list[str]
    params: list[nn.Parameter]
    start: list[Tensor]
    got_grad: list[bool]
    nonzero_grad: list[bool]
    called: set[str]
    probe: Callable[[list[nn.Parameter]], list[Tensor | None]] | None = None
    elsewhere: Callable[[], dict[str, str]] | None = None


def parameter_findings(
    optimizer: torch.optim.Optimizer, record: ParameterRecord, ignore: list[str]
) -> list[Finding]:
    """The parameters that got no gradient (``unused_parameter``) or never moved although they had one:
    not updated (``parameter_not_updated``), or updated by less than their dtype resolves
    (``update_below_precision``); names matching an ``fnmatch`` pattern of ``ignore`` are left out."""
    kept = [not any(fnmatch.fnmatchcase(n, pat) for pat in ignore) for n in record.names]
    return [
        *_without_gradient(optimizer, record, kept),
        *_zero_gradient(record, kept),
        *_not_updated(optimizer, record, kept),
    ]


def _without_gradient(
    optimizer: torch.optim.Optimizer, record: ParameterRecord, kept: list[bool]
) -> list[Finding]:
    """``unused_parameter``: info for those of a module that only another step uses (a validation-only
    head), a warning for those left untrained on purpose (in no param group, or their module never
    ran), an error for the rest."""
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    no_grad, not_trained, outside = [], [], []
    for name, p, g, keep in zip(record.names, record.params, record.got_grad, kept, strict=True):
        if g or not keep:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if id(p) not in in_optimizer:
            not_trained.append(name)  # no gradient and no optimizer: consistently left untrained
        elif owner and owner not in record.called:
            outside.append(name)  # its module never ran in training_step
        else:
            no_grad.append(name)
    idle = [n for n in not_trained + outside if "." in n and n.rsplit(".", 1)[0] not in record.called]
    by_step = _used_elsewhere(record, idle)
    elsewhere = {name for names in by_step.values() for name in names}
    not_trained = [name for name in not_trained if name not in elsewhere]
    outside = [name for name in outside if name not in elsewhere]
    findings = [_other_steps(by_step)] if by_step else []
    if not_trained or outside:
        findings.append(_left_untrained(not_trained, outside))
    if no_grad:
        findings.append(
            Finding(
                kind="unused_parameter",
                severity="error",
                names=no_grad,
                message=f"{len(no_grad)} trainable parameter(s) never received a gradient: "
                f"{listed(no_grad)}.",
                hint=HINTS["unused_parameter"],
                data={"count": float(len(no_grad))},
            )
        )
    return findings


def _used_elsewhere(record: ParameterRecord, names: list[str]) -> dict[str, list[str]]:
    """Of ``names`` (no gradient, their module never ran in ``training_step``), those whose module the
    code of another step uses, by that step."""
    used = record.elsewhere() if names and record.elsewhere is not None else {}
    by_step: dict[str, list[str]] = {}
    for name in names:
        owner = name.rsplit(".", 1)[0]
        step = next((s for m, s in used.items() if owner == m or owner.startswith(m + ".")), None)
        if step is not None:
            by_step.setdefault(step, []).append(name)
    return by_step


def _other_steps(by_step: dict[str, list[str]]) -> Finding:
    """``unused_parameter`` (info): parameters of modules only another step uses, by that step."""
    names = [name for step in by_step.values() for name in step]
    parts = [f"only {step} uses their module: {listed(found)}" for step, found in by_step.items()]
    return Finding(
        kind="unused_parameter",
        severity="info",
        names=names,
        message=f"{len(names)} trainable parameter(s) get no gradient in training_step; "
        + "; ".join(parts)
        + ". Expected for a head that only evaluates; nothing trains them, so they keep their initial "
        "values unless you update them yourself. Under DDP they need find_unused_parameters=True.",
        hint=_OTHER_STEPS_HINT,
        data={"count": float(len(names))},
    )


def _left_untrained(not_trained: list[str], outside: list[str]) -> Finding:
    """``unused_parameter`` (warning): no gradient, in no param group, or in a module that never ran."""
    parts = [f"in no param group of the optimizer either: {listed(not_trained)}"] if not_trained else []
    if outside:
        parts.append(f"their module never runs in training_step: {listed(outside)}")
    return Finding(
        kind="unused_parameter",
        severity="warning",
        names=not_trained + outside,
        message=f"{len(not_trained) + len(outside)} trainable parameter(s) get no gradient in "
        "training_step; " + "; ".join(parts) + ". Fine if they are meant for another step "
        "(validation, a teacher updated by hand); under DDP they need find_unused_parameters=True.",
        hint=HINTS["unused_parameter"],
        data={"count": float(len(not_trained) + len(outside))},
    )


def _zero_gradient(record: ParameterRecord, kept: list[bool]) -> list[Finding]:
    """``unused_parameter`` (warning): a gradient at some step, but exactly zero at every one."""
    zero_grad = [
        n
        for n, g, nz, keep in zip(record.names, record.got_grad, record.nonzero_grad, kept, strict=True)
        if g and not nz and keep
    ]
    if not zero_grad:
        return []
    return [
        Finding(
            kind="unused_parameter",
            severity="warning",
            names=zero_grad,
            message=f"{len(zero_grad)} parameter(s) got a gradient that was exactly zero at every step: "
            f"{listed(zero_grad)} (dead units, a multiplication by zero, or a constant branch).",
            hint=HINTS["unused_parameter"],
            data={"count": float(len(zero_grad))},
        )
    ]


def _not_updated(
    optimizer: torch.optim.Optimizer, record: ParameterRecord, kept: list[bool]
) -> list[Finding]:
    """A non-zero gradient, but the value never changed: ``parameter_not_updated`` (not in the optimizer,
    lr 0, or the optimizer computes no update for it), or ``update_below_precision`` (it does, and
    rounding to the parameter's dtype drops every one)."""
    lr_of: dict[int, float] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            lr = group.get("lr", math.nan)
            lr_of[id(p)] = float(lr.item() if isinstance(lr, Tensor) else lr)
    why: dict[str, list[str]] = {"missing": [], "zero_lr": [], "no_update": [], "unmeasured": []}
    other: list[int] = []
    rows = zip(record.names, record.params, record.start, record.nonzero_grad, kept, strict=True)
    for i, (name, p, s, nz, keep) in enumerate(rows):
        if not nz or not keep or not torch.equal(p.detach(), s):
            continue
        if id(p) not in lr_of:
            why["missing"].append(name)
        elif lr_of[id(p)] == 0:
            why["zero_lr"].append(name)
        else:
            other.append(i)
    lost, measured = _lost_to_rounding(record, other)
    for i in other:
        if i not in lost:
            why["no_update" if i in measured else "unmeasured"].append(record.names[i])
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in lost:
        by_dtype.setdefault(record.params[i].dtype, []).append(i)
    return _not_updated_finding(optimizer, why) + [
        _below_precision(record, lost, indices) for indices in by_dtype.values()
    ]


#: why a parameter with a gradient never changed, by the key :func:`_not_updated` files it under
_NOT_UPDATED_WHY = {
    "missing": "not in any param group of {optimizer}",
    "zero_lr": "in a param group with lr=0",
    "no_update": "in a param group with a non-zero lr, but optimizer.step() computes no update for them (an "
    "optimizer or a step hook that skips them or zeroes their gradient)",
    "unmeasured": "unchanged by optimizer.step() although their gradient was non-zero and their lr is not 0 "
    "(the update could not be measured to tell whether it was below the weights' floating-point "
    "resolution)",
}


def _not_updated_finding(optimizer: torch.optim.Optimizer, why: dict[str, list[str]]) -> list[Finding]:
    """``parameter_not_updated`` (error) for the parameters the optimizer does not update, and why."""
    stuck = [name for names in why.values() for name in names]
    if not stuck:
        return []
    parts = [
        _NOT_UPDATED_WHY[key].format(optimizer=type(optimizer).__name__) + ": " + listed(names)
        for key, names in why.items()
        if names
    ]
    return [
        Finding(
            kind="parameter_not_updated",
            severity="error",
            names=stuck,
            message=f"{len(stuck)} parameter(s) with a gradient never changed; " + "; ".join(parts) + ".",
            hint=HINTS["parameter_not_updated"],
            data={
                "count": float(len(stuck)),
                "not_in_optimizer": float(len(why["missing"])),
                "lr_zero": float(len(why["zero_lr"])),
            },
        )
    ]


def _lost_to_rounding(record: ParameterRecord, indices: list[int]) -> tuple[dict[int, Tensor], set[int]]:
    """Of the parameters at ``indices`` (a gradient, an LR, and no change): those the optimizer does
    update, by no more than their dtype's resolution at their values (their measured updates, by index),
    and every one whose update was measured."""
    if not indices or record.probe is None:
        return {}, set()
    try:
        updates = record.probe([record.params[i] for i in indices])
    except Exception:  # an optimizer the extra step cannot drive: nothing measured, the finding an error
        return {}, set()
    lost: dict[int, Tensor] = {}
    measured: set[int] = set()
    for i, update in zip(indices, updates, strict=True):
        p = record.params[i]
        if update is None or not p.is_floating_point():
            continue
        measured.add(i)
        size = update.detach().float().abs()
        moved = size.ne(0)
        if bool(moved.any()) and bool((size <= dtype_spacing(p, p.dtype))[moved].all()):
            lost[i] = size[moved]
    return lost, measured


def _below_precision(record: ParameterRecord, lost: dict[int, Tensor], indices: list[int]) -> Finding:
    """``update_below_precision`` (warning) for parameters of one dtype: the numbers of the lost updates."""
    dtype = record.params[indices[0]].dtype
    names = [record.names[i] for i in indices]
    magnitude = float(
        torch.cat([record.params[i].detach().float().abs().flatten() for i in indices]).median()
    )
    resolution = float(dtype_spacing(torch.tensor(magnitude), dtype))
    sizes = torch.cat([lost[i] for i in indices])
    typical, largest = float(sizes.median()), float(sizes.max())
    kind = str(dtype).removeprefix("torch.")
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1
    return Finding(
        kind="update_below_precision",
        severity="warning",
        names=names,
        message=f"{len(names)} {kind} parameter(s) never changed although their gradient was non-zero and "
        f"the optimizer updated them: {listed(names)}. Their typical |value| is {magnitude:.3g}, where "
        f"{kind} numbers ({bits} significant bits) are {resolution:.2g} apart; the optimizer's updates "
        f"(typically {typical:.2g}, at most {largest:.2g}) are too small for that: an update under half the "
        "gap rounds back to the old value.",
        hint=HINTS["update_below_precision"],
        data={
            "count": float(len(names)),
            "magnitude": magnitude,
            "resolution": resolution,
            "update": typical,
            "largest_update": largest,
        },
    )


def batch_mixing(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> list[Finding]:
    """``batch_mixing``: the output of one sample depends on the input of another (eval mode)."""
    n = batch_size_of(batch)
    source = next(
        (t for t in tensors_in(batch) if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == n),
        None,
    )
    if n is None or n < 2 or source is None:
        warn_once(trainer, "overfit_batch_mixing_input", "batch-mixing check skipped: no float input batch")
        return []
    x = source.detach().clone().requires_grad_(True)
    leaf = _eval_outputs(pl_module, apply_to_collection(batch, Tensor, lambda t: x if t is source else t), n)
    out = leaf.last
    if out is None or not out.requires_grad:
        warn_once(trainer, "overfit_batch_mixing_output", "batch-mixing check skipped: no per-sample output")
        return []
    mixed = _mixed_samples(out, x, n)
    if not mixed:
        return []
    desc = "; ".join(f"sample {i} <- samples {js[:MAX_LISTED]}" for i, js in mixed.items())
    return [
        Finding(
            kind="batch_mixing",
            severity="error",
            names=[leaf.name or ""],
            message=f"The output of `{leaf.name}` for one sample depends on the inputs of other samples "
            f"(eval mode): {desc}.",
            hint=HINTS["batch_mixing"],
            data={"samples_mixed": float(sum(len(v) for v in mixed.values()))},
        )
    ]


def _eval_outputs(pl_module: pl.LightningModule, probe: Any, n: int) -> LeafOutputs:
    """``training_step`` on ``probe`` in eval mode, with autograd: its last per-sample output (hooks
    removed, the model back in train mode)."""
    leaf = LeafOutputs(pl_module, n)
    pl_module.eval()
    try:
        with torch.enable_grad(), quiet_logging(pl_module):
            training_step_of(pl_module, probe)
    finally:
        leaf.remove()
        pl_module.train()
    return leaf


def _mixed_samples(out: Tensor, x: Tensor, n: int) -> dict[int, list[int]]:
    """For samples 0 and ``n // 2``: the other samples whose input moves a random projection of their
    output (the rows ``j != i`` of its gradient with respect to the input batch that are not zero)."""
    gen = torch.Generator().manual_seed(0)
    mixed: dict[int, list[int]] = {}
    for i in sorted({0, n // 2}):
        weights = torch.randn(out[i].shape, generator=gen).to(out)
        (g,) = torch.autograd.grad((out[i] * weights).sum(), x, retain_graph=True, allow_unused=True)
        if g is None:
            continue
        rows = g.detach().reshape(n, -1).abs().amax(dim=1)
        others = [j for j in range(n) if j != i and float(rows[j]) > 0]
        if others:
            mixed[i] = others
    return mixed
