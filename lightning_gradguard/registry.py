"""What the monitors declare, gathered one layer above them: alert kinds, tag families and charts.

Each monitor declares its rules (:class:`~lightning_gradguard.alerts.Rule`, registered with
:func:`~lightning_gradguard.alerts.declare`) in ``monitors/<name>/rules.py`` and its tag families and charts
in ``monitors/<name>/tags.py``; nothing below the monitors may import them, so the gathering is here. The
tags are declarations only: :data:`FAMILIES` and :data:`CHARTS` import no torch (``gradguard report`` reads
them). :data:`RULES` and :data:`ALERT_KINDS` import the rules modules (and so torch) on first use; ``import
lightning_gradguard`` imports neither until ``ALERT_KINDS`` is first used.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import Any

import lightning_gradguard.monitors as monitors
from lightning_gradguard.alerts import Rule, alert_kinds, kinds_table
from lightning_gradguard.tags import ALERT_CHARTS, ALERTS, PER_LAYER, Chart, Family

#: every monitor package, by name (a new monitor's folder is all it takes)
MONITORS = tuple(sorted(m.name for m in pkgutil.iter_modules(monitors.__path__) if m.ispkg))
#: the module declaring each monitor's rules, in the order of the monitors' names
DECLARED_IN = tuple(f"{monitors.__name__}.{m}.rules" for m in MONITORS)
#: the modules declaring the monitors' tags (a monitor that logs nothing has none)
TAGGED_IN = tuple(
    f"{monitors.__name__}.{m}.tags"
    for m in MONITORS
    if importlib.util.find_spec(f"{monitors.__name__}.{m}.tags")
)

#: every tag family a run can hold: the monitors', then the alert counts every callback writes
FAMILIES: tuple[Family, ...] = (*(f for t in TAGGED_IN for f in importlib.import_module(t).FAMILIES), ALERTS)
#: every chart of the "GradGuard" layout
CHARTS: tuple[Chart, ...] = (
    *(c for m in TAGGED_IN for c in importlib.import_module(m).CHARTS),
    *ALERT_CHARTS,
)
#: a chart's ``only`` setting -> the argument that turns it on, in words (each monitor's ``SWITCHES``)
SWITCHES: dict[str, str] = {}
for _m in TAGGED_IN:
    for _only, _words in getattr(importlib.import_module(_m), "SWITCHES", {}).items():
        if SWITCHES.setdefault(_only, _words) != _words:
            raise ValueError(f"chart setting {_only!r}: two monitors word it differently")
#: the scalar families, as tag prefixes (``"grad_norm/"``, ...)
SCALAR_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(f.prefix for f in FAMILIES if f.kind == "scalar"))

#: every declared rule, monitor by monitor (imported on first use: the rules modules import torch)
RULES: tuple[Rule[Any], ...]
#: The stable vocabulary of alert kinds: kind -> one line. Built from the declarations; a kind once released
#: is never renamed.
ALERT_KINDS: dict[str, str]


def __getattr__(name: str) -> Any:
    if name not in ("RULES", "ALERT_KINDS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    rules = tuple(r for m in DECLARED_IN for r in importlib.import_module(m).RULES)
    globals().update(RULES=rules, ALERT_KINDS=alert_kinds(rules))
    return globals()[name]


def alerts_table() -> str:
    """docs/alerts.md's table of kinds, from the declarations."""
    return kinds_table(globals().get("RULES") or __getattr__("RULES"))


def layout_table() -> str:
    """docs/tags.md's table of the "GradGuard" layout (Markdown): one row per declared chart; ``<layer>``
    stands for :data:`~lightning_gradguard.tags.PER_LAYER` (every layer's tag but the totals, aggregates)."""
    lines = ["| chart | tag regex | drawn by |", "|---|---|---|"]
    for c in CHARTS:
        regexes = ", ".join(
            f"`{r.removesuffix(PER_LAYER)}<layer>`" if r.endswith(PER_LAYER) else f"`{r}`" for r in c.regexes
        )
        by = f"`{c.owner}`" + (f", with {SWITCHES[c.only]}" if c.only else "")
        lines.append(f"| {c.title} | {regexes} | {by} |")
    return "\n".join(lines) + "\n"


def callbacks_reference() -> str:
    """docs/reference/callbacks.md's entries (mkdocstrings): the base, then the callbacks each monitor's
    ``callback`` module defines, monitor by monitor (each is exported from the package root: the
    architecture test checks it)."""
    from lightning_gradguard.core.base import GradGuardCallback

    names = [GradGuardCallback.__name__]
    for m in MONITORS:
        module = importlib.import_module(f"{monitors.__name__}.{m}.callback")
        names += [
            name
            for name, obj in vars(module).items()
            if isinstance(obj, type) and issubclass(obj, GradGuardCallback)
            if obj.__module__ == module.__name__ and not name.startswith("_")
        ]
    return "\n".join(f"::: lightning_gradguard.{name}\n" for name in names)


#: the generated tables: marker name -> (what it is built from, the function that builds it)
TABLES = {
    "alert kinds": ("monitors/*/rules.py", alerts_table),
    "layout": ("monitors/*/tags.py", layout_table),
    "callbacks": ("monitors/*/callback.py", callbacks_reference),
}
#: the pages holding generated tables
PAGES = ("docs/alerts.md", "docs/tags.md", "docs/reference/callbacks.md")
#: the command that rewrites the tables (the docs test names it when a page is stale)
REWRITE = "python -m lightning_gradguard.registry " + " ".join(PAGES)


def markers(table: str) -> tuple[str, str]:
    """The comments a page keeps the generated ``table`` between."""
    return f"<!-- {table}: begin (generated) -->", f"<!-- {table}: end -->"


def with_tables(page: str) -> str:
    """``page`` with every generated table it holds (between its :func:`markers`) rebuilt."""
    for table, (source, build) in TABLES.items():
        begin, end = markers(table)
        if begin not in page:
            continue
        head, rest = page.split(begin, 1)
        _, tail = rest.split(end, 1)
        note = f"<!-- do not edit: declared in {source}; `{REWRITE}` -->"
        page = f"{head}{begin}\n{note}\n\n{build()}\n{end}{tail}"
    return page


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:] or PAGES:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(with_tables(text))
