"""Reading a run's log directory: the GradGuard tags of its TensorBoard event files and the files beside.

What a run leaves (each part optional; a report is made of what is there): event files
(``events.out.tfevents.*``), ``gradguard_alerts.jsonl``, ``nan_report/step_<k>/report.json``,
``spikes.json``, ``lr_finder*.csv``, ``hparams.yaml`` and LightningCLI's ``config.yaml``. Event files are
read record by record (each checked against its checksum), scalars only and every point kept; only
GradGuard's tag families and the run's loss are held in memory.

The folder is not trusted (:mod:`~lightning_gradguard.report.damage`): every reader keeps what parses and
notes what it skipped in ``RunData.skipped``; no read follows a link out of the run folder, and a name is
never a pattern (versions are directories named ``version_<n>``, files are listed, not globbed).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning_gradguard.report.damage as _damage
from lightning_gradguard.monitors.lr_finder.tags import LR_FINDER
from lightning_gradguard.monitors.overfit.tags import PREFLIGHT
from lightning_gradguard.registry import SCALAR_PREFIXES
from lightning_gradguard.report.damage import Damage, Skipped
from lightning_gradguard.tags import ACROSS_LAYERS as _ACROSS

#: the aggregates over all layers of a monitor with ``max_layers``
ACROSS_LAYERS = f"{_ACROSS}/"
#: the scalar tag families GradGuard writes (docs/tags.md)
GRADGUARD_PREFIXES = SCALAR_PREFIXES
#: the tags whose x is not the run's step: a range test's sweep step (``lr_finder/loss``, ``smoothed_loss``
#: and ``lr``, with their ``_epoch<N>`` variants), its search's candidate index (``lr_finder/search_lr``,
#: ``search_round`` and ``search_loss``) and the overfit check's own step (``preflight/*``)
OWN_AXIS = re.compile(
    rf"{re.escape(LR_FINDER.prefix)}(?:loss|smoothed_loss|lr|search_lr|search_round|search_loss)(?:_epoch\d+)?$"
    rf"|{re.escape(PREFLIGHT.prefix)}"
)


@dataclass
class Series:
    """One scalar tag: its steps and values, in the order they were written."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RunData:
    """Everything a report shows, read from one run directory.

    Attributes:
        path: the run directory (a logger's ``version_<n>`` folder, or any folder with event files).
        scalars: tag -> series, GradGuard's tags and the loss, tags in the order they were first written.
        loss_tag: the tag taken as the training loss (``None`` when none was found).
        alerts: the records of ``gradguard_alerts.jsonl``, in order.
        nan_reports: the ``report.json`` of every NaN report folder, by step.
        spikes: the entries of ``spikes.json``.
        lr_curves: ``lr_finder*.csv`` name -> columns (``lr``, ``loss``, ``smoothed_loss``, ``curve``).
        lr_searches: the search after a range test, ``lr_search*.csv``, under its range test's name
            (``lr_search_epoch2.csv`` under ``lr_finder_epoch2``) -> columns (``round``, ``lr``, ``steps``,
            ``loss``, ``train_loss``, ``chosen``); absent in runs from before the search.
        hparams: ``hparams.yaml`` as flat ``key: value`` strings.
        log_every_n_steps: the Trainer's ``log_every_n_steps`` where the run recorded it (LightningCLI's
            ``config.yaml``, or a ``log_every_n_steps`` hyperparameter), else ``None``.
        skipped: what the readers could not read (a torn line, a corrupt record, a malformed row), in order.
    """

    path: str
    scalars: dict[str, Series] = field(default_factory=dict)
    loss_tag: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)
    nan_reports: list[dict[str, Any]] = field(default_factory=list)
    spikes: list[dict[str, Any]] = field(default_factory=list)
    lr_curves: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    lr_searches: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    hparams: dict[str, str] = field(default_factory=dict)
    log_every_n_steps: int | None = None
    skipped: list[Skipped] = field(default_factory=list)

    def step_range(self) -> tuple[int, int] | None:
        """The first and last step of the run: its scalars on the run's axis (not a range test's sweep
        nor the overfit check's own steps, :data:`OWN_AXIS`), its alerts, NaN reports and spikes."""
        ends = [
            (min(s.steps), max(s.steps))
            for tag, s in self.scalars.items()
            if s.steps and not OWN_AXIS.match(tag)
        ]
        steps = [step for end in ends for step in end]
        for record in (*self.alerts, *self.nan_reports, *self.spikes):
            if isinstance(record.get("step"), int | float):
                steps.append(int(record["step"]))
        return (min(steps), max(steps)) if steps else None

    def family(self, prefix: str, total: bool = False) -> dict[str, Series]:
        """The tags under ``prefix`` (``"grad_norm/"``), keyed by the rest of the name, in model order;
        ``total`` keeps ``<prefix>total``. The aggregates of a capped monitor (``across_layers/*``) are no
        layer and are left out."""
        return {
            tag[len(prefix) :]: s
            for tag, s in self.scalars.items()
            if tag.startswith(prefix)
            and (total or tag[len(prefix) :] != "total")
            and not tag[len(prefix) :].startswith(ACROSS_LAYERS)
        }


