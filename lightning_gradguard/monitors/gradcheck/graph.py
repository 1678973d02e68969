"""The model under a gradient check: its float64 copy, and which module made which part of its graph.

The gradient check (:mod:`~lightning_gradguard.monitors.gradcheck.engine`) targets the modules most
likely to have a wrong backward: those whose forward applies a custom ``torch.autograd.Function`` or that
carry a backward hook. :class:`GraphOwners` attributes every autograd node to the innermost module whose
forward created it (forward hooks, removed right after); :func:`find_custom_functions` exposes the
detection on any module and closure. :func:`copy64` makes the float64 copy the check works on (taken off
``torch.compile`` by :func:`uncompiled`, with dropout and spectral norm's power iteration switched off),
and :class:`Float64Mode` keeps a loss computation in float64 when it makes lower-precision tensors itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_gradguard.functional.tree import tensors_in


def _is_custom_node(node: Any) -> bool:
    from torch.autograd.function import BackwardCFunction

    return isinstance(node, BackwardCFunction) and type(node).__name__ != "BackwardHookFunctionBackward"


class GraphOwners:
    """Forward hooks that attribute every autograd node to the innermost module whose forward created it.

    When a module's forward starts, every node reachable from its inputs that nobody owns yet belongs to
    the module that is running (its parent, or "" outside any module); when it ends, every new node
    reachable from its outputs belongs to it. Children end before their parent, so a node goes to the
    innermost module. Nodes made outside any module (e.g. the loss in ``training_step``) belong to ``""``.
    """

    def __init__(self, root: nn.Module) -> None:
        self.owner: dict[Any, str] = {}
        self.stack: list[str] = []
        self.handles: list[Any] = []
        for name, m in root.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name)))

    def claim(self, obj: Any, owner: str) -> None:
        todo = [t.grad_fn for t in tensors_in(obj) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.owner:
                continue
            self.owner[node] = owner
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.claim(args, self.stack[-1] if self.stack else "")
            self.stack.append(name)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.claim(output, name)
            if self.stack:
                self.stack.pop()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def upstream_parameters(self, targets: list[str], names: dict[str, nn.Module]) -> set[int]:
        """``id`` of every leaf tensor whose gradient passes through a hand-written backward in ``targets``.

        The walk starts at the custom-Function and backward-hook nodes created inside each target (a
        target with neither and no parameters of its own: at every node it created) and follows the
        graph to the leaves.
        """
        from torch.autograd.function import BackwardCFunction

        todo: list[Any] = []
        for t in targets:
            own = [n for n, o in self.owner.items() if t == "" or o == t or o.startswith(t + ".")]
            custom = [n for n in own if isinstance(n, BackwardCFunction)]
            has_params = any(True for _ in names[t].parameters())
            todo.extend(custom if custom or has_params else own)
        seen: set[int] = set()
        found: set[int] = set()
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if isinstance(variable, Tensor):
                found.add(id(variable))
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return found

    def custom_functions(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for node, owner in self.owner.items():
            if _is_custom_node(node):
                name = type(node).__name__.removesuffix("Backward")
                if name not in found.setdefault(owner, []):
                    found[owner].append(name)
        return found


def find_custom_functions(module: nn.Module, closure: Callable[[], Any]) -> dict[str, list[str]]:
    """Which module's forward applies which custom ``torch.autograd.Function``.

    Runs ``closure()`` (which must call ``module`` and return its output or loss) with forward hooks on
    every sub-module, walks the autograd graph of what it returns, and maps every node of a custom
    ``Function`` (a ``BackwardCFunction``) to the innermost module whose forward created it (``""``:
    the root module or code outside any module).

    Returns:
        ``{module name: [Function class names]}``.
    """
    owners = GraphOwners(module)
    try:
        out = closure()
        owners.claim(out, "")
    finally:
        owners.remove()
    return owners.custom_functions()


def has_backward_hooks(m: nn.Module) -> bool:
    """Whether ``m`` carries a backward hook or a backward pre-hook."""
    return bool(m._backward_hooks) or bool(getattr(m, "_backward_pre_hooks", None))


#: casts of a tensor to a lower floating precision, kept in float64 under :class:`Float64Mode`
_LOWER_CASTS = frozenset({Tensor.float, Tensor.half, Tensor.bfloat16})
#: ops whose dtype argument reinterprets the bits (``x.view(torch.int32)``): never rewritten
_BIT_VIEWS = frozenset({Tensor.view})


def _float64_dtype(value: Any) -> Any:
    """``value`` with a floating ``torch.dtype`` of lower precision replaced by float64."""
    if isinstance(value, torch.dtype) and value.is_floating_point and value != torch.float64:
        return torch.float64
    return value


class Float64Mode(TorchFunctionMode):
    """Every floating-point tensor stays in float64; ``promoted`` says if the code asked for less.

    The model is copied to float64, but code in ``training_step`` often makes float32 tensors of its own
    (``logits.float()`` for a loss in float32, ``torch.zeros(n)``, ``.to(torch.float32)``), and models
    compute parts in float32 on purpose (``softmax(x, dtype=torch.float32)`` in Bloom's attention, norms in
    float32): a loss that passes through one is rounded to float32, and finite differences at
    ``eps = 1e-6`` then measure rounding noise, not the gradient (a healthy MLP whose loss takes
    ``logits.float()`` was a 1-88 % mismatch; a healthy Bloom 1e-3 to 9e-2 on a dozen tensors). So a cast
    to a lower floating precision is not made (``.float()`` / ``.half()`` / ``.bfloat16()`` of a float64
    tensor return it as it is), every op asked for a lower floating dtype (``.to()``, ``softmax(...,
    dtype=...)``, ``torch.zeros(..., dtype=...)``) gets float64 instead (but ``Tensor.view``, which
    reinterprets bits), and any other op's lower-precision output (a new ``torch.zeros(n)``) comes back in
    float64.
    """

    def __init__(self) -> None:
        super().__init__()
        self.promoted = False

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _LOWER_CASTS and args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            self.promoted = True
            return args[0]
        if func not in _BIT_VIEWS:  # every op that is asked for a lower precision computes in float64
            kept = (tuple(_float64_dtype(a) for a in args), {k: _float64_dtype(v) for k, v in kwargs.items()})
            if kept != (tuple(args), kwargs):  # a lower precision was asked for: the mode must stay on
                self.promoted = True
            args, kwargs = kept
        return self._to64(func(*args, **kwargs))

    def _to64(self, out: Any) -> Any:
        if isinstance(out, Tensor):
            if out.is_floating_point() and out.dtype != torch.float64:
                self.promoted = True
                return out.double()
            return out
        if type(out) in (tuple, list):
            return type(out)(self._to64(o) for o in out)
        return out


def copy64(module: nn.Module) -> nn.Module:
    """A float64 deep copy in train mode, with dropout and spectral norm's power iteration switched off.

    A deep copy drops a ``LightningModule``'s trainer: the loss closure of the caller puts it back. The
    copy is uncompiled (:func:`uncompiled`): the check never runs the user's compiled code.
    """
    clone = uncompiled(copy.deepcopy(module))
    clone.to(torch.float64)
    clone.train()
    for m in clone.modules():
        if isinstance(m, (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)):
            m.eval()
        if power_iterates(m):
            m.eval()
    return clone


def uncompiled(module: nn.Module) -> nn.Module:
    """``module`` with what ``torch.compile`` added taken off, in place; the unwrapped root is returned.

    An ``OptimizedModule`` (``torch.compile(net)``) is replaced by its ``_orig_mod`` (names lose their
    ``_orig_mod.`` part), ``Module.compile()`` is undone, and a compiled method set on an instance (Lightning
    compiles a LightningModule's ``forward`` and ``*_step`` that way) gives way to the class's. Meant for a
    copy: a deep copy keeps the compiled callables of the *original* (functions are not copied), which
    would run the original's weights, not the copy's.
    """
    while _compiled_wrapper(module):
        module = module._orig_mod  # type: ignore[assignment]
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            inner = child
            while _compiled_wrapper(inner):
                inner = inner._orig_mod  # type: ignore[assignment]
            if inner is not child:
                setattr(parent, name, inner)
        own = vars(parent)
        if own.get("_compiled_call_impl") is not None:
            own["_compiled_call_impl"] = None
        for key in [k for k, v in own.items() if hasattr(v, "_torchdynamo_orig_callable")]:
            del own[key]
    return module


def _compiled_wrapper(module: nn.Module) -> bool:
    """``torch.compile(net)``'s ``OptimizedModule`` (not imported: importing dynamo is slow)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        module._modules.get("_orig_mod"), nn.Module
    )


def power_iterates(m: nn.Module) -> bool:
    """A spectral-norm module: in train mode each forward runs a power-iteration step under ``no_grad``.

    Training differentiates ``W / (u^T W v)`` with ``u, v`` held constant; in eval mode the forward *is*
    that function of ``W`` (no iteration step), so the comparison with finite differences is exact.
    """
    from torch.nn.utils.spectral_norm import SpectralNorm

    return type(m).__name__ == "_SpectralNorm" or any(
        isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()
    )
