"""What the overfit-one-batch check measures besides the loss curve: :class:`OverfitResult`, and what its
rules about the parameters and the data read.

* :class:`ParameterRecord`: what the trial saw of the trainable parameters; :class:`ParameterEvidence`:
  that record with the optimizer, the parameters kept, and (:class:`Unchanged`) those that never moved
  although they had a gradient, by why (not in the optimizer, lr 0, no update computed, not measured)
  or updated by less than their dtype resolves (bf16 weights near 1.0, measured by an extra step);
  :func:`used_elsewhere`: the modules only another step uses;
* :func:`mixing_of`: which samples' inputs move another sample's output (eval mode).

The rules that judge them, their wording and hints, are in
:mod:`~lightning_gradguard.monitors.overfit.rules`; the loss curve (initial loss, chance level, its shape)
in :mod:`~lightning_gradguard.monitors.overfit.diagnosis`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_gradguard.alerts import Finding
from lightning_gradguard.core.batch import batch_size_of, tensors_in
from lightning_gradguard.core.lr import group_lr
from lightning_gradguard.core.preflight import MAX_LISTED
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


@dataclass(frozen=True, kw_only=True)
class Unchanged:
    """The parameters with a non-zero gradient whose value never changed, and why.

    Attributes:
        why: their names, by why: ``"missing"`` (in no param group), ``"zero_lr"`` (in a group with lr 0),
            ``"not_stepped"`` (``optimizer.step()`` computes no update for them), ``"unmeasured"`` (their
            update could not be measured); those whose update rounding dropped are in ``lost`` instead.
        lost: the parameters (by index in the record) the optimizer does update, by no more than their
            dtype resolves at their values: the sizes of their non-zero updates.
    """

    why: dict[str, list[str]]
    lost: dict[int, Tensor]


class ParameterEvidence:
    """What the rules about the trial's parameters judge: the record, the optimizer, and the parameters
    kept (names matching no ``fnmatch`` pattern of ``ignore``).

    Args:
        optimizer: the optimizer the trial stepped.
        record: what the trial saw of the trainable parameters.
        ignore: ``fnmatch`` patterns of parameter names left out.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, record: ParameterRecord, ignore: list[str]) -> None:
        self.optimizer = optimizer
        self.record = record
        self.kept = [not any(fnmatch.fnmatchcase(n, pat) for pat in ignore) for n in record.names]

    @cached_property
    def unchanged(self) -> Unchanged:
        """The kept parameters with a non-zero gradient that never changed, and why (measured on first
        use: telling an update rounded away from none takes one more optimizer step, ``record.probe``)."""
        lr_of: dict[int, float] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                lr = group_lr(group)
                lr_of[id(p)] = math.nan if lr is None else lr
        record = self.record
        why: dict[str, list[str]] = {"missing": [], "zero_lr": [], "not_stepped": [], "unmeasured": []}
        other: list[int] = []
        rows = zip(record.names, record.params, record.start, record.nonzero_grad, self.kept, strict=True)
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
                why["not_stepped" if i in measured else "unmeasured"].append(record.names[i])
        return Unchanged(why=why, lost=lost)


def used_elsewhere(record: ParameterRecord, names: list[str]) -> dict[str, list[str]]:
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


@dataclass(frozen=True, kw_only=True)
class Mixing:
    """Which samples' inputs move another sample's output.

    Attributes:
        leaf: the module whose per-sample output was read (the last leaf module with the batch's leading
            dimension).
        samples: for samples 0 and ``n // 2``: the other samples whose input moves their output (empty:
            no mixing).
    """

    leaf: str | None
    samples: dict[int, list[int]]


def mixing_of(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Mixing | None:
    """Whether the output of one sample depends on the input of another (eval mode); ``None`` when it
    cannot be measured (no float input batch, no per-sample output: a one-time warning says so)."""
    n = batch_size_of(batch)
    source = next(
        (t for t in tensors_in(batch) if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == n),
        None,
    )
    if n is None or n < 2 or source is None:
        warn_once(trainer, "overfit_batch_mixing_input", "batch-mixing check skipped: no float input batch")
        return None
    x = source.detach().clone().requires_grad_(True)
    leaf = _eval_outputs(pl_module, apply_to_collection(batch, Tensor, lambda t: x if t is source else t), n)
    out = leaf.last
    if out is None or not out.requires_grad:
        warn_once(trainer, "overfit_batch_mixing_output", "batch-mixing check skipped: no per-sample output")
        return None
    return Mixing(leaf=leaf.name, samples=_mixed_samples(out, x, n))


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
