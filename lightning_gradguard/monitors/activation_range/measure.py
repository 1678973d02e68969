"""What the blocks and the attention of one sampled forward pass produced: ranges and largest logits.

:class:`RangeCapture` is a context manager like DeadReLUMonitor's capture (both are
:class:`~lightning_gradguard.core.sampling.ScopedHooks`): on entry it opens an
:class:`~lightning_gradguard.core.compile.Uncompiled` scope (a ``torch.compile``'d model runs eagerly, dynamo
never sees us), registers global module forward hooks and pushes a ``TorchFunctionMode``; on exit all of it
goes. :meth:`RangeCapture.around_next_call` makes the scope exactly the next call of a method (the
LightningModule's ``training_step``, through
:class:`~lightning_gradguard.core.sampling.NextCall`). Inside it keeps, on the device:

* for every block (:func:`find_blocks`) the moments of the first floating-point tensor of each output
  (:func:`~lightning_gradguard.functional.activation_range.output_moments`);
* for every module whose ``forward`` calls ``F.scaled_dot_product_attention`` or
  ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, so ``nn.TransformerEncoderLayer`` and
  friends, in both its ``need_weights`` paths) the largest attention logit of each call and, per head,
  the sums that give its softmax's entropy
  (:func:`~lightning_gradguard.functional.activation_range.attention_stats`).

Example::

    capture = RangeCapture(model, find_blocks(model))
    with capture:
        model(x)
    capture.moments["layers.0"], capture.logits["layers.0.self_attn"]   # lists of device tensors
    capture.entropy["layers.0.self_attn"]                                # one (4, heads) tensor per call
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from lightning_gradguard.core.layers import user_name
from lightning_gradguard.core.sampling import ScopedHooks
from lightning_gradguard.core.state import strict_mode
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.functional.activation_range import (
    ENTROPY_SUMS,
    MOMENTS,
    AttentionEntropy,
    AttentionStats,
    BlockRange,
    attention_stats,
    mha_attention_stats,
    output_moments,
    pool_entropy,
    pool_moments,
)
from lightning_gradguard.functional.tree import tensors_in

F = nn.functional
#: the owner of an attention call made outside every module's ``forward`` (in ``training_step`` itself)
OUTSIDE = "training_step"
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose outputs ActivationRangeMonitor measures, by name, in model order.

    * the model's top-level children that hold parameters; a ``ModuleDict``, and a child that is the
      only one with parameters (``self.model = GPT(...)``), are looked into: their children are
      top-level too (a lone wrapper stays a block: its output is the model's);
    * the elements holding parameters of every outermost ``nn.ModuleList`` / ``nn.Sequential`` (a
      transformer's layers: ``encoder.layers.0``, ...); containers inside such an element (a block's MLP)
      are not looked into, so a transformer gets one row per layer.

    Names are the user's (:func:`~lightning_gradguard.core.layers.user_name`); where a wrapper
    (``torch.compile``'s) and the module it wraps share a name, the inner one is kept.
    """
    chosen: set[int] = set()

    def top(module: nn.Module) -> None:
        kids = [c for c in module.children() if _has_parameters(c)]
        for child in kids:
            if not isinstance(child, nn.ModuleDict):
                chosen.add(id(child))
            lone = len(kids) == 1 and not isinstance(child, _CONTAINERS)
            if isinstance(child, nn.ModuleDict) or (lone and any(True for _ in child.children())):
                top(child)

    def layers(module: nn.Module, inside: bool) -> None:
        for child in module.children():
            element = isinstance(module, _CONTAINERS) and not inside and _has_parameters(child)
            if element:
                chosen.add(id(child))
            layers(child, inside or element)

    top(model)
    layers(model, False)
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if id(module) in chosen and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            found[user_name(name)] = module  # model order; an inner module overwrites its wrapper
    return found


def _first_float(output: Any) -> Tensor | None:
    for t in tensors_in(output):
        if t.is_floating_point():
            return t
    return None


class _Mode(TorchFunctionMode):
    """Sees the torch functions called inside the scope; hands the attention calls to the capture."""

    def __init__(self, capture: RangeCapture) -> None:
        super().__init__()
        self.capture = capture
        self.live = True  # False once its scope ended (a mode left on the stack stays inert)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if self.live and capture.capturing:
            if func is F.scaled_dot_product_attention:
                capture.attention(lambda: attention_stats(**_sdpa_arguments(args, kwargs)))
            elif func is F.multi_head_attention_forward:
                capture.attention(lambda: mha_attention_stats(args, kwargs))
        return func(*args, **kwargs)