#: the name of a version folder a logger makes
_VERSION = re.compile(r"version_(\d+)")
_EVENTS = "events.out.tfevents."


def _names(folder: str) -> list[str]:
    """The names in ``folder``, sorted (none where it cannot be listed): listed, never globbed, so a name
    with ``[``, ``*`` or ``?`` is a name, not a pattern."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _event_files(folder: str) -> list[str]:
    """The event files directly in ``folder`` (regular files)."""
    paths = [os.path.join(folder, n) for n in _names(folder) if n.startswith(_EVENTS)]
    return [p for p in paths if os.path.isfile(p)]


def _versions(path: str) -> dict[str, int]:
    """The ``version_<n>`` directories of ``path`` (not a file named so, not a link out of it): name -> n."""
    found = {}
    for name in _names(path):
        match = _VERSION.fullmatch(name)
        full = os.path.join(path, name)
        if match and os.path.isdir(full) and _damage.inside(path, full):
            found[name] = int(match.group(1))
    return found


def find_run(path: str, version: int | str | None = None) -> str:
    """The run directory to report on: ``path`` itself when it holds event files or GradGuard files, else
    its ``version_<n>`` sub-folder (``version``, default the newest), else the newest folder below it that
    holds event files (links to folders are not followed).

    Raises:
        FileNotFoundError: no such folder, or no run under it.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"RUN_DIR {path!r} is not a directory")
    versions = _versions(path)
    if version is not None:
        name = str(version) if str(version).startswith("version_") else f"version_{version}"
        if name not in versions:
            raise FileNotFoundError(f"no {name} in {path!r}; there are: {sorted(versions) or 'none'}")
        return os.path.join(path, name)
    if _event_files(path) or os.path.exists(os.path.join(path, "gradguard_alerts.jsonl")):
        return path
    if versions:
        return os.path.join(path, max(versions, key=versions.__getitem__))
    found = [root for root, _, _ in os.walk(path) if _event_files(root)]
    if not found:
        raise FileNotFoundError(f"no TensorBoard event files or gradguard files under {path!r}")
    return max(found, key=os.path.getmtime)


def _loss_tag(tags: Sequence[str], wanted: str | None) -> str | None:
    if wanted is not None:
        return wanted if wanted in tags else None
    candidates = [t for t in tags if "loss" in t.lower() and not t.startswith(GRADGUARD_PREFIXES)]
    for rank in (
        lambda t: "train" in t.lower() and "epoch" not in t.lower(),
        lambda t: "val" not in t.lower(),
    ):
        preferred = [t for t in candidates if rank(t)]
        if preferred:
            return preferred[0]
    return candidates[0] if candidates else None


def _scalars_of(damage: Damage, path: str, number: int, data: bytes) -> Iterator[tuple[str, int, float]]:
    """The scalar values of one event record: ``(tag, step, value)``."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    try:
        event = event_pb2.Event.FromString(data)
    except DecodeError:
        damage.skip(path, f"record {number}", "not an event (undecodable)")
        return
    for value in event.summary.value:
        if value.HasField("simple_value"):
            yield value.tag, int(event.step), float(value.simple_value)
        elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
            try:
                array = tensor_util.make_ndarray(value.tensor)
                point = float(array.reshape(())) if array.size == 1 else None
            except (ValueError, TypeError):
                damage.skip(
                    path, f"record {number}", f"the scalar {_damage.clip(value.tag, 80)!r} is malformed"
                )
                continue
            if point is not None:
                yield value.tag, int(event.step), point


def _read_event_file(damage: Damage, path: str, wanted: str | None) -> dict[str, Series]:
    """The scalars of one event file that the report may show: GradGuard's tags and the loss candidates."""
    series: dict[str, Series] = {}
    too_long: set[str] = set()
    for number, data in enumerate(_damage.event_records(damage, path), 1):
        for tag, step, value in _scalars_of(damage, path, number, data):
            if len(tag) > _damage.MAX_NAME * 5:
                if tag not in too_long:
                    too_long.add(tag)
                    damage.skip(path, f"record {number}", f"a tag of {len(tag)} characters")
                continue
            if tag.startswith(GRADGUARD_PREFIXES) or tag == wanted or "loss" in tag.lower():
                points = series.setdefault(tag, Series())
                points.steps.append(step)
                points.values.append(value)
    return series


