"""The math of ActivationRangeMonitor: block output moments, fp16 headroom, the largest attention logit.

Everything on the device takes a tensor and returns a small tensor (no ``.item()``); the host side
combines what the device produced (over micro-batches and ranks) and judges it.

* :func:`output_moments`: one vector per block output, ``[n, mean, C2, C3, C4, max|x|]`` with ``Ck`` the
  sum of ``(x - mean)^k``: enough to pool several outputs exactly (:func:`pool_moments`);
* :func:`pool_moments` -> :class:`BlockRange`: max|x|, RMS, kurtosis (Pearson: a Gaussian gives 3) and
  the fp16 headroom ``log2(65504 / max|x|)`` in bits (:func:`fp16_headroom`);
* :func:`attention_stats` -> :class:`AttentionStats`: the largest ``q . k * scale`` (plus an additive
  mask, without the masked positions) of a ``scaled_dot_product_attention`` call, and per head the sums
  that give its softmax's entropy, in row chunks so the score matrix never has to exist at once;
  :func:`mha_attention_stats`: the same for ``F.multi_head_attention_forward``'s arguments;
  :func:`max_attention_logit`, :func:`mha_max_logit`: the largest logit alone;
* :func:`pool_entropy` -> :class:`AttentionEntropy`: the entropy sums of a step pooled on the host, in nats
  and as a fraction of ``ln(keys)`` (the entropy of uniform attention).

The rules that judge these numbers, and their wording, live in
:mod:`lightning_gradguard.monitors.activation_range.rules`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

#: the largest finite float16 number
FP16_MAX = 65504.0
#: the entries of an :func:`output_moments` vector
MOMENTS = ("n", "mean", "c2", "c3", "c4", "max_abs")
#: a float mask entry at or below this masks its position out (the -10000 of older Hugging Face models,
#: ``torch.finfo(dtype).min`` of newer ones): it counts neither as a key nor as a logit
MASKED_BELOW = -1e4
#: score-matrix entries computed at once by :func:`attention_stats` (64 MiB in float32)
CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def output_moments(x: Tensor) -> Tensor:
    """``[n, mean, sum (x-mean)^2, sum (x-mean)^3, sum (x-mean)^4, max|x|]`` of every entry, float32, on
    ``x``'s device (a few elementwise kernels; nothing is read back)."""
    values = x.detach().float().reshape(-1)
    n = values.numel()
    if n == 0:
        return torch.zeros(len(MOMENTS), device=x.device)
    mean = values.mean()
    d = values - mean
    d2 = d * d
    lo, hi = torch.aminmax(values)
    return torch.stack(
        [
            torch.full((), float(n), device=x.device),  # a fill kernel: no host copy
            mean,
            d2.sum(),
            (d2 * d).sum(),
            (d2 * d2).sum(),
            torch.maximum(hi, -lo),
        ]
    )


def fp16_headroom(max_abs: float) -> float:
    """Bits between ``max_abs`` and float16's largest finite number: ``log2(65504 / max_abs)``.

    0 at the overflow point, 1 at half of it, negative above it (an inf or NaN gives ``-inf`` / NaN), and
    ``inf`` for an all-zero output.
    """
    if math.isnan(max_abs):
        return math.nan
    if max_abs <= 0.0:
        return math.inf
    return math.log2(FP16_MAX / max_abs) if math.isfinite(max_abs) else -math.inf


@dataclass(frozen=True)
class BlockRange:
    """The range of one block's output over a sampled step (all its calls, micro-batches and ranks)."""

    max_abs: float
    rms: float
    kurtosis: float  # Pearson: E[(x - mean)^4] / var^2; 3 for a Gaussian, 1.8 for a uniform
    headroom_bits: float
    count: int  # entries seen

    def scalars(self) -> dict[str, float]:
        return {
            "max_abs": self.max_abs,
            "rms": self.rms,
            "kurtosis": self.kurtosis,
            "fp16_headroom": self.headroom_bits,
        }


