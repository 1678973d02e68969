"""The house table of docs/architecture.md names every module of the library, and only modules that exist
(issue 40: package docstrings listed modules long gone; they now point at this table, which this test
holds to the files). A module named in a docs page or a docstring as ``lightning_gradguard.x.y`` exists."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_gradguard"
HOUSE = (ROOT / "docs" / "architecture.md").read_text()
#: modules every monitor package has, which its row does not repeat (the house's intro says what they are)
EVERY_MONITOR = {"__init__", "tags"}


def _rows(first_cell: str) -> dict[str, str]:
    """The house table's rows whose first cell matches ``first_cell``: that cell -> the rest of the row."""
    rows = {}
    for line in HOUSE.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(first_cell, cells[0]):
            rows[cells[0].strip("`")] = " | ".join(cells[1:])
    return rows


def _named(cell: str) -> set[str]:
    """The modules a "modules" cell names: the backticked word that starts each entry (entries are
    separated by ``;`` outside parentheses)."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(cell + ";"):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            entries.append(cell[start:i])
            start = i + 1
    return {m.group(1) for e in entries if (m := re.match(r"\s*`(\w+)`", e))}


def test_every_monitor_module_is_in_the_house_table_and_every_named_one_exists() -> None:
    rows = _rows(r"`monitors/\w+`")
    packages = {p.parent.name for p in (PACKAGE / "monitors").glob("*/__init__.py")}
    assert {r.split("/")[1] for r in rows} == packages
    for row, cells in rows.items():
        files = {p.stem for p in (PACKAGE / row).glob("*.py")} - EVERY_MONITOR
        named = _named(cells.split(" | ")[-1])
        gone, missed = sorted(named - files), sorted(files - named)
        assert named == files, f"{row}: the table names {gone} that do not exist and misses {missed}"


def test_every_core_module_is_in_the_house_table() -> None:
    table = HOUSE.split("`core/`, module by module", 1)[1].split("\n\n", 2)[1]  # the table after the line
    named = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", table, re.M)}
    files = {p.stem for p in (PACKAGE / "core").glob("*.py")} - {"__init__"}
    assert named == files, f"the core table names {sorted(named - files)}, misses {sorted(files - named)}"


def _references() -> set[str]:
    texts = [p.read_text() for p in (ROOT / "docs").glob("*.md")]
    texts += [p.read_text() for p in PACKAGE.rglob("*.py")]
    texts.append((ROOT / "README.md").read_text())
    # a dotted name followed by "/" is a format tag ("lightning_gradguard.spikes/1"), not a module
    dotted = r"lightning_gradguard(?:\.\w+)+(?![\w/])"
    return {m.group(0) for t in texts for m in re.finditer(dotted, t)}


def _has(obj: object, attr: str) -> bool:
    """``obj`` has ``attr``: as an attribute, an annotated field, or one its class sets in a method."""
    if hasattr(obj, attr) or attr in getattr(obj, "__annotations__", {}):
        return True
    return isinstance(obj, type) and f"self.{attr} " in inspect.getsource(obj)


def test_every_dotted_name_in_the_docs_and_docstrings_exists() -> None:
    missing = []
    for ref in sorted(_references()):
        parts = ref.split(".")
        # the longest importable module prefix, then attributes
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                if not _has(obj, attr):
                    missing.append(ref)
                    break
                obj = getattr(obj, attr, None)
            break
        else:
            missing.append(ref)
    assert missing == []
