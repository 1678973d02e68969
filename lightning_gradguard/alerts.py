"""Alerts: one record for every finding, the sinks they go to, and the error types.

Every callback reports what it finds as an :class:`Alert`. The alert is appended to the callback's
``alerts`` list and fanned out to the sinks: Python logging (logger ``lightning_gradguard``), TensorBoard
(a Markdown row under the ``gradguard/alerts`` text tag plus a per-kind count scalar ``alerts/<kind>``)
and a JSON-lines file beside the run's logs. What happens next is the callback's ``action``:
``"warn"`` (only report), ``"stop"`` (ask the trainer to stop) or ``"raise"`` (raise a
:class:`GradGuardError` subclass from the hook).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

log = logging.getLogger("lightning_gradguard")


class _FallbackHandler(logging.StreamHandler):
    """Prints our records to stderr while the application has configured no logging at all.

    Python's own last resort shows only warnings, so a user who never set up logging would not see that
    a pre-flight check passed or that a sweep was skipped. As soon as the root logger or our own logger
    has another handler (``logging.basicConfig``, pytest's capture, a framework's or the user's set-up),
    this one steps aside and the records reach that handler, printed once.
    """

    def emit(self, record: logging.LogRecord) -> None:
        configured = logging.getLogger().handlers or any(h is not self for h in log.handlers)
        if not configured:
            super().emit(record)


if not any(isinstance(h, _FallbackHandler) for h in log.handlers):
    log.addHandler(_FallbackHandler())
if log.level == logging.NOTSET:  # INFO lines (a check passed, a sweep skipped) are part of what we say
    log.setLevel(logging.INFO)

Severity = Literal["info", "warning", "error", "critical"]
SEVERITIES: tuple[str, ...] = ("info", "warning", "error", "critical")
ACTIONS: tuple[str, ...] = ("warn", "stop", "raise")


#: what one check of a monitor judges: what it measured and what its rules remember
E = TypeVar("E")
E_contra = TypeVar("E_contra", contravariant=True)


class Check(Protocol[E_contra]):
    """A rule's check: the one shape every check has. It reads the monitor's evidence (one dataclass per
    monitor: what one check measured and what its rules remember) and returns the finding that holds, in
    words, or ``None``. A rule judged per place (a layer, a group of parameters) may find several: it
    returns them in a sequence, each reported on its own (its own cooldown).
    """

    def __call__(self, evidence: E_contra, /) -> Finding | Sequence[Finding] | None: ...


@dataclass(frozen=True)
class Rule(Generic[E]):
    """One alert kind as a monitor declares it, in its own folder: the one place its words live.

    ``lightning_gradguard.ALERT_KINDS`` (kind -> ``summary``) and docs/alerts.md's table of kinds (kind,
    ``severities``, ``monitor``, ``when``) are built from these declarations; a monitor that reports a
    kind it did not declare fails under ``GRADGUARD_STRICT=1``.

    Attributes:
        kind: the stable string alerts carry (never renamed once released).
        severity: the severity it is reported at (the first of ``severities``).
        monitor: the class name of the callback that reports it (the alert's ``source``).
        summary: one line: what it means (the value of ``ALERT_KINDS``).
        when: the docs table's "when" cell (Markdown): the condition, its thresholds and figures.
        also: the other severities it may be reported at (``loss_spike``: error when it raised).
        where: what the alert points at, for rules whose place does not change ("lr_scheduler").
        hint: the fix, for rules whose hint does not depend on the numbers.
        cause: the rule names a cause (a symptom rule defers to a cause found).
        thresholds: the names of the monitor's thresholds the check reads.
        check: the check itself (:class:`Check`): the monitor runs its rules from their declarations
            (``GradGuardCallback.run_rules``), in their declared order.
    """

    kind: str
    severity: Severity
    monitor: str
    summary: str
    when: str = ""
    also: tuple[Severity, ...] = ()
    where: str | None = None
    hint: str = ""
    cause: bool = False
    thresholds: tuple[str, ...] = ()
    check: Check[E] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for s in (self.severity, *self.also):
            if s not in SEVERITIES:
                raise ValueError(f"{self.kind}: `severity` must be one of {SEVERITIES}, got {s!r}")
        if not _KIND.fullmatch(self.kind) or not self.summary or "\n" in self.summary:
            raise ValueError(f"{self.kind!r}: a kind is snake_case and its summary one line")

    @property
    def severities(self) -> tuple[Severity, ...]:
        """Every severity it may be reported at, the usual one first."""
        return (self.severity, *self.also)

    def findings(self, evidence: E) -> list[Finding]:
        """What its check finds in ``evidence``: none, one, or one per place."""
        found = None if self.check is None else self.check(evidence)
        if found is None:
            return []
        return [found] if isinstance(found, Finding) else list(found)


@dataclass(frozen=True)
class Finding:
    """A rule that holds, in words: what a check returns. Its kind is the rule's; its severity, place and
    hint are the rule's unless the check states its own (a severity the rule declares in ``also``, the
    layer it found, a hint with the numbers in it).

    Attributes:
        rule: the declaration that held.
        message: what was seen, with the numbers.
        data: the numbers behind the message.
        hint: the check's own wording of the fix; empty: the rule's ``hint``.
        where: the place; ``None``: the rule's ``where``.
        severity: one of the rule's ``severities``; ``None``: its usual one.
    """

    rule: Rule[Any]
    message: str
    data: dict[str, float] = field(default_factory=dict)
    hint: str = ""
    where: str | None = None
    severity: Severity | None = None

    def __post_init__(self) -> None:
        if self.severity is None:
            object.__setattr__(self, "severity", self.rule.severity)
        elif self.severity not in self.rule.severities:
            raise ValueError(f"{self.rule.kind} is declared {self.rule.severities}, not {self.severity!r}")
        if self.where is None:
            object.__setattr__(self, "where", self.rule.where)
        if not self.hint:
            object.__setattr__(self, "hint", self.rule.hint)

    @property
    def kind(self) -> str:
        return self.rule.kind

    @property
    def level(self) -> Severity:
        """The severity it is reported at (``severity``, typed as always set)."""
        assert self.severity is not None  # set in __post_init__
        return self.severity


_KIND = re.compile(r"[a-z][a-z0-9_]*")
#: monitor class name -> the kinds it declared (filled by :func:`declare`)
_DECLARED: dict[str, set[str]] = {}


def declare(*rules: Rule[E]) -> tuple[Rule[E], ...]:
    """A monitor's declarations, registered so that :func:`undeclared` knows them; returns ``rules``."""
    kinds = [r.kind for r in rules]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"a kind declared twice: {sorted(k for k in kinds if kinds.count(k) > 1)}")
    for r in rules:
        _DECLARED.setdefault(r.monitor, set()).add(r.kind)
    return rules


