"""Pure tensor math behind the callbacks: no Trainer, usable from a plain PyTorch loop.

Example::

    from lightning_gradguard.functional import group_index, grouped_norms, layer_names

    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    layers, index = group_index(layer_names([n for n, _ in named]))
    per_param, per_layer, total = grouped_norms([g for _, g in named], index)
"""

from lightning_gradguard.functional.stats import (
    HistogramSpec,
    device_histograms,
    foreach_norms,
    group_index,
    grouped_norms,
    layer_name,
    layer_names,
    nonfinite_counts,
    percentile,
    reduce_norms,
    suggest_clip_value,
    total_norm,
)

__all__ = [
    "HistogramSpec",
    "device_histograms",
    "foreach_norms",
    "group_index",
    "grouped_norms",
    "layer_name",
    "layer_names",
    "nonfinite_counts",
    "percentile",
    "reduce_norms",
    "suggest_clip_value",
    "total_norm",
]