def pool_moments(rows: Sequence[Sequence[float]]) -> BlockRange | None:
    """Pool :func:`output_moments` vectors (one per output seen) exactly, in float64 on the host.

    Groups with their own means combine by the parallel-moments identity (Chan et al. 1979; Pebay 2008):
    with ``delta = mean_g - mean``, ``C2 = sum C2_g + n_g delta^2`` and ``C4 = sum C4_g + 4 delta C3_g +
    6 delta^2 C2_g + n_g delta^4``, so no sum of raw powers (and its cancellation) is ever formed.
    ``None`` when no entry was seen.
    """
    groups = [[float(v) for v in row] for row in rows if float(row[0]) > 0]
    if not groups:
        return None
    n = sum(g[0] for g in groups)
    mean = sum(g[0] * g[1] for g in groups) / n
    c2 = c4 = 0.0
    for count, m, g2, g3, g4, _ in groups:
        d = m - mean
        c2 += g2 + count * d * d
        c4 += g4 + 4 * d * g3 + 6 * d * d * g2 + count * d**4
    max_abs = max(g[5] for g in groups)
    var = c2 / n
    rms = math.sqrt(max(var + mean * mean, 0.0))
    kurtosis = (c4 / n) / (var * var) if var > 0 else math.nan
    if not all(math.isfinite(g[k]) for g in groups for k in range(1, 5)):
        rms = kurtosis = math.nan  # an inf/NaN in the output: its max says so, the moments are void
    return BlockRange(
        max_abs=max_abs, rms=rms, kurtosis=kurtosis, headroom_bits=fp16_headroom(max_abs), count=int(n)
    )


# ---------------------------------------------------------------------------------------------- attention
#: the rows of an :class:`AttentionStats` ``entropy`` matrix: per head, sums over the query rows that have
#: two keys or more (a row with one key has entropy 0 by construction: causal attention's first query)
ENTROPY_SUMS = ("rows", "entropy", "log_keys", "ratio")


@dataclass(frozen=True)
class AttentionStats:
    r"""What one attention call's softmax saw, on the device (nothing read back).

    Attributes:
        max_logit: the largest logit over the positions that take part (0-d float32; ``-inf`` when every
            position is masked).
        entropy: ``(4, heads)`` float32 sums per head over the query rows with at least two keys taking
            part (:data:`ENTROPY_SUMS`): the number of such rows, the sum of their entropies
            :math:`H = -\sum_j p_j \ln p_j` in nats, the sum of :math:`\ln n` (``n``: the row's keys;
            :math:`\ln n` is the entropy of uniform attention over them) and the sum of :math:`H / \ln n`
            (1: uniform, 0: one-hot). ``None`` when not asked for.
    """

    max_logit: Tensor
    entropy: Tensor | None = None


def _row_entropy_sums(logits: Tensor, heads: bool) -> Tensor:
    """:data:`ENTROPY_SUMS` per head of a chunk of logits ``(..., [heads,] rows, keys)``; masked keys are
    ``-inf``. NaN logits make their head's sums NaN (a non-finite forward pass is NaNSentinel's)."""
    keys = (logits > -math.inf).sum(-1)  # a NaN is not counted; its row's softmax is NaN anyway
    entropy = torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)
    valid = keys >= 2
    log_keys = torch.log(keys.clamp(min=2).float())
    zero = torch.zeros((), device=logits.device)
    parts = torch.stack(
        [valid.float(), torch.where(valid, entropy, zero), torch.where(valid, log_keys, zero)]
    )
    parts = torch.cat([parts, (parts[1] / log_keys).unsqueeze(0)])  # invalid rows: 0 / ln 2 = 0
    if heads:  # (4, ..., heads, rows) -> (4, heads)
        return parts.flatten(1, -3).sum(dim=(1, 3))
    return parts.reshape(len(ENTROPY_SUMS), -1).sum(1, keepdim=True)


