"""The alert kinds OverfitBatchSanity reports, declared once (their words: ``findings``, ``diagnosis``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

OVERFIT_FAILED = Rule(
    kind="overfit_failed",
    severity="error",
    monitor="OverfitBatchSanity",
    also=("warning",),
    summary="OverfitBatchSanity: the model could not overfit one batch; findings and likely causes",
    when=(
        "the model could not drive the loss of one batch below the target within `max_steps`; the "
        "message lists the findings and likely causes. A warning when only `Adam(fallback_lr)` "
        "reached the target (the configured LR is too slow for the check) or the curve fell "
        "steadily and at least halved (a slow objective), unless the user's curve rose above its "
        "start: a curve that diverged, or blew up above 1.5x its start and stayed at chance or near"
        ' its start, is a too-high LR ("Lower the learning rate"), an error (a warning under a '
        "warm-up the check skipped). See [pre-flight "
        "checks](preflight.md#a-too-high-learning-rate)."
    ),
)

UNUSED_PARAMETER = Rule(
    kind="unused_parameter",
    severity="error",
    monitor="OverfitBatchSanity",
    also=(
        "warning",
        "info",
    ),
    summary="a trainable parameter never received a gradient (or only exact zeros)",
    when=(
        "error: a trainable parameter in the optimizer, in a module that ran, never got a gradient "
        "(a `.detach()`, a broken graph); warning: its gradient was exactly zero at every step, or "
        "it is in no param group / its module never ran in `training_step` (a frozen teacher); "
        "info: its module never ran in `training_step` and the code of `validation_step`, "
        "`test_step` or `predict_step` uses it (a validation-only head, read from the source)."
    ),
)

PARAMETER_NOT_UPDATED = Rule(
    kind="parameter_not_updated",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="a parameter with a gradient did not change (missing from the optimizer, lr 0)",
    when=(
        "a parameter with a gradient never changed: missing from the optimizer, its group has lr 0,"
        " or `optimizer.step()` computes no update for it."
    ),
)

UPDATE_BELOW_PRECISION = Rule(
    kind="update_below_precision",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="a parameter's updates were below its dtype's resolution: rounded away (bf16)",
    when=(
        "a parameter with a gradient never changed although the optimizer updates it: every update "
        "was below its dtype's resolution at its value and rounded away (BatchNorm weights at 1.0 "
        "under `precision=\"bf16-true\"`: Adam's ~1e-3 steps against bfloat16's spacing of 2^-7 = "
        "0.0078 there). The message gives the dtype, the typical value, the spacing there and the "
        'update\'s size; the hint: float32 master weights (`precision="bf16-mixed"`). See '
        "[pre-flight checks](preflight.md#findings)."
    ),
)

INITIAL_LOSS_MISMATCH = Rule(
    kind="initial_loss_mismatch",
    severity="error",
    monitor="OverfitBatchSanity",
    also=(
        "warning",
        "info",
    ),
    summary="a classifier's initial loss is far from ln(C) (wrong loss, reduction or init)",
    when=(
        "error: the loss is N times the cross-entropy of the logits (a summed instead of averaged "
        "loss); warning: a plain cross-entropy far above ln C (bad init or logits scale); info: far"
        " below ln C (a pretrained model). No verdict when the loss is not the plain cross-entropy "
        "(label smoothing, focal, multi-label)."
    ),
)

BATCH_MIXING = Rule(
    kind="batch_mixing",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="the output of one sample depends on the input of another sample",
    when=("with `check_batch_mixing=True`: one sample's output depends on another sample's input."),
)

LABELS_UNSTABLE = Rule(
    kind="labels_unstable",
    severity="error",
    monitor="OverfitBatchSanity",
    summary="the same samples fetched again came back with other labels",
    when=("the first batch's samples fetched again came back with the same inputs and other labels."),
)

GRADIENT_NOT_SHRINKING = Rule(
    kind="gradient_not_shrinking",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="the batch was learned but the gradient norm did not shrink",
    when=(
        "the batch was learned to 1 % of its initial loss or less (targets of 1 % or below; the "
        "default target of 10 % stops the trial first) and the last gradient norm is at or above "
        "both the first and the median of the run. Judged only there: a cross-entropy's gradient "
        "grows while the logits sharpen (healthy digits runs: 0.16-1.17x the first norm at 10 % of "
        "the initial loss, 0.03-0.28x at 1 %, measured)."
    ),
)

OVERFIT_UNSTABLE = Rule(
    kind="overfit_unstable",
    severity="warning",
    monitor="OverfitBatchSanity",
    summary="OverfitBatchSanity: the loss rose far above its start before the batch was learned",
    when=(
        "the batch was learned, but on the way the loss rose above 1.5x its start: the LR "
        "overshoots and the trial bounced into the target. Healthy trials measured never rose above"
        " their first loss; too-high LRs rose 3-15x (measured, see [pre-flight "
        "checks](preflight.md#findings))."
    ),
)

#: every kind this monitor reports
RULES = declare(
    OVERFIT_FAILED,
    UNUSED_PARAMETER,
    PARAMETER_NOT_UPDATED,
    UPDATE_BELOW_PRECISION,
    INITIAL_LOSS_MISMATCH,
    BATCH_MIXING,
    LABELS_UNSTABLE,
    GRADIENT_NOT_SHRINKING,
    OVERFIT_UNSTABLE,
)
