"""Every alert kind the monitors declare, gathered one layer above them: ``ALERT_KINDS`` and the docs table.

Each monitor declares its rules in its own folder (:class:`~lightning_gradguard.alerts.Rule`, registered
with :func:`~lightning_gradguard.alerts.declare`); nothing below the monitors may import them, so the
gathering is here. Importing this module imports those declaration modules (and so torch); ``import
lightning_gradguard`` does not import it until ``ALERT_KINDS`` is first used.
"""

from __future__ import annotations

import importlib
import pkgutil

import lightning_gradguard.monitors as monitors
from lightning_gradguard.alerts import Rule, alert_kinds, kinds_table

#: the module declaring each monitor's rules: every ``monitors/<name>/rules.py``, found (a new monitor's
#: folder is all it takes), in the order of the monitors' names
DECLARED_IN = tuple(
    f"{monitors.__name__}.{m.name}.rules"
    for m in sorted(pkgutil.iter_modules(monitors.__path__), key=lambda m: m.name)
    if m.ispkg
)

#: every declared rule, monitor by monitor
RULES: tuple[Rule, ...] = tuple(r for m in DECLARED_IN for r in importlib.import_module(m).RULES)

#: The stable vocabulary of alert kinds: kind -> one line. Built from the declarations; a kind once released
#: is never renamed.
ALERT_KINDS: dict[str, str] = alert_kinds(RULES)


def alerts_table() -> str:
    """docs/alerts.md's table of kinds, from the declarations."""
    return kinds_table(RULES)


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
