r"""
NaNSentinel
===========

Fails a run the moment a loss, gradient or parameter turns NaN/inf: on every rank, before the optimizer
applies the poisoned update, with a forensic report that says where the value was born.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.alerts import NonFiniteError
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.stats import step_stats
from lightning_gradguard.core.trial import quiet_logging
from lightning_gradguard.core.validate import check_bool, check_float, check_int, check_path
from lightning_gradguard.functional.stats import foreach_norms, nonfinite_counts
from lightning_gradguard.hooks.forensics import find_backward_origin, find_forward_origin

__all__ = ["NaNSentinel"]

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
class _MicroBatch:
    """One micro-batch as the sentinel saw it: what a report, ``batch.pt`` and the replay are made of."""

    batch: Any
    batch_idx: int | None
    loss: Tensor | None
    #: batch indices of an optimizer step's micro-batches when the finding cannot name one of them
    among: tuple[int, ...] = ()


class NaNSentinel(GradGuardCallback):
    r"""Stop at the first NaN/inf loss, gradient or parameter, with nothing lost.

    Checks, at almost no cost (one fused finiteness reduction and one host read per optimizer step):

    * the loss, in ``on_before_backward`` (every micro-batch);
    * the gradients, in ``on_before_optimizer_step``, from the statistics every gradguard callback shares
      (no extra pass over the gradients when GradientNormLogger also runs);
    * optionally the parameters after the update, every ``check_parameters_every_n_steps``.

    The loss and gradient verdicts of one step are read from the device together, so a step costs one
    sync. With ``accumulate_grad_batches > 1`` the loss of each micro-batch is judged as it comes (one
    read per micro-batch), so a non-finite loss names its own micro-batch (report, ``batch.pt``, replay);
    the accumulated gradients are judged once, at the optimizer step, from the shared statistics. An
    optimizer step yields at most one finding: once a micro-batch is found poisoned, the rest of the step
    is not judged again. When every loss of the step was finite but its gradients are not, the report
    lists the step's micro-batches; ``check_micro_batches=True`` names the one whose backward made the
    first NaN/inf (it judges the gradients summed so far after every micro-batch: one extra pass over
    the gradients per micro-batch; non-finite values persist in a sum, so the first micro-batch after
    which they are non-finite is the one).

    On detection (alert ``nonfinite_loss``, ``nonfinite_gradient`` or ``nonfinite_parameter``, severity
    critical) every rank takes the same decision at the same point (one collective) and, with the
    default ``action="raise"``, raises :class:`~lightning_gradguard.NonFiniteError` before the optimizer
    step: the weights are those after the last good step. Beside the run's logs, in
    ``nan_report/step_<k>/``, it writes ``report.json`` (step, kind, non-finite parameters in model
    order with counts, loss, learning rates, the last total gradient norms, precision, origin), the
    offending batch (``batch.pt``) and ``last_good.ckpt``, a checkpoint Lightning can resume from. The
    origin comes from replaying the batch on copies of the good weights: forward hooks name the first
    module whose output went non-finite (or say that the batch itself was bad); when the forward pass is
    clean, the backward replay names the op that made the first NaN/inf gradient and the line that
    created it.

    Under 16-mixed with a GradScaler, non-finite gradients are the scaler's business: the step is
    skipped and counted (``skipped_steps``), not failed. ``loss_scale_collapse`` fires when the scale
    drops below ``loss_scale_floor`` or ``max_consecutive_skips`` steps in a row are skipped.

    Args:
        check_loss: check the loss before backward.
        check_gradients: check the gradients before the optimizer step.
        check_parameters_every_n_steps: also check parameters after the update every N steps (0: never).
        action: ``"raise"`` (default), ``"stop"``, ``"warn"`` or ``"skip"``. ``"skip"`` drops the
            poisoned update and goes on: every gradient of the optimizer is set to ``None``, which
            ``torch.optim`` optimizers treat as "no update" (Adam's step count and moments stay as
            they were), exactly like the GradScaler's own skip; the LR scheduler still advances.
            ``"stop"`` drops the poisoned update the same way and sets ``trainer.should_stop``: the run
            ends with the weights of the last good step (Lightning ends it after the current batch and
            a validation run, if any; with ``accumulate_grad_batches > 1`` possibly before the
            accumulation window is complete, and then no update is made at all). Until ``min_epochs``
            / ``min_steps`` are met Lightning keeps training: every poisoned update meanwhile is
            dropped too. ``"warn"`` only reports: the poisoned update is applied. Under
            ``accumulate_grad_batches > 1``, ``"skip"`` and ``"stop"`` drop the update of the whole
            optimizer step that holds the poisoned micro-batch.
        report_dir: where reports go (default: ``<log_dir>/nan_report``).
        save_batch: write the offending batch.
        save_checkpoint: write the last-good checkpoint (a collective under DDP: every rank calls it).
        find_origin: replay the batch to find where the value was born (automatic optimization only).
        history_size: how many recent total gradient norms the report lists.
        loss_scale_floor: GradScaler scale below which the scale counts as collapsed.
        max_consecutive_skips: consecutive GradScaler skips that count as a collapse.
        check_micro_batches: under ``accumulate_grad_batches > 1``, also judge the gradients after every
            micro-batch, so a gradient finding names the micro-batch that poisoned them (one extra pass
            over the gradients per micro-batch; off by default).
        cooldown_steps: minimum steps between two alerts of the same kind.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import NaNSentinel, NonFiniteError

        trainer = Trainer(callbacks=[NaNSentinel()])
        try:
            trainer.fit(model)
        except NonFiniteError as err:
            print(err)              # what, where, step, origin, hint
            print(err.report_dir)   # report.json, batch.pt, last_good.ckpt
    """

    error_type = NonFiniteError
    allowed_actions = ("warn", "stop", "raise", "skip")

    def __init__(
        self,
        check_loss: bool = True,
        check_gradients: bool = True,
        check_parameters_every_n_steps: int = 0,
        action: Literal["raise", "stop", "warn", "skip"] = "raise",
        report_dir: str | None = None,
        save_batch: bool = True,
        save_checkpoint: bool = True,
        find_origin: bool = True,
        history_size: int = 50,
        loss_scale_floor: float = 1.0,
        max_consecutive_skips: int = 16,
        check_micro_batches: bool = False,
        cooldown_steps: int = 100,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.check_loss = check_bool("check_loss", check_loss)
        self.check_gradients = check_bool("check_gradients", check_gradients)
        self.check_parameters_every_n_steps: int = check_int(
            "check_parameters_every_n_steps", check_parameters_every_n_steps, 0
        )
        self.report_dir: str | None = check_path("report_dir", report_dir)
        self.save_batch = check_bool("save_batch", save_batch)
        self.save_checkpoint = check_bool("save_checkpoint", save_checkpoint)
        self.find_origin = check_bool("find_origin", find_origin)
        self.history_size: int = check_int("history_size", history_size, 1)
        self.loss_scale_floor: float = check_float("loss_scale_floor", loss_scale_floor, 0.0, low_open=True)
        self.max_consecutive_skips: int = check_int("max_consecutive_skips", max_consecutive_skips, 1)
        self.check_micro_batches = check_bool("check_micro_batches", check_micro_batches)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_report_dir: str | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._loss_bad: Tensor | None = None
        # the micro-batch whose backward ran last; under accumulation the micro-batches judged in the
        # current optimizer step, and the one its finding named (the step then yields no other finding)
        self._current: _MicroBatch | None = None
        self._in_step = 0
        self._poisoned: _MicroBatch | None = None
        self._stepped = False  # an optimizer step ran in the current batch
        self._step_batches: list[int] = []  # batch indices of the current optimizer step's micro-batches
        self._history: Tensor | None = None
        self._history_steps: list[int] = []
        # the skip counters before the step being judged, and the state the last-good checkpoint holds
        self._counters_before = (0, 0)
        self._state_override: dict[str, Any] | None = None

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):  # the report of this run lists this run's steps only
            self.skipped_steps = self.consecutive_skips = 0
            self._history, self._history_steps = None, []
        # a fit never starts inside an optimizer step (one stopped mid-accumulation leaves this behind)
        self._loss_bad = self._batch = self._current = self._poisoned = None
        self._in_step, self._stepped, self._step_batches = 0, False, []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch, self._batch_idx = batch, batch_idx

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        loss = loss.detach()
        previous = self._current
        self._current = current = _MicroBatch(batch=self._batch, batch_idx=self._batch_idx, loss=loss)
        if not (pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1):
            if self.check_loss:  # judged with the gradients, in on_before_optimizer_step
                bad = ~torch.isfinite(loss).all()
                self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
            return
        # Accumulation: judge each micro-batch now, so the finding names it (and the replay and batch.pt
        # are its own), and at most once per optimizer step.
        first = self._in_step == 0
        self._in_step += 1
        if first:
            self._step_batches = []
        self._step_batches.append(self._batch_idx)
        if self._poisoned is not None:  # this step has its finding; its update is dealt with at the step
            return
        loss_bad = ~torch.isfinite(loss).all() if self.check_loss else None
        earlier_bad = None
        if self.check_micro_batches and self.check_gradients and not first and not _scaler_enabled(trainer):
            # the gradients summed over the step's earlier micro-batches (local ones under DDP's no_sync);
            # a flag on every rank, even one without gradients, so that every rank joins the collective
            grads = [g for _, g in _named_grads(trainer, pl_module)]
            earlier_bad = (
                ~torch.isfinite(foreach_norms(grads)).all()
                if grads
                else torch.zeros((), dtype=torch.bool, device=loss.device)
            )
        if loss_bad is None and earlier_bad is None:
            return
        self._decide(
            trainer,
            pl_module,
            None,
            current=current,
            loss_bad=loss_bad,
            grad_bad=None,
            earlier_bad=earlier_bad,
            previous=previous,
        )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss_bad, self._loss_bad = self._loss_bad, None
        self._stepped = True
        poisoned, self._poisoned, self._in_step = self._poisoned, None, 0
        step_batches, self._step_batches = self._step_batches, []
        if poisoned is not None:
            # Accumulation: a micro-batch of this step was found poisoned and reported already (on every
            # rank alike, so no rank waits in a collective here). No second finding; drop the update.
            if self.check_gradients:
                self._remember_norm(
                    step_stats(trainer, pl_module, optimizer).grad_total(2.0), int(trainer.global_step)
                )
            if self.action in ("skip", "stop"):
                _drop_update(optimizer)
            return
        if not self.check_gradients and loss_bad is None:
            return
        stats = step_stats(trainer, pl_module, optimizer)
        grad_bad = None
        if self.check_gradients:
            grad_bad = ~stats.grads_finite()
            self._remember_norm(stats.grad_total(2.0), int(trainer.global_step))
        current = self._current or _MicroBatch(batch=self._batch, batch_idx=self._batch_idx, loss=None)
        if len(step_batches) > 1 and not self.check_micro_batches:
            # every loss of the step was finite (judged as they came): which micro-batch's backward made
            # the gradients non-finite is not known, and the last one is not to be blamed for it
            current = _MicroBatch(batch=None, batch_idx=None, loss=None, among=tuple(step_batches))
        self._decide(trainer, pl_module, optimizer, current=current, loss_bad=loss_bad, grad_bad=grad_bad)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        micro = self._current or _MicroBatch(batch=self._batch, batch_idx=self._batch_idx, loss=None)
        if self._in_step == 0:  # no optimizer step is open: hold no micro-batch longer than needed
            self._current = None
        stepped, self._stepped = self._stepped, False
        every = self.check_parameters_every_n_steps
        # parameters change only where an optimizer stepped: not after the other micro-batches of a step
        if not every or not stepped or trainer.global_step == 0 or trainer.global_step % every:
            return
        params = [p.detach() for p in pl_module.parameters()]
        bad = ~torch.isfinite(foreach_norms(params)).all() if params else torch.zeros((), dtype=torch.bool)
        flags = bad.float().reshape(1)
        if trainer.world_size > 1:
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        if float(flags.sum()) > 0:
            self._fail(trainer, pl_module, "nonfinite_parameter", culprit=0, micro=micro, can_replay=False)

    # ------------------------------------------------------------------ the verdict
    def _remember_norm(self, total: Tensor, step: int) -> None:
        if self._history is None or self._history.device != total.device:
            self._history = torch.full((self.history_size,), float("nan"), device=total.device)
            self._history_steps = []
        self._history[len(self._history_steps) % self.history_size] = total.float()
        self._history_steps.append(step)
        del self._history_steps[: -self.history_size]

    def _decide(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        *,
        current: _MicroBatch,
        loss_bad: Tensor | None,
        grad_bad: Tensor | None,
        earlier_bad: Tensor | None = None,
        previous: _MicroBatch | None = None,
    ) -> None:
        """Reduce the flags across ranks, read them once, and act on the same verdict everywhere.

        ``optimizer`` is ``None`` for a micro-batch judged under accumulation (``on_before_backward``);
        there ``earlier_bad`` says whether the gradients summed over the step's earlier micro-batches are
        non-finite, which names ``previous`` (the micro-batch just before ``current``) as the culprit.
        """
        world, rank = trainer.world_size, trainer.global_rank
        self._counters_before = (self.skipped_steps, self.consecutive_skips)
        given = [t for t in (loss_bad, earlier_bad, grad_bad) if t is not None]
        device = given[0].device
        # one slot per rank for the loss, one per rank for the earlier micro-batches' gradients (local
        # under DDP's no_sync), one for the step's gradients (all-reduced: the same on every rank)
        flags = torch.zeros(2 * world + 1, device=device)
        if loss_bad is not None:
            flags[rank] = loss_bad.float()
        if earlier_bad is not None:
            flags[world + rank] = earlier_bad.float()
        if grad_bad is not None:
            flags[2 * world] = grad_bad.float()
        if world > 1:
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        parts = [flags]
        if scaler is not None and scaler.is_enabled() and optimizer is not None:
            parts.append(scaler._scale.reshape(1).float().to(device))
        host = torch.cat(parts).tolist()  # the one device -> host read of this step (or micro-batch)
        earlier_ranks = [r for r in range(world) if host[world + r] > 0]
        if earlier_ranks and previous is not None:  # the first poisoned micro-batch is the previous one
            self._poisoned = previous
            self._fail(trainer, pl_module, "nonfinite_gradient", culprit=earlier_ranks[0], micro=previous)
            return
        loss_ranks = [r for r in range(world) if host[r] > 0]
        if loss_ranks:
            if optimizer is None:  # under accumulation: the rest of this optimizer step is not judged
                self._poisoned = current
            self._fail(
                trainer,
                pl_module,
                "nonfinite_loss",
                culprit=loss_ranks[0],
                micro=current,
                optimizer=optimizer,
            )
            return
        if optimizer is None:
            return
        grads_bad = host[2 * world] > 0
        if len(host) == 2 * world + 2:  # a GradScaler is active: non-finite gradients mean "skip this step"
            scale = host[2 * world + 1]
            self.consecutive_skips = self.consecutive_skips + 1 if grads_bad else 0
            self.skipped_steps += int(grads_bad)
            if scale < self.loss_scale_floor or self.consecutive_skips >= self.max_consecutive_skips:
                self._fail(
                    trainer,
                    pl_module,
                    "loss_scale_collapse",
                    culprit=0,
                    micro=current,
                    optimizer=optimizer,
                    scale=scale,
                )
            return
        if grads_bad:
            self._fail(
                trainer, pl_module, "nonfinite_gradient", culprit=None, micro=current, optimizer=optimizer
            )

    # ------------------------------------------------------------------ the failure path (rare)
    def _fail(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        kind: str,
        culprit: int | None,
        micro: _MicroBatch,
        optimizer: Any = None,
        can_replay: bool = True,
        scale: float | None = None,
    ) -> None:
        """Report ``kind``, found in ``micro`` (this rank's micro-batch), and apply the action."""
        step = int(trainer.global_step)
        last = self._last_reported.get(kind)
        if self.action != "raise" and last is not None and step - last < self.cooldown_steps:
            # Reported within the cooldown (a "warn"/"skip" run that keeps meeting NaNs): no replay, no
            # gather, no files, only the action. Every rank has the same cooldown, so all skip alike.
            self._apply(trainer, optimizer, kind, "", {})
            return
        # The last-good checkpoint holds this callback as it was before the bad step: without this
        # failure in the cooldown (a resumed run that meets the same NaN must report it in full) and
        # with the skip counters before this step.
        last_good = self.state_dict()
        last_good["skipped_steps"], last_good["consecutive_skips"] = self._counters_before
        local = self._local_findings(trainer, pl_module, kind, optimizer, can_replay, micro)
        findings = _gather(trainer, local)
        if culprit is None:  # gradients are all-reduced: the first rank whose replay found an origin
            culprit = next((r for r, f in enumerate(findings) if f.get("origin")), 0)
        mine = findings[culprit]
        report: dict[str, Any] = {
            "kind": kind,
            "step": step,
            "epoch": int(trainer.current_epoch),
            "batch_idx": mine["batch_idx"],
            "micro_batches": list(micro.among),
            "losses_checked": self.check_loss,
            "rank": culprit,
            "world_size": trainer.world_size,
            "precision": str(trainer.precision),
            "loss": mine["loss"],
            "learning_rates": mine["learning_rates"],
            "nonfinite_parameters": mine["nonfinite_parameters"],
            "origin": mine["origin"],
            "recent_total_grad_norms": mine["history"],
            "grad_scaler": {
                "scale": scale,
                "skipped_steps": self.skipped_steps,
                "consecutive": self.consecutive_skips,
            }
            if scale is not None
            else None,
            "weights": _weights_note(kind, self.action),
        }
        message = self._message(report)
        alert = self.report(
            trainer,
            kind,
            "critical" if kind != "loss_scale_collapse" else "error",
            _first_place(report),
            message,
            _hint(kind, report.get("origin"), report.get("loss")),
            {"step": float(step), "rank": float(culprit)},
            step=step,
            cooldown_key=kind,  # one finding of a kind per cooldown, wherever the origin moves
        )
        if alert is None:  # within the cooldown: already reported
            self._apply(trainer, optimizer, kind, message, report)
            return
        folder = os.path.join(
            self.report_dir or os.path.join(_emit.log_dir(trainer), "nan_report"), f"step_{step}"
        )
        self._state_override = last_good
        try:
            report["files"] = self._write(trainer, folder, report, culprit, kind, micro)
        finally:
            self._state_override = None
        self.last_report_dir = folder
        self._apply(trainer, optimizer, kind, message + f" Report: {folder}", report, folder)

    def _apply(
        self,
        trainer: pl.Trainer,
        optimizer: Any,
        kind: str,
        message: str,
        report: dict[str, Any],
        folder: str | None = None,
    ) -> None:
        if self.action == "raise":
            raise NonFiniteError(message, [a for a in self.alerts if a.kind == kind][-1:], report, folder)
        if self.action == "stop":  # Lightning ends the run after this batch (see the class docstring)
            trainer.should_stop = True
        if self.action in ("skip", "stop") and optimizer is not None and kind != "nonfinite_parameter":
            _drop_update(optimizer)  # under accumulation without an optimizer: at the step, via _poisoned

    def _local_findings(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        kind: str,
        optimizer: Any,
        can_replay: bool,
        micro: _MicroBatch,
    ) -> dict[str, Any]:
        """What this rank knows: its loss, its non-finite tensors, and the replayed origin."""
        loss = None if micro.loss is None else float(micro.loss.float().mean())
        if kind == "nonfinite_parameter":
            named = [(n, p.detach()) for n, p in pl_module.named_parameters()]
        elif optimizer is not None:
            stats = step_stats(trainer, pl_module, optimizer)
            named = list(zip(stats.grad_names, stats.grads, strict=True))
        else:  # a micro-batch under accumulation: the gradients summed so far
            named = _named_grads(trainer, pl_module)
        bad: list[dict[str, Any]] = []
        if named:
            norms = foreach_norms([t for _, t in named]).tolist()
            idx = [i for i, x in enumerate(norms) if not math.isfinite(x)]
            counts = nonfinite_counts([named[i][1] for i in idx]).tolist() if idx else []
            bad = [
                {"name": named[i][0], "nonfinite": int(c), "numel": int(named[i][1].numel())}
                for i, c in zip(idx, counts, strict=True)
            ]
        origin: dict[str, Any] | None = None
        if self.find_origin and can_replay and pl_module.automatic_optimization and micro.batch is not None:
            origin = self._replay(trainer, pl_module, kind, micro)
        history: list[dict[str, float]] = []
        if self._history is not None and self._history_steps:
            values = self._history.tolist()
            n = len(self._history_steps)
            history = [
                {"step": s, "total_grad_norm": values[(n - len(self._history_steps) + i) % self.history_size]}
                for i, s in enumerate(self._history_steps)
            ]
        return {
            "batch_idx": micro.batch_idx,
            "loss": loss,
            "learning_rates": [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers],
            "nonfinite_parameters": bad,
            "origin": origin,
            "history": history,
        }

    def _replay(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str, micro: _MicroBatch
    ) -> dict[str, Any] | None:
        batch, batch_idx = micro.batch, micro.batch_idx

        def run() -> Any:
            with trainer.precision_plugin.train_step_context(), quiet_logging(pl_module):
                out = pl_module.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, dict) else out

        try:
            forward = find_forward_origin(pl_module, run)
            if forward is not None:
                return {"phase": "forward", **forward.to_dict(), "description": forward.describe()}
            if kind in ("nonfinite_gradient", "loss_scale_collapse"):
                backward = find_backward_origin(pl_module, run)
                if backward is not None:
                    return {"phase": "backward", **backward.to_dict(), "description": backward.describe()}
        except Exception as err:  # forensics must never hide the real failure
            return {"phase": "unknown", "description": f"replay failed: {type(err).__name__}: {err}"}
        return None

    def _write(
        self,
        trainer: pl.Trainer,
        folder: str,
        report: dict[str, Any],
        culprit: int,
        kind: str,
        micro: _MicroBatch,
    ) -> dict[str, str]:
        files: dict[str, str] = {}
        if trainer.global_rank == culprit and self.save_batch and micro.batch is not None:
            os.makedirs(folder, exist_ok=True)
            files["batch"] = os.path.join(folder, "batch.pt")
            torch.save(apply_to_collection(micro.batch, Tensor, lambda t: t.detach().cpu()), files["batch"])
        if self.save_checkpoint and kind != "nonfinite_parameter":
            files["checkpoint"] = os.path.join(folder, "last_good.ckpt")
            trainer.save_checkpoint(files["checkpoint"])  # every rank calls it (a barrier under DDP)
        if self.save_batch and micro.batch is not None:
            files["batch"] = os.path.join(folder, "batch.pt")  # written by the culprit rank
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            files["report"] = os.path.join(folder, "report.json")
            with open(files["report"], "w", encoding="utf-8") as fh:
                json.dump({**report, "files": files}, fh, indent=2, default=str)
        return files

    @staticmethod
    def _message(report: dict[str, Any]) -> str:
        kind, step = report["kind"], report["step"]
        what = {
            "nonfinite_loss": f"the loss is {report['loss']}",
            "nonfinite_gradient": "gradients hold NaN/inf",
            "nonfinite_parameter": "parameters hold NaN/inf after the update",
            "loss_scale_collapse": "the GradScaler keeps skipping steps",
        }[kind]
        among = report.get("micro_batches") or []
        batch = f"batch {report['batch_idx']}" if not among else f"micro-batches {among[0]}-{among[-1]}"
        parts = [f"{kind} at step {step} (rank {report['rank']}, {batch}): {what}."]
        if among:
            if report["losses_checked"]:
                parts.append("Every loss of the step's micro-batches was finite.")
            parts.append(
                "Which micro-batch's backward made the gradients non-finite is not known "
                "(NaNSentinel(check_micro_batches=True) names it)."
            )
        bad = report["nonfinite_parameters"]
        if bad:
            listed = ", ".join(f"{b['name']} ({b['nonfinite']}/{b['numel']})" for b in bad[:_MAX_LISTED])
            more = f" and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
            label = "parameters" if kind == "nonfinite_parameter" else "gradients"
            parts.append(f"Non-finite {label}, in model order: {listed}{more}.")
        origin = report["origin"]
        if origin:
            parts.append(f"Origin: {origin['description']}.")
        if report["grad_scaler"]:
            gs = report["grad_scaler"]
            parts.append(
                f"Scale {gs['scale']:g}, {gs['consecutive']} consecutive skips, {gs['skipped_steps']} in all."
            )
        return " ".join(parts)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._state_override is not None:  # while the last-good checkpoint is written
            return dict(self._state_override)
        return {
            **super().state_dict(),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))


