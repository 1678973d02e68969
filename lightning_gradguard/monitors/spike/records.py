"""``spikes.json``: every batch LossSpikeGuard kept out of the run, in a form a resumed run reads back.

The file holds one entry per spike: the optimizer step, the epoch, the batch indices of the step's
micro-batches, the loss and gradient norm with their z-scores, and what was done. A later run (a restart
from an earlier checkpoint, or the same run resumed) given the file as ``skip_batches_path`` drops the
updates of the steps that contain those batches again, so the batches that spiked never reach the
weights. Batches are named by ``(epoch, batch index)``: the data order must be the same (a seeded
sampler), as for Lightning's ``exclude_batches_path``.

:class:`SpikeRecord` is one entry; :func:`record_spike` appends a step's record and rewrites the file
(:func:`write_spikes`); :func:`read_skip_batches` reads back the batches a later run drops again.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import lightning.pytorch as pl

from lightning_gradguard.alerts import write_atomically
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.functional.spikes import SpikeScore

#: the ``format`` field of the file
FORMAT = "lightning_gradguard.spikes/1"


@dataclass(frozen=True, kw_only=True)
class SpikeRecord:
    """One spike: where it happened, how large it was, and what was done about it.

    Attributes:
        step: ``trainer.global_step`` of the optimizer step.
        epoch: the epoch.
        batch_idx: the batch indices of the step's micro-batches (one without accumulation).
        loss: the step's training loss (mean over its micro-batches and ranks), ``None`` when not judged.
        loss_zscore: its robust z-score against the recent steps.
        grad_norm: the total gradient norm before clipping, ``None`` when not judged.
        grad_norm_zscore: its robust z-score.
        batch_variance_factor: how many times a BatchNorm layer's batch variance was over (or, below 1,
            under) its running variance, when that made the step an outlier.
        inputs_factor: how many times the mean square of the batch's floating inputs was over (or under)
            the median of the recent batches', when that made the step an outlier.
        action: ``"warn"``, ``"skip"``, ``"rollback"``, ``"raise"`` or ``"replayed"`` (a batch a former
            run recorded, skipped again).
    """

    step: int
    epoch: int
    batch_idx: list[int] = field(default_factory=list)
    loss: float | None = None
    loss_zscore: float | None = None
    grad_norm: float | None = None
    grad_norm_zscore: float | None = None
    batch_variance_factor: float | None = None
    inputs_factor: float | None = None
    action: str = "skip"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: non-finite numbers become ``None``."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
        return out


def write_spikes(path: str, records: list[SpikeRecord]) -> None:
    """Write every record to ``path`` (the whole list: the file is always complete), atomically: the file
    is rewritten on every spike, and a reader (a resumed run, ``gradguard report``) never sees half of it."""
    write_atomically(path, json.dumps({"format": FORMAT, "spikes": [r.to_dict() for r in records]}, indent=2))


def read_skip_batches(path: str) -> set[tuple[int, int]]:
    """The ``(epoch, batch index)`` pairs whose update a ``spikes.json`` says was kept out of the run.

    Every entry but ``"warn"`` (a warned spike was applied): skipped, rolled back, raised and replayed.
    """
    wrong = f"`skip_batches_path` must be a spikes.json written by LossSpikeGuard; got {path!r}"
    try:
        with open(path, encoding="utf-8") as fh:
            content = json.load(fh)
    except ValueError as err:  # not JSON (or not text)
        raise ValueError(f"{wrong} (not JSON: {err})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(wrong)
    try:
        spikes = [s for s in content["spikes"] if s.get("action") != "warn"]
        return {(int(s["epoch"]), int(i)) for s in spikes for i in s["batch_idx"]}
    except (KeyError, TypeError, ValueError) as err:  # an entry without its fields
        raise ValueError(f"{wrong} (malformed entry: {type(err).__name__}: {err})") from None


def record_spike(
    trainer: pl.Trainer,
    records: list[SpikeRecord],
    *,
    batches: list[int],
    values: dict[str, float],
    scores: dict[str, SpikeScore],
    action: str,
) -> None:
    """Append this step's record and rewrite ``<log_dir>/spikes.json`` (global rank zero)."""
    records.append(
        SpikeRecord(
            step=int(trainer.global_step),
            epoch=int(trainer.current_epoch),
            batch_idx=list(batches),
            loss=values.get("loss"),
            loss_zscore=scores["loss"].zscore if "loss" in scores else None,
            grad_norm=values.get("grad_norm"),
            grad_norm_zscore=scores["grad_norm"].zscore if "grad_norm" in scores else None,
            batch_variance_factor=values.get("batch_variance"),
            inputs_factor=values.get("inputs"),
            action=action,
        )
    )
    if trainer.is_global_zero:  # a read-only log dir loses the file (one warning), never the run
        path = os.path.join(_emit.log_dir(trainer), "spikes.json")
        _emit.write_file(trainer, path, lambda: write_spikes(path, records))
