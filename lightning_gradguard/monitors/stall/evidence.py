"""Whether a run is learning while its loss still sits at the chance level: whether its outputs lean
toward the labels more than a random model's would.

A plateau at chance that a warm-up or a layer-wise LR decay makes and a run that cannot learn (labels that
do not belong to their inputs, a model blind to its input, a frozen one) have the same loss for tens of
steps. Their outputs differ: a model that is learning gives the examples of each class a little more of
that class than of the others, long before the loss moves (the logits are still too small for that; their
direction already holds the labels). Each training batch, before the model trained on it, adds its
examples' scores to a per-class profile (:func:`~lightning_gradguard.functional.health.class_profile`);
at each check the profile of the loss window is tested against every relabeling of its classes
(:func:`~lightning_gradguard.functional.health.label_lean`): a model that learned nothing of the labels
cannot tell its classes' names apart, however much class structure its initialization gave its outputs.

The logits are the output of the last module of a training forward whose output is a float ``(batch, K)``
tensor (or carries one as ``.logits``: a Hugging Face output): found once, on the first batch with class
targets, by a hook on every module for that one forward; then one forward hook on that module, attached
only while a chance rule may still judge (the loss at chance, no cause named), so a run that learns pays
nothing after its first checks. Not measured for a compiled model (dynamo would trace our hook into its
graph), for fewer than 4 or more than :data:`MAX_PROFILE` classes, or without class targets (token
targets, a regression): the chance rules then judge the loss alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_gradguard.core.compile import holds_compiled
from lightning_gradguard.core.runstate import RunField, Stateful, nothing
from lightning_gradguard.core.state import strict_mode
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.health import class_profile
from lightning_gradguard.monitors.stall.measure import LEAN_KEY, class_targets

#: the widest head whose class profile is measured (its ``K x K`` sums cross to the host at each check)
MAX_PROFILE = 128
#: the narrowest: among the relabelings of 2 or 3 classes no diagonal is rare (see ``label_lean``)
MIN_PROFILE = 4
#: what a failure of the measuring means for the run (said once)
NO_EVIDENCE = (
    "the outputs' lean toward the labels is not measured for the rest of the run (the chance rules judge "
    "the loss alone). Please report this to lightning_gradguard with the model's layout."
)


def _logits(output: Any) -> Tensor | None:
    """A module's output as ``(batch, K)`` scores: the tensor itself, or its ``.logits``; else ``None``."""
    z = output if isinstance(output, Tensor) else getattr(output, "logits", None)
    if isinstance(z, Tensor) and z.dim() == 2 and z.shape[1] >= 2 and z.is_floating_point():
        return z
    return None


def _profile_saved(lean: LabelLean, sums: Tensor | None) -> list[Any] | None:
    return None if sums is None else sums.tolist()  # a checkpoint is a sync point


def _profile_loaded(lean: LabelLean, saved: Any) -> Tensor | None:
    return None if saved is None else torch.tensor(saved, dtype=torch.float32)


