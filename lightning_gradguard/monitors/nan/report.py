"""NaNSentinel's failure path: the forensic report of a NaN/inf, and the files that keep nothing lost.

Runs only on the rare failing step, never on the happy path, and reads nothing of the callback: what it
needs of it comes as :class:`ReportSettings` (its settings and its skip counters, as values).
:func:`build_report` gathers what every rank knows (its loss, its non-finite tensors in model order, the
origin found by replaying the offending micro-batch with
:func:`~lightning_gradguard.monitors.nan.forensics.replay_origin`, its recent total gradient norms) in one
object all-gather, and makes a :class:`~lightning_gradguard.monitors.nan.measure.NaNReport` of the culprit
rank's findings (the alert's words are its rule's check:
:func:`~lightning_gradguard.monitors.nan.rules.finding_of`). :func:`write_report` writes ``report.json``,
the offending batch (``batch.pt``) and ``last_good.ckpt`` into the finding's folder and gives it back as
:class:`Filed`. :meth:`NaNReport.to_dict` is the report as ``report.json`` and ``NonFiniteError.report``
hold it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_gradguard.alerts import Rule, write_atomically
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core import sharding as _sharding
from lightning_gradguard.core.collective import gather
from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.lr import group_lr
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.stats import step_stats
from lightning_gradguard.functional.stats import foreach_norms, nonfinite_counts
from lightning_gradguard.monitors.nan.forensics import ForwardOrigin, replay_origin
from lightning_gradguard.monitors.nan.measure import (
    NOT_REPLAYED,
    MicroBatch,
    NaNReport,
    NonFiniteTensor,
    NormRecord,
    ScalerState,
    SkipCounters,
    add_up_pieces,
    named_grads,
)
from lightning_gradguard.monitors.nan.rules import (
    LOSS_SCALE_COLLAPSE,
    NONFINITE_GRADIENT,
    NONFINITE_PARAMETER,
    Detection,
    finding_of,
)


@dataclass(frozen=True)
class RankFindings:
    """What one rank knows: its loss, its non-finite tensors, the replayed origin, its recent norms."""

    batch_idx: int | None
    loss: float | None
    learning_rates: list[list[float]]
    nonfinite_parameters: list[NonFiniteTensor]
    origin: dict[str, Any] | None
    history: list[NormRecord]


@dataclass(frozen=True)
class ReportSettings:
    """What the failure path needs of the sentinel, as values: its settings and its skip counters."""

    action: str
    check_loss: bool
    find_origin: bool
    report_dir: str | None
    save_batch: bool
    save_checkpoint: bool
    #: the GradScaler's skip counters after the step being judged (the report's ``grad_scaler``)
    counters: SkipCounters


@dataclass(frozen=True)
class Filed:
    """A finding's report, and the folder its files went to."""

    report: NaNReport
    #: ``None`` when no files were written (a finding within the cooldown)
    folder: str | None

    def message(self) -> str:
        """The error's message: the alert's (its rule's words), and where its files are."""
        message = finding_of(self.report).message
        return message if self.folder is None else f"{message} Report: {self.folder}"


def build_report(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    detection: Detection,
    settings: ReportSettings,
    history: list[NormRecord],
) -> NaNReport:
    """Gather every rank's findings (one object all-gather under DDP) into the report of the culprit."""
    rule, micro, sharded = detection.rule, detection.micro, _sharding.is_sharded(trainer)
    replay, opt = settings.find_origin and detection.can_replay, detection.optimizer
    local = _local_findings(trainer, pl_module, rule, opt, micro, replay and not sharded, history)
    findings: list[RankFindings] = gather(trainer, local)
    if sharded:  # no replay (its collectives would differ between ranks); add up the ranks' pieces
        whole, note = add_up_pieces([f.nonfinite_parameters for f in findings], pl_module), NOT_REPLAYED
        findings = [replace(f, nonfinite_parameters=whole, origin=note if replay else None) for f in findings]
    culprit = detection.culprit
    if culprit is None:  # gradients are all-reduced: the first rank whose replay found an origin
        culprit = next((r for r, f in enumerate(findings) if f.origin), 0)
    mine = findings[culprit]
    scaler = None
    if detection.scale is not None:
        skips = settings.counters
        scaler = ScalerState(
            scale=detection.scale, skipped_steps=skips.skipped_steps, consecutive=skips.consecutive_skips
        )
    return NaNReport(
        rule=rule,
        step=int(trainer.global_step),
        epoch=int(trainer.current_epoch),
        batch_idx=mine.batch_idx,
        micro_batches=list(micro.among),
        losses_checked=settings.check_loss,
        rank=culprit,
        world_size=trainer.world_size,
        precision=str(trainer.precision),
        loss=mine.loss,
        learning_rates=mine.learning_rates,
        nonfinite_parameters=mine.nonfinite_parameters,
        origin=mine.origin,
        recent_total_grad_norms=mine.history,
        grad_scaler=scaler,
        weights=_weights_note(rule, settings.action),
    )