def _mask_chunk(logits: Tensor, attn_mask: Tensor | None, is_causal: bool, start: int) -> Tensor:
    """Apply ``scaled_dot_product_attention``'s masks to the score rows from ``start`` on."""
    stop = start + logits.size(-2)
    if is_causal:
        keep = torch.ones(stop - start, logits.size(-1), dtype=torch.bool, device=logits.device)
        logits = logits.masked_fill(~keep.tril(start), -math.inf)
    if attn_mask is not None:
        rowwise = attn_mask.dim() >= 2 and attn_mask.size(-2) > 1
        part = attn_mask[..., start:stop, :] if rowwise else attn_mask
        if part.dtype == torch.bool:
            return logits.masked_fill(~part, -math.inf)
        return (logits + part.float()).masked_fill(part <= MASKED_BELOW, -math.inf)
    return logits


@torch.no_grad()
def attention_stats(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    entropy: bool = True,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> AttentionStats:
    """The largest logit and the per-head entropy sums of the softmax that
    ``F.scaled_dot_product_attention(query, key, ...)`` computes (:class:`AttentionStats`, on the device).

    Same conventions as ``scaled_dot_product_attention``: ``(..., L, E)`` queries, ``(..., S, E)`` keys,
    ``scale`` defaults to ``1/sqrt(E)``, a boolean mask is True where a position takes part, a float mask
    is added to the logits (and so counts in the entropy; an entry at or below :data:`MASKED_BELOW` masks
    its position out), ``is_causal`` keeps the lower triangle (top-left
    aligned), ``enable_gqa`` shares each key head among ``Hq / Hk`` query heads. With 4 dimensions or
    more, dimension -3 of the logits is the heads; with fewer, the call is one head. Computed in float32
    (autocast off) in chunks of query rows of at most ``chunk_elements`` scores: one extra ``q @ k^T`` per
    call, and a softmax of it with ``entropy``.
    """
    with torch.autocast(query.device.type, enabled=False):
        q, k = query.detach().float(), key.detach().float()
        if enable_gqa and q.dim() >= 3 and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        length, source = q.size(-2), k.size(-2)
        q = q * (1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale))
        kt = k.transpose(-2, -1)
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        rows = max(1, chunk_elements // max(math.prod(lead) * source, 1))
        best = torch.full((), -math.inf, device=query.device)
        sums: Tensor | None = None
        for start in range(0, length, rows):
            logits = _mask_chunk(q[..., start : start + rows, :] @ kt, attn_mask, is_causal, start)
            best = torch.maximum(best, logits.amax())
            if entropy:
                part = _row_entropy_sums(logits, heads=logits.dim() >= 4)
                sums = part if sums is None else sums + part
        if entropy and sums is None:  # no query row
            sums = torch.zeros(len(ENTROPY_SUMS), 1, device=query.device)
        return AttentionStats(max_logit=best, entropy=sums)


@torch.no_grad()
def max_attention_logit(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> Tensor:
    """The largest logit ``q . k * scale (+ mask)`` that ``F.scaled_dot_product_attention(query, key, ...)``
    feeds its softmax, over the positions that take part (a 0-d float32 tensor on the device):
    :func:`attention_stats` without the entropy."""
    return attention_stats(
        query, key, attn_mask, is_causal, scale, enable_gqa, entropy=False, chunk_elements=chunk_elements
    ).max_logit


@dataclass(frozen=True)
class AttentionEntropy:
    """The entropy of one attention module's softmax over a sampled step, pooled on the host.

    Means over the heads and the query rows with two keys or more (every call, micro-batch and rank).
    """

    entropy: float  # nats
    min_head_entropy: float  # the lowest head's mean entropy, nats
    log_keys: float  # mean ln(keys): the entropy of uniform attention (ln T without a mask)
    ratio: float  # mean of entropy / ln(keys): 1 uniform, 0 one-hot
    min_head_ratio: float  # the lowest head's
    heads: int
    rows: int  # query rows per head

    def scalars(self) -> dict[str, float]:
        return {"entropy": self.entropy, "entropy_min_head": self.min_head_entropy}


def pool_entropy(sums: Sequence[Sequence[float]]) -> AttentionEntropy | None:
    """:class:`AttentionEntropy` from summed :attr:`AttentionStats.entropy` matrices (4 rows, one column
    per head); ``None`` when no query row had two keys (every sequence of length 1)."""
    count, entropy, log_keys, ratio = ([float(v) for v in row] for row in sums)
    heads = [i for i, c in enumerate(count) if c > 0]
    if not heads:
        return None
    total = sum(count[i] for i in heads)
    return AttentionEntropy(
        entropy=sum(entropy[i] for i in heads) / total,
        min_head_entropy=min(entropy[i] / count[i] for i in heads),
        log_keys=sum(log_keys[i] for i in heads) / total,
        ratio=sum(ratio[i] for i in heads) / total,
        min_head_ratio=min(ratio[i] / count[i] for i in heads),
        heads=len(heads),
        rows=round(total / len(heads)),
    )


_MHA_PARAMS: inspect.Signature | None = None


def _mha_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    global _MHA_PARAMS
    if _MHA_PARAMS is None:
        _MHA_PARAMS = inspect.signature(F.multi_head_attention_forward)
    bound = _MHA_PARAMS.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _additive(mask: Tensor | None) -> Tensor | None:
    """An ``nn.MultiheadAttention`` mask (bool: True = masked out; float: added) as a float mask."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.float()
    return torch.zeros(mask.shape, device=mask.device).masked_fill(mask, -math.inf)


@torch.no_grad()
def mha_max_logit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """:func:`max_attention_logit` of one ``F.multi_head_attention_forward(*args, **kwargs)`` call."""
    return mha_attention_stats(args, kwargs, entropy=False).max_logit


@torch.no_grad()
def mha_attention_stats(
    args: tuple[Any, ...], kwargs: dict[str, Any], entropy: bool = True
) -> AttentionStats:
    """:func:`attention_stats` of one ``F.multi_head_attention_forward(*args, **kwargs)`` call.

    The queries and keys are projected again from the call's own weights (``in_proj_weight`` or the
    separate ``q_proj_weight`` / ``k_proj_weight``, with their biases; ``static_k``, ``bias_k`` and
    ``add_zero_attn`` as the function applies them), per head, with ``attn_mask`` and
    ``key_padding_mask`` as masks: two extra projections and one ``q @ k^T``, whichever path
    (``need_weights`` or not) the function then takes.
    """
    p = _mha_arguments(args, kwargs)
    query, key = p["query"].detach(), p["key"].detach()
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
    length, batch, embed = query.shape
    heads = int(p["num_heads"])
    head_dim = embed // heads
    bias = p["in_proj_bias"]
    b_q, b_k = (None, None) if bias is None else (bias[:embed], bias[embed : 2 * embed])
    if p["use_separate_proj_weight"]:
        w_q, w_k = p["q_proj_weight"], p["k_proj_weight"]
    else:
        w_q, w_k = p["in_proj_weight"][:embed], p["in_proj_weight"][embed : 2 * embed]
    attn_mask, padding = _additive(p["attn_mask"]), _additive(p["key_padding_mask"])
    if padding is not None and padding.dim() == 1:
        padding = padding.unsqueeze(0)
    q = F.linear(query, w_q, b_q).reshape(length, batch * heads, head_dim).transpose(0, 1)
    if p["static_k"] is not None:
        k = p["static_k"].detach()
    else:
        k = F.linear(key, w_k, b_k)
        if p["bias_k"] is not None:  # one more key position, never masked
            k = torch.cat([k, p["bias_k"].detach().expand(1, batch, embed)])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            padding = None if padding is None else F.pad(padding, (0, 1))
        k = k.reshape(k.size(0), batch * heads, head_dim).transpose(0, 1)
    if p["add_zero_attn"]:  # a zero key: logit 0 at one more position
        k = torch.cat([k, k.new_zeros(k.size(0), 1, head_dim)], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        padding = None if padding is None else F.pad(padding, (0, 1))
    source = k.size(1)
    q, k = q.reshape(batch, heads, length, head_dim), k.reshape(batch, heads, source, head_dim)
    mask: Tensor | None = None
    if attn_mask is not None:
        mask = attn_mask.reshape(batch, heads, length, source) if attn_mask.dim() == 3 else attn_mask
    if padding is not None:
        padding = padding.reshape(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return attention_stats(q, k, attn_mask=mask, entropy=entropy)