def _sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    named = dict(zip(_SDPA_NAMES, args, strict=False), **kwargs)
    named.pop("value", None)
    named.pop("dropout_p", None)
    return named


def normalizes_queries_and_keys(module: nn.Module) -> bool:
    """Whether ``module`` holds its own normalization of the queries and of the keys (QK-norm: children
    named ``q_norm`` / ``k_norm``, ``q_layernorm`` / ``k_layernorm``, ``query_norm`` / ``key_norm`` that are
    norm layers, as Gemma 3/4, Qwen3, OLMo 2, Cohere and Persimmon hold them). Then the scale of the
    attention logits is the norms' gain, which training sets, and not the projections' initialization."""
    norms = [name for name, child in module.named_children() if _is_norm(child)]
    queries = any(n.startswith(("q_", "q", "query")) and not n.startswith("qkv") for n in norms)
    return queries and any(n.startswith(("k_", "k", "key")) for n in norms)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith(
        ("Norm", "Norm2d")
    )


class RangeCapture(ScopedHooks):
    """Block output moments, largest attention logits and attention entropies of the forward passes inside
    its scopes.

    Args:
        model: the LightningModule (or any module): names come from its ``named_modules``.
        blocks: name -> module of the blocks to measure (:func:`find_blocks`, filtered).
        attention: also measure attention logits.
        watch_attention: which attention owners are measured (``None``: all).

    Attributes:
        moments: block name -> one :func:`output_moments` vector per output seen (on the device).
        logits: attention owner name -> one 0-d tensor per call (on the device).
        entropy: attention owner name -> one ``(4, heads)`` tensor of entropy sums per call (on the device;
            :attr:`~lightning_gradguard.functional.activation_range.AttentionStats.entropy`).
        qk_normed: the attention owners that normalize their queries and keys
            (:func:`normalizes_queries_and_keys`).
        error: what stopped the recording (an output we could not measure); the records are partial.
        left_inert: another ``TorchFunctionMode`` entered after ours was still active when a scope ended.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Mapping[str, nn.Module],
        attention: bool = True,
        watch_attention: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(model)
        self.model = model
        self.attention_on = attention
        self.watch_attention = watch_attention
        self.moments: dict[str, list[Tensor]] = {}
        self.logits: dict[str, list[Tensor]] = {}
        self.entropy: dict[str, list[Tensor]] = {}
        self.error: Exception | None = None
        self._blocks = {id(m): name for name, m in blocks.items()}
        self.qk_normed: set[str] = set()
        self._names: dict[int, str] = {}
        self._stack: list[tuple[str, nn.Module]] = []
        self._judged: set[str] = set()  # owners whose QK-norm was looked at

    def __enter__(self) -> RangeCapture:
        if self._open:
            return self
        self._open = True
        if self.attention_on and not self._names:
            self._names = {id(m): user_name(n, self.model) for n, m in self.model.named_modules()}
        self._stack = []
        self._eager.open()
        self._handles = [register_module_forward_hook(self._post_hook, always_call=True)]
        if self.attention_on:  # who calls the attention: the stack of running modules, and the mode
            self._handles.append(register_module_forward_pre_hook(self._pre_hook))
            self._mode = _Mode(self)
            self._mode.__enter__()
        self.capturing = self.error is None
        return self

    # ------------------------------------------------------------------ during the forward pass
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._stack.append((self._names.get(id(module), f"<{type(module).__name__}>"), module))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.attention_on and self._stack:
            self._stack.pop()
        name = self._blocks.get(id(module))
        if name is None or not self.capturing:
            return
        self._safely(lambda: self._record_block(name, output))

    def _record_block(self, name: str, output: Any) -> None:
        x = _first_float(output)
        if x is not None and x.numel():
            self.moments.setdefault(name, []).append(output_moments(x))

    def attention(self, measure: Callable[[], AttentionStats]) -> None:
        """Record the largest logit and the entropy sums of the attention call now running, under the module
        that made it."""
        owner, module = self._stack[-1] if self._stack else (OUTSIDE, None)
        if self.watch_attention is not None and not self.watch_attention(owner):
            return
        if owner not in self._judged:  # once per owner and sample: a walk over its children
            self._judged.add(owner)
            if module is not None and normalizes_queries_and_keys(module):
                self.qk_normed.add(owner)
        self._safely(lambda: self._record_attention(owner, measure()))

    def _record_attention(self, owner: str, stats: AttentionStats) -> None:
        self.logits.setdefault(owner, []).append(stats.max_logit)
        if stats.entropy is not None:
            self.entropy.setdefault(owner, []).append(stats.entropy)

    def _safely(self, record: Callable[[], Any]) -> None:
        """Run inside the user's forward pass: a failure of ours stops the recording, never their step."""
        try:
            record()
        except Exception as err:
            if strict_mode():
                raise
            self.capturing = False
            self.error = err


