"""The alert kinds GradientNormLogger reports, declared once (their words: ``clipping``, ``ratio``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

CLIPPING_ALWAYS_ACTIVE = Rule(
    kind="clipping_always_active",
    severity="warning",
    monitor="GradientNormLogger",
    also=("info",),
    summary="gradient clipping fired on nearly every step: the threshold is too low",
    when=(
        "with `gradient_clip_val` set, at least 95 % of the last `clip_window` steps were clipped "
        "(checked once `min(100, clip_window)` steps were seen). The hint proposes the 90th "
        "percentile of recent pre-clip norms as the new threshold. Under an adaptive optimizer "
        "(Adam and its family) it is an `info` line: their step does not scale with the gradient, "
        "so a clip on every step (the usual `gradient_clip_val=1` of a small transformer) does not "
        "slow them."
    ),
)

CLIPPING_NEVER_ACTIVE = Rule(
    kind="clipping_never_active",
    severity="info",
    monitor="GradientNormLogger",
    summary="gradient clipping never fired: the threshold is far above every norm seen",
    when=(
        "a full window of `clip_window` steps (default 1000) without a single clip, and the largest"
        " norm below a tenth of `gradient_clip_val`: clipping guards nothing. When every norm of "
        "the window was exactly 0, the hint says that no parameter got a gradient."
    ),
)

UPDATE_RATIO_HIGH = Rule(
    kind="update_ratio_high",
    severity="warning",
    monitor="GradientNormLogger",
    summary="the update/weight ratio stayed far above ~1e-3: LR too high (GradientNormLogger)",
    when=(
        "the total update/weight ratio stayed above `max_update_ratio` (0.03, 30x the ~1e-3 of "
        "CS231n) on 3 logging checks in a row spanning 20 steps or more, from step 20 on; names the"
        " learning rate and suggests one (the weight decay instead, when `lr · weight_decay` alone "
        "is half the ratio or more). Measured: healthy digits runs held at most 0.024 for 20 steps "
        "(0.020 without the fine-tuned head at Adam 1e-2: an LSTM at Adam 3e-3), SGD at 10x its lr "
        "0.04-0.055. See [the learning-rate "
        "rule](optimizer.md#the-learning-rate-rule-gradientnormlogger)."
    ),
)

#: every kind this monitor reports
RULES = declare(CLIPPING_ALWAYS_ACTIVE, CLIPPING_NEVER_ACTIVE, UPDATE_RATIO_HIGH)
