"""Forward hooks the overfit-one-batch check puts on the user's model.

* :class:`LeafOutputs`: the last output of a leaf module with the batch's leading dimension (the logits
  of a classifier, the per-sample output the batch-mixing check differentiates);
* :class:`CalledModules`: which modules ran in a forward pass (a parameter without a gradient whose
  module never ran is not a bug of the graph).

While either is on the model, the model runs uncompiled: each opens an
:class:`~lightning_gradguard.core.compile.Uncompiled` scope, so dynamo never traces a hook of ours (no
recompile, no graph break, no cache entry added to the user's compiled code). Both hold their hook
handles; call ``remove()`` in a ``finally``: a hook is never left on the model.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.functional.stats import clean_name

__all__ = ["CalledModules", "LeafOutputs"]


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
