"""The one way out to the loggers.

* Scalars go to every logger attached to the trainer (TensorBoard, CSV, W&B, anything with
  ``log_metrics``), rank zero only.
* Histograms, alert text and the custom-scalars layout go to TensorBoard writers only.
* With no logger at all, scalars are skipped with one info line; alerts still reach Python logging and
  the JSON-lines file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.loggers.tensorboard import TensorBoardLogger as _FabricTensorBoardLogger
from torch import Tensor

from lightning_gradguard.core.state import raised_in_strict, trainer_state, warn_once

log = logging.getLogger("lightning_gradguard")

LAYOUT_CATEGORY = "GradGuard"


def safely(trainer: pl.Trainer, what: str, write: Any) -> None:
    """Run one write to a logger; a failing logger (a full disk, a network error) costs that write only.

    What we log is a copy of what we measured: losing it must never crash the run, nor skip the decision
    that follows it (under DDP the other ranks take that decision too). One warning per kind of write.
    """
    try:
        write()
    except Exception as err:
        if raised_in_strict(err):
            raise
        warn_once(
            trainer,
            f"emit:{what}",
            f"lightning_gradguard could not write {what} ({type(err).__name__}: {err}); training goes on.",
        )


#: what torch's serializer (``torch.save``, ``Trainer.save_checkpoint``) raises when a write fails
TORCH_IO_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError)


def write_file(
    trainer: pl.Trainer,
    path: str,
    write: Callable[[], Any],
    *,
    environmental: tuple[type[BaseException], ...] = (OSError,),
) -> bool:
    """Run one forensic write to ``path`` (a report, a batch, a checkpoint, a record); ``True`` when it was
    written.

    A write is a courtesy; what follows it (a NaN's stop, a skip, the alert) is the promise. Its failure
    becomes one warning naming the path, and the caller goes on. Under ``GRADGUARD_STRICT=1`` a failure of
    our code is raised, one of the environment (``environmental``) is not: see
    :func:`~lightning_gradguard.core.state.raised_in_strict`.
    """
    try:
        write()
    except Exception as err:
        if raised_in_strict(err, environmental):
            raise
        warn_once(
            trainer,
            f"write:{path}",
            f"lightning_gradguard could not write {path} ({type(err).__name__}: {err}); nothing waits on it: "
            "the stop, the skip or the alert happens as it would have.",
        )
        return False
    return True


def is_rank_zero(trainer: pl.Trainer) -> bool:
    return bool(trainer.is_global_zero)


#: TensorBoard's Custom Scalars reads a line's run back from its label "tag (run)" with ``\((.*)\)$``: a
#: "(" inside the tag ("dead_relu/relu(hidden1)") makes it take the wrong run and draw nothing
_TAG_SAFE = str.maketrans("()", "[]")


def safe_tag(tag: str) -> str:
    """``tag`` as every chart can draw it: parentheses become brackets (``relu(h1)`` -> ``relu[h1]``)."""
    return tag.translate(_TAG_SAFE)


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Send plain-float scalars to every attached logger at ``step`` (rank zero only; tags made safe)."""
    if not metrics or not is_rank_zero(trainer):
        return
    metrics = {safe_tag(k): v for k, v in metrics.items()}
    if not trainer.loggers:
        state = trainer_state(trainer)
        if not state.said_no_logger:
            state.said_no_logger = True
            log.info(
                "lightning_gradguard: the trainer has no logger, so scalars and histograms are not recorded; "
                "alerts still go to Python logging and %s",
                alerts_path(trainer),
            )
        return
    trainer_state(trainer).logged_tags.update(metrics)
    for logger in trainer.loggers:
        safely(
            trainer,
            f"scalars to {type(logger).__name__}",
            lambda lg=logger: _write_packed(lg, metrics, step) or lg.log_metrics(dict(metrics), step=step),
        )


def _write_packed(logger: Any, metrics: Mapping[str, float], step: int) -> bool:
    """All of a step's scalars in one TensorBoard event (one summary, many values), where
    ``TensorBoardLogger.log_metrics`` writes one event per scalar: about 20x less time for 100 scalars
    (0.3 ms instead of 5.8) and a smaller file; TensorBoard reads both alike. Only for the stock logger
    on torch's ``SummaryWriter`` without a ``prefix`` (``False``: the caller uses ``log_metrics``)."""
    if not isinstance(logger, _FabricTensorBoardLogger) or type(logger).log_metrics is not _STOCK_LOG_METRICS:
        return False
    writer = logger.experiment
    if getattr(logger, "_prefix", "") or not type(writer).__module__.startswith("torch.utils.tensorboard"):
        return False
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
    writer._get_file_writer().add_summary(Summary(value=values), step)
    return True


_STOCK_LOG_METRICS = _FabricTensorBoardLogger.log_metrics


def tensorboard_writers(trainer: pl.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger on the trainer (empty off rank zero)."""
    if not is_rank_zero(trainer):
        return []
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, _FabricTensorBoardLogger)]


def log_histogram_raw(
    trainer: pl.Trainer,
    tag: str,
    stats: Sequence[float] | Tensor,
    edges: Sequence[float] | Tensor,
    counts: Sequence[float] | Tensor,
    step: int,
) -> None:
    """One histogram from host values computed on the device (see ``functional.device_histograms``).

    ``stats`` is ``(min, max, num, sum, sum_squares)``, ``edges`` has one more entry than ``counts``.
    An empty histogram (no finite values) is skipped: TensorBoard cannot draw it.
    """
    lo, hi, num, total, sumsq = (float(x) for x in stats)
    edges = [float(e) for e in edges]
    if num <= 0:
        return
    limits = edges[1:]
    bucket_counts = [float(c) for c in counts]
    if hi <= lo:  # a constant tensor: one bucket
        limits, bucket_counts = [hi], [num]
    for writer in tensorboard_writers(trainer):
        safely(
            trainer,
            "a histogram to TensorBoard",
            lambda w=writer: w.add_histogram_raw(
                safe_tag(tag),
                min=lo,
                max=hi,
                num=int(num),
                sum=total,
                sum_squares=sumsq,
                bucket_limits=limits,
                bucket_counts=bucket_counts,
                global_step=step,
            ),
        )


def log_text(trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
    """Markdown text under exactly ``tag`` (``add_text`` would append ``/text_summary`` to it)."""
    from torch.utils.tensorboard.summary import text as text_summary

    def write(writer: Any) -> None:
        try:
            summary = text_summary(tag, text)
            summary.value[0].tag = tag
            writer._get_file_writer().add_summary(summary, step)
        except (AttributeError, IndexError):  # a writer without the private file-writer API
            writer.add_text(tag, text, global_step=step)

    for writer in tensorboard_writers(trainer):
        safely(trainer, "text to TensorBoard", lambda w=writer: write(w))


def write_layout(trainer: pl.Trainer, charts: Mapping[str, Sequence[str]], replace: bool = False) -> None:
    """Write the "GradGuard" custom-scalars layout once per TensorBoard writer.

    ``charts`` maps a chart title to tag regular expressions (TensorBoard matches them as regexes).
    ``replace=True`` writes it again (TensorBoard shows the run's latest layout).
    """
    state = trainer_state(trainer)
    for writer in tensorboard_writers(trainer):
        if id(writer) in state.layout_written and not replace:
            continue
        state.layout_written.add(id(writer))
        layout = {LAYOUT_CATEGORY: {title: ["Multiline", list(tags)] for title, tags in charts.items()}}
        safely(trainer, "the custom-scalars layout", lambda w=writer, lay=layout: w.add_custom_scalars(lay))


def log_dir(trainer: pl.Trainer) -> str:
    """Where this run's logs live: the first logger's ``log_dir``, else the trainer's root dir."""
    for logger in trainer.loggers:
        path = getattr(logger, "log_dir", None)
        if path:
            return os.fspath(path)
    return os.fspath(trainer.default_root_dir)


def alerts_path(trainer: pl.Trainer) -> str:
    return os.path.join(log_dir(trainer), "gradguard_alerts.jsonl")
