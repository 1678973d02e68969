"""Activation capture: what every ReLU (and sigmoid/tanh) of one forward pass did, per unit, on the device.

:class:`ActivationCapture` is a context manager: on entry it pushes a ``TorchFunctionMode`` and registers
global module forward hooks, on exit it removes both, so they exist only inside its scope. The scope is
also an :class:`~lightning_gradguard.core.compile.Uncompiled` one: ``torch.compile``'d code runs eagerly
inside it, so dynamo never traces (nor recompiles for) the mode and the hooks. Inside, it
watches each ReLU output (``nn.ReLU``, ``nn.ReLU6``, in-place ReLUs, and ``F.relu`` / ``torch.relu`` /
``Tensor.relu`` called inside any ``forward``) and, on request, each ``sigmoid`` / ``tanh`` input, and
keeps one :class:`~lightning_gradguard.monitors.dead_units.rules.UnitCounts` per layer (counted by
:func:`~lightning_gradguard.functional.health.activity_counts` /
:func:`~lightning_gradguard.functional.health.saturation_counts`, pooled over the capture's scopes; nothing
leaves the device). :meth:`ActivationCapture.around_next_call` makes the scope exactly the next call of a
method (a LightningModule's ``training_step``, see :class:`NextCall`).

Naming: a functional call is named after the module whose ``forward`` made it and the child whose output it
got (``"encoder.block3:relu(fc1)"``; at the root ``"relu(hidden1)"``), a ReLU module by its own name; a
name reached twice in one forward pass (one scope) gets ``#2``, ``#3``. Calls outside every module's
``forward`` (loss code) and outputs with fewer than 2 dimensions are not layers and are not recorded
(:attr:`ActivationCapture.outside_seen` says the former were seen). The recompute of activation
checkpointing during backward is not seen: autograd runs it without the caller's function modes.

Example::

    capture = ActivationCapture(model)
    with capture:
        model(x)
    {key: (r.counts == 0).float().mean() for key, r in capture.records.items() if not r.saturation}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.sampling import ScopedHooks
from lightning_gradguard.core.state import strict_mode
from lightning_gradguard.functional.health import activity_counts, saturation_counts, unit_dim
from lightning_gradguard.monitors.dead_units.rules import UnitCounts, pool

#: what :class:`ActivationCapture` says (through its ``warn``) when it cannot see everything
OUTSIDE_MODULES = (
    "ReLU/sigmoid/tanh calls outside every module's forward (loss code in training_step, or a model called "
    "as self.forward(x) instead of self(x)) are not watched."
)
MODE_ORDER = (
    "another TorchFunctionMode is active above its capture mode; the capture mode is left inert on the stack."
)

F = nn.functional

#: functions whose output is a ReLU output (``nn.ReLU`` calls ``F.relu``; ``nn.ReLU6`` calls ``F.hardtanh``)
_RELU_FUNCS: dict[Any, str] = {
    F.relu: "relu",
    F.relu_: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    torch.Tensor.relu: "relu",
    torch.Tensor.relu_: "relu",
    F.relu6: "relu6",
}
#: functions whose input decides saturation
_SATURATING_FUNCS: dict[Any, str] = {
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.Tensor.sigmoid: "sigmoid",
    torch.Tensor.sigmoid_: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    torch.Tensor.tanh: "tanh",
    torch.Tensor.tanh_: "tanh",
}
#: activation modules whose own name is the layer name (a functional call elsewhere is named "<module>:<fn>")
_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid, nn.Tanh)
#: modules whose outputs are channel-first (units along dimension 1)
_CHANNEL_FIRST = (_ConvNd, _BatchNorm, _InstanceNorm, nn.GroupNorm)
_UNITS_LAST = (nn.Linear, nn.LayerNorm, nn.Embedding, nn.RNNBase, nn.MultiheadAttention)


def _hardtanh_is_relu6(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    low = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
    return float(low) == 0.0


class _Mode(TorchFunctionMode):
    """Sees every torch function called inside the capture's scope; hands the watched ones to it."""

    def __init__(self, capture: ActivationCapture) -> None:
        super().__init__()
        self.capture = capture
        self.live = True  # False once its scope ended (a mode left inert on the stack stays inert)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if not (self.live and capture.capturing):
            return func(*args, **kwargs)
        try:
            relu = _RELU_FUNCS.get(func)
            sat = None if relu is not None else _SATURATING_FUNCS.get(func)
        except TypeError:  # an unhashable callable
            return func(*args, **kwargs)
        if relu is None and func is F.hardtanh and _hardtanh_is_relu6(args, kwargs):
            relu = "relu6"
        if sat is not None and capture.check_saturation and args and isinstance(args[0], Tensor):
            capture._safe_record(sat, args[0], saturation=True)
        out = func(*args, **kwargs)
        if relu is not None and isinstance(out, Tensor):
            capture._safe_record(relu, out, saturation=False)
        return out


