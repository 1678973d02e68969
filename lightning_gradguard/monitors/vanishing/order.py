"""The forward order of a model's layers, from one watched forward pass: which layer is first, which last.

Names are no guide to depth (``a_out`` may run last, ``z_in`` first). :class:`ForwardOrder` records the
order in which the layers first run, keyed by the labels the step's norms carry
(:func:`~lightning_gradguard.core.layers.parameter_layers`): a module that is the layer of its parameters
(a ``Linear``, a block's ``LayerNorm``) by a forward pre-hook, and a parameter that is its own layer (one on
the root module, as a ViT's ``cls_token``, or on a container, as ``encoder.pos_embed`` beside
``encoder.blocks``) where a torch function first takes it (a ``TorchFunctionMode``, only when the model has
such parameters). It is meant to watch a single forward pass (in a Lightning callback: attached on the
first training batch, removed before backward) and costs nothing once removed. Works on any ``nn.Module``.
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
from torch.overrides import TorchFunctionMode

from lightning_gradguard.core.layers import parameter_layers, user_name
from lightning_gradguard.core.sampling import ScopedHooks


class ForwardOrder(ScopedHooks):
    """Records, in :attr:`order`, the position at which each layer first runs (layer label -> position).

    The hooks (and the mode, where the model has parameters that are their own layer) are attached on
    construction and stay until :meth:`remove` (or the end of a ``with`` block); a layer that runs again
    keeps its first position.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        #: layer label -> position of its first run (filled while attached)
        self.order: dict[str, int] = {}
        labels = parameter_layers(module)
        own: dict[int, str] = {}  # parameters that are their own layer: ordered where they are first used
        for name, sub in module.named_modules():
            layer, mine = user_name(name), [p for p in sub.parameters(recurse=False) if id(p) in labels]
            if any(labels[id(p)] == layer for p in mine):
                self._handles.append(sub.register_forward_pre_hook(self._hook(layer)))
            own.update({id(p): labels[id(p)] for p in mine if labels[id(p)] != layer})
        self._eager.open()
        if own:
            self._mode = _FirstUse(own, self.order)
            self._mode.__enter__()
        self._open = True

    def _hook(self, name: str) -> Any:
        order = self.order

        def hook(mod: nn.Module, args: Any) -> None:
            order.setdefault(name, len(order))

        return hook

    @property
    def attached(self) -> bool:
        """Whether the hooks are still on the model."""
        return self._open

    def remove(self) -> None:
        """Take every hook (and the mode) off the model (idempotent)."""
        self.close()

    def __enter__(self) -> ForwardOrder:
        return self


class _FirstUse(TorchFunctionMode):
    """Notes the first torch function that takes each watched parameter (as an argument, or in a list)."""

    def __init__(self, params: dict[int, str], order: dict[str, int]) -> None:
        super().__init__()
        self.params, self.order = params, order
        self.live = True  # False once its scope ended (a mode left inert on the stack stays inert)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.live:
            for arg in (*args, *kwargs.values()):
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    label = self.params.get(id(t))
                    if label is not None:
                        self.order.setdefault(label, len(self.order))
        return func(*args, **kwargs)
