"""The forward order of a model's layers, from one watched forward pass: which layer is first, which last.

Names are no guide to depth (``a_out`` may run last, ``z_in`` first). :class:`ForwardOrder` puts a
forward pre-hook on every module that owns parameters of its own and records the order in which they
first run. It is meant to watch a single forward pass (in a Lightning callback: attached on the first
training batch, removed before backward) and costs nothing once removed. Works on any ``nn.Module``.
While attached, ``torch.compile``'d code runs uncompiled
(:class:`~lightning_gradguard.core.compile.Uncompiled`): dynamo never traces the hooks.

Example::

    with ForwardOrder(model) as watch:
        model(x)
    watch.order  # {"z_in": 0, "m_mid": 1, "a_out": 2}
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.functional.stats import clean_name


class ForwardOrder:
    """Records, in :attr:`order`, the position at which each parameter-owning module first runs.

    The hooks are attached on construction and stay until :meth:`remove` (or the end of a ``with``
    block); a module that runs again keeps its first position.
    """

    def __init__(self, module: nn.Module) -> None:
        #: module name -> position of its first call (filled while the hooks are attached)
        self.order: dict[str, int] = {}
        self._handles: list[RemovableHandle] = []
        for name, sub in module.named_modules():
            if any(True for _ in sub.parameters(recurse=False)):
                self._handles.append(sub.register_forward_pre_hook(self._hook(clean_name(name))))
        self._eager = Uncompiled(module).open()

    def _hook(self, name: str) -> Any:
        order = self.order

        def hook(mod: nn.Module, args: Any) -> None:
            order.setdefault(name, len(order))

        return hook

    @property
    def attached(self) -> bool:
        """Whether the hooks are still on the model."""
        return bool(self._handles)

    def remove(self) -> None:
        """Take every hook off the model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._eager.close()

    def __enter__(self) -> ForwardOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