@dataclass(frozen=True)
class CaptureReading:
    """A sampled step's numbers on the host, pooled over its outputs, calls and ranks."""

    ranges: dict[str, BlockRange] = field(default_factory=dict)
    max_logits: dict[str, float] = field(default_factory=dict)
    entropies: dict[str, AttentionEntropy] = field(default_factory=dict)
    loss: float | None = None  # the step's mean loss over the ranks, when it was read
    qk_normed: frozenset[str] = frozenset()  # attention owners that normalize their queries and keys


def _summed_entropy(calls: list[Tensor]) -> Tensor:
    """The entropy sums of every call of one module, per head (summed over the heads too when the calls
    disagree on the number of heads)."""
    if len({tuple(c.shape) for c in calls}) > 1:
        calls = [c.sum(1, keepdim=True) for c in calls]
    return torch.stack(calls).sum(0)


def _same_layout(trainer: pl.Trainer, layout: str) -> bool:
    """Whether every rank recorded the same layout (one small all-reduce; ``True`` in one process)."""
    if trainer.world_size == 1:
        return True
    sig = zlib.crc32(layout.encode())
    check = torch.tensor([sig, -sig], dtype=torch.int64, device=trainer.strategy.root_device)
    check = trainer.strategy.reduce(check, reduce_op="max")
    return int(check[0]) == -int(check[1])


def read_capture(
    trainer: pl.Trainer, capture: RangeCapture, loss: Tensor | None = None
) -> CaptureReading | None:
    """What ``capture`` recorded, pooled over every rank, on the host (call it on every rank alike), with
    the step's ``loss`` (its mean over the ranks; every rank passes one or none alike).

    One device -> host transfer. Under DDP, first one small collective compares the ranks' layouts (an
    all-reduce of different layouts would mix blocks or hang: ``None`` on every rank when they differ),
    then one all-reduce: each rank writes its moments and maxima into its own row of a zero matrix, so the
    sum is an all-gather and the host pools every rank's moments exactly and takes the maxima; the entropy
    sums are summed as they are. A capture that failed (``error``) counts as empty.
    """
    ok = capture.error is None
    moments = {k: torch.stack(v) for k, v in capture.moments.items()} if ok else {}
    logits = {k: torch.stack(v).amax() for k, v in capture.logits.items()} if ok else {}
    entropy = {k: _summed_entropy(v) for k, v in capture.entropy.items()} if ok else {}
    world, rank = trainer.world_size, trainer.global_rank
    layout = [f"{k}:{len(m)}" for k, m in moments.items()] + list(logits)
    if not _same_layout(trainer, "|".join(layout + [f"{k}:{e.size(1)}" for k, e in entropy.items()])):
        return None
    if not moments and not logits:
        return CaptureReading()
    transfer = HostTransfer()
    for kind, values in (("m", moments), ("a", logits)):
        for key, value in values.items():
            rows = value.new_zeros((world, *value.shape))
            rows[rank] = value
            transfer.add((kind, key), rows)
    for key, sums in entropy.items():
        transfer.add(("e", key), sums)
    if loss is not None:
        transfer.add("loss", loss, reduce="mean")
    host = transfer.fetch(trainer, reduce_op="sum")  # the one device -> host transfer of the step
    reading = _pooled(host, moments, logits, entropy)
    loss_value = float(host["loss"]) if loss is not None else None
    return replace(reading, loss=loss_value, qk_normed=frozenset(capture.qk_normed))


def _pooled(
    host: Mapping[Any, Tensor], moments: Iterable[str], logits: Iterable[str], entropy: Iterable[str]
) -> CaptureReading:
    """The host's numbers (:func:`read_capture`'s transfer) pooled into ranges, maxima and entropies."""
    ranges: dict[str, BlockRange] = {}
    for key in moments:
        pooled = pool_moments(host[("m", key)].reshape(-1, len(MOMENTS)).tolist())
        if pooled is not None:
            ranges[key] = pooled
    peaks: dict[str, float] = {}
    for key in logits:
        per_rank = [float(v) for v in host[("a", key)].tolist()]
        peaks[key] = math.nan if any(math.isnan(v) for v in per_rank) else max(per_rank)
    entropies: dict[str, AttentionEntropy] = {}
    for key in entropy:
        found = pool_entropy(host[("e", key)].reshape(len(ENTROPY_SUMS), -1).tolist())
        if found is not None:
            entropies[key] = found
    return CaptureReading(ranges=ranges, max_logits=peaks, entropies=entropies)
