"""OptimizerMonitor's tag families and charts: declarations (no torch)."""

from __future__ import annotations

from lightning_gradguard.tags import ACROSS_LAYERS, PER_LAYER, Chart, Family

OPTIMIZER = Family("optimizer", "OptimizerMonitor")

FAMILIES: tuple[Family, ...] = (OPTIMIZER,)

CHARTS: tuple[Chart, ...] = (
    Chart(
        "Optimizer step size across all layers: min / median / max",
        (OPTIMIZER.tag("step_size", ACROSS_LAYERS, ".*"),),
        "OptimizerMonitor",
        "capped",
    ),
    Chart(
        "Optimizer cos(update, -gradient) across all layers: min / median / max",
        (OPTIMIZER.tag("update_cosine", ACROSS_LAYERS, ".*"),),
        "OptimizerMonitor",
        "capped",
    ),
    Chart(
        "Optimizer step size (update norm / lr): total",
        (OPTIMIZER.tag("step_size", "total.*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "Optimizer step size (update norm / lr) per layer",
        (OPTIMIZER.tag("step_size", PER_LAYER),),
        "OptimizerMonitor",
    ),
    Chart(
        "cos(update, -gradient) per layer and total (1 = plain SGD)",
        (OPTIMIZER.tag("update_cosine", ".*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "Optimizer moments: total exp_avg and momentum_buffer norms",
        (OPTIMIZER.tag("exp_avg_norm", "total.*"), OPTIMIZER.tag("momentum_norm", "total.*")),
        "OptimizerMonitor",
    ),
    Chart("Adam exp_avg norm per layer", (OPTIMIZER.tag("exp_avg_norm", PER_LAYER),), "OptimizerMonitor"),
    Chart(
        "Adam RMS of sqrt(v_hat) per layer, to compare with eps (use the log y axis)",
        (OPTIMIZER.tag("exp_avg_sq_rms", ".*"),),
        "OptimizerMonitor",
    ),
    Chart(
        "SGD momentum_buffer norm per layer",
        (OPTIMIZER.tag("momentum_norm", PER_LAYER),),
        "OptimizerMonitor",
    ),
    Chart(
        "Skipped optimizer updates by cause (cumulative)",
        (OPTIMIZER.tag("skipped_updates", ".*"),),
        "OptimizerMonitor",
    ),
)

#: a chart's ``only`` setting -> the argument that turns it on, in words (docs/tags.md's layout table)
SWITCHES: dict[str, str] = {"capped": "`max_layers`"}
