"""Every architecture ``transformers`` ships, at its family's recipe, judged by every gradguard monitor.

The catalogue is not picked by hand: it is every model class in ``transformers``' auto mappings of six
task families (causal LM, seq2seq LM, sequence classification, masked LM, image classification, audio
classification), one run per model type and family. Each config is shrunk automatically: the config's
own defaults, then the common size attributes it has (hidden sizes, layers, heads, vocabularies, image
and patch sizes, and the same inside its text / vision / audio / encoder / decoder sub-configs) set to
a tiny model. A model that will not build, will not take its family's batch, is over
``MAX_PARAMS`` or does not finish a training run on CPU in ``TIMEOUT_S`` is listed with its reason.

Every run is a real ``Trainer.fit`` (CPU, one torch thread, ``seed_everything(0)``) of ``STEPS``
optimizer steps on its family's learnable data (``benchmarks/real_models.py``: Markov-chain tokens,
padded topic sequences, reversed token sequences, scikit-learn digits at 32x32x3, noisy tones) with the
family's usual recipe (AdamW, linear warm-up then cosine, clipping at 1 for the language families), the
eight training monitors and the pre-flight pair (``OverfitBatchSanity``, ``GradientCheck``, at their
defaults but ``action="warn"`` so that every check runs) at their defaults. Any warning, error or failed
pre-flight check on these healthy runs is a false alarm.

Then the recipes users also run on a few of the architectures: torch's ``Muon`` (matrices; AdamW for
the rest), ``Adafactor`` with relative steps (``lr=None``), Lion, schedule-free AdamW, and manual
optimization with two optimizers.

Usage::

    python benchmarks/every_arch.py --markdown              # make bench-every-arch
    python benchmarks/every_arch.py --list
    python benchmarks/every_arch.py --only causal_lm:gpt2,image:vit --markdown --json /tmp/sweep.json

Each run is a forked child with a time limit (a hang or a crash of one model never ends the sweep).
``tests/integration/test_every_arch.py`` runs a fast subset.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl
import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_models as rm

transformers.logging.set_verbosity_error()

STEPS = 40
TIMEOUT_S = 120.0
MAX_PARAMS = 3_000_000
MAX_RSS = 4 * 2**30  # a child above this is stopped: the sweep shares a 24 GiB machine
LM_VOCAB = rm.VOCAB + 4  # content tokens 0-63, then pad 64, bos 65, eos 66
S2S_VOCAB = rm.S2S_VOCAB

# ---------------------------------------------------------------------------------------------- shrinking
_SIZE: dict[str, Any] = {
    # widths
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "embed_dim": 64,
    "embedding_size": 64,
    "word_embed_proj_dim": 64,
    "projection_dim": 32,
    "classifier_proj_size": 32,
    "pooler_hidden_size": 64,
    # depths
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "attention_head_dim": 16,
    # feed-forward
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "hidden_dim": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    # positions
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_source_positions": 64,
    "max_target_positions": 32,
    # state-space layers (Mamba, hybrids): their chunked scans allocate by state size and chunk
    "mamba_d_state": 16,
    "mamba_chunk_size": 32,
    "chunk_size": 32,
    "state_size": 16,
    "ssm_state_size": 16,
    "time_step_rank": 8,
    "rotary_dim": 8,
    "conv_kernel": 4,
    # images
    "image_size": 32,
    "patch_size": 4,
    "num_channels": 3,
}
#: list-valued sizes of the hierarchical vision configs, replaced by these
_LISTS: dict[str, Any] = {
    "hidden_sizes": [16, 32, 64, 128],
    "depths": [1, 1, 2, 1],
    "embed_dims": [16, 32, 64, 128],
}
_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder", "backbone_config")


def _tokens(config: Any, family: str) -> dict[str, Any]:
    if family == "seq2seq":  # the decoder starts with the token the config's defaults start it with
        ours = {"pad_token_id": rm.PAD, "bos_token_id": rm.S2S_BOS, "eos_token_id": rm.S2S_EOS}
        start = getattr(config, "decoder_start_token_id", None)
        same = [k for k in ours if start is not None and getattr(config, k, None) == start]
        return dict(vocab_size=S2S_VOCAB, **ours, decoder_start_token_id=ours[same[0]] if same else rm.PAD)
    if family in ("seq_cls", "masked_lm"):
        return dict(
            vocab_size=rm.VOCAB,
            pad_token_id=rm.PAD,
            bos_token_id=rm.CLS,
            eos_token_id=rm.SEP,
            cls_token_id=rm.CLS,
            sep_token_id=rm.SEP,
        )
    return dict(
        vocab_size=LM_VOCAB, pad_token_id=rm.VOCAB, bos_token_id=rm.VOCAB + 1, eos_token_id=rm.VOCAB + 2
    )


#: what is left out of the overrides on each retry, when a config refuses them (derived sizes that must
#: agree with each other: heads and head dims, layer-type lists, expert counts)
_RETRIES: tuple[frozenset[str], ...] = (
    frozenset(),
    frozenset({"head_dim", "d_kv", "attention_head_dim", "num_key_value_heads", "layer_types"}),
    frozenset(
        {
            "head_dim",
            "d_kv",
            "attention_head_dim",
            "num_key_value_heads",
            "layer_types",
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "intermediate_size",
            "hidden_dim",
            "embedding_size",
        }
    ),
)


def shrink(config_class: type, family: str, left_out: frozenset[str] = frozenset()) -> Any:
    """A tiny config of ``config_class``: its defaults, then every common size attribute it has but
    ``left_out`` (a config that refuses them is built again without the sub-configs' sizes)."""
    return _shrunk(config_class(), family, config_class, left_out)


def _wanted(have: dict[str, Any], base: Any, family: str, left_out: frozenset[str]) -> dict[str, Any]:
    wanted: dict[str, Any] = {k: v for k, v in _SIZE.items() if k in have and have[k] is not None}
    for k, v in _LISTS.items():
        if isinstance(have.get(k), list):
            n = len(have[k])
            wanted[k] = (v * n)[:n] if n != len(v) else v
    if isinstance(have.get("num_heads"), list):
        wanted["num_heads"] = [2 * (i + 1) if i < 2 else 4 for i in range(len(have["num_heads"]))]
    wanted.update({k: v for k, v in _tokens(base, family).items() if k in have})
    if isinstance(have.get("layer_types"), list):
        wanted["layer_types"] = have["layer_types"][: wanted.get("num_hidden_layers", 2)]
    if family in ("seq_cls", "audio"):
        wanted["num_labels"] = rm.CLASSES
    elif family == "image":
        wanted["num_labels"] = 10
    wanted["use_cache"] = False
    return {k: v for k, v in wanted.items() if k not in left_out}


def _shrunk(base: Any, family: str, config_class: type, left_out: frozenset[str] = frozenset()) -> Any:
    wanted = _wanted(base.to_dict(), base, family, left_out)
    for sub in _SUBCONFIGS:
        value = getattr(base, sub, None)
        if value is not None and hasattr(value, "to_dict"):
            wanted[sub] = _shrunk(value, family, type(value), left_out).to_dict()
    try:
        config = config_class(**wanted)
    except Exception:
        config = config_class(**{k: v for k, v in wanted.items() if k not in _SUBCONFIGS})
    if "num_labels" in wanted:
        config.num_labels = wanted["num_labels"]
    return config


# ---------------------------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    mapping: str
    data: Callable[[], DataLoader[Any]]
    recipe: rm.Recipe


_LM = rm.Recipe(lr=3e-3)
_ENC = rm.Recipe(lr=2e-3)
_VISION = rm.Recipe(lr=2e-3, clip=None)

FAMILIES: dict[str, Family] = {
    "causal_lm": Family("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", lambda: _lm_tokens(), _LM),
    "seq2seq": Family("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", lambda: rm.reversal_pairs(), _LM),
    "seq_cls": Family("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", lambda: rm.topic_sequences(), _ENC),
    "masked_lm": Family("MODEL_FOR_MASKED_LM_MAPPING_NAMES", lambda: _masked_tokens(), _ENC),
    "image": Family("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", lambda: rm.digit_images(), _VISION),
    "audio": Family("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", lambda: rm.tones(), _ENC),
}


def _lm_tokens() -> DataLoader[Any]:
    return rm.lm_tokens()


def _masked_tokens(n: int = 1024, batch_size: int = 16) -> DataLoader[Any]:
    """The Markov-chain sequences with 15 % of the tokens masked (token 3), the rest's labels -100."""
    loader = rm.lm_tokens(n, batch_size)
    seq = loader.dataset.tensors["input_ids"]  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(1)
    masked = torch.rand(seq.shape, generator=g) < 0.15
    masked[:, 0] = True
    labels = torch.where(masked, seq, torch.full_like(seq, -100))
    ids = torch.where(masked, torch.full_like(seq, 3), seq)
    return rm._loader(rm.Records(input_ids=ids, labels=labels), batch_size)


def _audio_batch(model: nn.Module) -> DataLoader[Any]:
    """Tones as the model's own input: a waveform (``input_values``), or mel-like features
    (``input_features``: channels x frames, or frames x channels where the config says so)."""
    name = getattr(model, "main_input_name", "input_values")
    config = model.config
    if name == "input_features":
        bins = getattr(config, "num_mel_bins", 16)
        frames = 2 * getattr(config, "max_source_positions", 32)
        return rm.mel_bands(bins=bins, frames=frames) if bins >= 16 else rm.mel_bands()
    if hasattr(config, "num_mel_bins") and hasattr(config, "max_length"):  # spectrogram transformers (AST)
        loader = rm.mel_bands(bins=config.num_mel_bins, frames=config.max_length)
        x = loader.dataset.tensors["input_features"].transpose(1, 2).contiguous()  # type: ignore[attr-defined]
        return rm._loader(rm.Records(input_values=x, labels=loader.dataset.tensors["labels"]), 16)  # type: ignore[attr-defined]
    return rm.tones()


# ---------------------------------------------------------------------------------------------- catalogue
@dataclass(frozen=True)
class Arch:
    """One model class of one family: ``family:model_type``."""

    family: str
    model_type: str
    class_name: str
    recipe: str = "family"  # or one of RECIPES

    @property
    def name(self) -> str:
        suffix = "" if self.recipe == "family" else f"+{self.recipe}"
        return f"{self.family}:{self.model_type}{suffix}"


def catalogue() -> list[Arch]:
    from transformers.models.auto import configuration_auto, modeling_auto

    archs: list[Arch] = []
    seen: set[str] = set()  # a model type runs once, in the first family that has it (the body is the same)
    for family, fam in FAMILIES.items():
        mapping: dict[str, str] = getattr(modeling_auto, fam.mapping)
        for model_type, class_name in sorted(mapping.items()):
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            if model_type not in configuration_auto.CONFIG_MAPPING_NAMES or model_type in seen:
                continue
            seen.add(model_type)
            archs.append(Arch(family, model_type, class_name))
    archs += [Arch("causal_lm", "gpt2", "GPT2LMHeadModel", r) for r in RECIPES]
    archs += [Arch("image", "vit", "ViTForImageClassification", r) for r in RECIPES if r != "manual"]
    return archs


def build_model(arch: Arch, left_out: frozenset[str] = frozenset()) -> nn.Module:
    from transformers.models.auto import configuration_auto

    config_class = configuration_auto.CONFIG_MAPPING[arch.model_type]
    config = shrink(config_class, arch.family, left_out)
    model_class = getattr(transformers, arch.class_name)
    return model_class(config)


def first_that_runs(arch: Arch) -> tuple[frozenset[str], nn.Module | None, str, str]:
    """The first of :data:`_RETRIES` whose shrunk model builds and takes its family's batch (one forward
    and backward): ``(left_out, model, "", "")``, or the last failure's stage and reason."""
    stage, reason = "config", ""
    for left_out in _RETRIES:
        stage = "config"
        try:
            pl.seed_everything(0, verbose=False)
            model = build_model(arch, left_out)
            stage = "batch"
            _probe(model, _loader_for(arch, model))
            return left_out, model, "", ""
        except Exception as err:
            reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return frozenset(), None, stage, reason


# ---------------------------------------------------------------------------------------------- optimizers
def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What an optimizer's ``step(closure)`` returns: the closure's loss, computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024) in its train-mode form: the gradient is taken at an
    interpolation y of the fast iterate z and the average x; the model holds y while training."""

    def __init__(
        self,
        params: Any,
        lr: float = 2.5e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 4,
    ) -> None:
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                warmup_steps=warmup_steps,
                k=0,
                weight_sum=0.0,
            ),
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            k = group["k"] = group["k"] + 1
            lr = group["lr"] * min(1.0, k / group["warmup_steps"])
            weight = lr**2
            group["weight_sum"] += weight
            c = weight / group["weight_sum"]
            bias2 = 1 - b2**k
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["z"] = p.detach().clone()
                    state["v"] = torch.zeros_like(p)
                z, v = state["z"], state["v"]
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                step = p.grad / (v / bias2).sqrt().add_(group["eps"]) + group["weight_decay"] * p
                x = (p - (1 - b1) * z) / b1  # y = (1 - b1) z + b1 x
                z.sub_(step, alpha=lr)
                x.lerp_(z, c)
                p.copy_(x.mul(b1).add_(z, alpha=1 - b1))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's ``Muon`` on the hidden matrices and ``AdamW`` on the rest (embeddings, heads, vectors), as
    one optimizer: how Muon is used (it orthogonalizes 2-D updates only), and what Lightning's automatic
    optimization steps."""

    def __init__(self, module: nn.Module, lr: float) -> None:
        outer = ("embed", "wte", "wpe", "head", "classifier", "patch", "pooler")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        matrices = [p for n, p in named if p.ndim == 2 and not any(k in n for k in outer)]
        ids = {id(p) for p in matrices}
        self.muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01)
        self.adamw = torch.optim.AdamW([p for _, p in named if id(p) not in ids], lr=lr, weight_decay=0.01)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.muon.state = self.adamw.state = self.state  # one state for both (their parameters are disjoint)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss


