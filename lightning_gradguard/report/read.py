"""Reading a run's log directory: the GradGuard tags of its TensorBoard event files and the files beside.

What a run leaves (each part optional; a report is made of what is there): event files
(``events.out.tfevents.*``), ``gradguard_alerts.jsonl``, ``nan_report/step_<k>/report.json``,
``spikes.json``, ``lr_finder*.csv``, ``hparams.yaml`` and LightningCLI's ``config.yaml``. Event files are
read with TensorBoard's own ``EventAccumulator``, scalars only and every point kept; only GradGuard's tag
families and the run's loss are held in memory.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_gradguard.monitors.lr_finder.tags import LR_FINDER
from lightning_gradguard.monitors.overfit.tags import PREFLIGHT
from lightning_gradguard.registry import SCALAR_PREFIXES
from lightning_gradguard.tags import ACROSS_LAYERS as _ACROSS

#: the aggregates over all layers of a monitor with ``max_layers``
ACROSS_LAYERS = f"{_ACROSS}/"
#: the scalar tag families GradGuard writes (docs/tags.md)
GRADGUARD_PREFIXES = SCALAR_PREFIXES
#: the tags whose x is not the run's step: a range test's sweep step (``lr_finder/loss``, ``smoothed_loss``
#: and ``lr``, with their ``_epoch<N>`` variants) and the overfit check's own step (``preflight/*``)
OWN_AXIS = re.compile(
    rf"{re.escape(LR_FINDER.prefix)}(?:loss|smoothed_loss|lr)(?:_epoch\d+)?$|{re.escape(PREFLIGHT.prefix)}"
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
        hparams: ``hparams.yaml`` as flat ``key: value`` strings.
        log_every_n_steps: the Trainer's ``log_every_n_steps`` where the run recorded it (LightningCLI's
            ``config.yaml``, or a ``log_every_n_steps`` hyperparameter), else ``None``.
    """

    path: str
    scalars: dict[str, Series] = field(default_factory=dict)
    loss_tag: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)
    nan_reports: list[dict[str, Any]] = field(default_factory=list)
    spikes: list[dict[str, Any]] = field(default_factory=list)
    lr_curves: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    hparams: dict[str, str] = field(default_factory=dict)
    log_every_n_steps: int | None = None

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


def _has_events(folder: str) -> bool:
    return bool(glob.glob(os.path.join(folder, "events.out.tfevents.*")))


def find_run(path: str, version: int | str | None = None) -> str:
    """The run directory to report on: ``path`` itself when it holds event files or GradGuard files, else
    its ``version_<n>`` sub-folder (``version``, default the newest), else the newest folder below it that
    holds event files.

    Raises:
        FileNotFoundError: no such folder, or no run under it.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"RUN_DIR {path!r} is not a directory")
    if version is not None:
        name = str(version) if str(version).startswith("version_") else f"version_{version}"
        chosen = os.path.join(path, name)
        if not os.path.isdir(chosen):
            versions = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "version_*")))
            raise FileNotFoundError(f"no {name} in {path!r}; there are: {versions or 'none'}")
        return chosen
    if _has_events(path) or os.path.exists(os.path.join(path, "gradguard_alerts.jsonl")):
        return path
    versions = glob.glob(os.path.join(path, "version_*"))
    if versions:
        return max(versions, key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or -1))
    found = [root for root, _, _ in os.walk(path) if _has_events(root)]
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


def _read_events(run: str, loss_tag: str | None) -> tuple[dict[str, Series], str | None]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, Series] = {}
    chosen: str | None = None
    for file in sorted(glob.glob(os.path.join(run, "events.out.tfevents.*")), key=os.path.getmtime):
        acc = EventAccumulator(file, size_guidance={"scalars": 0, "images": 1, "histograms": 1, "tensors": 1})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        chosen = chosen or _loss_tag(tags, loss_tag)
        for tag in tags:
            if tag.startswith(GRADGUARD_PREFIXES) or tag == chosen:
                series = scalars.setdefault(tag, Series())
                for event in acc.Scalars(tag):
                    series.steps.append(int(event.step))
                    series.values.append(float(event.value))
    return scalars, chosen


def _json_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _lr_csv(path: str) -> dict[str, list[float]]:
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    keys = [k for k in (rows[0] if rows else {}) if k != "step"]
    return {k: [float(r[k]) if r[k] not in ("", "nan") else float("nan") for r in rows] for k in keys}


def _hparams(path: str) -> dict[str, str]:
    """``hparams.yaml``'s top-level ``key: value`` lines, as strings."""
    out: dict[str, str] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and not line.startswith((" ", "-")):
                    out[key.strip()] = value.strip()
    return out


#: Lightning's ``log_every_n_steps`` when the Trainer is given ``None`` (its default)
LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS = 50


def _recorded_log_every_n_steps(run: str, hparams: dict[str, str]) -> int | None:
    """The Trainer's ``log_every_n_steps`` where the run wrote it down: LightningCLI's ``config.yaml``
    (``trainer.log_every_n_steps``; ``null`` is Lightning's default, 50), else a hyperparameter."""
    config = os.path.join(run, "config.yaml")
    if os.path.exists(config):
        import yaml

        try:
            with open(config, encoding="utf-8") as fh:
                trainer = (yaml.safe_load(fh) or {}).get("trainer") or {}
        except (yaml.YAMLError, AttributeError):
            trainer = {}
        if isinstance(trainer, dict) and "log_every_n_steps" in trainer:
            value = trainer["log_every_n_steps"]
            return LIGHTNING_DEFAULT_LOG_EVERY_N_STEPS if value is None else int(value)
    value = hparams.get("log_every_n_steps", "")
    return int(value) if value.isdigit() else None


def read_run(run: str, loss_tag: str | None = None) -> RunData:
    """Read everything a report shows from the run directory ``run`` (see :func:`find_run`)."""
    data = RunData(path=run)
    data.scalars, data.loss_tag = _read_events(run, loss_tag)
    data.alerts = _json_lines(os.path.join(run, "gradguard_alerts.jsonl"))
    for report in sorted(
        glob.glob(os.path.join(run, "**", "nan_report", "step_*", "report.json"), recursive=True)
    ):
        with open(report, encoding="utf-8") as fh:
            data.nan_reports.append(json.load(fh) | {"folder": os.path.dirname(report)})
    spikes = os.path.join(run, "spikes.json")
    if os.path.exists(spikes):
        with open(spikes, encoding="utf-8") as fh:
            data.spikes = list(json.load(fh).get("spikes", []))
    for path in sorted(glob.glob(os.path.join(run, "lr_finder*.csv"))):
        data.lr_curves[os.path.splitext(os.path.basename(path))[0]] = _lr_csv(path)
    data.hparams = _hparams(os.path.join(run, "hparams.yaml"))
    data.log_every_n_steps = _recorded_log_every_n_steps(run, data.hparams)
    return data
