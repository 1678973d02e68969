"""The house keeps its shape: layers import only downwards, no circle, no module grows past its limit.

The layers (docs/architecture.md): ``functional`` and ``alerts`` at the bottom, then ``core``, then
``hooks``, then the faces (``callbacks``, ``preflight``, ``tuner``), which never import each other; the
package root and ``callbacks/__init__`` only re-export.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "lightning_gradguard"
LAYERS = {
    "functional": 0,
    "alerts": 0,
    "core": 1,
    "hooks": 2,
    "callbacks": 3,
    "preflight": 3,
    "tuner": 3,
    "report": 3,
}
# re-export only: the package root, and the module paths of before 0.2 kept for imports, CLI configs, pickles
FACADES = {
    "lightning_gradguard",
    "lightning_gradguard.callbacks",
    "lightning_gradguard.callbacks.gradient_check",
    "lightning_gradguard.callbacks.lr_finder",
    "lightning_gradguard.callbacks.overfit_batch",
    "lightning_gradguard.forensics",
}
MODULE_LIMIT, CALLBACK_LIMIT = 400, 300


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """The lightning_gradguard modules ``path`` imports at run time (type-checking-only imports left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_gradguard"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_gradguard"))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _allowed(mine: str, theirs: str | None) -> bool:
    if theirs is None:
        return False
    if mine in ("functional", "alerts"):  # the bottom: imports nothing of ours but itself
        return theirs == mine
    if LAYERS[theirs] == LAYERS["callbacks"]:  # the faces never import each other
        return theirs == mine
    return LAYERS[theirs] <= LAYERS[mine]


def test_every_module_imports_only_its_own_layer_or_lower() -> None:
    graph = _graph()
    assert sum(map(len, graph.values())) > 100  # the rule below is checked on the real graph
    wrong = []
    for module, targets in graph.items():
        if module in FACADES:
            continue
        mine = _layer(module)
        assert mine is not None, f"{module} belongs to no layer: add it to one (docs/architecture.md)"
        wrong += [f"{module} -> {target}" for target in targets if not _allowed(mine, _layer(target))]
    assert not wrong


def test_there_is_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ re-exporting its own modules is not a circle of code
    real = [c for c in circles if not all(m.startswith(c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not real


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_outgrows_its_limit(name: str) -> None:
    path = _modules()[name]
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    defines_callback = any(
        isinstance(node, ast.ClassDef)
        and any(
            ast.unparse(base) in ("Callback", "GradGuardCallback", "PreflightCheck") for base in node.bases
        )
        for node in ast.parse(text).body
    )
    limit = CALLBACK_LIMIT if defines_callback else MODULE_LIMIT
    assert lines <= limit, f"{name}: {lines} lines (limit {limit})"
