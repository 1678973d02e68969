"""Griffe extension for `make docs`: the package's docstrings use Sphinx markup inside Google sections.

Rewrites, at build time only (the sources are untouched), what Markdown would show raw:

* roles (``:class:`~a.b.C```, ``:func:`f```, ``:math:`x```...) become code spans (`` `C` ``, `` `f` ``);
* a literal block introduced by ``Example::`` becomes a fenced Python block after ``Example:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]*?)\s*(?:<([^>`]+)>)?`")


def _role(match: re.Match[str]) -> str:
    tilde, text, target = match.groups()
    if target and text:
        return f"`{text}`"
    name = target or text
    return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_blocks(text: str) -> str:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.rstrip().endswith("::") or line.strip() == "::":
            out.append(line)
            continue
        start = i
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > _indent(line)):
            end += 1
        while end > start and not lines[end - 1].strip():
            end -= 1
        if end == start:  # no indented block follows: leave the line alone
            out.append(line)
            continue
        pad, cut = " " * _indent(line), min(_indent(b) for b in lines[start:end] if b.strip())
        out += [line.rstrip()[:-1], "", pad + "```python"]
        out += [pad + b[cut:] if b.strip() else "" for b in lines[start:end]]
        out.append(pad + "```")
        i = end
    return "\n".join(out)


class RstMarkup(griffe.Extension):
    """Rewrites the Sphinx markup of every docstring before mkdocstrings parses it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _literal_blocks(ROLE.sub(_role, obj.docstring.value))