def _read_events(damage: Damage, run: str, loss_tag: str | None) -> tuple[dict[str, Series], str | None]:
    scalars: dict[str, Series] = {}
    chosen: str | None = None
    for file in sorted(_event_files(run), key=os.path.getmtime):
        if not _damage.readable(damage, file):
            continue
        found = _read_event_file(damage, file, loss_tag)
        chosen = chosen or _loss_tag(list(found), loss_tag)
        for tag, points in found.items():
            if tag.startswith(GRADGUARD_PREFIXES) or tag == chosen:
                series = scalars.setdefault(tag, Series())
                series.steps += points.steps
                series.values += points.values
    return scalars, chosen


def _alerts(damage: Damage, path: str) -> list[dict[str, Any]]:
    """``gradguard_alerts.jsonl``, line by line: a torn, non-UTF-8 or malformed line is skipped alone."""
    out: list[dict[str, Any]] = []
    if not _damage.readable(damage, path):
        return out
    for number, line in _damage.text_lines(damage, path):
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError):
            damage.skip(path, f"line {number}", "not JSON (a torn or damaged line)")
            continue
        alert = _damage.record(damage, path, f"line {number}", raw, mappings=("data",))
        if alert is not None:
            out.append(alert)
    return out


def _json_file(damage: Damage, path: str) -> Any:
    """The JSON content of ``path``, or ``None`` (skipped) when it is not whole JSON."""
    text = _damage.text_of(damage, path) if _damage.readable(damage, path) else None
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        damage.skip(path, "file", f"not whole JSON ({type(err).__name__}: {_damage.clip(str(err), 80)})")
    return None


def _nan_reports(damage: Damage, run: str) -> list[dict[str, Any]]:
    """Every ``nan_report/step_<k>/report.json`` under the run (links to folders are not followed)."""
    found = []
    for root, dirs, files in os.walk(run):  # followlinks=False: two links to "." never loop
        dirs.sort()
        parent, name = os.path.split(root)
        if os.path.basename(parent) == "nan_report" and name.startswith("step_") and "report.json" in files:
            found.append(os.path.join(root, "report.json"))
    reports = []
    for path in sorted(found):
        content = _json_file(damage, path)
        if content is not None:
            report = _damage.record(damage, path, "file", content, mappings=("origin",))
            if report is not None:
                reports.append(report | {"folder": _damage.clip(os.path.dirname(path))})
    return reports


def _spikes(damage: Damage, path: str) -> list[dict[str, Any]]:
    """The entries of ``spikes.json``; of a half-written file, the entries before the tear."""
    text = _damage.text_of(damage, path) if _damage.readable(damage, path) else None
    if text is None:
        return []
    try:
        content = json.loads(text)
        entries = content.get("spikes") if isinstance(content, dict) else None
        if not isinstance(entries, list):
            damage.skip(path, "file", "no list of spikes")
            return []
    except (ValueError, RecursionError):
        entries = _entries_before_tear(text)
        damage.skip(path, f"after entry {len(entries)}", "torn (a half-written file): the rest is unread")
    spikes = []
    for i, raw in enumerate(entries[: _damage.MAX_ITEMS * 10], 1):
        spike = _damage.record(damage, path, f"entry {i}", raw)
        if spike is not None:
            spikes.append(spike)
    return spikes


def _entries_before_tear(text: str) -> list[Any]:
    """The whole entries of a torn ``{"spikes": [...`` list, up to the first that does not parse."""
    decoder, entries = json.JSONDecoder(), []
    start = text.find("[", text.find('"spikes"'))
    at = start + 1 if start >= 0 and text.find('"spikes"') >= 0 else len(text)
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            entry, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            break
        entries.append(entry)
    return entries


