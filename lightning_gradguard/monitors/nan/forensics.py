"""Find where a non-finite value was born: in which module's forward, or in which backward op.

Both functions replay a computation (a closure returning the loss) on copies of the parameters, so the
real parameters, their ``.grad`` and any DDP gradient hooks are untouched, and the caller's RNG state
is restored afterwards. They are meant for the rare failing step, never for the happy path, and work
on any ``nn.Module`` (no Trainer needed). :func:`replay_origin` runs them on a LightningModule's
``training_step`` as the run called it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradguard.core.batch import tensors_in
from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.snapshot import RNGState
from lightning_gradguard.core.trial import loss_of, quiet_logging, training_step_of


def _nonfinite(obj: Any) -> int:
    """Number of NaN/inf entries in every floating tensor inside ``obj``."""
    total = 0
    for t in tensors_in(obj):
        if t.is_floating_point() or t.is_complex():
            total += int((~torch.isfinite(t.detach())).sum())
    return total


@dataclass
class ForwardOrigin:
    """The first place in forward order where a non-finite value appeared.

    ``module`` is the qualified module name; the root module (the LightningModule) is named by its class
    and has ``root`` set. ``in_input`` is True when the module *received* non-finite values it did not
    make (typically: the batch itself was bad), False when it turned finite inputs into a non-finite
    output. ``in_step`` (the root only): the value was born in the step's own code, outside every
    module's forward (``training_step`` dividing by zero after the last module ran).
    ``inputs_finite``: whether what the step was given (the batch) was finite, when known: a module
    whose input was non-finite although the batch was not got it from the step's own code.
    """

    module: str
    module_type: str
    in_input: bool
    nonfinite: int
    root: bool = False
    in_step: bool = False
    inputs_finite: bool | None = None

    def label(self) -> str:
        """The module's name in backticks, then its type, or for the root that it is the model itself."""
        if not self.root:
            return f"`{self.module}` ({self.module_type})"
        where = ", in its step code outside any module's forward" if self.in_step else ""
        return f"`{self.module}` (the model itself{where})"

    def describe(self) -> str:
        values = f"{self.nonfinite} non-finite value" + ("" if self.nonfinite == 1 else "s")
        if self.in_input and self.inputs_finite:
            return (
                f"the input of {self.label()} already held {values} although the batch was finite: the "
                "step's own code made them before calling the module"
            )
        if self.in_input:
            return f"the input of {self.label()} already held {values}"
        return f"{self.label()} produced {values} from finite inputs"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BackwardOrigin:
    """The backward op that first produced a non-finite gradient (from anomaly mode)."""

    op: str
    message: str
    forward_trace: str

    def describe(self) -> str:
        where = f" (created at {self.forward_trace})" if self.forward_trace else ""
        return f"backward op `{self.op}` returned non-finite values{where}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def replayed(module: nn.Module, requires_grad: bool) -> Iterator[None]:
    """Run the body on detached copies of ``module``'s parameters and buffers, restoring the RNG state
    afterwards: the replayed forward writes BatchNorm's running statistics into the copies, not the model."""
    params = {
        n: p.detach().clone().requires_grad_(requires_grad and p.requires_grad)
        for n, p in module.named_parameters()
    }
    params.update((n, b.detach().clone()) for n, b in module.named_buffers() if isinstance(b, torch.Tensor))
    rng = RNGState()
    try:
        with torch.nn.utils.stateless._reparametrize_module(module, params):
            yield
    finally:
        rng.restore()