def judge(rules: Iterable[Rule[E]], evidence: E) -> list[Finding]:
    """What ``rules`` find in ``evidence``, in their declared order, unreported: for a check whose
    findings are reported later (a pre-flight check judges inside its trial, and reports once the run is
    restored). A monitor judges and reports in one go with ``GradGuardCallback.run_rules``."""
    return [f for rule in rules for f in rule.findings(evidence)]


def undeclared(monitor: str, kind: str) -> bool:
    """Whether ``monitor`` declared kinds (:func:`declare`) and ``kind`` is not one of them: a bug in the
    monitor. A callback that declared nothing (your own checks) may report any kind."""
    return monitor in _DECLARED and kind not in _DECLARED[monitor]


def alert_kinds(rules: Iterable[Rule[Any]]) -> dict[str, str]:
    """kind -> summary, in declaration order (a kind two monitors declare once: its summaries must agree)."""
    out: dict[str, str] = {}
    for r in rules:
        if out.setdefault(r.kind, r.summary) != r.summary:
            raise ValueError(f"{r.kind}: two monitors declare it with different summaries")
    return out


def kinds_table(rules: Iterable[Rule[Any]]) -> str:
    """docs/alerts.md's table of kinds (Markdown): one row per kind, in declaration order; a kind two
    monitors report lists both, with both "when" texts."""
    rows: dict[str, list[Rule[Any]]] = {}
    for r in rules:
        rows.setdefault(r.kind, []).append(r)
    lines = ["| kind | severity | reported by | when |", "|---|---|---|---|"]
    for kind, same in rows.items():
        severities = list(dict.fromkeys(s for r in same for s in r.severities))
        by = ", ".join(f"`{r.monitor}`" for r in same)
        when = " ".join(r.when or r.summary for r in same)
        lines.append(f"| `{kind}` | {' / '.join(severities)} | {by} | {when} |")
    return "\n".join(lines) + "\n"


