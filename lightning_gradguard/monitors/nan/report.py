"""NaNSentinel's failure path: the forensic report of a NaN/inf, and the files that keep nothing lost.

Runs only on the rare failing step, never on the happy path, and reads nothing of the callback: what it
needs of it comes as :class:`ReportSettings` (its settings and its skip counters, as values).
:func:`build_report` gathers what every rank knows (its loss, its non-finite tensors in model order, the
origin found by replaying the offending micro-batch with
:func:`~lightning_gradguard.monitors.nan.forensics.replay_origin`, its recent total gradient norms) in one
object all-gather, and makes a :class:`NaNReport` of the culprit rank's findings: the message, the hint,
the severity and the place an alert names. :func:`write_report` writes ``report.json``, the offending
batch (``batch.pt``) and ``last_good.ckpt`` into the finding's folder and gives it back as :class:`Filed`.
:meth:`NaNReport.to_dict` is the report as ``report.json`` and ``NonFiniteError.report`` hold it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_gradguard.alerts import Severity
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core import sharding as _sharding
from lightning_gradguard.core.collective import gather
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.stats import step_stats
from lightning_gradguard.functional.stats import clean_name, foreach_norms, nonfinite_counts
from lightning_gradguard.monitors.nan.forensics import ForwardOrigin, replay_origin
from lightning_gradguard.monitors.nan.measure import (
    NOT_REPLAYED,
    Finding,
    MicroBatch,
    NonFiniteTensor,
    NormRecord,
    SkipCounters,
    add_up_pieces,
    named_grads,
)

_MAX_LISTED = 10

_HINTS = {
    "nonfinite_loss": (
        "Check the batch for NaN/inf (data pipeline, bad labels), then the loss: use log-softmax / "
        "cross_entropy on logits instead of log(softmax), clamp before log/sqrt/division, add eps to "
        "normalisers. If the loss grew until it overflowed, lower the learning rate and clip gradients "
        "(gradient_clip_val=1.0)."
    ),
    "nonfinite_gradient": (
        "The loss was finite, so a backward op overflowed or divided by zero: look at the named op "
        "(sqrt/pow/div/log at 0 are the usual suspects; add eps or clamp). Exploding gradients: clip "
        "them (gradient_clip_val=1.0) and lower the learning rate."
    ),
    "nonfinite_parameter": (
        "An update wrote NaN/inf into the weights: lower the learning rate, clip gradients, and enable "
        "check_gradients so the next occurrence is caught before the update."
    ),
    "loss_scale_collapse": (
        "16-mixed keeps overflowing: something produces values beyond fp16's range. Use bf16-mixed if the "
        "hardware supports it, keep softmax/normalisation/loss in float32, lower the learning rate, or "
        "clip gradients."
    ),
}


@dataclass(frozen=True)
class ScalerState:
    """The GradScaler at a finding under 16-mixed: its scale and the steps it skipped."""

    scale: float
    skipped_steps: int
    consecutive: int


@dataclass(frozen=True)
class RankFindings:
    """What one rank knows: its loss, its non-finite tensors, the replayed origin, its recent norms."""

    batch_idx: int | None
    loss: float | None
    learning_rates: list[list[float]]
    nonfinite_parameters: list[NonFiniteTensor]
    origin: dict[str, Any] | None
    history: list[NormRecord]


@dataclass
class NaNReport:
    """The forensic report; :meth:`to_dict` gives it as ``report.json`` and ``NonFiniteError.report``."""

    kind: str
    step: int
    epoch: int
    batch_idx: int | None
    micro_batches: list[int]
    losses_checked: bool
    rank: int
    world_size: int
    precision: str
    loss: float | None
    learning_rates: list[list[float]]
    nonfinite_parameters: list[NonFiniteTensor]
    origin: dict[str, Any] | None
    recent_total_grad_norms: list[NormRecord]
    grad_scaler: ScalerState | None
    weights: str
    #: the files written (``report``, ``batch``, ``checkpoint``); set by :func:`write_report`
    files: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["files"] is None:
            del out["files"]
        return out

    def message(self) -> str:
        kind, step = self.kind, self.step
        what = {
            "nonfinite_loss": f"the loss is {self.loss}",
            "nonfinite_gradient": "gradients hold NaN/inf",
            "nonfinite_parameter": "parameters hold NaN/inf after the update",
            "loss_scale_collapse": "the GradScaler keeps skipping steps",
        }[kind]
        among = self.micro_batches
        batch = f"batch {self.batch_idx}" if not among else f"micro-batches {among[0]}-{among[-1]}"
        parts = [f"{kind} at step {step} (rank {self.rank}, {batch}): {what}."]
        if among:
            if self.losses_checked:
                parts.append("Every loss of the step's micro-batches was finite.")
            parts.append(
                "Which micro-batch's backward made the gradients non-finite is not known "
                "(NaNSentinel(check_micro_batches=True) names it)."
            )
        bad = self.nonfinite_parameters
        if bad:
            listed = ", ".join(f"{b.name} ({b.nonfinite}/{b.numel})" for b in bad[:_MAX_LISTED])
            more = f" and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
            label = "parameters" if kind == "nonfinite_parameter" else "gradients"
            parts.append(f"Non-finite {label}, in model order: {listed}{more}.")
        if self.origin:
            parts.append(f"Origin: {self.origin['description']}.")
        if self.grad_scaler:
            gs = self.grad_scaler
            parts.append(
                f"Scale {gs.scale:g}, {gs.consecutive} consecutive skips, {gs.skipped_steps} in all."
            )
        return " ".join(parts)

    def hint(self) -> str:
        """Advice for what was found, sharpened by where the value was born when the replay found it."""
        kind, origin = self.kind, self.origin
        if kind == "nonfinite_gradient" and self.loss is not None and not math.isfinite(self.loss):
            kind = "nonfinite_loss"  # the loss went unchecked (check_loss=False): never claim it was finite
        if origin and origin.get("phase") == "forward":
            return _forward_hint(origin, _HINTS[kind].split(". ", 1)[-1])
        if origin and origin.get("phase") == "backward":
            return (
                f"The forward pass was finite; the backward of `{origin.get('op')}` made the first NaN/inf. "
                "Derivatives of sqrt/pow/log/div blow up at 0: add eps or clamp the input there."
            )
        return _HINTS[kind]

    def where(self) -> str | None:
        """The place an alert names: the origin's module or op, else the first non-finite tensor."""
        origin = self.origin or {}
        if origin.get("module") is not None and origin.get("phase") == "forward":
            return str(origin["module"]) or "<root>"
        if origin.get("op"):
            return str(origin["op"])
        return self.nonfinite_parameters[0].name if self.nonfinite_parameters else None

    def severity(self) -> Severity:
        """The alert's severity: critical, but a GradScaler that keeps skipping is an error."""
        return "error" if self.kind == "loss_scale_collapse" else "critical"


