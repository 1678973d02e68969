"""Grouped gradient and weight statistics computed on the device in a few fused kernels.

Everything here takes plain tensors and returns tensors that stay on the device: no ``.item()``, no
``.cpu()``, no Python loop that launches one kernel per parameter for the common statistics. Bringing
values to the host is the caller's decision (the callbacks do it at most once per logging step).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"`norm_type` must be a positive number or 'inf', got {norm_type!r}")
    return norm_type


#: a tensor's ``(device, dtype, layout)``
_KIND = operator.attrgetter("device", "dtype", "layout")

#: the name FSDP1 (``use_orig_params=False``) gives the one flat parameter of each wrapped unit
_FLAT_PARAM = "_flat_param"


def layer_name(param_name: str, depth: int | None = None, container: bool = False) -> str:
    """The layer a parameter belongs to: the module that owns it, optionally cut to ``depth`` levels.

    ``"encoder.blocks.3.attn.qkv.weight"`` belongs to ``"encoder.blocks.3.attn.qkv"``; with ``depth=2``
    to ``"encoder.blocks"``. A parameter is its own layer, named by its qualified name, when it is
    registered directly on the root module (``"cls_token"``) or on a ``container``: a module that also
    has child modules with parameters, such as a ViT's ``"encoder.pos_embed"`` beside
    ``"encoder.blocks"`` (naming it ``"encoder"`` would pass it off as the whole encoder). FSDP1's
    ``_flat_param`` always stands for its module. :func:`layer_names` finds the containers itself.
    """
    if depth is not None and depth < 1:
        raise ValueError(f"`depth` must be None or an integer >= 1, got {depth!r}")
    owner, sep, local = param_name.rpartition(".")
    own_layer = not sep or (container and local != _FLAT_PARAM)
    label = param_name if own_layer else owner
    if depth is None:
        return label
    return ".".join(label.split(".")[:depth])


def container_modules(param_names: Sequence[str]) -> frozenset[str]:
    """The owners of ``param_names`` that are also the ancestor of another owner: modules holding
    parameters of their own beside child modules with parameters (``"net"`` for ``"net.pos_embed"`` and
    ``"net.blocks.0.weight"``). Decided from the names alone; the root (``""``) is never listed."""
    owners = {name.rpartition(".")[0] for name in param_names}
    ancestors: set[str] = set()
    for owner in owners:
        parts = owner.split(".")
        ancestors.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return frozenset(owners & ancestors)


#: name parts that wrappers add and users never wrote: torch.compile's ``OptimizedModule``, FSDP1's and
#: activation checkpointing's wrappers
WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def clean_name(name: str) -> str:
    """A module or parameter name as the user wrote it: wrapper parts left out
    (``net._orig_mod.0.weight`` -> ``net.0.weight``)."""
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def module_label(qualified_name: str, root: object) -> str:
    """A module's name as users read it: :func:`clean_name`, and the root module, whose qualified name is
    ``""``, named by its class (``"MyModel"``, for ``root`` a ``MyModel``) instead of by nothing."""
    return clean_name(qualified_name) or type(root).__name__


def layer_names(
    param_names: Sequence[str], depth: int | None = None, among: Sequence[str] | None = None
) -> list[str]:
    """:func:`layer_name` for every name, in order, the containers found by :func:`container_modules`.

    ``among``: more parameter names that tell which modules are containers. Pass every parameter of the
    model when ``param_names`` is a subset (those with a gradient, say), so that a parameter gets the
    same layer in both lists.
    """
    containers = container_modules(param_names if among is None else [*param_names, *among])
    if not containers:
        return [layer_name(n, depth) for n in param_names]
    return [layer_name(n, depth, n.rpartition(".")[0] in containers) for n in param_names]


def group_index(labels: Sequence[str]) -> tuple[list[str], list[int]]:
    """Unique labels in first-seen order and, for each input, the position of its label."""
    order: dict[str, int] = {}
    index = [order.setdefault(label, len(order)) for label in labels]
    return list(order), index


def foreach_norms(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Per-tensor p-norms as one float32 vector on the first tensor's device.

    Tensors are grouped by (device, dtype) and each group is reduced by one ``torch._foreach_norm``
    call, so a model with hundreds of parameters costs a handful of kernel launches. A tensor holding a
    NaN gets a NaN norm, one holding an inf gets an inf norm: finiteness of the result is finiteness
    of the input.
    """
    if norm_type != 2.0:  # the usual 2-norm needs no check
        norm_type = _check_norm_type(norm_type)
    if len(tensors) == 0:
        return torch.zeros(0)
    kinds = set(map(_KIND, tensors))  # one pass, C calls only (no Python call per tensor)
    if len(kinds) == 1 and next(iter(kinds))[2] == torch.strided and not math.isinf(norm_type):
        norms = torch.stack(torch._foreach_norm(list(tensors), norm_type))  # the usual case: one kernel
        return norms if norms.dtype == torch.float32 else norms.float()
    return _grouped_foreach_norms(dense_values(tensors), norm_type)


