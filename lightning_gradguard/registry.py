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
from lightning_gradguard.tags import ALERT_CHARTS, ALERTS, Chart, Family

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
#: the scalar families, as tag prefixes (``"grad_norm/"``, ...)
SCALAR_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(f.prefix for f in FAMILIES if f.kind == "scalar"))

#: every declared rule, monitor by monitor (imported on first use: the rules modules import torch)
RULES: tuple[Rule, ...]
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


#: the markers docs/alerts.md keeps the generated table between
BEGIN, END = "<!-- alert kinds: begin (generated) -->", "<!-- alert kinds: end -->"
#: the command that rewrites the table (the docs test names it when the page is stale)
REWRITE = "python -m lightning_gradguard.registry docs/alerts.md"


def with_table(page: str) -> str:
    """``page`` with the text between :data:`BEGIN` and :data:`END` replaced by :func:`alerts_table`."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    note = f"<!-- do not edit: declared in monitors/*/rules.py; `{REWRITE}` -->"
    return f"{head}{BEGIN}\n{note}\n\n{alerts_table()}\n{END}{tail}"


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(with_table(text))