def _forward_hint(origin: dict[str, Any], general: str) -> str:
    """The advice when the forward replay found where the value was born (``origin``: its dict)."""
    module, guard = f"`{origin.get('module')}`", "guard its divisions, logs and sqrt (add eps, clamp)"
    if origin.get("in_input") and origin.get("inputs_finite"):
        return (
            f"The batch was finite but the input of {module} was not: the code of the step before it "
            "(training_step, or the forward that calls it) made NaN/inf: guard the divisions, logs and sqrt "
            "there (add eps, clamp)."
        )
    if origin.get("in_input"):
        return (
            "The batch itself holds NaN/inf (it entered the model that way): inspect the saved batch.pt "
            "and the data pipeline (missing values, division in preprocessing, corrupt samples); filter "
            "or impute them."
        )
    if origin.get("root"):  # the model's own code, not one of its submodules
        code = "step code (training_step)" if origin.get("in_step") else "forward"
        module = f"{module}'s own {code}, outside its submodules,"
    return (
        f"{module} turned finite inputs into NaN/inf: {guard}, compute softmax/log-softmax stably, and "
        f"check its parameters' scale. {general}"
    )


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
        """The error's message: the report's, and where its files are."""
        message = self.report.message()
        return message if self.folder is None else f"{message} Report: {self.folder}"