def _hint(kind: str, origin: dict[str, Any] | None, loss: float | None = None) -> str:
    """Advice for what was found, sharpened by where the value was born when the replay found it."""
    if kind == "nonfinite_gradient" and loss is not None and not math.isfinite(loss):
        kind = "nonfinite_loss"  # the loss went unchecked (check_loss=False): never claim it was finite
    if origin and origin.get("phase") == "forward" and origin.get("in_input"):
        return (
            "The batch itself holds NaN/inf (it entered the model that way): inspect the saved batch.pt and "
            "the data pipeline (missing values, division in preprocessing, corrupt samples); filter or "
            "impute them."
        )
    if origin and origin.get("phase") == "forward":
        return (
            f"`{origin.get('module')}` turned finite inputs into NaN/inf: guard its divisions, logs and sqrt "
            "(add eps, clamp), compute softmax/log-softmax stably, and check its parameters' scale. "
            + _HINTS[kind].split(". ", 1)[-1]
        )
    if origin and origin.get("phase") == "backward":
        return (
            f"The forward pass was finite; the backward of `{origin.get('op')}` made the first NaN/inf. "
            "Derivatives of sqrt/pow/log/div blow up at 0: add eps or clamp the input there."
        )
    return _HINTS[kind]


def _weights_note(kind: str, action: str) -> str:
    """What the report says about the weights at the time it was written."""
    if kind == "nonfinite_parameter":
        return "already non-finite: the update that caused it was applied"
    if action == "warn" and kind != "loss_scale_collapse":
        return "as after the last good step when written; action='warn' lets this step's update through"
    return "as after the last good step (the update was not applied)"


def _scaler_enabled(trainer: pl.Trainer) -> bool:
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return bool(scaler is not None and scaler.is_enabled())


def _named_grads(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, Tensor]]:
    """The gradients the optimizers hold now, by parameter name in model order (trainable ones only)."""
    wanted = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    return [
        (name, p.grad)
        for name, p in pl_module.named_parameters()
        if id(p) in wanted and p.requires_grad and p.grad is not None
    ]


def _drop_update(optimizer: Any) -> None:
    """Set every gradient of ``optimizer`` to ``None``: ``torch.optim`` optimizers then skip the update."""
    opt = getattr(optimizer, "optimizer", optimizer)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def _first_place(report: dict[str, Any]) -> str | None:
    origin = report.get("origin") or {}
    if origin.get("module") is not None and origin.get("phase") == "forward":
        return str(origin["module"]) or "<root>"
    if origin.get("op"):
        return str(origin["op"])
    bad = report.get("nonfinite_parameters") or []
    return str(bad[0]["name"]) if bad else None


def _gather(trainer: pl.Trainer, local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's findings, on every rank (one object all-gather under DDP)."""
    if trainer.world_size <= 1 or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return [local]
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, local)
    return out
