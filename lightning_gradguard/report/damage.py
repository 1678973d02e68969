"""Reading a run folder that may be torn, truncated, planted with links or named with markup.

A run folder is not trusted: a kill, a full disk or a power loss leaves a torn last line, a half-written
file or a truncated event record; other people leave links and names. The report reads what parses and
says what it skipped. Everything here is the one way the report's readers meet a file:

* :class:`Damage` collects what was skipped (:class:`Skipped`: file, line or record, reason) for the page
  and the terminal line;
* :func:`inside` keeps every read inside the run folder (a link out of it is not followed);
* :func:`text_lines` reads a text file line by line (a line that is not UTF-8 is skipped, not the file);
* :func:`event_records` frames a TensorBoard event file record by record, checking each record's checksum
  (a corrupt record is skipped, a truncated tail said);
* :func:`record` turns a parsed JSON object into what the report draws: a finite whole ``step``, every
  string bounded (:data:`MAX_NAME`, :data:`MAX_TEXT`), every list and mapping capped (:data:`MAX_ITEMS`).
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: the longest name the report keeps (a kind, a place, a source, a severity, a tag shown in a picture)
MAX_NAME = 200
#: the longest text it keeps (a message, a hint, any other string of a record)
MAX_TEXT = 4000
#: the most items it keeps of a list or a mapping inside a record
MAX_ITEMS = 1000
#: the most levels of nesting it keeps inside a record
_MAX_DEPTH = 8
#: the fields of a record that are names
NAME_FIELDS = ("kind", "where", "source", "severity")


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis when longer."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


@dataclass(frozen=True)
class Skipped:
    """One thing the report could not read: the file (relative to the run), where in it, and why."""

    file: str
    where: str
    reason: str


@dataclass
class Damage:
    """What the readers of one run skipped, in the order they met it."""

    run: str
    skipped: list[Skipped] = field(default_factory=list)

    def skip(self, path: str, where: str, reason: str) -> None:
        """Note that ``where`` in ``path`` (a line, a record, a row, or the whole file) was skipped."""
        name = os.path.relpath(path, self.run) if os.path.isabs(path) or os.sep in path else path
        self.skipped.append(Skipped(file=clip(name, MAX_NAME), where=where, reason=clip(reason, MAX_NAME)))


def summary(skipped: list[Skipped]) -> str | None:
    """The one terminal line: how many damaged entries were skipped, per file and reason."""
    if not skipped:
        return None
    groups: dict[tuple[str, str], list[str]] = {}
    for s in skipped:
        groups.setdefault((s.file, s.reason), []).append(s.where)
    parts = []
    for (file, reason), wheres in list(groups.items())[:5]:
        more = f" and {len(wheres) - 3} more" if len(wheres) > 3 else ""
        parts.append(f"{file} {', '.join(wheres[:3])}{more}: {reason}")
    rest = f"; and {len(groups) - 5} more kinds of damage" if len(groups) > 5 else ""
    return f"gradguard report: skipped {len(skipped)} damaged entries ({'; '.join(parts)}{rest})"


def inside(run: str, path: str) -> bool:
    """Whether ``path`` resolves to a place inside the run folder ``run`` (no link out of it)."""
    root = os.path.realpath(run)
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def readable(damage: Damage, path: str) -> bool:
    """Whether the report may read ``path``: a regular file inside the run folder (else it is skipped)."""
    if not os.path.lexists(path):
        return False
    if not inside(damage.run, path):
        damage.skip(path, "file", "a link out of the run folder (not followed)")
        return False
    if not os.path.isfile(path):
        damage.skip(path, "file", "not a regular file")
        return False
    return True


def text_lines(damage: Damage, path: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``path`` with their numbers; a line that is not UTF-8 is skipped."""
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    damage.skip(path, f"line {number}", "not UTF-8 text")
                    continue
                if text.strip():
                    yield number, text
    except OSError as err:
        damage.skip(path, "file", f"unreadable ({type(err).__name__}: {err.strerror or err})")


