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
from lightning_gradguard.core.snapshot import RNGState
from lightning_gradguard.core.trial import loss_of, quiet_logging, training_step_of
from lightning_gradguard.functional.stats import clean_name

__all__ = [
    "BackwardOrigin",
    "ForwardOrigin",
    "find_backward_origin",
    "find_forward_origin",
    "replay_origin",
    "replayed",
]


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

    ``module`` is the qualified module name (``""`` for the root). ``in_input`` is True when the
    module *received* non-finite values it did not make (typically: the batch itself was bad), False
    when it turned finite inputs into a non-finite output.
    """

    module: str
    module_type: str
    in_input: bool
    nonfinite: int

    def describe(self) -> str:
        name = self.module or "<root module>"
        if self.in_input:
            return (
                f"the input of `{name}` ({self.module_type}) was already non-finite ({self.nonfinite} values)"
            )
        return f"`{name}` ({self.module_type}) produced {self.nonfinite} non-finite values from finite inputs"

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
    """Run the body on detached copies of ``module``'s parameters, restoring the RNG state afterwards."""
    params = {
        n: p.detach().clone().requires_grad_(requires_grad and p.requires_grad)
        for n, p in module.named_parameters()
    }
    rng = RNGState()
    try:
        with torch.nn.utils.stateless._reparametrize_module(module, params):
            yield
    finally:
        rng.restore()


def find_forward_origin(module: nn.Module, run: Callable[[], Any]) -> ForwardOrigin | None:
    """Replay ``run()`` with forward hooks on every submodule and name the first non-finite value.

    Pre-hooks see inputs in call order (parents first), post-hooks see outputs as modules finish
    (children first); whichever event shows a non-finite value first in time wins. Returns ``None``
    when the forward pass stays finite.
    """
    found: list[ForwardOrigin] = []
    names = {m: clean_name(n) for n, m in module.named_modules()}

    def pre(mod: nn.Module, args: Any) -> None:
        if not found:
            bad = _nonfinite(args)
            if bad:
                found.append(ForwardOrigin(names.get(mod, "?"), type(mod).__name__, True, bad))

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        if not found:
            bad = _nonfinite(output)
            if bad:
                found.append(ForwardOrigin(names.get(mod, "?"), type(mod).__name__, False, bad))

    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with Uncompiled(module), replayed(module, requires_grad=False), torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


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

    forward = find_forward_origin(pl_module, run)
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
