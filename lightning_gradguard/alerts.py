"""Alerts: one record for every finding, the sinks they go to, and the error types.

Every callback reports what it finds as an :class:`Alert`. The alert is appended to the callback's
``alerts`` list and fanned out to the sinks: Python logging (logger ``lightning_gradguard``), TensorBoard
(a Markdown row under the ``gradguard/alerts`` text tag plus a per-kind count scalar ``alerts/<kind>``)
and a JSON-lines file beside the run's logs. What happens next is the callback's ``action``:
``"warn"`` (only report), ``"stop"`` (ask the trainer to stop) or ``"raise"`` (raise a
:class:`GradGuardError` subclass from the hook).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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

#: The stable vocabulary of alert kinds. New kinds are added; existing ones are never renamed.
ALERT_KINDS: dict[str, str] = {
    "nonfinite_loss": "the loss was NaN/inf before backward (NaNSentinel)",
    "nonfinite_gradient": "a gradient held NaN/inf before the optimizer step (NaNSentinel)",
    "nonfinite_parameter": "a parameter held NaN/inf after an optimizer step (NaNSentinel)",
    "loss_scale_collapse": "the 16-mixed GradScaler scale fell below its floor or kept skipping",
    "clipping_always_active": "gradient clipping fired on nearly every step: the threshold is too low",
    "clipping_never_active": "gradient clipping never fired: the threshold is far above every norm seen",
    "exploding_gradient": "grad norm over its ceiling, a spike over the run's baseline, or a sustained rise",
    "vanishing_gradient": "gradients vanish: first/last layer ratio under a floor, or a layer far below",
    "dead_relu": "most units of a ReLU layer output 0 for every sample over a window of sampled batches",
    "saturated_activation": "most units of a sigmoid/tanh layer sit where the derivative is numerically 0",
    "overfit_failed": "OverfitBatchSanity: the model could not overfit one batch; findings and likely causes",
    "unused_parameter": "a trainable parameter never received a gradient (or only exact zeros)",
    "parameter_not_updated": "a parameter with a gradient did not change (missing from the optimizer, lr 0)",
    "update_below_precision": "a parameter's updates were below its dtype's resolution: rounded away (bf16)",
    "initial_loss_mismatch": "a classifier's initial loss is far from ln(C) (wrong loss, reduction or init)",
    "batch_mixing": "the output of one sample depends on the input of another sample",
    "labels_unstable": "the same samples fetched again came back with other labels",
    "gradient_not_shrinking": "the batch was learned but the gradient norm did not shrink",
    "overfit_unstable": "OverfitBatchSanity: the loss rose far above its start before the batch was learned",
    "gradient_mismatch": "GradientCheck: autograd and finite differences disagree for a parameter",
    "loss_spike": "LossSpikeGuard: a step's loss or gradient norm spiked far above the recent steps",
    "early_divergence": "LossSpikeGuard: in the first steps the loss climbed and stayed far above its start",
    "batch_statistics_outlier": "LossSpikeGuard: a batch's BatchNorm variance was far off the running one",
    "lr_finder_failed": "the LR range test gave no suggestion; the learning rate was left unchanged",
    "no_update": "StallDetector: every update was exactly 0 on consecutive checks (nothing moves)",
    "clipped_updates": "StallDetector: the gradient the optimizer used was far smaller than the raw one",
    "lr_decayed": "StallDetector: the LR fell ~100x early in the run and the updates collapsed with it",
    "updates_collapsed": "StallDetector: most layers' updates collapsed while the LR did not",
    "chance_level": "StallDetector: the training loss stayed at the chance level after the warm-up",
    "loss_plateau": "StallDetector: the smoothed loss stopped improving far above its best or initial level",
    "lr_jump": "StallDetector: the LR went far past the highest LR it was configured with",
    "warmup_never_ends": "StallDetector: the LR never rose above a few percent of its configured value",
    "warmup_missing": "StallDetector: a transformer at its full LR from step 0 rewrote far too much a step",
    "sorted_labels": "StallDetector: batches came one class at a time (a loader sorted by class)",
    "weight_decay_collapse": "StallDetector: weight decay outweighed the gradient, shrank most layers 10x+",
    "fp16_headroom_low": "under 16-mixed, a block's output came within a few bits of float16's overflow",
    "attention_logit_growth": "the largest attention logit passed its ceiling or grew fast toward it",
    "attention_entropy_collapse": "an attention module's entropy fell near 0: each query attends to ~one key",
    "adam_epsilon_dominates": "Adam's eps outweighs a layer's typical sqrt(v_hat) (OptimizerMonitor)",
    "update_ratio_outlier": "a layer's update/weight ratio is far from the median layer's (OptimizerMonitor)",
    "adam_step_too_large": "an Adam entry moved far more than lr allows: beta2 <= beta1^2 (OptimizerMonitor)",
    "parameters_not_in_optimizer": "trainable parameters got a gradient but no optimizer holds them",
    "update_ratio_high": "the update/weight ratio stayed far above ~1e-3: LR too high (GradientNormLogger)",
}

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
        kind: what was found, from :data:`ALERT_KINDS` (stable strings, safe to match on).
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

    def format(self) -> str:
        """One human line: severity, kind, place, step, message and hint."""
        where = f" at {self.where}" if self.where else ""
        return f"[{self.severity}] {self.kind}{where} (step {self.step}): {self.message} Hint: {self.hint}"

    def markdown(self) -> str:
        """A Markdown rendering for TensorBoard's text tab."""
        where = f" at `{self.where}`" if self.where else ""
        return (
            f"**{self.severity.upper()}** `{self.kind}`{where}, step {self.step} "
            f"({self.source})  \n{self.message}  \n*Hint:* {self.hint}"
        )


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
    """Appends one JSON object per alert to ``path`` (directories created on first write)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __call__(self, alert: Alert) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(alert.to_dict(), sort_keys=True) + "\n")
