"""Forward hooks on the user's model for the pre-flight checks, and the scope every hook of ours runs in.

* :class:`LeafOutputs`: the last output of a leaf module with the batch's leading dimension (the logits
  of a classifier, the per-sample output the batch-mixing check differentiates);
* :class:`CalledModules`: which modules ran in a forward pass (a parameter without a gradient whose
  module never ran is not a bug of the graph);
* :class:`Uncompiled`: while it is open, ``torch.compile``'d code runs eagerly. Every hook of ours
  (these, :class:`~lightning_gradguard.hooks.capture.ActivationCapture`,
  :class:`~lightning_gradguard.hooks.order.ForwardOrder`) lives inside one, so dynamo never traces a
  hook of ours: no recompile, no graph break, no cache entry added to the user's compiled code.

Both hook classes hold their hook handles; call ``remove()`` in a ``finally``: a hook is never left on the
model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gradguard.functional.stats import clean_name

__all__ = ["CalledModules", "LeafOutputs", "Uncompiled"]

#: the open :class:`Uncompiled` scopes, and how to undo what the first one (and the fallback) changed
_OPEN: list[Uncompiled] = []
_UNDO: list[Callable[[], None]] = []
_SWAPPED: set[int] = set()  # modules whose compiled calls the fallback replaced
_STANCE: list[bool] = [False]  # force_eager is set


class Uncompiled(AbstractContextManager["Uncompiled"]):
    """While open, ``torch.compile``'d code runs eagerly: hooks fire and dynamo traces none of ours.

    With ``torch.compiler.set_stance`` (torch 2.6 and later) the first scope sets the stance
    ``"force_eager"``, which covers a compiled submodule (``torch.compile(net)``, ``net.compile()``), a
    compiled function and a compiled LightningModule alike; dynamo compiles nothing and its caches are left
    as they were. Without it (older torch, or when dynamo refuses because a compiled region is running),
    every compiled call found on ``model`` (an ``OptimizedModule``'s ``forward``, a ``Module.compile()``,
    a compiled method set on an instance) is replaced by its uncompiled original while a scope is open.
    Scopes nest, also out of order: everything comes back when the last one closes. :meth:`open` and
    :meth:`close` are idempotent. Inside code dynamo is tracing it does nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.is_open = False

    def open(self) -> Uncompiled:
        if self.is_open or _is_compiling():
            return self
        self.is_open = True
        _OPEN.append(self)
        if len(_OPEN) == 1 and hasattr(torch.compiler, "set_stance"):
            try:
                stance = torch.compiler.set_stance("force_eager")  # set now; __exit__ puts the prior back
            except RuntimeError:  # a compiled region is running: the fallback below
                pass
            else:
                _STANCE[0] = True
                _UNDO.append(lambda: stance.__exit__(None, None, None))
        if not _STANCE[0]:
            _swap_compiled(self.model)
        return self

    def close(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        _OPEN.remove(self)
        if not _OPEN:
            _STANCE[0] = False
            _SWAPPED.clear()
            while _UNDO:
                _UNDO.pop()()

    def __enter__(self) -> Uncompiled:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _swap_compiled(model: nn.Module) -> None:
    """Replace every compiled call on ``model``'s modules by its original (undone when the scopes close)."""
    for module in model.modules():
        if id(module) in _SWAPPED:
            continue
        _SWAPPED.add(id(module))
        own = vars(module)
        for key, value in list(own.items()):
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if original is not None:  # OptimizedModule.forward, Lightning's compiled forward/training_step
                own[key] = original
                _UNDO.append(functools.partial(own.__setitem__, key, value))
        compiled = own.get("_compiled_call_impl")
        if compiled is not None:  # Module.compile()
            _UNDO.append(functools.partial(own.__setitem__, "_compiled_call_impl", compiled))
            own["_compiled_call_impl"] = None


class LeafOutputs:
    """Forward hooks on every leaf module that keep the last output with a given leading dimension.

    The model runs uncompiled (:class:`Uncompiled`) until :meth:`remove`.
    """

    def __init__(self, module: nn.Module, batch_size: int) -> None:
        self.batch_size = batch_size
        self.last: Tensor | None = None
        self.name: str | None = None
        self.handles = [
            m.register_forward_hook(self._hook(clean_name(name)))
            for name, m in module.named_modules()
            if not any(True for _ in m.children())
        ]
        self._eager = Uncompiled(module).open()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.dim() >= 1 and output.shape[0] == self.batch_size:
                self.last, self.name = output, name

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._eager.close()


class CalledModules:
    """Forward pre-hooks on every sub-module that note which ones ran (``called``: their names).

    The model runs uncompiled (:class:`Uncompiled`) until :meth:`remove`.
    """

    def __init__(self, module: nn.Module) -> None:
        self.called: set[str] = set()
        self.handles = [
            m.register_forward_pre_hook(self._hook(clean_name(name))) for name, m in module.named_modules()
        ]
        self._eager = Uncompiled(module).open()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.called.add(name)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._eager.close()