_LEVELS = {
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


@dataclass
class Alert:
    """One finding about the health of a run.

    Attributes:
        kind: what was found, a :class:`Rule`'s kind (``lightning_gradguard.ALERT_KINDS``: stable strings,
            safe to match on).
        severity: ``"info"``, ``"warning"``, ``"error"`` or ``"critical"``.
        step: ``trainer.global_step`` when it was found.
        where: the layer or parameter concerned, or ``None`` for the whole model.
        message: what was seen, with the numbers.
        hint: what to do about it.
        source: the name of the callback that raised it.
        data: the numbers behind the message.
    """

    kind: str
    severity: Severity
    step: int
    where: str | None
    message: str
    hint: str
    source: str
    data: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"`severity` must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers become strings ``"nan"``/``"inf"``)."""
        d = asdict(self)
        d["data"] = {k: _json_number(v) for k, v in self.data.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Alert:
        """The alert :meth:`to_dict` gave (``"nan"``/``"inf"`` numbers back to floats)."""
        data = {k: float(v) if isinstance(v, str) else v for k, v in dict(d.get("data") or {}).items()}
        fields = {
            k: d[k] for k in ("kind", "severity", "step", "where", "message", "hint", "source") if k in d
        }
        return cls(**fields, data=data)

    def key(self) -> tuple[Any, ...]:
        """What tells this alert apart in a run's record: step, kind, place and source (a replayed step's
        alert has the same key as the one written before the run was killed)."""
        return alert_key(self.to_dict())

    def format(self) -> str:
        """One human line: severity, kind, place, step, message and hint."""
        where = f" at {self.where}" if self.where else ""
        return f"[{self.severity}] {self.kind}{where} (step {self.step}): {self.message} Hint: {self.hint}"

    def markdown(self) -> str:
        """A Markdown rendering for TensorBoard's text tab: every field escaped (:func:`markdown_text`)."""
        md = markdown_text
        where = f" at {md(self.where)}" if self.where else ""
        return (
            f"**{self.severity.upper()}** {md(self.kind)}{where}, step {self.step} "
            f"({md(self.source)})  \n{md(self.message)}  \n*Hint:* {md(self.hint)}"
        )


def alert_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """:meth:`Alert.key` of a record of ``gradguard_alerts.jsonl``."""
    return tuple(str(record.get(k)) for k in ("step", "kind", "where", "source"))


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class GradGuardError(RuntimeError):
    """Base of every error lightning_gradguard raises to stop a run; ``alerts`` holds the findings."""

    def __init__(self, message: str, alerts: list[Alert] | None = None) -> None:
        super().__init__(message)
        self.alerts: list[Alert] = list(alerts or [])


class NonFiniteError(GradGuardError):
    """A NaN/inf loss, gradient or parameter stopped the run (raised by ``NaNSentinel`` on every rank).

    ``report`` is the forensic report (also written as JSON beside the run's logs) and ``report_dir``
    the folder holding it, the offending batch and the last-good checkpoint.
    """

    def __init__(
        self,
        message: str,
        alerts: list[Alert] | None = None,
        report: dict[str, Any] | None = None,
        report_dir: str | None = None,
    ) -> None:
        super().__init__(message, alerts)
        self.report: dict[str, Any] = dict(report or {})
        self.report_dir = report_dir


class LossSpikeError(GradGuardError):
    """Spikes kept coming past every recovery (``LossSpikeGuard``): raised on every rank at the same step."""


class SanityCheckError(GradGuardError):
    """A pre-flight check (``OverfitBatchSanity``, ``GradientCheck``) failed; ``alerts`` has the findings.

    Raised on every rank (the verdict is reduced across ranks first), before the first real step.
    """


class LoggingSink:
    """Writes alerts to the ``lightning_gradguard`` Python logger at a level matching the severity."""

    def __call__(self, alert: Alert) -> None:
        log.log(_LEVELS[alert.severity], alert.format())


class JsonlSink:
    """Appends one JSON object per alert to ``path`` (directories created on first write).

    A line is started on a line of its own when the file does not end with one (what a kill, a full disk
    or a power loss leaves): a torn line never swallows the next alert (:func:`append_line`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __call__(self, alert: Alert) -> None:
        append_line(self.path, json.dumps(alert.to_dict(), sort_keys=True))


def recorded_alerts(path: str) -> Counter[tuple[Any, ...]]:
    """The keys (:func:`alert_key`) of the alerts ``path`` holds, counted; a damaged line is passed over."""
    found: Counter[tuple[Any, ...]] = Counter()
    if not os.path.isfile(path):
        return found
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                record = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # a torn line, not UTF-8: not an alert
                continue
            if isinstance(record, dict):
                found[alert_key(record)] += 1
    return found


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (directories created), on a line of its own: when the file
    does not end with a newline (a torn last line), one is written first, so the damage stays in its line."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "ab+") as fh:
        fh.seek(0, os.SEEK_END)
        torn = False
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
            fh.seek(0, os.SEEK_END)
        fh.write((b"\n" if torn else b"") + line.encode("utf-8") + b"\n")


def write_atomically(path: str, text: str | bytes) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a new temporary file beside it, then renamed over
    it. A reader never sees a half-written file, and a symlink planted at ``path`` is replaced, never written
    through (the rename replaces the link itself; the temporary file is created exclusively)."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


#: the Markdown punctuation a name or a message could use to format itself (backslash-escaped)
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")


def markdown_text(text: object) -> str:
    """``text`` as literal Markdown: ``&``, ``<`` and ``>`` as entities (no HTML reaches the page), the
    Markdown punctuation backslash-escaped (no emphasis, link, image, code or heading), newlines as
    Markdown line breaks. A module name or a hint is data, never markup."""
    out = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out = _MARKDOWN_SPECIALS.sub(r"\\\1", out)
    return out.replace("\r", "").replace("\n", "  \n")