def _grouped_foreach_norms(tensors: list[Tensor], norm_type: float) -> Tensor:
    """:func:`foreach_norms` of tensors on several devices or of several dtypes, or of empty pieces under
    the infinity norm: one ``_foreach_norm`` per (device, dtype)."""
    if math.isinf(norm_type) and any(t.numel() == 0 for t in tensors):  # a shard can be empty: norm 0
        tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    out_device = tensors[0].device
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    if len(buckets) == 1:
        return torch.stack(torch._foreach_norm(list(tensors), norm_type)).float()
    out = torch.empty(len(tensors), dtype=torch.float32, device=out_device)
    for idx in buckets.values():
        norms = torch.stack(torch._foreach_norm([tensors[i] for i in idx], norm_type)).float()
        out[torch.tensor(idx, device=out_device)] = norms.to(out_device, non_blocking=True)
    return out


def dense_values(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` with every sparse tensor replaced by its stored values (``nn.Embedding(sparse=True)``).

    The implicit zeros of a sparse gradient change no norm and hold no NaN/inf, so norms and finiteness
    of the values are those of the whole tensor; a histogram of them leaves the zeros out.
    """
    if not any(t.layout != torch.strided for t in tensors):
        return list(tensors)
    return [t.coalesce().values() if t.is_sparse else t for t in tensors]


def reduce_norms(norms: Tensor, index: Tensor, num_groups: int, norm_type: float = 2.0) -> Tensor:
    """Combine per-tensor norms into per-group norms (group ``index[i]`` owns ``norms[i]``).

    The result equals the norm of each group's tensors concatenated into one vector.
    """
    norm_type = _check_norm_type(norm_type)
    if math.isinf(norm_type):
        init = torch.zeros(num_groups, dtype=norms.dtype, device=norms.device)
        return init.scatter_reduce(0, index, norms, reduce="amax", include_self=True)
    powered = norms.pow(norm_type)
    summed = torch.zeros(num_groups, dtype=norms.dtype, device=norms.device).index_add_(0, index, powered)
    return summed.pow(1.0 / norm_type)


def norm_shares(norms: Tensor, copies: Tensor, norm_type: float = 2.0) -> Tensor:
    """One rank's shares of whole-tensor norms, from the norms of its pieces (sharded training).

    ``norms[i]`` is the norm of this rank's piece of tensor ``i``, ``copies[i]`` how many ranks hold each
    of its entries. The share is ``norms ** p / copies``: summed over the ranks it is the p-th power of
    the whole tensor's norm. For the infinity norm the share is the piece's norm (combined by a max).
    """
    norm_type = _check_norm_type(norm_type)
    if math.isinf(norm_type):
        return norms
    return norms.pow(norm_type) / copies.to(norms.device, norms.dtype)


def group_shares(shares: Tensor, index: Tensor, num_groups: int, norm_type: float = 2.0) -> Tensor:
    """Per-group shares (group ``index[i]`` owns ``shares[i]``): sums, or maxima for the infinity norm."""
    norm_type = _check_norm_type(norm_type)
    out = torch.zeros(num_groups, dtype=shares.dtype, device=shares.device)
    if math.isinf(norm_type):
        return out.scatter_reduce(0, index, shares, reduce="amax", include_self=True)
    return out.index_add_(0, index, shares)


def total_share(shares: Tensor, norm_type: float = 2.0) -> Tensor:
    """The share of all tensors together (0-dim): the sum, or the maximum for the infinity norm."""
    norm_type = _check_norm_type(norm_type)
    if shares.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=shares.device)
    return shares.amax() if math.isinf(norm_type) else shares.sum()


def total_norm(norms: Tensor, norm_type: float = 2.0) -> Tensor:
    """The norm of all tensors together, from their per-tensor norms (a 0-dim tensor)."""
    norm_type = _check_norm_type(norm_type)
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=norms.device)
    return torch.linalg.vector_norm(norms, ord=norm_type)


def grouped_norms(
    tensors: Sequence[Tensor], index: Sequence[int], norm_type: float = 2.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tensor norms, per-group norms and the total norm in one pass.

    Args:
        tensors: the tensors (e.g. gradients), any devices and dtypes.
        index: for each tensor, the group it belongs to (``0 .. G-1``), e.g. from :func:`group_index`.
        norm_type: 2.0 (Euclidean), ``float("inf")`` (max-abs) or any positive p.

    Returns:
        ``(per_tensor[N], per_group[G], total[])``, float32, on the first tensor's device.
    """
    if len(index) != len(tensors):
        raise ValueError(f"`index` has {len(index)} entries for {len(tensors)} tensors")
    per_tensor = foreach_norms(tensors, norm_type)
    idx = torch.tensor(list(index), dtype=torch.long).to(per_tensor.device, non_blocking=True)
    num_groups = max(index) + 1 if len(index) else 0
    per_group = reduce_norms(per_tensor, idx, num_groups, norm_type)
    return per_tensor, per_group, total_norm(per_tensor, norm_type)


def nonfinite_counts(tensors: Sequence[Tensor]) -> Tensor:
    """Number of NaN/inf elements in each tensor (int64 vector on the first tensor's device).

    One kernel per tensor: meant for the rare step where a norm already came out non-finite.
    """
    if len(tensors) == 0:
        return torch.zeros(0, dtype=torch.long)
    tensors = dense_values(tensors)
    device = tensors[0].device
    return torch.stack([(~torch.isfinite(t)).sum().to(device) for t in tensors])


@dataclass(frozen=True)
class HistogramSpec:
    """Device-side histograms of many tensors, ready for TensorBoard's ``add_histogram_raw``.

    Row ``i`` describes tensor ``i``: ``stats[i] = (min, max, num, sum, sum_squares)`` over its finite
    values (non-zero finite values for a log10 histogram), ``edges[i]`` the ``bins + 1`` bucket
    edges, ``counts[i]`` the ``bins`` counts, ``nonfinite[i]`` how many NaN/inf it held.
    """

    stats: Tensor
    edges: Tensor
    counts: Tensor
    nonfinite: Tensor


def device_histograms(
    tensors: Sequence[Tensor],
    bins: int = 64,
    log10: bool = False,
    chunk_elements: int = 1 << 24,
    method: str = "auto",
) -> HistogramSpec:
    """Histograms of every tensor at once, on the device: one concatenation, one bincount per chunk.

    Tensors are processed in chunks of about ``chunk_elements`` entries so the temporary
    concatenation stays bounded for large models. Non-finite values are excluded from the buckets
    and counted in ``nonfinite``. With ``log10=True`` the values are ``log10(|x|)`` of the non-zero
    finite entries, which spreads gradients that span many decades (vanishing layers) over a
    readable axis.

    ``method``: ``"fused"`` bins every tensor together (a handful of kernels, no host round trip: the
    right choice on a GPU), ``"per_tensor"`` runs one ``aminmax`` + ``histc`` per tensor (about 10x
    faster on a CPU, where there is no sync to avoid; three host reads per tensor elsewhere), ``"auto"``
    (default) takes it only when every tensor is on the CPU. Both give the same buckets.
    """
    if bins < 1:
        raise ValueError(f"`bins` must be >= 1, got {bins!r}")
    tensors = dense_values(tensors)
    if len(tensors) == 0:
        z = torch.zeros(0)
        return HistogramSpec(z.reshape(0, 5), z.reshape(0, bins + 1), z.reshape(0, bins), z)
    if method not in ("auto", "fused", "per_tensor"):
        raise ValueError(f"`method` must be one of 'auto', 'fused', 'per_tensor'; got {method!r}")
    if method == "per_tensor" or (method == "auto" and all(t.device.type == "cpu" for t in tensors)):
        # On a CPU the fused scatter/index_add formulation is ~10x slower than one histc per tensor, and
        # reading a per-tensor min/max costs no device sync: "auto" uses the per-tensor path there.
        rows = [_histogram_one(t, bins, log10) for t in tensors]
        return HistogramSpec(*(torch.stack([r[i] for r in rows]) for i in range(4)))
    chunks: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if chunks[-1] and size + t.numel() > chunk_elements:
            chunks.append([])
            size = 0
        chunks[-1].append(t)
        size += t.numel()
    parts = [_histogram_chunk(chunk, bins, log10, tensors[0].device) for chunk in chunks]
    if len(parts) == 1:
        return parts[0]
    return HistogramSpec(
        *(torch.cat([getattr(p, f) for p in parts]) for f in ("stats", "edges", "counts", "nonfinite"))
    )


def _histogram_one(t: Tensor, bins: int, log10: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One tensor's ``(stats, edges, counts, nonfinite)`` row with per-tensor kernels (the CPU path)."""
    flat = t.detach().reshape(-1).float()
    finite = torch.isfinite(flat)
    nonfinite = flat.numel() - int(finite.sum())
    vals = flat if nonfinite == 0 else flat[finite]
    if log10:
        vals = vals.abs()
        vals = vals[vals > 0].log10()
    if vals.numel() == 0:
        zero = torch.zeros(())
        stats = torch.zeros(5)
        return stats, torch.zeros(bins + 1), torch.zeros(bins), zero + nonfinite
    lo, hi = torch.aminmax(vals)
    lo_f, hi_f = float(lo), float(hi)
    counts = torch.histc(vals, bins=bins, min=lo_f, max=hi_f if hi_f > lo_f else lo_f + 1e-12)
    stats = torch.stack([lo, hi, torch.tensor(float(vals.numel())), vals.sum(), torch.dot(vals, vals)])
    edges = lo + (hi - lo) * torch.linspace(0.0, 1.0, bins + 1)
    return stats.float(), edges.float(), counts.float(), torch.tensor(float(nonfinite))


def _histogram_chunk(
    tensors: Sequence[Tensor], bins: int, log10: bool, device: torch.device
) -> HistogramSpec:
    n = len(tensors)
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])
    sizes = torch.tensor([t.numel() for t in tensors], device=device)
    seg = torch.repeat_interleave(torch.arange(n, device=device), sizes)
    finite = torch.isfinite(flat)
    nonfinite = torch.zeros(n, device=device).index_add_(0, seg, (~finite).float())
    if log10:
        absval = flat.abs()
        keep = finite & (absval > 0)
        vals = torch.where(keep, absval, torch.ones_like(absval)).log10()
    else:
        keep = finite
        vals = torch.where(keep, flat, torch.zeros_like(flat))
    w = keep.float()
    inf = torch.tensor(float("inf"), device=device)
    lo = torch.full((n,), float("inf"), device=device).scatter_reduce(
        0, seg, torch.where(keep, vals, inf), reduce="amin"
    )
    hi = torch.full((n,), float("-inf"), device=device).scatter_reduce(
        0, seg, torch.where(keep, vals, -inf), reduce="amax"
    )
    empty = ~torch.isfinite(lo)
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    width = (hi - lo).clamp_min(1e-12)
    bucket = ((vals - lo[seg]) / width[seg] * bins).floor().clamp_(0, bins - 1).long()
    counts = torch.bincount(seg * bins + bucket, weights=w, minlength=n * bins).reshape(n, bins)
    num = torch.zeros(n, device=device).index_add_(0, seg, w)
    sums = torch.zeros(n, device=device).index_add_(0, seg, vals * w)
    sumsq = torch.zeros(n, device=device).index_add_(0, seg, vals * vals * w)
    frac = torch.linspace(0.0, 1.0, bins + 1, device=device)
    edges = lo[:, None] + (hi - lo)[:, None] * frac[None, :]
    stats = torch.stack([lo, hi, num, sums, sumsq], dim=1)
    return HistogramSpec(stats=stats, edges=edges, counts=counts, nonfinite=nonfinite)


def percentile(values: Tensor, q: Sequence[float]) -> Tensor:
    """Percentiles (``q`` in 0..100) of the finite entries of a 1-D tensor; NaN where none are finite."""
    finite = values[torch.isfinite(values)].float()
    qs = torch.tensor([float(x) / 100.0 for x in q], device=values.device)
    if finite.numel() == 0:
        return torch.full((len(q),), float("nan"), device=values.device)
    return torch.quantile(finite, qs)


def suggest_clip_value(pre_clip_norms: Sequence[float] | Tensor, quantile: float = 0.9) -> float | None:
    """A ``gradient_clip_val`` that clips the outliers and leaves normal steps alone.

    Following the usual advice (measure typical norms without clipping, then set the threshold at the
    top of the typical range), this is the ``quantile`` of the observed pre-clip norms, rounded up to
    two significant digits. ``None`` when no finite norm was observed.
    """
    values = torch.as_tensor(pre_clip_norms, dtype=torch.float64).reshape(-1)
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return None
    x = float(torch.quantile(values, quantile))
    if x <= 0:
        return None
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(x / scale - 1e-9) * scale:.2g}")