class ActivationCapture(ScopedHooks):
    """Records the watched activations of ``model``'s forward passes inside ``with capture:``.

    Each scope is one forward pass (names with ``#2`` restart in each); the records of successive scopes
    are pooled per layer (:func:`~lightning_gradguard.monitors.dead_units.rules.pool`: the micro-batches of
    one optimizer step). :meth:`close` ends the current scope early (before a backward pass that runs
    inside it, as in manual optimization); leaving the ``with`` block ends it in any case, also on an
    exception. Entering a scope that is already open does nothing.

    Args:
        model: the module whose submodule names name the layers (others are named ``<TypeName>``).
        check_saturation: also record ``sigmoid`` / ``tanh`` inputs.
        warn: called as ``warn(key, message)`` when a scope ends that missed something: ``"outside_modules"``
            (:data:`OUTSIDE_MODULES`) or ``"mode_order"`` (:data:`MODE_ORDER`); the caller says it once.
        watch: which layers (by name) are measured; the others cost a name lookup (``None``: all).

    Attributes:
        records: per layer name, its :class:`~lightning_gradguard.monitors.dead_units.rules.UnitCounts`, in
            the order the layers were first reached.
        outside_seen: a watched call was made outside every module's ``forward`` (not recorded).
        error: what stopped the recording (an activation we could not measure); the records are partial.
        left_inert: another ``TorchFunctionMode`` entered after ours was still active when a scope ended:
            ours was left on the stack, inert, rather than popping theirs.
    """

    def __init__(
        self,
        model: nn.Module,
        check_saturation: bool = True,
        warn: Callable[[str, str], None] | None = None,
        watch: Callable[[str], bool] | None = None,
    ) -> None:
        self.model = model
        self.watch = watch  # which layer names are measured (None: all)
        self.check_saturation = check_saturation
        self.warn = warn
        super().__init__(model)
        self.records: dict[str, UnitCounts] = {}
        self.outside_seen = False
        self.error: Exception | None = None
        self._names: dict[int, str] = {}
        # modules whose forward is running: [name, is an activation module, last child that finished]
        self._stack: list[list[Any]] = []
        self._channel_first = False
        self._calls: dict[str, int] = {}

    def __enter__(self) -> ActivationCapture:
        if self._open:
            return self
        self._open = True
        self._names = {id(m): user_name(name) for name, m in self.model.named_modules()}
        self._stack, self._calls, self._channel_first = [], {}, False  # names (``#2``) restart each pass
        self._eager.open()  # torch.compile'd code runs eagerly in the scope: dynamo never sees our hooks
        self._handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()
        self.capturing = self.error is None
        return self

    def close(self) -> None:
        """End the current scope now (idempotent): the mode, the hooks and a pending next call go."""
        if not self._release():
            self._say("mode_order", MODE_ORDER)
        if self.outside_seen:
            self._say("outside_modules", OUTSIDE_MODULES)

    def _say(self, key: str, message: str) -> None:
        if self.warn is not None:
            self.warn(key, message)

    # ------------------------------------------------------------------ during the forward pass
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module), f"<{type(module).__name__}>")
        self._stack.append([name, isinstance(module, _ACTIVATION_MODULES), None])

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            done = self._stack.pop()[0]
            if self._stack:  # the caller's latest finished child: what a functional ReLU most likely eats
                self._stack[-1][2] = done
        if isinstance(module, _CHANNEL_FIRST):
            self._channel_first = True
        elif isinstance(module, _UNITS_LAST):
            self._channel_first = False

    def _safe_record(self, fn: str, x: Tensor, saturation: bool) -> None:
        """:meth:`_record`, run inside the user's forward pass: a failure of ours must not break it.

        An activation we cannot measure (a tensor subclass, an exotic layout) stops the recording and is
        kept in :attr:`error` (the caller then skips what was captured).
        """
        try:
            self._record(fn, x, saturation)
        except Exception as err:
            if strict_mode():
                raise
            self.capturing = False
            self.error = err

    def _record(self, fn: str, x: Tensor, saturation: bool) -> None:
        # Only layers are watched: a call outside every module's ``forward`` is loss or glue code in
        # ``training_step`` (a hinge loss ``F.relu(1 - y * f(x))`` outputs 0 exactly when it is satisfied),
        # and a tensor with fewer than 2 dimensions has no unit axis (one value per sample, or a scalar).
        if x.dim() < 2 or not x.is_floating_point():
            return
        if not self._stack:
            self.outside_seen = True
            return
        top, is_activation, producer = self._stack[-1]
        if is_activation:
            base = top
        else:  # a functional call: named by the calling module and the child whose output it got
            if producer and top and producer.startswith(top + "."):
                producer = producer[len(top) + 1 :]
            call = f"{fn}({producer})" if producer else fn
            base = f"{top}:{call}" if top else call
        n = self._calls[base] = self._calls.get(base, 0) + 1
        key = base if n == 1 else f"{base}#{n}"
        if self.watch is not None and not self.watch(key):
            return
        dim = unit_dim(x.dim(), self._channel_first and x.dim() >= 3)
        if saturation:
            counts, per_unit = saturation_counts(x, fn, dim)
        else:
            counts, per_unit = activity_counts(x, dim)
        pool(self.records, {key: UnitCounts(saturation=saturation, counts=counts, samples=per_unit)})
