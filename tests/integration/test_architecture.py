"""The house keeps its shape (docs/architecture.md): monitors in packages of their own, shared code in core.

* Layers import downwards only: ``functional``, ``alerts`` and ``tags`` at the bottom, then ``core``, then
  one package per monitor under ``monitors/`` (a monitor never imports another) and ``report``; the
  package root only re-exports.
* No import circle at all, type-checking imports included.
* ``functional/`` is stateless public math: no hooks, no state, no alert prose.
* A ``core/`` module serves two monitors or more; a module that only re-exports another is a shim.
* No function over 60 lines.
* A kind's string is typed once, in its ``Rule`` declaration; checks return ``alerts.Finding(RULE, ...)``.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "lightning_gradguard"
BOTTOM = ("functional", "alerts", "tags")
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every lightning_gradguard module ``path`` imports, type-checking imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_gradguard"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_gradguard"))
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _home(module: str) -> str:
    """``functional``, ``alerts``, ``tags``, ``core``, ``report``, ``monitors.<name>`` or ``root``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "monitors":
        return ".".join(parts[1:3]) if len(parts) > 2 else "monitors"
    return parts[1]


def _allowed(mine: str, theirs: str) -> bool:
    if mine in BOTTOM:
        return theirs == mine
    if mine == "core":
        return theirs in (*BOTTOM, "core")
    if mine == "report":
        return theirs in (*BOTTOM, "report")
    if mine.startswith("monitors."):  # a monitor never imports another monitor
        return theirs in (*BOTTOM, "core", mine)
    return mine in ("root", "registry")  # the top: the package root and the registry of declared kinds


def test_every_module_imports_only_its_own_layer_or_lower() -> None:
    assert sum(map(len, GRAPH.values())) > 100  # the rule is checked on the real graph
    homes = {_home(m) for m in MODULES}
    assert {"core", "functional", "report", "monitors.nan", "monitors.overfit", "monitors.gradcheck"} <= homes
    wrong = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if not _allowed(_home(module), _home(target)) and not _reads_declarations(module, target)
    ]
    assert not wrong


def _reads_declarations(module: str, target: str) -> bool:
    """``gradguard report`` reads what the monitors declare: their tag modules (declarations only, no torch)
    and the registry that gathers them."""
    declared = target == f"{PACKAGE.name}.registry" or (
        _is_tags_module(target) and target != "lightning_gradguard.tags"
    )
    return _home(module) == "report" and declared


def _is_tags_module(name: str) -> bool:
    return name.endswith(".tags")


def test_a_monitors_tags_are_declarations_only() -> None:
    """``monitors/<name>/tags.py`` imports nothing but the bottom ``tags`` (no torch): the report reads it."""
    declaring = [m for m in MODULES if m.startswith("lightning_gradguard.monitors.") and _is_tags_module(m)]
    assert len(declaring) >= 9
    for name in declaring:
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert imported <= {"__future__", "lightning_gradguard.tags"}, (name, imported)


def test_there_is_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])
    assert not circles


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_longer_than_sixty_lines() -> None:
    long = []
    for name, path in MODULES.items():
        for fn in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1  # docstring included
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{name}.{fn.name}: {lines} lines")
    assert not long


def _functional_sins(tree: ast.Module) -> list[str]:
    sins = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("register_") and "hook" in node.attr:
            sins.append(f"registers a hook ({node.attr})")
        if isinstance(node, ast.Name) and node.id.startswith("register_module_forward"):
            sins.append(f"registers a hook ({node.id})")
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b) for b in node.bases}
            if bases & {"TorchFunctionMode", "TorchDispatchMode", "nn.Module", "Callback"}:
                sins.append(f"{node.name} is a {bases}")
            for fn in _functions(node):
                if fn.name in ("state_dict", "load_state_dict"):
                    sins.append(f"{node.name}.{fn.name}: state")
                if fn.name not in ("__init__", "__post_init__") and any(
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    for stmt in ast.walk(fn)
                    if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                    for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                ):
                    sins.append(f"{node.name}.{fn.name} changes its object: state")
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and ("HINT" in t.id or "MESSAGE" in t.id or "WORDING" in t.id):
                    sins.append(f"alert prose ({t.id})")
    return sins


def test_functional_is_stateless_math_without_hooks_or_prose() -> None:
    found = {
        name: sins
        for name, path in MODULES.items()
        if _home(name) == "functional"
        for sins in [_functional_sins(ast.parse(path.read_text(encoding="utf-8")))]
        if sins
    }
    assert not found