def build_report(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    finding: Finding,
    settings: ReportSettings,
    history: list[NormRecord],
) -> NaNReport:
    """Gather every rank's findings (one object all-gather under DDP) into the report of the culprit."""
    kind, micro, sharded = finding.kind, finding.micro, _sharding.is_sharded(trainer)
    replay, opt = settings.find_origin and finding.can_replay, finding.optimizer
    local = _local_findings(trainer, pl_module, kind, opt, micro, replay and not sharded, history)
    findings: list[RankFindings] = gather(trainer, local)
    if sharded:  # no replay (its collectives would differ between ranks); add up the ranks' pieces
        whole, note = add_up_pieces([f.nonfinite_parameters for f in findings], pl_module), NOT_REPLAYED
        findings = [replace(f, nonfinite_parameters=whole, origin=note if replay else None) for f in findings]
    culprit = finding.culprit
    if culprit is None:  # gradients are all-reduced: the first rank whose replay found an origin
        culprit = next((r for r, f in enumerate(findings) if f.origin), 0)
    mine = findings[culprit]
    scaler = None
    if finding.scale is not None:
        skips = settings.counters
        scaler = ScalerState(
            scale=finding.scale, skipped_steps=skips.skipped_steps, consecutive=skips.consecutive_skips
        )
    return NaNReport(
        kind=kind,
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
        weights=_weights_note(kind, settings.action),
    )


def _local_findings(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    kind: str,
    optimizer: Any,
    micro: MicroBatch,
    replay: bool,
    history: list[NormRecord],
) -> RankFindings:
    """What this rank knows: its loss, its non-finite tensors, and the replayed origin."""
    loss = None if micro.loss is None else float(micro.loss.float().mean())
    numels: list[int] | None = None
    if kind == "nonfinite_parameter":
        named = [(clean_name(n), _sharding.local_tensor(p.detach())) for n, p in pl_module.named_parameters()]
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
        backward = kind in ("nonfinite_gradient", "loss_scale_collapse")
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
        learning_rates=[[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers],
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
    (rank 0, with the file list). Sets ``report.files``.
    """
    root = settings.report_dir or os.path.join(_emit.log_dir(trainer), "nan_report")
    folder = os.path.join(root, f"step_{report.step}")
    files: dict[str, str] = {}
    save_batch = settings.save_batch and micro.batch is not None
    if trainer.global_rank == report.rank and save_batch:
        os.makedirs(folder, exist_ok=True)
        files["batch"] = os.path.join(folder, "batch.pt")
        torch.save(apply_to_collection(micro.batch, Tensor, lambda t: t.detach().cpu()), files["batch"])
    if settings.save_checkpoint and _sharding.fsdp_checkpoint_on_cpu(trainer):
        warn_once(trainer, "nan:fsdp_cpu_checkpoint", _sharding.FSDP_CPU_CHECKPOINT)
    elif settings.save_checkpoint and report.kind != "nonfinite_parameter":
        files["checkpoint"] = os.path.join(folder, "last_good.ckpt")
        trainer.save_checkpoint(files["checkpoint"])  # every rank calls it (a barrier under DDP)
    if save_batch:
        files["batch"] = os.path.join(folder, "batch.pt")  # written by the culprit rank
    if trainer.is_global_zero:
        os.makedirs(folder, exist_ok=True)
        files["report"] = os.path.join(folder, "report.json")
        with open(files["report"], "w", encoding="utf-8") as fh:
            json.dump({**report.to_dict(), "files": files}, fh, indent=2, default=str)
    report.files = files
    return Filed(report=report, folder=folder)


def _weights_note(kind: str, action: str) -> str:
    """What the report says about the weights at the time it was written."""
    if kind == "nonfinite_parameter":
        return "already non-finite: the update that caused it was applied"
    if action == "warn" and kind != "loss_scale_collapse":
        return "as after the last good step when written; action='warn' lets this step's update through"
    return "as after the last good step (the update was not applied)"