def _lr_csv(damage: Damage, path: str) -> dict[str, list[float]] | None:
    """A range test's CSV, row by row: a row with a missing, extra or non-numeric field is skipped."""
    columns: dict[str, list[float]] | None = None
    head: list[str] = []
    for number, line in _damage.text_lines(damage, path):
        try:
            row = next(csv.reader([line]))
            if columns is None:
                head, columns = row, {k: [] for k in row if k != "step"}
                continue
            values = dict(zip(head, row, strict=True))
            parsed = {k: float(values[k]) if values[k] not in ("", "nan") else math.nan for k in columns}
        except (ValueError, csv.Error, StopIteration):
            damage.skip(path, f"row {number}", "malformed (a wrong number of fields, or not a number)")
            continue
        for k, v in parsed.items():
            columns[k].append(v)
    if columns is None or "lr" not in columns:
        damage.skip(path, "file", "no header row with an lr column")
        return None
    return columns


def _hparams(damage: Damage, path: str) -> dict[str, str]:
    """``hparams.yaml``'s top-level ``key: value`` lines, as strings."""
    out: dict[str, str] = {}
    if _damage.readable(damage, path):
        for _, line in _damage.text_lines(damage, path):
            key, sep, value = line.partition(":")
            if sep and not line.startswith((" ", "-")):
                out[_damage.clip(key.strip(), _damage.MAX_NAME)] = _damage.clip(value.strip())
    return out


#: Lightning's ``log_every_n_steps`` when the Trainer is given ``None`` (its default)
LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS = 50


def _recorded_log_every_n_steps(damage: Damage, run: str, hparams: dict[str, str]) -> int | None:
    """The Trainer's ``log_every_n_steps`` where the run wrote it down: LightningCLI's ``config.yaml``
    (``trainer.log_every_n_steps``; ``null`` is Lightning's default, 50), else a hyperparameter. A value
    that is not a positive whole number is skipped (said), not taken."""
    config = os.path.join(run, "config.yaml")
    text = _damage.text_of(damage, config) if _damage.readable(damage, config) else None
    if text is not None:
        import yaml

        try:
            trainer = (yaml.safe_load(text) or {}).get("trainer") or {}
        except (yaml.YAMLError, AttributeError, RecursionError):
            damage.skip(config, "file", "not a YAML mapping")
            trainer = {}
        if isinstance(trainer, dict) and "log_every_n_steps" in trainer:
            value = trainer["log_every_n_steps"]
            if value is None:
                return LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS
            step = _damage.whole_step(value)
            if step is not None and step > 0:
                return step
            damage.skip(
                config,
                "trainer.log_every_n_steps",
                f"not a positive whole number ({_damage.clip(repr(value), 40)})",
            )
    value = hparams.get("log_every_n_steps", "")
    return int(value) if re.fullmatch(r"[0-9]{1,9}", value) and int(value) > 0 else None


def read_run(run: str, loss_tag: str | None = None) -> RunData:
    """Read everything a report shows from the run directory ``run`` (see :func:`find_run`); what could not
    be read is in ``skipped``."""
    damage = Damage(run)
    data = RunData(path=run, skipped=damage.skipped)
    data.scalars, data.loss_tag = _read_events(damage, run, loss_tag)
    data.alerts = _alerts(damage, os.path.join(run, "gradguard_alerts.jsonl"))
    data.nan_reports = _nan_reports(damage, run)
    data.spikes = _spikes(damage, os.path.join(run, "spikes.json"))
    for name in _names(run):
        path = os.path.join(run, name)
        if name.startswith("lr_finder") and name.endswith(".csv") and _damage.readable(damage, path):
            curve = _lr_csv(damage, path)
            if curve is not None:
                data.lr_curves[os.path.splitext(name)[0]] = curve
        if name.startswith("lr_search") and name.endswith(".csv") and _damage.readable(damage, path):
            search = _lr_csv(damage, path)
            if search is not None:
                data.lr_searches["lr_finder" + os.path.splitext(name)[0].removeprefix("lr_search")] = search
    data.hparams = _hparams(damage, os.path.join(run, "hparams.yaml"))
    data.log_every_n_steps = _recorded_log_every_n_steps(damage, run, data.hparams)
    return data