def _users(module: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The monitors that import ``module``, directly or through other core modules."""
    users: set[str] = set()
    for importer, targets in GRAPH.items():
        if module not in targets or importer in seen:
            continue
        home = _home(importer)
        if home.startswith("monitors."):
            users.add(home)
        elif home == "core":
            users |= _users(importer, seen | {module})
    return users


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if _home(m) == "core" and m != "lightning_gradguard.core")
)
def test_every_core_module_serves_two_monitors_or_more(module: str) -> None:
    users = _users(module)
    assert len(users) >= 2, f"{module} serves {sorted(users)}: it belongs in that monitor's package"


#: the packages users import from: only their ``__init__`` lists names in ``__all__``
PUBLIC_INITS = ("lightning_gradguard", "lightning_gradguard.functional", "lightning_gradguard.report")


def test_only_public_packages_declare_all() -> None:
    """``__all__`` is for what users import; an internal module's list is ceremony nobody reads."""
    declaring = []
    for name, path in MODULES.items():
        body = ast.parse(path.read_text(encoding="utf-8")).body
        targets = [ast.unparse(t) for n in body if isinstance(n, ast.Assign) for t in n.targets]
        if "__all__" in targets and name not in PUBLIC_INITS:
            declaring.append(name)
    assert not declaring


def test_an_export_is_registered_once_in_the_package_root() -> None:
    """A public name is one ``_WHERE`` entry of ``lightning_gradguard/__init__.py`` and its typed import
    beside it (for type checkers): the two agree, and ``__all__`` follows from ``_WHERE``."""
    import lightning_gradguard

    typed: dict[str, str | None] = {}
    for node in ast.walk(ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            typed |= {a.name: i.module for i in node.body if isinstance(i, ast.ImportFrom) for a in i.names}
    assert typed == lightning_gradguard._WHERE  # type: ignore[attr-defined]
    assert lightning_gradguard.__all__ == sorted([*typed, "__version__"])


def test_every_monitor_callback_is_exported() -> None:
    """A callback class a monitor's ``callback`` module defines is exported (so its reference entry, which
    the registry builds from the exports, exists)."""
    import importlib
    import inspect

    import lightning_gradguard
    from lightning_gradguard.core.base import GradGuardCallback
    from lightning_gradguard.registry import MONITORS

    missing = []
    for monitor in MONITORS:
        module = importlib.import_module(f"lightning_gradguard.monitors.{monitor}.callback")
        for name, obj in inspect.getmembers(module, inspect.isclass):
            defined_here = obj.__module__ == module.__name__ and not name.startswith("_")
            if (
                defined_here
                and issubclass(obj, GradGuardCallback)
                and name not in lightning_gradguard.__all__
            ):
                missing.append(f"{monitor}: {name}")
    assert not missing, (
        f"add each to _WHERE and the typed imports of lightning_gradguard/__init__.py: {missing}"
    )


def test_no_module_only_re_exports_another() -> None:
    shims = []
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        body = ast.parse(path.read_text(encoding="utf-8")).body
        defines = [
            n
            for n in body
            if not isinstance(n, (ast.Import, ast.ImportFrom))
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # docstring
        ]
        if not defines:
            shims.append(name)
    assert not shims


def test_monitor_packages_hold_no_code_in_their_init() -> None:
    """A monitor's ``__init__`` says what its modules hold; code lives in the modules (no re-export loop)."""
    busy = [
        name
        for name, path in MODULES.items()
        if path.name == "__init__.py"
        and _home(name).startswith(("monitors", "core"))
        and any(not isinstance(n, ast.Expr) for n in ast.parse(path.read_text(encoding="utf-8")).body)
    ]
    assert not busy


def test_state_methods_have_one_name() -> None:
    """A callback's sub-objects keep their checkpoint state through ``state_dict`` / ``load_state_dict``,
    as the callbacks themselves and torch do (not ``state`` / ``load``)."""
    odd = [
        f"{name}.{node.name}.{fn.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        for fn in node.body
        if isinstance(fn, ast.FunctionDef) and fn.name in ("state", "load", "save", "restore_state")
    ]
    assert not odd


#: names a module of a monitor once had for a role that now has one name: what a step or a sampled forward
#: measures is ``measure``, the verdicts and declared kinds are ``rules``
RETIRED_ROLE_NAMES = {"step", "norms", "capture", "sample", "probe", "windows", "verdict"}


def test_every_monitor_names_its_modules_by_role() -> None:
    """One module name per role: a reader finds a monitor's Callback in ``callback``, its measurements in
    ``measure`` (when it measures steps) and its verdicts and kinds in ``rules``, whichever monitor."""
    packages = sorted({p.parent for p in (PACKAGE / "monitors").glob("*/*.py")})
    assert len(packages) >= 11
    for package in packages:
        names = {p.stem for p in package.glob("*.py")}
        assert {"callback", "rules"} <= names, package.name
        assert not names & RETIRED_ROLE_NAMES, (package.name, names & RETIRED_ROLE_NAMES)


def _declared_kinds() -> dict[str, str]:
    """kind -> the module declaring it (``Rule(kind="...")`` in a rules module), read without torch."""
    out: dict[str, str] = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Rule":
                out.update({k.value.value: name for k in node.keywords if k.arg == "kind"})  # type: ignore[attr-defined]
    return out


def _typed_kinds(tree: ast.Module, kinds: Collection[str]) -> list[tuple[int, str]]:
    """The string constants of ``tree`` that spell a declared kind, outside a ``Rule(kind=...)`` and prose."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Rule":
            skip.update(id(k.value) for k in node.keywords if k.arg == "kind")
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # a docstring
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in kinds and id(node) not in skip
    ]


#: strings that spell a kind but name something else: (module, string) -> what it names
NOT_A_KIND = {
    ("lightning_gradguard.core.skips", "loss_spike"): "LossSpikeGuard as the cause of a dropped update",
    ("lightning_gradguard.monitors.stall.callback", "chance_level"): "the chance level's chart tag",
    ("lightning_gradguard.monitors.stall.tags", "chance_level"): "the chance level's chart tag",
    ("lightning_gradguard.monitors.spike.callback", "loss_spike"): "its cause name for a dropped update",
    ("lightning_gradguard.monitors.dead_units.tags", "dead_relu"): "the dead units' tag family",
}


def test_a_kind_is_typed_once_in_its_declaration() -> None:
    """A check returns ``alerts.Finding(RULE, ...)``: the kind's string lives in its ``Rule`` only, so a
    rename or a second spelling cannot drift from the declaration (docs/architecture.md)."""
    kinds = _declared_kinds()
    assert len(kinds) >= 40 and "nonfinite_loss" in kinds  # the walk found the declarations
    typed = [
        (name, line, kind)
        for name, path in MODULES.items()
        for line, kind in _typed_kinds(ast.parse(path.read_text(encoding="utf-8")), kinds)
        if (name, kind) not in NOT_A_KIND
    ]
    assert not typed