def text_of(damage: Damage, path: str) -> str | None:
    """The whole of ``path`` as text, or ``None`` (skipped) when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError:
        damage.skip(path, "file", "not UTF-8 text")
    except OSError as err:
        damage.skip(path, "file", f"unreadable ({type(err).__name__}: {err.strerror or err})")
    return None


def event_records(damage: Damage, path: str) -> Iterator[bytes]:
    """The records of the TensorBoard event file ``path``, each checked against its checksum (TFRecord
    framing: length, its CRC, data, its CRC). A record whose data fails its checksum is skipped and the
    reading goes on; a header that fails its own (the length cannot be trusted) or a truncated tail ends it,
    with what was left unread."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    try:
        size = os.path.getsize(path)
        fh = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as err:
        damage.skip(path, "file", f"unreadable ({type(err).__name__}: {err.strerror or err})")
        return
    with fh:
        number = 0
        while header := fh.read(12):
            number += 1
            unread = size - fh.tell() + len(header)
            if len(header) < 12 or masked_crc32c(header[:8]) != struct.unpack("<I", header[8:])[0]:
                what = "truncated at the end of the file" if len(header) < 12 else "corrupt record header"
                damage.skip(path, f"record {number}", f"{what}: {unread} bytes left unread")
                return
            (length,) = struct.unpack("<Q", header[:8])
            data, tail = fh.read(length), fh.read(4)
            if len(data) < length or len(tail) < 4:
                damage.skip(
                    path, f"record {number}", f"truncated at the end of the file: {unread} bytes unread"
                )
                return
            if masked_crc32c(data) != struct.unpack("<I", tail)[0]:
                damage.skip(path, f"record {number}", "corrupt: failed its checksum")
                continue
            yield data


#: the largest step the report takes (a float still holds it exactly; an axis can draw it)
MAX_STEP = 2**53


def whole_step(value: Any) -> int | None:
    """``value`` as a step: a whole number from 0 to :data:`MAX_STEP` (``None`` for anything else: NaN,
    inf, a fraction, a string, ``True``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value <= MAX_STEP else None


#: C0 and C1 control characters: a terminal would act on them (clear the screen, move the cursor)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal(text: str) -> str:
    """``text`` as a terminal shows it literally: every control character but tab and newline as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def bounded(value: Any, depth: int = 0) -> Any:
    """``value`` with every string cut to :data:`MAX_TEXT`, every list and mapping to :data:`MAX_ITEMS`
    items, nesting to a few levels; numbers, booleans and ``None`` as they are, anything else as text."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return clip(value)
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(value, dict):
        items = list(value.items())[:MAX_ITEMS]
        return {clip(str(k), MAX_NAME): bounded(v, depth + 1) for k, v in items}
    if isinstance(value, list | tuple):
        return [bounded(v, depth + 1) for v in value[:MAX_ITEMS]]
    return clip(str(value))


def record(
    damage: Damage, path: str, where: str, raw: Any, mappings: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """A parsed JSON object as the report draws it, or ``None`` (skipped, with the reason): an object with a
    whole finite ``step``, every string bounded, the name fields (:data:`NAME_FIELDS`) to
    :data:`MAX_NAME`, and each field of ``mappings`` a mapping (an empty one when it was something else)."""
    if not isinstance(raw, dict):
        damage.skip(path, where, f"not a JSON object (a {type(raw).__name__})")
        return None
    step = whole_step(raw.get("step"))
    if step is None:
        damage.skip(path, where, f"its step is not a whole finite number ({clip(repr(raw.get('step')), 40)})")
        return None
    out: dict[str, Any] = bounded(raw)
    out["step"] = step
    for name in NAME_FIELDS:
        if out.get(name) is not None:
            out[name] = clip(str(out[name]), MAX_NAME)
    for name in mappings:
        if not isinstance(out.get(name), dict):
            out[name] = {}
    return out
