"""Pure tensor math behind the callbacks: no Trainer, no hooks, no state, usable from a plain PyTorch loop.

* ``stats``: grouped gradient/weight norms, non-finite counts, on-device histograms, clip suggestions;
* ``health``: robust baselines, spike and growth tests, gradient flow, dead-unit and saturation counts;
* ``gradcheck``: symmetric finite differences and the Taylor test, in float64, on any closure;
* ``lr_suggest``: the LR range test's sweep, smoothing and suggestions;
* ``overfit``: the overfit-one-batch check's reading of a loss curve;
* ``tree``: the tensors in nested batches and outputs;
* ``updates`` (the update of a step from a weight snapshot, ``||delta w|| / ||w||``), ``clipping``
  (clip-window statistics), ``spikes`` (a robust spike score), ``layers`` (which layers to show under a cap),
  ``optimizer_state`` (step size, update cosine, Adam's moments per layer, Adam's per-entry step bound),
  ``noise_scale`` (the gradient noise scale's estimator) and ``activation_range`` (block output moments, fp16
  headroom, the largest attention logit and the attention entropy): the math under the monitors, importable by
  module; their names are not re-exported here. The monitors' rules in words live in their own packages.

Example::

    from lightning_gradguard.functional import group_index, grouped_norms, layer_names

    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    layers, index = group_index(layer_names([n for n, _ in named]))
    per_param, per_layer, total = grouped_norms([g for _, g in named], index)
"""

from lightning_gradguard.functional.gradcheck import (
    DirectionalResult,
    FiniteDifferenceResult,
    TaylorCheckResult,
    TaylorResult,
    directional_difference,
    finite_difference_check,
    observed_order,
    relative_error,
    sample_coordinates,
    taylor_check,
    taylor_test,
)
from lightning_gradguard.functional.health import (
    SATURATION_BOUNDS,
    SLIVER_SHARE,
    activity_counts,
    class_profile,
    dead_units,
    depth_ratio,
    ema,
    gradient_flow,
    growth_factor,
    label_lean,
    log10_norms,
    robust_baseline,
    saturation_counts,
    sizeable_share,
    spike_ratio,
    unit_dim,
)
from lightning_gradguard.functional.lr_suggest import (
    SUGGESTION_METHODS,
    centered_smooth,
    ema_smooth,
    suggest_all,
    suggest_minimum,
    suggest_slide,
    suggest_steep,
    suggest_valley,
    sweep_lrs,
)
from lightning_gradguard.functional.stats import (
    HistogramSpec,
    container_modules,
    dense_values,
    device_histograms,
    foreach_norms,
    group_index,
    grouped_norms,
    layer_name,
    layer_names,
    module_label,
    nonfinite_counts,
    percentile,
    reduce_norms,
    suggest_clip_value,
    total_norm,
)

__all__ = [
    "SATURATION_BOUNDS",
    "SLIVER_SHARE",
    "SUGGESTION_METHODS",
    "DirectionalResult",
    "FiniteDifferenceResult",
    "HistogramSpec",
    "TaylorCheckResult",
    "TaylorResult",
    "activity_counts",
    "centered_smooth",
    "class_profile",
    "container_modules",
    "dead_units",
    "dense_values",
    "depth_ratio",
    "device_histograms",
    "directional_difference",
    "ema",
    "ema_smooth",
    "finite_difference_check",
    "foreach_norms",
    "gradient_flow",
    "group_index",
    "grouped_norms",
    "growth_factor",
    "label_lean",
    "layer_name",
    "layer_names",
    "log10_norms",
    "module_label",
    "nonfinite_counts",
    "observed_order",
    "percentile",
    "reduce_norms",
    "relative_error",
    "robust_baseline",
    "sample_coordinates",
    "saturation_counts",
    "sizeable_share",
    "spike_ratio",
    "suggest_all",
    "suggest_clip_value",
    "suggest_minimum",
    "suggest_slide",
    "suggest_steep",
    "suggest_valley",
    "sweep_lrs",
    "taylor_check",
    "taylor_test",
    "total_norm",
    "unit_dim",
]
