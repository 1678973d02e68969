"""Which modules of the user's model the overfit-one-batch check sees at work, and where.

* :class:`LeafOutputs`: the last output of a leaf module with the batch's leading dimension (the logits
  of a classifier, the per-sample output the batch-mixing check differentiates);
* :class:`CalledModules`: which modules ran in a forward pass (a parameter without a gradient whose
  module never ran is not a bug of the graph);
* :func:`used_outside_training`: the modules that the code of ``validation_step``, ``test_step`` or
  ``predict_step`` names and ``training_step``'s code does not reach (a validation-only head), read from
  the source: nothing runs.

While a hook is on the model, the model runs uncompiled: each opens an
:class:`~lightning_gradguard.core.compile.Uncompiled` scope, so dynamo never traces a hook of ours (no
recompile, no graph break, no cache entry added to the user's compiled code). Both hold their hook
handles; call ``remove()`` in a ``finally``: a hook is never left on the model.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from types import FunctionType
from typing import Any

from torch import Tensor, nn

from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.core.layers import user_name


class _Hooked:
    """Hook handles on a model that runs uncompiled (:class:`Uncompiled`) until :meth:`remove`."""

    def __init__(self, module: nn.Module, handles: list[Any]) -> None:
        self.handles = handles
        self._eager = Uncompiled(module).open()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._eager.close()


class LeafOutputs(_Hooked):
    """Forward hooks on every leaf module that keep the last output with a given leading dimension.

    The model runs uncompiled (:class:`Uncompiled`) until :meth:`remove`.
    """

    def __init__(self, module: nn.Module, batch_size: int) -> None:
        self.batch_size = batch_size
        self.last: Tensor | None = None
        self.name: str | None = None
        leaves = [(name, m) for name, m in module.named_modules() if not any(True for _ in m.children())]
        super().__init__(module, [m.register_forward_hook(self._hook(user_name(n))) for n, m in leaves])

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.dim() >= 1 and output.shape[0] == self.batch_size:
                self.last, self.name = output, name

        return hook


class CalledModules(_Hooked):
    """Forward pre-hooks on every sub-module that note which ones ran (``called``: their names).

    The model runs uncompiled (:class:`Uncompiled`) until :meth:`remove`.
    """

    def __init__(self, module: nn.Module) -> None:
        self.called: set[str] = set()
        modules = module.named_modules()
        super().__init__(module, [m.register_forward_pre_hook(self._hook(user_name(n))) for n, m in modules])

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.called.add(name)

        return hook


#: the steps of a LightningModule that run outside training, in the order a message names them
EVAL_STEPS = ("validation_step", "test_step", "predict_step")

#: code of these packages is not read: it is not the user's (``self.log``, ``nn.Module.forward``)
_LIBRARIES = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics"})

#: one function to read: the module its ``self`` is, that module's qualified name, the function
_Code = tuple[nn.Module, str, FunctionType]


def used_outside_training(pl_module: nn.Module) -> dict[str, str]:
    """The sub-modules that code run only outside training names: qualified name -> the step.

    Reads the source of ``validation_step``, ``test_step`` and ``predict_step`` and of the methods they
    call on ``self`` or on a sub-module (``self.helper(x)``, ``self(x)``, ``super().validation_step(...)``,
    ``self.model.evaluate(x)``), transitively, and keeps the functions ``training_step`` does not reach
    the same way. A sub-module they name (``self.aux(x)``, ``self.heads["aux"]``, ``self.aux.weight``)
    counts with everything under it. Static: nothing runs, so the run is left exactly as it was. A
    function without readable source (built in a notebook cell that is gone, compiled) names nothing.
    """
    training = _reach(pl_module, "training_step")
    used: dict[str, str] = {}
    for step in EVAL_STEPS:
        for code, names in _reach(pl_module, step).items():
            if code not in training:
                for name in names:
                    used.setdefault(name, step)
    return used


def _users(fn: Any) -> FunctionType | None:
    """``fn`` (a property's getter) when it is a plain Python function of the user's code, else ``None``."""
    fn = fn.fget if isinstance(fn, property) else fn
    if not isinstance(fn, FunctionType):
        return None
    package = (getattr(fn, "__module__", None) or "").split(".")[0]
    return None if package in _LIBRARIES else fn


def _reach(root: nn.Module, entry: str) -> dict[tuple[str, FunctionType], set[str]]:
    """Every function reached from ``root``'s method ``entry``, by (module name, function): the
    sub-modules it names."""
    start = _users(inspect.getattr_static(type(root), entry, None))
    todo: list[_Code] = [(root, "", start)] if start is not None else []
    reached: dict[tuple[str, FunctionType], set[str]] = {}
    while todo:
        owner, path, fn = todo.pop()
        if (path, fn) in reached:
            continue
        reached[(path, fn)] = set()
        tree = _parse(fn)
        if tree is not None:
            reached[(path, fn)] = _scan(tree, owner, path, fn, todo)
    return reached


def _parse(fn: FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of ``fn``'s definition, or ``None`` without readable source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _scan(
    tree: ast.FunctionDef | ast.AsyncFunctionDef,
    owner: nn.Module,
    path: str,
    fn: FunctionType,
    todo: list[_Code],
) -> set[str]:
    """The sub-modules of ``owner`` that ``fn`` names; the methods it calls go to ``todo``."""
    args = [*tree.args.posonlyargs, *tree.args.args]
    if not args:
        return set()
    me, names = args[0].arg, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == me:
            forward = _users(inspect.getattr_static(type(owner), "forward", None))
            if forward is not None:
                todo.append((owner, path, forward))  # self(x)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_super(node.func):
            todo.extend((owner, path, f) for f in _overridden(type(owner), fn, node.func.attr))
    for parts in _chains(tree, me):
        name = _resolve(owner, path, parts, todo)
        if name is not None:
            names.add(name)
    return names


def _is_super(func: ast.Attribute) -> bool:
    """``super().name``."""
    return (
        isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
    )


def _overridden(cls: type, fn: FunctionType, name: str) -> Iterator[FunctionType]:
    """The user's definitions of ``name`` in ``cls``'s MRO after the class that defines ``fn``."""
    mro = cls.__mro__
    here = next((i for i, c in enumerate(mro) if any(v is fn for v in vars(c).values())), None)
    for c in mro[here + 1 :] if here is not None else ():
        found = _users(vars(c).get(name))
        if found is not None:
            yield found
            return


def _chains(tree: ast.AST, me: str) -> Iterator[list[str | None]]:
    """Every longest chain ``me.a.b["c"][i]`` in ``tree``, as its parts (``None``: a subscript that is
    not a constant, where the chain stops)."""
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, (ast.Attribute, ast.Subscript))}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Subscript)) or id(node) in inner:
            continue
        parts: list[str | None] = []
        cur: ast.expr = node
        while isinstance(cur, (ast.Attribute, ast.Subscript)):
            if isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
            else:
                key = cur.slice.value if isinstance(cur.slice, ast.Constant) else None
                parts.append(str(key) if isinstance(key, (str, int)) and not isinstance(key, bool) else None)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id == me:
            yield parts[::-1]


def _resolve(owner: nn.Module, path: str, parts: list[str | None], todo: list[_Code]) -> str | None:
    """The deepest sub-module a chain of ``owner`` names (``None``: none, or a method it calls on one,
    which goes to ``todo`` instead)."""
    cur, name = owner, None
    for part in parts:
        if part is None:
            break
        child = cur._modules.get(part)
        if child is not None:
            cur, path = child, f"{path}.{part}" if path else part
            name = path
            continue
        method = _users(inspect.getattr_static(type(cur), part, None))
        if method is not None:
            todo.append((cur, path, method))  # self.model.evaluate(x): what the method names counts
            return None
        break
    return name