class _FirstNonFinite:
    """The forward hooks of :func:`find_forward_origin`: the first non-finite value, and who made it.

    The modules whose forward is running are kept on a stack: a module that receives a non-finite value
    while its parent runs got it from the parent's own code (its inputs were finite, else the parent's
    pre-hook would have seen them), so the parent is named, not the child.
    """

    def __init__(self, root: nn.Module, inputs_finite: bool | None) -> None:
        self.root = root
        self.names = {m: user_name(n, root) for n, m in root.named_modules()}
        self.inputs_finite = inputs_finite
        self.running: list[nn.Module] = []
        self.found: ForwardOrigin | None = None

    def note(self, mod: nn.Module, in_input: bool, bad: int, in_step: bool = False) -> None:
        name, finite = self.names.get(mod, "?"), self.inputs_finite if in_input else None
        self.found = ForwardOrigin(name, type(mod).__name__, in_input, bad, mod is self.root, in_step, finite)

    def pre(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        if self.found is None:
            bad = _nonfinite((args, kwargs))
            if bad and self.running:  # made by the running module's own code, between its calls
                self.note(self.running[-1], False, bad)
            elif bad:
                self.note(mod, True, bad)
        self.running.append(mod)

    def post(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.running and self.running[-1] is mod:
            self.running.pop()
        if self.found is None:
            bad = _nonfinite(output)
            if bad:
                self.note(mod, False, bad)

    def returned(self, result: Any) -> None:
        """What the replayed step returned: non-finite while every module's output was finite means the
        step's own code made it (or the batch was bad and reached the loss through no module)."""
        if self.found is None:
            bad = _nonfinite(result)
            if bad:
                in_input = self.inputs_finite is False
                self.note(self.root, in_input, bad, in_step=not in_input)


def find_forward_origin(
    module: nn.Module, run: Callable[[], Any], inputs: Any = None
) -> ForwardOrigin | None:
    """Replay ``run()`` with forward hooks on every module and name the first non-finite value.

    Pre-hooks see inputs in call order (parents first), post-hooks see outputs as modules finish
    (children first); whichever event shows a non-finite value first in time wins. A non-finite value
    that no module's output carried and that ``run()`` returned was made by the code around the modules:
    the root is named (by its class). ``inputs`` (the batch ``run()`` reads, if given) tells a bad batch
    from code that made a NaN out of a good one. Returns ``None`` when the forward pass stays finite.
    """
    watch = _FirstNonFinite(module, None if inputs is None else _nonfinite(inputs) == 0)
    handles = []
    for m in watch.names:
        handles.append(m.register_forward_pre_hook(watch.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(watch.post, with_kwargs=True))
    try:
        with Uncompiled(module), replayed(module, requires_grad=False), torch.no_grad():
            watch.returned(run())
    finally:
        for h in handles:
            h.remove()
    return watch.found


def find_backward_origin(module: nn.Module, run: Callable[[], Any]) -> BackwardOrigin | None:
    """Replay ``run()`` and its backward; name the first backward op that made a NaN/inf gradient.

    Every node of the autograd graph gets a hook; in backward order, the first node whose incoming
    gradients are finite but whose outgoing gradients are not is the origin (this catches inf as well
    as NaN, which anomaly mode alone does not). The forward was recorded under anomaly mode, so the
    line of user code that created the op is reported too. Returns ``None`` when backward stays finite.
    """
    found: list[BackwardOrigin] = []

    def hook_for(node: Any) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if not found and _nonfinite(grad_inputs) and not _nonfinite(grad_outputs):
                trace = getattr(node, "metadata", {}).get("traceback_", "")
                trace = "".join(trace) if isinstance(trace, (list, tuple)) else str(trace)
                found.append(BackwardOrigin(node.name(), _nonfinite_message(node.name()), _user_frame(trace)))

        return hook

    with Uncompiled(module), replayed(module, requires_grad=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            loss = run()
        if isinstance(loss, dict):
            loss = loss["loss"]
        if not isinstance(loss, Tensor) or loss.grad_fn is None:
            return None
        handles = [node.register_hook(hook_for(node)) for node in _graph_nodes(loss.grad_fn)]
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
    return found[0] if found else None


def replay_origin(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, backward: bool
) -> ForwardOrigin | BackwardOrigin | None:
    """Replay ``training_step`` on ``batch`` (the precision context, no logging): where NaN/inf was born.

    The forward pass first; when it is clean and ``backward`` is set, the backward pass. ``None`` when
    both stay finite.
    """

    def run() -> Any:
        with trainer.precision_plugin.train_step_context(), quiet_logging(pl_module):
            return loss_of(training_step_of(pl_module, batch, batch_idx))

    forward = find_forward_origin(pl_module, run, inputs=batch)
    if forward is not None or not backward:
        return forward
    return find_backward_origin(pl_module, run)


def _nonfinite_message(op: str) -> str:
    return f"backward of {op} turned finite incoming gradients into NaN/inf"


def _graph_nodes(root: Any) -> list[Any]:
    seen: set[int] = set()
    stack, out = [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _user_frame(trace: str) -> str:
    """The last ``File "...", line N`` of a forward traceback that lies outside torch and lightning."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\n]+)\n(?: +([^\n]*)\n)?', trace)
    user = [f for f in frames if "/torch/" not in f[0] and "/lightning/" not in f[0]]
    if not user:
        return ""
    path, line, func, code = user[-1]
    return f"{path}:{line} in {func}" + (f": {code.strip()}" if code.strip() else "")
