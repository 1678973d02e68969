"""``torch.compile`` and our hooks: :class:`Uncompiled`, the scope every hook of ours runs in.

While an :class:`Uncompiled` scope is open, ``torch.compile``'d code runs eagerly, so dynamo never traces a
hook of ours: no recompile, no graph break, no cache entry added to the user's compiled code. The
sampled-step scopes (:mod:`lightning_gradguard.core.sampling`), the pre-flight checks' hooks, the NaN
replay and the forward-order hooks all open one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

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


def holds_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules runs compiled code (``torch.compile(net)``,
    ``Module.compile()``, a compiled method set on an instance, Lightning's compiled ``forward`` /
    ``training_step``): a hook of ours that fires on every step is not attached to such a model (dynamo
    would trace it into the graph)."""
    for module in model.modules():
        own = vars(module)
        if own.get("_compiled_call_impl") is not None:
            return True
        if any(getattr(v, "_torchdynamo_orig_callable", None) is not None for v in own.values()):
            return True
        if type(module).__name__ == "OptimizedModule":
            return True
    return False


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
