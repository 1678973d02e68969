"""The alert kind LRFinderPlus reports, declared once (its words: ``callback``)."""

from __future__ import annotations

from lightning_gradguard.alerts import Rule, declare

LR_FINDER_FAILED = Rule(
    kind="lr_finder_failed",
    severity="warning",
    monitor="LRFinderPlus",
    summary="the LR range test gave no suggestion; the learning rate was left unchanged",
    when=(
        "the range test gave no suggestion (too few points before divergence or NaN, a curve that "
        "never falls, a fall smaller than 6 times its own noise (measured margins: a loss that "
        "cannot fall ≤ 5.1 with 20 to 100 points, models learning at batch size ≥ 4 ≥ 7.8), an "
        "unsupported setup); the learning rate is left as it was. See [LR finder](lr_finder.md)."
    ),
)

#: every kind this monitor reports
RULES = declare(LR_FINDER_FAILED)