class LabelLean(Stateful):
    """The outputs' class profile (``class_profile``), summed on the device over the steps between two
    checks.

    Attributes:
        off: why nothing is measured (``None`` while it may be): no module gives ``(batch, K)`` scores, a
            compiled model, a head narrower than the classes seen.
        width: the head's ``K``.
    """

    #: the class profile's sums and counts since the last check (run state: a checkpoint between two
    #: checks keeps them, as lists; they go back to the device with the next batch's)
    _sums: RunField[Tensor | None] = RunField(nothing, key="sums", save=_profile_saved, load=_profile_loaded)
    _counts: RunField[Tensor | None] = RunField(
        nothing, key="counts", save=_profile_saved, load=_profile_loaded
    )

    def __init__(self) -> None:
        self.off: str | None = None
        self.error: Exception | None = None  # what ended the measuring, if our code failed (said once)
        self.width = 0
        self._head: nn.Module | None = None
        self._handles: list[RemovableHandle] = []
        #: while finding the head: the last module so far that returned (batch, K) scores, and its output
        self._found: list[tuple[nn.Module, Any]] = []
        self._finding = False
        self._targets: Tensor | None = None  # the current training batch's class targets

    # ------------------------------------------------------------------ every step, while wanted
    def batch_start(self, model: nn.Module, batch: Any) -> None:
        """A training batch begins: keep its class targets; on the first one that has them, find the head."""
        if self.off is not None:
            return
        self._targets = class_targets(batch)
        if self._head is not None and not self._handles:  # a fit after the first
            self._handles = [self._head.register_forward_hook(self._measure)]
        if self._targets is not None and self._head is None and not self._finding:
            if holds_compiled(model):
                self.off = "the model runs compiled code"
                return
            self._found, self._finding = [], True
            self._handles = [m.register_forward_hook(self._candidate) for m in model.modules()]

    def batch_end(self) -> None:
        """The training batch's forward is over: forget its targets (a validation forward is not measured);
        after the first one, keep the last module that gave ``(batch, K)`` scores as the head (and measure
        that batch from its output)."""
        if self._finding:
            self._choose()
        self._targets = None

    def _choose(self) -> None:
        self._finding = False
        self._remove()
        found, self._found = self._found, []
        if not found:
            self.off = "no module gives (batch, classes) scores"
            return
        head, output = found[-1]
        width = _logits(output).shape[1]  # type: ignore[union-attr]
        if not MIN_PROFILE <= width <= MAX_PROFILE:
            self.off = f"the classifier's {width} classes (measured: {MIN_PROFILE} to {MAX_PROFILE})"
            return
        self._head, self.width = head, width
        self._measure(head, None, output)
        self._handles = [head.register_forward_hook(self._measure)]

    def _candidate(self, module: nn.Module, args: Any, output: Any) -> None:
        try:  # inside the user's forward: a failure of ours ends the finding, never their step
            z, y = _logits(output), self._targets
            if z is not None and y is not None and z.shape[0] == y.shape[0]:
                self._found = [(module, output)]  # the last one is the head: only its output is kept
        except Exception as err:
            self._fail(err)

    def _fail(self, err: Exception) -> None:
        if strict_mode():
            raise err
        self.error, self.off = err, f"it failed ({type(err).__name__}: {err})"
        self._finding, self._found = False, []
        self._remove()  # (PyTorch iterates over a copy of the module's hooks: removing one here is safe)

    def _measure(self, module: nn.Module, args: Any, output: Any) -> None:
        z, y = _logits(output), self._targets
        if z is None or y is None or z.shape[0] != y.shape[0] or z.shape[1] != self.width:
            return
        try:  # inside the user's forward: a failure of ours ends the measuring, never their step
            sums, counts = class_profile(z, y)
        except Exception as err:
            self._fail(err)
            return
        if self._sums is None or self._counts is None or self._sums.shape != sums.shape:
            self._sums, self._counts = sums, counts
        elif self._sums.device != sums.device:  # read back from a checkpoint: on the CPU until now
            self._sums = sums.add_(self._sums.to(sums.device))
            self._counts = counts.add_(self._counts.to(counts.device))
        else:
            self._sums += sums
            self._counts += counts

    # ------------------------------------------------------------------ at checks
    def want(self, on: bool) -> None:
        """Measure from now on (``on``, once the head is known) or not (its hook removed)."""
        if not on or self.off is not None:
            self._remove()
        elif self._head is not None and not self._handles:
            self._handles = [self._head.register_forward_hook(self._measure)]

    def check_width(self, classes_seen: int) -> None:
        """A head narrower than the classes seen is not the classifier's: measure nothing."""
        if self._head is not None and self.width < classes_seen:
            self.off = f"the last (batch, K) output has K={self.width} < {classes_seen} classes seen"
            self._remove()

    def queue(self, transfer: HostTransfer, world: bool, device: torch.device) -> None:
        """Add the profile since the last check to the check's transfer. Under DDP every rank adds one of
        the same size, ``MAX_PROFILE`` wide, whatever it measured (zeros where nothing, or where finding the
        head failed on it alone), to be summed: the ranks' collective never depends on a rank's own luck."""
        sums, counts, self._sums, self._counts = self._sums, self._counts, None, None
        if world:
            block = torch.zeros(MAX_PROFILE + 1, MAX_PROFILE, device=device)  # the sums, then the counts
            if sums is not None and counts is not None:
                k = sums.shape[0]
                block[:k, :k] = sums
                block[MAX_PROFILE, :k] = counts
            transfer.add(LEAN_KEY, torch.cat([block[:MAX_PROFILE].reshape(-1), block[MAX_PROFILE]]), "sum")
        elif sums is not None and counts is not None:
            transfer.add(LEAN_KEY, torch.cat([sums.reshape(-1), counts]))

    def close(self) -> None:
        """Remove every hook of ours (the fit ended or failed)."""
        self._remove()
        self._finding, self._targets, self._found = False, None, []

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