RECIPES = ("muon", "adafactor", "lion", "schedule_free", "manual")


class SweepTask(rm.HFTask):
    """``rm.HFTask`` with the recipe variants of :data:`RECIPES`."""

    def __init__(self, model: nn.Module, recipe: rm.Recipe, total_steps: int, variant: str) -> None:
        super().__init__(model, recipe, total_steps)
        self.variant = variant
        if variant == "manual":
            self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        if self.variant == "family":
            return super().configure_optimizers()
        if self.variant == "muon":
            return MuonWithAdamW(self, self.recipe.lr)
        if self.variant == "adafactor":
            from transformers.optimization import Adafactor

            return Adafactor(
                self.parameters(), lr=None, relative_step=True, scale_parameter=True, warmup_init=False
            )
        if self.variant == "lion":
            return Lion(self.parameters(), lr=self.recipe.lr / 10, weight_decay=0.1)
        if self.variant == "schedule_free":
            return ScheduleFreeAdamW(self.parameters(), lr=self.recipe.lr)
        # manual: two optimizers, body and head, each with the family's warm-up and cosine, stepped by hand
        head = [p for n, p in self.named_parameters() if "lm_head" in n or "classifier" in n]
        ids = {id(p) for p in head}
        body = [p for p in self.parameters() if id(p) not in ids]
        opts = [
            torch.optim.AdamW(body, lr=self.recipe.lr),
            torch.optim.AdamW(head or body[:1], lr=self.recipe.lr),
        ]
        factor = self.recipe.factor(self.total_steps)
        return opts, [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.variant != "manual":
            return super().training_step(batch, batch_idx)
        opts = self.optimizers()
        loss: Tensor = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opts[0], gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        for opt in opts:
            opt.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        return loss


# ---------------------------------------------------------------------------------------------- one run
@dataclass
class Result:
    name: str
    family: str
    model_type: str
    recipe: str
    stage: str  # "trained", or where it stopped: "config", "build", "too big", "batch", "timeout", "crashed"
    reason: str = ""
    params: int = 0
    seconds: float = 0.0
    loss_first: float = math.nan
    loss_last: float = math.nan
    alerts: list[dict[str, Any]] = field(default_factory=list)  # warning and above, training monitors
    preflight: list[dict[str, Any]] = field(default_factory=list)  # warning and above, or a failed check
    ended: str = ""
    infos: list[str] = field(default_factory=list)  # the kinds of the info lines said

    @property
    def quiet(self) -> bool:
        return self.stage == "trained" and not self.alerts and not self.preflight and self.ended != "crashed"

    def first_alert(self) -> str:
        said = sorted(self.preflight + self.alerts, key=lambda a: a.get("step", -1))
        if not said:
            return ""
        a = said[0]
        return f"{a['kind']}@{a.get('step', 0)} ({a['source']})"


def _loader_for(arch: Arch, model: nn.Module) -> DataLoader[Any]:
    if arch.family == "audio":
        return _audio_batch(model)
    loader = FAMILIES[arch.family].data()
    fed = _with_audio(model, loader)
    if fed is not None:
        return fed
    swap = _padding_swap(model, arch.family)
    if swap is None:
        return loader
    configs = [model.config] + [getattr(model.config, sub, None) for sub in _SUBCONFIGS]
    for config in [c for c in configs if c is not None and hasattr(c, "to_dict")]:
        for key, value in config.to_dict().items():
            if key.endswith("_token_id") and value in swap:
                setattr(config, key, swap[1 - swap.index(value)])
    return _swapped(loader, swap, tokens_in_labels=arch.family != "seq_cls")


#: the config attribute of a multimodal model's audio placeholder token, by the names models give it
_AUDIO_TOKEN_KEYS = ("audio_token_id", "audio_token_index")


def _with_audio(model: nn.Module, loader: DataLoader[Any]) -> DataLoader[Any] | None:
    """The family's token batches with the model's audio tower fed, for a multimodal model whose
    ``get_audio_features(input_features, input_features_mask)`` says how many placeholders a clip fills
    (AudioFlamingo3, GLM-ASR): each sample gets a clip of ``rm.mel_bands`` and as many placeholder tokens
    before its text; the last placeholder's label is a token naming the clip's band (so the tower has
    something to learn: a clip the loss ignores leaves its attention without a gradient). The
    placeholder id of the published model lies beyond the shrunk vocabulary: the embedding grows by one
    row for it. ``None`` for every other model (the family's
    batch as it is: a tower it never feeds is ``unused_parameter``'s)."""
    config = model.config
    audio, features = getattr(config, "audio_config", None), getattr(model, "get_audio_features", None)
    key = next((k for k in _AUDIO_TOKEN_KEYS if isinstance(getattr(config, k, None), int)), None)
    records = getattr(loader.dataset, "tensors", {})
    if audio is None or features is None or key is None or "input_ids" not in records:
        return None
    bins, frames = audio.num_mel_bins, 2 * getattr(audio, "max_source_positions", 32)
    try:
        with torch.no_grad():
            out = features(torch.zeros(1, bins, frames), torch.ones(1, frames, dtype=torch.long))
    except (TypeError, ValueError, RuntimeError):  # another signature: not fed
        return None
    emitted = getattr(out, "pooler_output", None)
    emitted = emitted if emitted is not None else getattr(out, "last_hidden_state", out)
    per_clip = emitted.shape[0] if emitted.ndim == 2 else emitted.shape[1]
    vocab = model.get_input_embeddings().num_embeddings
    model.resize_token_embeddings(vocab + 1)
    setattr(config, key, vocab)
    n = len(records["input_ids"])
    clips = rm.mel_bands(n=n, bins=bins, frames=frames).dataset.tensors  # type: ignore[attr-defined]
    ones = torch.ones(n, per_clip, dtype=torch.long)
    heard = ones * -100
    heard[:, -1] = records["input_ids"].max() - clips["labels"]  # the clip's band: a content token
    data = rm.Records(
        input_ids=torch.cat([ones * vocab, records["input_ids"]], 1),
        attention_mask=torch.cat([ones, records["attention_mask"]], 1),
        labels=torch.cat([heard, records["labels"], ones[:, :1] * -100], 1),  # aligned with the ids
        input_features=clips["input_features"],
        input_features_mask=torch.ones(n, frames, dtype=torch.long),
    )
    g = torch.Generator().manual_seed(0)
    return DataLoader(data, batch_size=loader.batch_size or 16, shuffle=True, generator=g, drop_last=True)


#: the family's padding token in its batches (the language models' batches have none: an id past them)
_FAMILY_PAD = {"causal_lm": rm.VOCAB, "seq2seq": rm.PAD, "seq_cls": rm.PAD, "masked_lm": rm.PAD}


def _padding_swap(model: nn.Module, family: str) -> tuple[int, int] | None:
    """``(row, pad)`` when the model's token embedding has a ``padding_idx`` (a row autograd never trains)
    other than the family's padding token: MPNet's is 1 whatever its config says, the id of our
    ``[CLS]``. Swapping the two ids in the batch and in the config's token ids leaves the batch the same
    sentence, with the untrained row read only at padding. ``None``: nothing to swap."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    vocab, pad = getattr(text, "vocab_size", None), _FAMILY_PAD.get(family)
    if not isinstance(vocab, int) or pad is None:
        return None
    rows = {
        m.padding_idx
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.num_embeddings == vocab and m.padding_idx is not None
    }
    rows = {r % vocab for r in rows} - {pad}
    return (min(rows), pad) if rows and pad < vocab else None


def _swapped(loader: DataLoader[Any], swap: tuple[int, int], tokens_in_labels: bool) -> DataLoader[Any]:
    """``loader``'s records with the token ids ``swap`` exchanged (in ``labels`` too where they are tokens):
    see :func:`_padding_swap` (the caller exchanges them in the config's ``*_token_id`` too)."""
    a, b = swap
    records = loader.dataset.tensors  # type: ignore[attr-defined]
    keys = ("input_ids", "decoder_input_ids") + (("labels",) if tokens_in_labels else ())
    out = {}
    for k, t in records.items():
        out[k] = t.clone()
        if k in keys:
            out[k][t == a], out[k][t == b] = b, a
    return rm._loader(rm.Records(**out), loader.batch_size or 16)


def _probe(model: nn.Module, loader: DataLoader[Any]) -> None:
    batch = next(iter(loader))
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None or not torch.is_tensor(loss) or loss.ndim != 0:
        raise TypeError(f"no scalar .loss in the output ({type(out).__name__})")
    loss.backward()
    model.zero_grad(set_to_none=True)


class _Built:
    """The entry's model and loader, built once per process (the child builds both runs from seeds)."""

    def __init__(self, arch: Arch, left_out: frozenset[str]) -> None:
        self.arch, self.left_out = arch, left_out

    def __call__(self) -> tuple[nn.Module, DataLoader[Any]]:
        model = build_model(self.arch, self.left_out)
        return model, _loader_for(self.arch, model)


def _task_class(arch: Arch) -> type[rm.HFTask]:
    variant = arch.recipe

    class Task(SweepTask):
        def __init__(self, model: nn.Module, recipe: rm.Recipe, total_steps: int = 200) -> None:
            super().__init__(model, recipe, total_steps, variant)

    return Task


def run_one(arch: Arch, steps: int = STEPS, preflight: bool = True) -> Result:
    """Build, probe and train ``arch``; never raises for the model's own failures."""
    res = Result(arch.name, arch.family, arch.model_type, arch.recipe, stage="config")
    left_out, model, stage, reason = first_that_runs(arch)
    if model is None:
        res.stage, res.reason = stage, reason
        return res
    res.params = sum(p.numel() for p in model.parameters())
    if res.params > MAX_PARAMS:
        res.stage, res.reason = "too big", f"{res.params / 1e6:.1f} M parameters after shrinking"
        return res
    family = FAMILIES[arch.family]
    recipe = family.recipe if arch.recipe != "manual" else rm.replace(family.recipe, clip=None)
    built = _Built(arch, left_out)
    entry = rm.Entry(arch.name, arch.family, built, recipe, steps, module=_task_class(arch))
    started = time.perf_counter()
    out = rm.run_entry(entry, steps, preflight=preflight)
    res.seconds = time.perf_counter() - started
    res.stage = "trained"
    t = out.training
    res.ended = t.ended
    if t.ended == "crashed":
        res.reason = " / ".join(t.error.strip().splitlines()[-2:])[:300]
    elif t.ended == "stopped":
        res.reason = t.error.splitlines()[0][:300]
    res.alerts = t.alerts
    res.loss_first, res.loss_last = out.mean_loss("first"), out.mean_loss("last")
    if out.preflight is not None:
        for c in out.preflight.checks:
            if c.name == "LRFinderPlus":
                continue
            res.preflight += [{**a, "check": c.name} for a in c.alerts]
            if c.passed is False and not c.alerts:
                res.preflight.append(
                    {"kind": "failed", "source": c.name, "step": 0, "message": "", "hint": ""}
                )
        if out.preflight.ended == "crashed":
            res.preflight.append(
                {
                    "kind": "CRASH",
                    "source": "pre-flight",
                    "step": 0,
                    "message": out.preflight.error.strip().splitlines()[-1][:300],
                    "hint": "",
                }
            )
    return res


# ---------------------------------------------------------------------------------------------- the sweep
def _child(arch: Arch, steps: int, preflight: bool, conn: Any) -> None:
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            res = run_one(arch, steps, preflight)
    except BaseException as err:  # pragma: no cover - the child reports whatever happened
        res = Result(
            arch.name,
            arch.family,
            arch.model_type,
            arch.recipe,
            stage="crashed",
            reason=f"{type(err).__name__}: {err}"[:300] + " " + traceback.format_exc()[-300:],
        )
    conn.send(asdict(res))
    conn.close()


def _rss(pid: int) -> int:
    """The resident memory of process ``pid`` in bytes (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_forked(arch: Arch, steps: int, preflight: bool, timeout: float = TIMEOUT_S) -> Result:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(arch, steps, preflight, child))
    started = time.perf_counter()
    proc.start()
    child.close()
    got, why = False, f"no result in {timeout:.0f} s"
    while time.perf_counter() - started < timeout:
        if parent.poll(0.5):
            got = True
            break
        if _rss(proc.pid) > MAX_RSS:
            why = f"over {MAX_RSS / 2**30:.0f} GiB of memory"
            break
    data = parent.recv() if got else None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if data is None:
        why = why if not got else f"the child died (exit {proc.exitcode})"
        return Result(
            arch.name,
            arch.family,
            arch.model_type,
            arch.recipe,
            stage="timeout" if not got else "crashed",
            reason=why,
            seconds=time.perf_counter() - started,
        )
    return Result(**data)


def markdown(results: list[Result]) -> str:
    trained = [r for r in results if r.stage == "trained"]
    quiet = [r for r in trained if r.quiet]
    lines = [
        f"Model classes tried: {len(results)}; trained: {len(trained)}; quiet: {len(quiet)}; "
        f"with a warning or a failed pre-flight check: {len(trained) - len(quiet)}",
        "",
        "| family | model | params | stage | loss first10 -> last10 | first alert | said |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        said = sorted({f"{a['kind']} ({a['source']})" for a in r.preflight + r.alerts})
        loss = f"{r.loss_first:.2f} -> {r.loss_last:.2f}" if r.stage == "trained" else "-"
        stage = r.stage if r.stage == "trained" else f"{r.stage}: {r.reason[:90]}"
        if r.stage == "trained" and r.ended != "completed":
            stage += f" ({r.ended}: {r.reason[:90]})"
        model = r.model_type + ("" if r.recipe == "family" else f" + {r.recipe}")
        lines.append(
            f"| {r.family} | {model} | {r.params / 1e3:.0f}k | {stage} | {loss} "
            f"| {r.first_alert() or 'quiet'} | {'; '.join(said)[:200]} |"
        )
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    trained = [r for r in results if r.stage == "trained"]
    loud = [r for r in trained if not r.quiet]
    kinds: dict[str, int] = {}
    for r in loud:
        for k in {a["kind"] for a in r.preflight + r.alerts}:
            kinds[k] = kinds.get(k, 0) + 1
    stages: dict[str, int] = {}
    for r in results:
        stages[r.stage] = stages.get(r.stage, 0) + 1
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    tried = ", ".join(f"{s} {n}" for s, n in sorted(stages.items()))
    return (
        f"tried {len(results)} ({tried}); trained and quiet {len(trained) - len(loud)} of {len(trained)}; "
        f"runs with each kind: {by_kind or 'none'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--only", default="", help="comma-separated family:model_type[+recipe] names")
    parser.add_argument("--family", default="", help="comma-separated families")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--no-preflight", action="store_true")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--shard", default="", help="i/n: run every n-th entry from the i-th (0-based)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", default="", help="write every result here (updated after each run)")
    args = parser.parse_args(argv)
    archs = catalogue()
    if args.list:
        for a in archs:
            print(f"{a.name:<50} {a.class_name}")
        print(f"{len(archs)} runs")
        return 0
    if args.only:
        wanted = set(args.only.split(","))
        archs = [a for a in archs if a.name in wanted]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        archs = archs[i::n]
    if args.family:
        fams = set(args.family.split(","))
        archs = [a for a in archs if a.family in fams]
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_gradguard").setLevel(logging.CRITICAL + 1)
    warnings.simplefilter("ignore")
    results: list[Result] = []
    started = time.perf_counter()
    for arch in archs:
        r = run_forked(arch, args.steps, not args.no_preflight, args.timeout)
        results.append(r)
        print(
            f"{r.name:<44} {r.stage:<8} {'quiet' if r.quiet else r.first_alert() or r.reason[:80]:<60} "
            f"{r.seconds:5.1f} s",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(x) for x in results], indent=1, default=str))
    print(markdown(results) if args.markdown else "")
    print("\n" + summary(results))
    print(
        f"\n{len(archs)} runs in {time.perf_counter() - started:.0f} s (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, lightning {pl.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