def _local_findings(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    rule: Rule,
    optimizer: Any,
    micro: MicroBatch,
    replay: bool,
    history: list[NormRecord],
) -> RankFindings:
    """What this rank knows: its loss, its non-finite tensors, and the replayed origin."""
    loss = None if micro.loss is None else float(micro.loss.float().mean())
    numels: list[int] | None = None
    if rule is NONFINITE_PARAMETER:
        named = [(user_name(n), _sharding.local_tensor(p.detach())) for n, p in pl_module.named_parameters()]
    elif optimizer is not None:  # sizes of the whole tensors: under sharding a rank holds pieces
        stats = step_stats(trainer, pl_module, optimizer)
        named, numels = list(zip(stats.grad_names, stats.grads, strict=True)), stats.grad_numels()
    else:  # a micro-batch under accumulation: the gradients summed so far
        named = named_grads(trainer, pl_module)
    bad: list[NonFiniteTensor] = []
    if named:
        norms = foreach_norms([t for _, t in named]).tolist()
        idx = [i for i, x in enumerate(norms) if not math.isfinite(x)]
        counts = nonfinite_counts([named[i][1] for i in idx]).tolist() if idx else []
        bad = [
            NonFiniteTensor(
                name=named[i][0], nonfinite=int(c), numel=numels[i] if numels else named[i][1].numel()
            )
            for i, c in zip(idx, counts, strict=True)
        ]
    origin: dict[str, Any] | None = None
    if replay and pl_module.automatic_optimization and micro.batch is not None:
        backward = rule is NONFINITE_GRADIENT or rule is LOSS_SCALE_COLLAPSE
        try:
            found = replay_origin(trainer, pl_module, micro.batch, micro.batch_idx or 0, backward)
        except Exception as err:  # forensics must never hide the real failure
            origin = {"phase": "unknown", "description": f"replay failed: {type(err).__name__}: {err}"}
        else:
            if found is not None:
                phase = "forward" if isinstance(found, ForwardOrigin) else "backward"
                origin = {"phase": phase, **found.to_dict(), "description": found.describe()}
    return RankFindings(
        batch_idx=micro.batch_idx,
        loss=loss,
        learning_rates=[[_lr(g) for g in opt.param_groups] for opt in trainer.optimizers],
        nonfinite_parameters=bad,
        origin=origin,
        history=history,
    )


def write_report(
    trainer: pl.Trainer, report: NaNReport, micro: MicroBatch, settings: ReportSettings
) -> Filed:
    """Write the files of ``report`` into ``<report_dir>/step_<k>``: every rank alike.

    ``batch.pt`` (the culprit rank), ``last_good.ckpt`` (every rank: ``trainer.save_checkpoint`` is a
    collective under DDP, and holds every callback's ``state_dict`` as it is now) and ``report.json``
    (rank 0, with the file list, written atomically). Sets ``report.files`` to the files written. Each write
    is guarded (``core.emit.write_file``): one that fails (a full disk, a path under a regular file) is one
    warning naming its path and is left out of the list; the stop or the skip after it never depends on it.
    """
    root = settings.report_dir or os.path.join(_emit.log_dir(trainer), "nan_report")
    folder = os.path.join(root, f"step_{report.step}")
    files: dict[str, str] = {}
    save_batch = settings.save_batch and micro.batch is not None
    if trainer.global_rank == report.rank and save_batch:
        batch = micro.batch
        save_batch = _save(
            trainer,
            os.path.join(folder, "batch.pt"),
            lambda path: torch.save(apply_to_collection(batch, Tensor, _to_cpu), path),
        )
    if settings.save_checkpoint and _sharding.fsdp_checkpoint_on_cpu(trainer):
        warn_once(trainer, "nan:fsdp_cpu_checkpoint", _sharding.FSDP_CPU_CHECKPOINT)
    elif settings.save_checkpoint and report.rule is not NONFINITE_PARAMETER:
        checkpoint = os.path.join(folder, "last_good.ckpt")  # every rank calls it (a barrier under DDP)
        if _save(trainer, checkpoint, lambda path: _checkpoint(trainer, path)):
            files["checkpoint"] = checkpoint
    if save_batch:
        files["batch"] = os.path.join(folder, "batch.pt")  # written by the culprit rank (unless it failed)
    if trainer.is_global_zero:
        path = os.path.join(folder, "report.json")
        text = json.dumps({**report.to_dict(), "files": {**files, "report": path}}, indent=2, default=str)
        if _save(trainer, path, lambda p: write_atomically(p, text), environmental=(OSError,)):
            files["report"] = path
    report.files = files
    return Filed(report=report, folder=folder if files else None)


def _save(
    trainer: pl.Trainer,
    path: str,
    save: Any,
    environmental: tuple[type[BaseException], ...] = _emit.TORCH_IO_ERRORS,
) -> bool:
    """One forensic file: its folder made, then ``save(path)``, guarded (one warning naming the path)."""

    def write() -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save(path)

    return _emit.write_file(trainer, path, write, environmental=environmental)


def _checkpoint(trainer: pl.Trainer, path: str) -> None:
    """``trainer.save_checkpoint(path)``. Under DDP rank 0 writes the file and every rank then meets the
    others in a barrier: a rank whose write failed goes to that barrier before the failure is reported,
    so the ranks whose part went well do not wait there for it."""
    try:
        trainer.save_checkpoint(path)
    except Exception:
        if trainer.world_size > 1:
            trainer.strategy.barrier("Trainer.save_checkpoint")
        raise


def _to_cpu(t: Tensor) -> Tensor:
    return t.detach().cpu()


def _weights_note(rule: Rule, action: str) -> str:
    """What the report says about the weights at the time it was written."""
    if rule is NONFINITE_PARAMETER:
        return "already non-finite: the update that caused it was applied"
    if action == "warn" and rule is not LOSS_SCALE_COLLAPSE:
        return "as after the last good step when written; action='warn' lets this step's update through"
    return "as after the last good step (the update was not applied)"


def _lr(group: dict[str, Any]) -> float:
    """A param group's LR for the report (NaN where the optimizer sets its own step: ``lr=None``)."""
    lr = group_lr(group)
    return math.nan if lr is None else lr
