"""Hooks that exist only on a sampled step: the scope a sampling monitor measures in.

:class:`ScopedHooks` holds what a scope attaches to the user's model (global module hooks, a
``TorchFunctionMode``, the eager stance for a compiled model) and lets all of it go on :meth:`close`;
:class:`NextCall` makes the scope exactly the next call of a method (the LightningModule's
``training_step``). DeadReLUMonitor and ActivationRangeMonitor build their captures on it.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_gradguard.core.compile import Uncompiled

__all__ = ["NextCall", "ScopedHooks"]


class ScopedHooks(AbstractContextManager[Any]):
    """What a capture scope holds and lets go: global module hooks, a ``TorchFunctionMode``, the eager
    stance for a compiled model (:class:`~lightning_gradguard.monitors.preflight.modules.Uncompiled`) and a pending
    :class:`NextCall`. Subclasses open them in ``__enter__``; :meth:`close` (also ``__exit__``) removes
    them all, idempotently.

    Attributes:
        capturing: the scope is open and measuring.
        left_inert: another ``TorchFunctionMode`` entered after ours was still active when a scope ended:
            ours was left on the stack, inert, rather than popping theirs.
    """

    def __init__(self, model: nn.Module) -> None:
        self.capturing = False
        self.left_inert = False
        self._next_call: NextCall | None = None
        self._mode: Any = None  # the subclass's TorchFunctionMode while a scope is open (with ``live``)
        self._handles: list[RemovableHandle] = []
        self._eager = Uncompiled(model)

    def around_next_call(self, owner: Any, name: str) -> None:
        """Open a scope around the next call of ``owner.<name>`` only (:class:`NextCall`)."""
        self._next_call = NextCall(owner, name, self)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End the current scope now (idempotent): the mode, the hooks and a pending next call go."""
        self._release()

    def _release(self) -> bool:
        """Remove everything; ``False`` when the mode had to be left inert (see ``left_inert``)."""
        self.capturing = False
        if self._next_call is not None:
            self._next_call.remove()
            self._next_call = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._eager.close()
        mode, self._mode = self._mode, None
        if mode is None:
            return True
        mode.live = False
        current = getattr(torch.overrides, "_get_current_function_mode", lambda: mode)()
        if current is mode:
            mode.__exit__(None, None, None)
            return True
        self.left_inert = True  # a mode entered after ours is still active: leave ours, not pop theirs
        return False


class NextCall:
    """The next call of ``owner.<name>`` runs inside ``scope``; later calls are plain again.

    An instance attribute shadows the method and removes itself before the call it wraps (as Lightning's
    forward redirection does), so exactly one call is wrapped, whoever makes it (Lightning's loop, or the
    DDP wrapper's forward redirection). :meth:`remove` takes it away if that call never came. The wrapper
    keeps the method's signature (``functools.wraps``), which Lightning inspects for ``batch_idx``.
    """

    def __init__(self, owner: Any, name: str, scope: AbstractContextManager[Any]) -> None:
        self.owner, self.name = owner, name
        own = vars(owner)
        self._shadowed = (name in own, own.get(name))
        original = getattr(owner, name)

        @functools.wraps(original)
        def once(*args: Any, **kwargs: Any) -> Any:
            if self._wrapper is None:  # a reference someone kept past its one call: a plain call now
                return original(*args, **kwargs)
            self.remove()
            with scope:
                return original(*args, **kwargs)

        # Lightning unwraps one ``__wrapped__`` level to read the signature: let it land where it would
        # without us (a compiled or decorated ``training_step`` has ``(*args, **kwargs)`` one level up)
        once.__wrapped__ = getattr(original, "__wrapped__", original)
        self._wrapper: Any = once
        setattr(owner, name, once)

    def remove(self) -> None:
        """Put the method back (idempotent)."""
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is None or vars(self.owner).get(self.name) is not wrapper:
            return
        had, previous = self._shadowed
        if had:
            setattr(self.owner, self.name, previous)
        else:
            delattr(self.owner, self.name)
