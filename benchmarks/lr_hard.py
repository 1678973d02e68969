"""LR range-test finders on hard tasks, each scored against a brute-force grid of learning rates.

Four finders, side by side, each at its defaults as a user would run it:

* ``ours``: ``lightning_gradguard.lr_find`` (LRFinderPlus in a throwaway Trainer; 1e-7..1, 100 points, then
  the search inside the sweep's bracket, ``search_steps=300``, run again with trials twice as long up to
  twice where its trials learned nothing it can rank by, ``search_retries=2``);
* ``ours_sweep``: the same with ``search_steps=0``: the range test alone, as before the search;
* ``lightning``: ``Tuner(trainer).lr_find`` and its ``suggestion()`` (1e-8..1, 100 points);
* ``torch_lr_finder``: the plain-PyTorch package ``torch-lr-finder`` (``range_test`` 1e-7..10, 100
  points, then the steepest-gradient point of its plot).

On ``regression_noisy_40`` every finder sweeps 40 points instead of 100. Where the task's
LightningModule configures a warm-up + cosine schedule (``lm_warmup_cosine``) or a ``OneCycleLR``
(``vit_onecycle``), a suggestion is used as the schedule's peak learning rate. Where the task clips its
gradients (``gru_lm_sgd_clip``), ours and Lightning's run on a Trainer with that ``gradient_clip_val``
(torch-lr-finder has no clipping setting: it sweeps unclipped, as its users would).

Scoring. Each task has a training budget (optimizer steps) and a held-out loss. A log grid of constant (or
peak) learning rates, 4 points per decade, 3 seeds each, is trained; the best LR is the one with the lowest
3-seed mean. Each finder runs once per seed (0, 1, 2; ``--finder-seeds 6``: 0..5, as ``make bench-lr-hard``
runs it, since three seeds of a finder's choices were too few to tell rules apart) and the task is trained at
that seed's suggestion with that seed. A finder's ratio is the mean held-out loss of those trainings over the
best grid mean (1.0: as good as the brute-force best). A refusal (no suggestion), and a training that ends no
better than chance (a blow-up, whether its loss became non-finite or stayed finite), score the task's chance
loss: the held-out loss of predicting the training prior (the training mean for a regression, the training
class frequencies for a classification, the training characters' frequencies for the language model). Capping
a finite blow-up at chance keeps one diverged training (a held-out loss of 250 nats) from deciding the mean
over all tasks; ``ratio_uncapped`` in the JSON scores only non-finite losses as chance. ``ratio_expected``
scores each suggestion by the grid's mean loss at it instead (linear in log-LR between grid points): how good
that LR is over the grid's seeds, without the chaos of the one seed it is trained with (a digits CNN at a good
LR blew up on one seed of six).

Tasks (offline data only):

* ``linreg_sgd``: make_regression (30 features, noise), one ``nn.Linear``, plain SGD, MSE, batch 32;
* ``regression_noisy_40``: make_friedman1 with heavy noise, MLP, Adam, batch 32; 40-point sweeps;
* ``mlp_adam_b4``: digits MLP, Adam, batch 4;
* ``lm_warmup_cosine``: a 2-layer causal transformer character LM on the source of a few stdlib modules,
  AdamW, linear warm-up then cosine decay (``LambdaLR``, per step);
* ``deep_tanh``: a 10-layer tanh MLP on digits, plain SGD: the loss stays flat for the whole sweep and
  breaks away only after hundreds of steps at a good LR (the sweep alone refuses it; the blind search's
  trials of a few hundred steps can learn it);
* ``gru_lm_sgd_clip``: a GRU character LM under plain SGD with ``gradient_clip_val=1`` (large LRs are safe);
* ``vit_onecycle``: a small ViT on digits (16 patches of 2x2) under AdamW and ``OneCycleLR(max_lr)``;
* ``linreg_unscaled_sgd``: linear regression on features scaled 0.1..10 (not standardised), plain SGD;
* ``mlp_adam_b4_cls``: a classification MLP under Adam at batch 4 (make_classification, 4 classes);
* ``cnn_bn``, ``logreg``: the easy tasks of ``benchmarks/lr_finder.py``, as a check that nothing regresses.

Held-out sets (``--set heldout``, ``heldout2``, ``heldout3``, ``heldout4``, ``heldout5``), written as checks
on ourselves and never used to choose a rule; ``heldout3``: a post-LN transformer encoder under AdamW with
linear warm-up and decay to 0, a small ResNet (BatchNorm) under SGD Nesterov with weight decay and LR / 10
steps, a GRU forecaster under Adam with clipping, a tabular MLP (LayerNorm, dropout) under SGD momentum at
batch 8, and a multi-label classifier (BCE) under NAdam with a cosine schedule; ``heldout4``: a
MobileNet-style depthwise-separable CNN (GroupNorm) under AdamW with label smoothing and warm-up + cosine, a
pre-LN transformer tagger under Adam (0.9, 0.98) with an inverse-square-root schedule, a convolutional VAE
under Adam with exponential decay, a Poisson GLM under SGD momentum with poly decay, and a
matrix-factorisation recommender (sparse embeddings) under SparseAdam; ``heldout5``: a graph convolutional
network (node classification in stochastic block model graphs) under Adam with L2 weight decay, a SimCLR-style
contrastive encoder (NT-Xent) under SGD momentum at batch 256 with warm-up + cosine, a student distilled from
a fixed teacher (soft targets at temperature 4) under SGD Nesterov with LR / 10 steps, a fastText-style
bag-of-embeddings text classifier under plain SGD with a linear decay to 0, and a 1-D U-Net denoiser (Huber
loss) under RAdam.

A sixth held-out set, ``--set heldout6``, was written to judge the next rule change once; it judged a probe
of the chosen LR held at its peak (not adopted, docs/benchmarks.md) and the search as it is, and is now in
``--set all``: a tabular MLP
(BatchNorm, dropout) under fastai's fit_one_cycle (SGD Nesterov, ``OneCycleLR``) at batch 128, a
bidirectional LSTM tagger under Adam with clipping 1.0 and warm-up + linear decay, a deep residual MLP
regressor (L1 loss) under Adamax with an exponential decay at batch 16, a siamese embedding network (triplet
margin loss) under SGD momentum with LR halvings, and a quantile regressor (pinball loss) under AdamW with a
cosine decay at batch 256.

A seventh held-out set, ``--set heldout7``, judged the next rule change once (the 600-step default budget;
in ``--set all`` since): a DeepSets
model (the sum of a set of digit images, MSE) under SGD momentum with a triangular cyclic LR, a character CNN
(which stdlib module a snippet of source is from) under SGD Nesterov with weight decay, dropout, label
smoothing and cosine warm restarts, an encoder-decoder ``nn.Transformer`` reversing digits under Adafactor at
a constant LR, the PyTorch examples' MNIST recipe (a CNN with dropout under Adadelta, LR x 0.7 every epoch)
on digits, and a CORAL ordinal regressor under Adam at batch 256.

An eighth held-out set, ``--set heldout8``, judged the next rule change once (a rise smaller than 1 % of the
loss's level no longer stops a sweep; in ``--set all`` since): a digits MLP
with a zero-initialised output layer under plain SGD with LR / 10 at 30, 60 and 90 %, an MLP autoencoder of
digits under SGD Nesterov with a quadratic decay, a two-tower retrieval model (in-batch softmax) under
Adagrad, a temporal convolutional network forecasting a series under AdamW with warm-up then a constant LR,
and a classifier of noisy labels (symmetric cross-entropy) under Adam with AMSGrad.

A ninth held-out set, ``--set heldout9``, judged the next rule changes once (a step decay's last level held
as long as the one before, and the sweep ended where the optimizer caps its step; in ``--set all`` since):
an MLP-Mixer on digits under NAdam with decoupled weight decay and a
warm-up-stable-decay schedule, a linear multiclass SVM (multi-class hinge loss) under ASGD, a classifier of
imbalanced classes with the focal loss under centered RMSprop with momentum, a heteroscedastic regressor
(Gaussian negative log-likelihood of a predicted mean and variance) under Adam with a gradual warm-up then LR
/ 10 steps, and a RealNVP normalising flow of two moons (exact negative log-likelihood) under Adam with a
cosine decay.

A tenth held-out set, ``--set heldout10``, judged the same code as the ninth once more, and lost it to
torch-lr-finder (in ``--set all`` since): a vanilla tanh RNN recalling the first values of a sequence under
SGD momentum without clipping (a plateau at chance, then a cliff just above the best LR), a
convolutional-recurrent recogniser of symbol sequences (CTC loss) under Adam with Ma and Yarats's exponential
warm-up, a BatchNorm CNN of digits trained on mixup's soft targets under AdamW with ``StepLR``, GloVe word
vectors of the stdlib's source (sparse embeddings, weighted least squares of log co-occurrences) under
Adagrad, and a DeepSurv-style survival model (Cox partial likelihood, a large constant offset) under NAdam
with an inverse-time decay at batch 512.

An eleventh held-out set, ``--set heldout11``, judged the blind search after a refused sweep and the margin
below the edge of a warm-up to a held LR, and was won narrowly (ours 1.48, torch-lr-finder 1.51; in ``--set
all`` since): a WaveNet-style dilated causal convolutional character LM under
Adam with a triangular2 cyclic LR, a mixture density network of Bishop's inverse problem (Gaussian mixture
negative log-likelihood) under AdamW with cosine warm restarts, a small U-Net segmenting synthetic blobs
with the soft Dice loss under SGD momentum 0.99 (a cliff just above the best LR), a tiny DDPM-style
diffusion model of a 2-D swiss roll (noise-prediction MSE, a noisy curve) under RAdam, and TransE embeddings
of a synthetic knowledge graph (margin ranking loss against corrupted triples) under plain SGD (a plateau,
a narrow good range, then a cliff).

A twelfth held-out set, ``--set heldout12``, written after the eleventh had judged, judged the same code once
more and was won (ours 1.03, torch-lr-finder 2.66; in ``--set all`` since): a PointNet classifying synthetic
2-D point clouds under AdamW with a one-cycle LR annealed linearly, a SIREN (sine activations) fitting a
synthetic image from three quarters of its pixels under Adam at a constant LR (a narrow good range, then a
cliff just above the best LR), a NeuMF neural collaborative filter of implicit feedback (BCE against sampled
negatives) under SGD momentum with an exp_range cyclic LR (good LRs up to 3, the best at 1), a Keras-style
LSTM autoencoder of noisy sequences under RMSprop with an exponential decay (a plateau at the mean before it
breaks away), and a sparse top-2 mixture-of-experts MLP classifier (cross-entropy plus the Switch
Transformer's load-balancing loss) under NAdam with a linear warm-up and decay.

A thirteenth held-out set, ``--set heldout13``, is written to judge the next rule change once, and so is not
in ``--set all`` until then (only the grid and the two third-party finders were run on it): a Perceiver-style
classifier of digits (learned latents cross-attending to the pixels) under AdamW with a warm-up-stable-decay
schedule, a physics-informed network solving a 1-D Poisson equation (the residual of its second derivative
plus the boundary conditions) under Adam with DeepXDE's inverse-time decay, a Gumbel-softmax discrete VAE of
binarised digits (the relaxed ELBO) under Adam with a cosine decay, an N-BEATS forecaster of seasonal series
(the sMAPE loss) under Adam with LR / 10 steps, and a deep & cross network (DCN-V2) of synthetic
click-through data (BCE) under Adagrad.

Optionally (``--real``, not scored) whether ``ours`` suggests anything on the ``mobilenet_v2`` and ``vit``
entries of ``benchmarks/real_models.py`` with their recipes.

The grid, and every training at a suggestion, is cached by (task, LR, seed) in ``--cache`` (default
``benchmarks/.lr_hard_grid.json``), keyed by a fingerprint of the task (data, model, optimizer, schedule,
budget), so a rerun after a change to our finder re-runs only the sweeps and the trainings at new
suggestions. The two third-party finders are cached too (keyed by their versions); ``--finders ours``
runs only ours. Every sweep's curve is written to ``--out`` (default ``benchmarks/results/lr_hard.json``;
ours: the raw losses, its smoothed curves, every method's suggestion and why it refused; the other two:
the smoothed losses they keep), so that a decision rule can be re-run offline on the saved curves.

The report also gives the search's cost per task: its optimizer steps, its seconds and the whole
``lr_find`` call's seconds (mean over the seeds), and where a sweep still falling at ``max_lr`` was extended.

Run: ``python benchmarks/lr_hard.py`` (one thread; cold cache: about 790 trainings, 24 minutes of wall
time on a busy 2-core machine; warm cache: about 2 minutes), ``--quick`` (2 points per
decade, 2 seeds), ``--tasks a,b``, ``--finders ours``, ``--no-cache``. Every training is deterministic
(same numbers bit for bit on a rerun).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import re
import sys
import sysconfig
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from typing import Any

import matplotlib

matplotlib.use("Agg")  # torch_lr_finder imports pyplot; its plot must never open a window

import lightning
import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.tuner import Tuner
from sklearn.datasets import (
    load_digits,
    make_classification,
    make_friedman1,
    make_friedman3,
    make_moons,
    make_multilabel_classification,
    make_regression,
)
from sklearn.model_selection import train_test_split
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import digits_mlp, environment

from lightning_gradguard import lr_find

warnings.filterwarnings("ignore")
for _name in ("lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
    logging.getLogger(_name).setLevel(logging.ERROR)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE = os.path.join(HERE, ".lr_hard_grid.json")
FINDERS = ("ours", "ours_sweep", "lightning", "torch_lr_finder")
SEEDS = (0, 1, 2)
PER_DECADE = 4  # grid points per decade (``--quick``: 2)
SEARCH_STEPS: int | None = None  # ours' search_steps (``--search-steps``; None: lr_find's default)
SEARCH_RETRIES: int | None = None  # ours' search_retries (``--search-retries``; None: lr_find's default)

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A training task: data, model, optimizer, optional schedule and the budget it is scored after.

    ``grid`` is the brute-force grid's range in grid steps of 1/4 decade (``(-20, 4)``: 1e-5..10).
    ``schedule(total)`` returns the ``LambdaLR`` multiplier of a step (``None``: constant LR).
    """

    name: str
    data: Data
    make_model: Callable[[], nn.Module]
    make_opt: Callable[[Any, float], torch.optim.Optimizer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps: int
    batch: int
    chance: float
    grid: tuple[int, int] = (-20, 4)
    schedule: Callable[[int], Callable[[int], float]] | None = None
    num_training: int = 100
    what: str = ""
    chance_what: str = ""
    clip: float | None = None  # gradient clipping by norm (the Trainer's gradient_clip_val)
    one_cycle: bool = False  # OneCycleLR(max_lr=lr, total_steps=steps), stepped per step


def _standardise(xtr: np.ndarray, xva: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu, sd = xtr.mean(0), xtr.std(0)
    return ((xtr - mu) / sd).astype(np.float32), ((xva - mu) / sd).astype(np.float32)


def _class_split(x: np.ndarray, y: np.ndarray, seed: int, standardise: bool = False) -> Data:
    """Split 75/25, stratified by class; with ``standardise``, the features scaled by the training
    statistics."""
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    if standardise:
        xtr, xva = _standardise(xtr, xva)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _regression_data(x: np.ndarray, y: np.ndarray, seed: int) -> Data:
    """Split 75/25, standardise the features and the target with the training statistics."""
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=seed)
    xtr, xva = _standardise(xtr, xva)
    ymu, ysd = ytr.mean(), ytr.std()
    f = np.float32
    return (
        torch.tensor(xtr),
        torch.tensor(((ytr - ymu) / ysd).astype(f)),
        torch.tensor(xva),
        torch.tensor(((yva - ymu) / ysd).astype(f)),
    )


def _digits() -> Data:
    """The split of ``benchmarks/lr_finder.py``: pixels / 16, 25 % held out, stratified."""
    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    xtr, xva, ytr, yva = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (a sequence of logits is flattened)."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mse_chance(data: Data) -> float:
    """Held-out MSE of predicting the training mean."""
    ytr, yva = data[1], data[3]
    return float(((yva - ytr.mean()) ** 2).mean())


def _prior_chance(data: Data, classes: int) -> float:
    """Held-out cross-entropy of predicting the training class (or character) frequencies."""
    ytr, yva = data[1].reshape(-1), data[3].reshape(-1)
    counts = torch.bincount(ytr, minlength=classes).double() + 1.0  # add-one: no class has probability 0
    logp = torch.log(counts / counts.sum())
    return float(-logp[yva].mean())


class WarmupCosine:
    """LR multiplier: linear warm-up over ``warmup`` of ``total`` steps, then cosine decay to 0.

    A callable object rather than a closure, so that ``LambdaLR.state_dict`` keeps it.
    """

    def __init__(self, total: int, warmup: float = 0.1) -> None:
        self.total = total
        self.warm = max(1, round(warmup * total))

    def __call__(self, step: int) -> float:
        if step < self.warm:
            return (step + 1) / self.warm
        t = min(1.0, (step - self.warm) / max(1, self.total - self.warm))
        return 0.5 * (1.0 + math.cos(math.pi * t))

    def __repr__(self) -> str:
        return f"WarmupCosine(total={self.total}, warm={self.warm})"


# ----- a. linreg_sgd
def linreg_sgd() -> Task:
    x, y = make_regression(n_samples=1200, n_features=30, n_informative=20, noise=100.0, random_state=0)
    data = _regression_data(x, y, 0)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "linreg_sgd",
        data,
        lambda: nn.Linear(30, 1),
        opt,
        _mse,
        steps=150,
        batch=32,
        chance=_mse_chance(data),
        what="make_regression 30 features, nn.Linear, SGD, batch 32, 150 steps",
        chance_what="predict the training mean",
    )


# ----- b. regression_noisy_40
def regression_noisy_40() -> Task:
    x, y = make_friedman1(n_samples=1200, n_features=10, noise=4.0, random_state=0)
    data = _regression_data(x, y, 0)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "regression_noisy_40",
        data,
        mlp,
        opt,
        _mse,
        steps=300,
        batch=32,
        chance=_mse_chance(data),
        grid=(-20, 2),
        num_training=40,
        what="make_friedman1 noise 4, MLP 64-64, Adam, batch 32, 300 steps; 40-point sweeps",
        chance_what="predict the training mean",
    )


# ----- c. mlp_adam_b4
def mlp_adam_b4() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "mlp_adam_b4",
        data,
        digits_mlp,
        opt,
        _ce,
        steps=600,
        batch=4,
        chance=_prior_chance(data, 10),
        grid=(-20, 2),
        what="digits MLP 128-64, Adam, batch 4, 600 steps",
        chance_what="predict the training class frequencies",
    )


# ----- d. lm_warmup_cosine
LM_FILES = ("textwrap.py", "argparse.py", os.path.join("json", "decoder.py"))
LM_CONTEXT = 64


def _stdlib_text() -> str:
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in LM_FILES:
        with open(os.path.join(root, name), encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def _lm_data() -> tuple[Data, int]:
    """Windows of ``LM_CONTEXT`` characters and their next characters: the first 90 % of the text for
    training (stride half a window), the last 10 % held out (disjoint windows)."""
    text = _stdlib_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))

    def windows(part: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.arange(0, len(part) - LM_CONTEXT - 1, stride)
        offsets = torch.arange(LM_CONTEXT + 1)
        w = part[starts[:, None] + offsets[None, :]]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    xtr, ytr = windows(ids[:cut], LM_CONTEXT // 2)
    xva, yva = windows(ids[cut:], LM_CONTEXT)
    return (xtr, ytr, xva, yva), len(vocab)


class _Block(nn.Module):
    """A pre-LN causal self-attention block (``scaled_dot_product_attention``) with a GELU MLP."""

    def __init__(self, d: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A causal transformer over characters: learned positions, ``layers`` pre-LN blocks, a linear head.

    (Our own small block rather than ``nn.TransformerEncoderLayer``: about 1.5 times faster on one CPU
    thread at this size.)
    """

    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(LM_CONTEXT, d))
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.norm(self.blocks(h)))


def lm_warmup_cosine() -> Task:
    data, vocab = _lm_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.05)

    return Task(
        "lm_warmup_cosine",
        data,
        lambda: CharLM(vocab),
        opt,
        _ce,
        steps=150,
        batch=16,
        chance=_prior_chance(data, vocab),
        grid=(-14, -2),
        schedule=WarmupCosine,
        what=f"char LM ({vocab} chars) on {', '.join(LM_FILES)}: 2-layer transformer d64 h4 ctx64, AdamW wd "
        "0.05, 10 % warm-up + cosine, batch 16, 150 steps; a suggestion is the peak LR",
        chance_what="predict the training character frequencies",
    )


# ----- e. deep_tanh
def deep_tanh() -> Task:
    data = _digits()

    def mlp() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(64, 64), nn.Tanh()]
        for _ in range(8):
            layers += [nn.Linear(64, 64), nn.Tanh()]
        layers.append(nn.Linear(64, 10))
        return nn.Sequential(*layers)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "deep_tanh",
        data,
        mlp,
        opt,
        _ce,
        steps=1500,
        batch=32,
        chance=_prior_chance(data, 10),
        grid=(-10, 4),
        what="digits, 10-layer tanh MLP width 64 (PyTorch init), SGD, batch 32, 1500 steps",
        chance_what="predict the training class frequencies",
    )


# ----- g. gru_lm_sgd_clip: a GRU character LM under plain SGD with gradient clipping at 1
GRU_CONTEXT = 32


class GRULM(nn.Module):
    """A one-layer GRU over characters: embedding, GRU, linear head."""

    def __init__(self, vocab: int, d: int = 32, hidden: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(x))
        return self.head(out)


def gru_lm_sgd_clip() -> Task:
    (xtr, ytr, xva, yva), vocab = _lm_data()
    data = (xtr[:, :GRU_CONTEXT], ytr[:, :GRU_CONTEXT], xva[:, :GRU_CONTEXT], yva[:, :GRU_CONTEXT])

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "gru_lm_sgd_clip",
        data,
        lambda: GRULM(vocab),
        opt,
        _ce,
        steps=200,
        batch=16,
        chance=_prior_chance(data, vocab),
        grid=(-12, 8),
        clip=1.0,
        what=f"char LM ({vocab} chars, context {GRU_CONTEXT}) on the LM's text: GRU 96, plain SGD, "
        "gradient_clip_val=1, batch 16, 200 steps",
        chance_what="predict the training character frequencies",
    )


# ----- h. vit_onecycle: a small ViT on digits under AdamW and OneCycleLR(max_lr)
class TinyViT(nn.Module):
    """8x8 digits cut into 2x2 patches (16 tokens), a class token, 2 pre-LN blocks d32 h4, a linear head."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.patch = nn.Linear(4, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(17, d))
        self.blocks = nn.Sequential(*[_Block(d, heads, causal=False) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        patches = x.view(b, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(b, 16, 4)
        h = torch.cat([self.cls.expand(b, -1, -1), self.patch(patches)], dim=1) + self.pos
        return self.head(self.norm(self.blocks(h))[:, 0])


def vit_onecycle() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.05)

    return Task(
        "vit_onecycle",
        data,
        TinyViT,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 10),
        grid=(-16, -2),
        one_cycle=True,
        what="digits as 16 patches of 2x2: ViT 2 blocks d32 h4, AdamW wd 0.05, OneCycleLR(max_lr) per step, "
        "batch 32, 300 steps; a suggestion is the max_lr",
        chance_what="predict the training class frequencies",
    )


# ----- i. linreg_unscaled_sgd: linear regression on features of very different scales, plain SGD
def linreg_unscaled_sgd() -> Task:
    x, y = make_regression(n_samples=1200, n_features=20, n_informative=12, noise=20.0, random_state=1)
    scales = np.logspace(-1, 1, 20)[np.random.default_rng(1).permutation(20)]  # 0.1 .. 10, shuffled
    x = x * scales
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=1)
    ymu, ysd = ytr.mean(), ytr.std()
    f = np.float32
    data = (
        torch.tensor(xtr.astype(f)),
        torch.tensor(((ytr - ymu) / ysd).astype(f)),
        torch.tensor(xva.astype(f)),
        torch.tensor(((yva - ymu) / ysd).astype(f)),
    )

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "linreg_unscaled_sgd",
        data,
        lambda: nn.Linear(20, 1),
        opt,
        _mse,
        steps=300,
        batch=32,
        chance=_mse_chance(data),
        grid=(-20, 0),
        what="make_regression 20 features scaled 0.1..10 (not standardised), nn.Linear, SGD, batch 32, "
        "300 steps",
        chance_what="predict the training mean",
    )


# ----- j. mlp_adam_b4_cls: a classification MLP under Adam at batch 4
def mlp_adam_b4_cls() -> Task:
    x, y = make_classification(
        n_samples=1600, n_features=20, n_informative=10, n_classes=4, class_sep=1.0, random_state=3
    )
    data = _class_split(x, y, 3, standardise=True)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "mlp_adam_b4_cls",
        data,
        mlp,
        opt,
        _ce,
        steps=500,
        batch=4,
        chance=_prior_chance(data, 4),
        grid=(-20, 0),
        what="make_classification 20 features (10 informative), 4 classes, MLP 64-64, Adam, batch 4, "
        "500 steps",
        chance_what="predict the training class frequencies",
    )


# ---------------------------------------------------------------------------------------------- held-out set
# Written for issue 39 as a check on ourselves: evaluated only after the search's rules were settled, never
# used to choose them (``--set heldout``). Other model families, optimizers, batch sizes and schedules than
# the tasks above.
class Cosine:
    """LR multiplier: cosine decay from 1 to 0 over ``total`` steps (a callable object: picklable)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, self.total))))

    def __repr__(self) -> str:
        return f"Cosine(total={self.total})"


class WarmupConstant:
    """LR multiplier: linear warm-up over ``warmup`` of ``total`` steps, then constant."""

    def __init__(self, total: int, warmup: float = 0.2) -> None:
        self.total = total
        self.warm = max(1, round(warmup * total))

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warm)

    def __repr__(self) -> str:
        return f"WarmupConstant(total={self.total}, warm={self.warm})"


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers (no normalisation), max-pooling, a linear head, on 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def cnn_momentum_cosine() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True)

    return Task(
        "cnn_momentum_cosine",
        data,
        DigitsCNN,
        opt,
        _ce,
        steps=200,
        batch=64,
        chance=_prior_chance(data, 10),
        grid=(-16, 4),
        schedule=Cosine,
        what="digits CNN 16-32 (no BatchNorm), SGD Nesterov momentum 0.9, cosine to 0 per step, batch 64, "
        "200 steps; a suggestion is the peak LR",
        chance_what="predict the training class frequencies",
    )


SEQ_LEN = 24


def _sequence_data() -> Data:
    """Sequences of 24 noisy values; the label: whether the motif (+1, -1, +1) occurs anywhere."""
    rng = np.random.default_rng(7)
    n = 2000
    x = rng.normal(0.0, 0.6, size=(n, SEQ_LEN)).astype(np.float32)
    y = rng.integers(0, 2, size=n)
    for i in np.flatnonzero(y):
        at = rng.integers(0, SEQ_LEN - 3)
        x[i, at : at + 3] += np.array([1.5, -1.5, 1.5], dtype=np.float32)
    return _class_split(x, y, 7)


class MotifConv(nn.Module):
    """A 1-D conv net over a sequence: two conv layers, a global max over time, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Unflatten(1, (1, SEQ_LEN)),
            nn.Conv1d(1, 16, 5, padding=2),
            nn.GELU(),
            nn.Conv1d(16, 16, 5, padding=2),
            nn.GELU(),
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).amax(dim=-1))


def conv1d_adam_clip() -> Task:
    data = _sequence_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr, betas=(0.9, 0.99))

    return Task(
        "conv1d_adam_clip",
        data,
        MotifConv,
        opt,
        _ce,
        steps=300,
        batch=16,
        chance=_prior_chance(data, 2),
        grid=(-20, 0),
        clip=0.5,
        what="motif detection in noisy sequences of 24: 1-D conv 16-16 + max over time, Adam (0.9, 0.99), "
        "gradient_clip_val=0.5, batch 16, 300 steps",
        chance_what="predict the training class frequencies",
    )


def wide_mlp_adamw_warmup() -> Task:
    x, y = make_friedman1(n_samples=2000, n_features=12, noise=1.0, random_state=5)
    data = _regression_data(x, y, 5)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(12, 512), nn.SiLU(), nn.Linear(512, 1))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.01)

    return Task(
        "wide_mlp_adamw_warmup",
        data,
        mlp,
        opt,
        _mse,
        steps=250,
        batch=64,
        chance=_mse_chance(data),
        grid=(-20, 0),
        schedule=WarmupConstant,
        what="make_friedman1 noise 1: one hidden layer of 512 SiLU, AdamW wd 0.01, 20 % linear warm-up then "
        "constant, batch 64, 250 steps; a suggestion is the peak LR",
        chance_what="predict the training mean",
    )


def logreg_l2_adagrad() -> Task:
    x, y = make_classification(
        n_samples=1500, n_features=60, n_informative=15, n_classes=3, class_sep=0.8, random_state=11
    )
    data = _class_split(x, y, 11, standardise=True)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(p, lr=lr, weight_decay=1e-3)

    return Task(
        "logreg_l2_adagrad",
        data,
        lambda: nn.Linear(60, 3),
        opt,
        _ce,
        steps=200,
        batch=16,
        chance=_prior_chance(data, 3),
        grid=(-16, 4),
        what="make_classification 60 features (15 informative), 3 classes: logistic regression, Adagrad with "
        "L2 1e-3, batch 16, 200 steps",
        chance_what="predict the training class frequencies",
    )


HELD_OUT = {
    "cnn_momentum_cosine": cnn_momentum_cosine,
    "conv1d_adam_clip": conv1d_adam_clip,
    "wide_mlp_adamw_warmup": wide_mlp_adamw_warmup,
    "logreg_l2_adagrad": logreg_l2_adagrad,
}


# ------------------------------------------------------------------------------------------- held-out set 2
# Written after the second round's last change (the note), as a second check on ourselves: evaluated once
# (``--set heldout2``), never used to choose a rule.
class StepDecay:
    """LR multiplier: halved at 50 % and again at 75 % of ``total`` steps (a step schedule)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, step: int) -> float:
        return 0.25 if step >= 0.75 * self.total else 0.5 if step >= 0.5 * self.total else 1.0

    def __repr__(self) -> str:
        return f"StepDecay(total={self.total})"


def rmsprop_mlp_step() -> Task:
    rng = np.random.default_rng(21)
    x = rng.normal(size=(2000, 8))
    y = np.sin(x[:, 0] * x[:, 1]) + 0.5 * np.tanh(x[:, 2] - x[:, 3]) + 0.3 * rng.normal(size=2000)
    data = _regression_data(x, y, 21)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 1))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(p, lr=lr, alpha=0.9)

    return Task(
        "rmsprop_mlp_step",
        data,
        mlp,
        opt,
        _mse,
        steps=300,
        batch=128,
        chance=_mse_chance(data),
        grid=(-20, 0),
        schedule=StepDecay,
        what="a smooth nonlinear regression (8 features): tanh MLP 96-96, RMSprop (alpha 0.9), LR halved at "
        "50 % and 75 %, batch 128, 300 steps; a suggestion is the initial LR",
        chance_what="predict the training mean",
    )


COUNT_LEN = 20


def _count_data() -> Data:
    """Binary sequences of 20; the label: whether they hold more ones than zeros (ties: no)."""
    rng = np.random.default_rng(23)
    x = (rng.random((2400, COUNT_LEN)) < rng.uniform(0.3, 0.7, size=(2400, 1))).astype(np.float32)
    y = (x.sum(1) > COUNT_LEN / 2).astype(np.int64)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=23)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class CountLSTM(nn.Module):
    """An LSTM over a binary sequence (one input per step), classified from its last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, 24, batch_first=True)
        self.head = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.unsqueeze(-1))
        return self.head(out[:, -1])


def lstm_count_adam() -> Task:
    data = _count_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "lstm_count_adam",
        data,
        CountLSTM,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 2),
        grid=(-20, 0),
        what="majority of ones in binary sequences of 20: LSTM 24, last state, Adam, batch 32, 300 steps",
        chance_what="predict the training class frequencies",
    )


class Denoiser(nn.Module):
    """A small conv denoiser of 8x8 digits: two conv layers and a conv output, on the flattened image."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 1, 3, padding=1),
            nn.Flatten(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _denoise_data() -> Data:
    """Digits (pixels / 16) with Gaussian noise 0.3 as the input, the clean image as the target."""
    xtr, _, xva, _ = _digits()
    g = torch.Generator().manual_seed(29)
    return (
        xtr + 0.3 * torch.randn(xtr.shape, generator=g),
        xtr,
        xva + 0.3 * torch.randn(xva.shape, generator=g),
        xva,
    )


def _image_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def denoiser_sgd_momentum() -> Task:
    data = _denoise_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    ytr, yva = data[1], data[3]
    return Task(
        "denoiser_sgd_momentum",
        data,
        Denoiser,
        opt,
        _image_mse,
        steps=250,
        batch=16,
        chance=float(((yva - ytr.mean(0)) ** 2).mean()),
        grid=(-16, 4),
        what="denoising digits (noise 0.3): conv 16-16-1, SGD momentum 0.9, MSE, batch 16, 250 steps",
        chance_what="predict the mean training image",
    )


HELD_OUT_2 = {
    "rmsprop_mlp_step": rmsprop_mlp_step,
    "lstm_count_adam": lstm_count_adam,
    "denoiser_sgd_momentum": denoiser_sgd_momentum,
}


# ------------------------------------------------------------------------------------------- held-out set 3
# Written as a third check on ourselves, before any finder's result on it was seen: evaluated once (``--set
# heldout3``), never used to choose a rule. Each task is a common recipe of its kind, unlike the 18 above:
# a post-LN transformer encoder under the transformers recipe, a residual BatchNorm CNN under the ResNet
# recipe, a GRU forecaster, a tabular MLP with LayerNorm and dropout at batch 8, a multi-label classifier.
class WarmupLinear:
    """LR multiplier: linear warm-up from 0 over ``warmup`` of ``total`` steps, then linear decay to 0 (the
    transformers library's ``get_linear_schedule_with_warmup``)."""

    def __init__(self, total: int, warmup: float = 0.1) -> None:
        self.total = total
        self.warm = max(1, round(warmup * total))

    def __call__(self, step: int) -> float:
        if step < self.warm:
            return step / self.warm
        return max(0.0, (self.total - step) / max(1, self.total - self.warm))

    def __repr__(self) -> str:
        return f"WarmupLinear(total={self.total}, warm={self.warm})"


class TenthSteps:
    """LR multiplier: divided by 10 at 50 % and again at 75 % of ``total`` steps (the ResNet step recipe,
    ``MultiStepLR(gamma=0.1)``)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, step: int) -> float:
        return 0.01 if step >= 0.75 * self.total else 0.1 if step >= 0.5 * self.total else 1.0

    def __repr__(self) -> str:
        return f"TenthSteps(total={self.total})"


# ----- k. sorted_transformer_adamw: is a sequence of digits sorted? A post-LN encoder, transformers recipe
SORT_LEN = 12


def _sorted_data() -> Data:
    """Sequences of 12 tokens 0..9; half sorted (non-decreasing), half not: a sorted sequence shuffled (half
    of them) or with two neighbours of different values swapped (the other half, the hard negatives); the
    label, whether it is sorted."""
    rng = np.random.default_rng(31)
    n = 3000
    x = np.sort(rng.integers(0, 10, size=(n, SORT_LEN)), axis=1)
    y = rng.integers(0, 2, size=n)
    for i in np.flatnonzero(y == 0):
        while not np.any(np.diff(x[i]) < 0):
            if rng.random() < 0.5:
                x[i] = rng.permutation(x[i])
            else:
                a = int(rng.integers(0, SORT_LEN - 1))
                x[i, a], x[i, a + 1] = x[i, a + 1], x[i, a]
    return _class_split(x, y, 31)


class SortedEncoder(nn.Module):
    """Token embedding + learned positions, ``nn.TransformerEncoder`` (2 post-LN layers d32 h4, ff 64,
    dropout 0.1: PyTorch's defaults but the sizes), mean pool, a linear head."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.pos = nn.Parameter(0.02 * torch.randn(SORT_LEN, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos).mean(1))


def sorted_transformer_adamw() -> Task:
    data = _sorted_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.01)

    return Task(
        "sorted_transformer_adamw",
        data,
        SortedEncoder,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 2),
        grid=(-14, -2),
        schedule=WarmupLinear,
        what=f"is a sequence of {SORT_LEN} digits sorted (negatives: shuffled, or 2 neighbours swapped): "
        "nn.TransformerEncoder 2 post-LN layers d32 h4 ff64 dropout 0.1, mean pool, AdamW wd 0.01, 10 % "
        "linear warm-up then linear decay to 0, batch 32, 300 steps; a suggestion is the peak LR",
        chance_what="predict the training class frequencies",
    )


# ----- l. resnet_bn_nesterov_step: a small ResNet on synthetic shapes, the ResNet recipe
SHAPE_SIZE = 12


def _shapes_data() -> Data:
    """12x12 images of one of 4 shapes (a filled square, a square's outline, a plus, an X) of random size
    and position, random brightness, on Gaussian noise 0.4; the label, the shape."""
    rng = np.random.default_rng(37)
    n = 2400
    x = rng.normal(0.0, 0.4, size=(n, 1, SHAPE_SIZE, SHAPE_SIZE)).astype(np.float32)
    y = rng.integers(0, 4, size=n)
    for i in range(n):
        s = int(rng.integers(2, 4))  # half-size: the shape spans 2 s + 1 pixels
        r, c = rng.integers(s, SHAPE_SIZE - s, size=2)
        v = rng.uniform(0.6, 1.4)
        rows, cols = np.arange(r - s, r + s + 1), np.arange(c - s, c + s + 1)
        patch = np.zeros((2 * s + 1, 2 * s + 1), dtype=np.float32)
        if y[i] == 0:
            patch[:] = 1.0
        elif y[i] == 1:
            patch[[0, -1], :] = 1.0
            patch[:, [0, -1]] = 1.0
        elif y[i] == 2:
            patch[s, :] = 1.0
            patch[:, s] = 1.0
        else:
            patch[np.arange(2 * s + 1), np.arange(2 * s + 1)] = 1.0
            patch[np.arange(2 * s + 1), np.arange(2 * s, -1, -1)] = 1.0
        x[i, 0, rows[:, None], cols[None, :]] += v * patch
    return _class_split(x, y, 37)


class _ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (a ResNet basic block, 3x3, same width)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SmallResNet(nn.Module):
    """A conv-BN-ReLU stem of 16 channels, two basic blocks, a 2x2 max-pool between, global average pool,
    a linear head."""

    def __init__(self, c: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            _ResBlock(c),
            nn.MaxPool2d(2),
            _ResBlock(c),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(c, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet_bn_nesterov_step() -> Task:
    data = _shapes_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    return Task(
        "resnet_bn_nesterov_step",
        data,
        SmallResNet,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 4),
        grid=(-13, 3),
        schedule=TenthSteps,
        what=f"4 noisy shapes in {SHAPE_SIZE}x{SHAPE_SIZE} images: ResNet (BN stem 16, 2 basic blocks), SGD "
        "Nesterov momentum 0.9 wd 5e-4, LR / 10 at 50 % and 75 %, batch 32, 300 steps; a suggestion is the "
        "initial LR",
        chance_what="predict the training class frequencies",
    )


# ----- m. gru_forecast_adam_clip: forecasting the next values of noisy sine mixtures, GRU, Adam, clipping
FORECAST_IN, FORECAST_OUT = 32, 5


def _forecast_data() -> Data:
    """Windows of 32 values of a series (two sines of random periods 8..40 and phases, plus AR(1) noise
    with coefficient 0.8) and the 5 values after them, as the target; standardised by the training series'
    statistics."""
    rng = np.random.default_rng(41)
    n, length = 2400, FORECAST_IN + FORECAST_OUT
    t = np.arange(length)
    periods = rng.uniform(8, 40, size=(n, 2, 1))
    phases = rng.uniform(0, 2 * np.pi, size=(n, 2, 1))
    amps = rng.uniform(0.5, 1.5, size=(n, 2, 1))
    series = (amps * np.sin(2 * np.pi * t / periods + phases)).sum(1)
    noise = np.zeros((n, length))
    eps = rng.normal(0.0, 0.3, size=(n, length))
    for k in range(length):
        noise[:, k] = (0.8 * noise[:, k - 1] if k else 0.0) + eps[:, k]
    series = series + noise
    xtr, xva, ytr, yva = train_test_split(
        series[:, :FORECAST_IN], series[:, FORECAST_IN:], test_size=0.25, random_state=41
    )
    mu, sd = xtr.mean(), xtr.std()

    def scaled(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(((a - mu) / sd).astype(np.float32))

    return scaled(xtr), scaled(ytr), scaled(xva), scaled(yva)


class GRUForecaster(nn.Module):
    """A one-layer GRU of 32 over the window (one input per step); a linear head on its last state."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(1, 32, batch_first=True)
        self.head = nn.Linear(32, FORECAST_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.unsqueeze(-1))
        return self.head(out[:, -1])


def gru_forecast_adam_clip() -> Task:
    data = _forecast_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "gru_forecast_adam_clip",
        data,
        GRUForecaster,
        opt,
        _image_mse,
        steps=300,
        batch=32,
        chance=_mse_chance(data),
        grid=(-18, 0),
        clip=1.0,
        what=f"forecast the next {FORECAST_OUT} values from {FORECAST_IN} of sine mixtures + AR(1) noise: "
        "GRU 32, last state, Adam, gradient_clip_val=1, MSE, batch 32, 300 steps",
        chance_what="predict the training targets' mean",
    )


# ----- n. tabular_ln_dropout_sgd_b8: a tabular MLP with LayerNorm and dropout, 12 classes, momentum, batch 8
def tabular_ln_dropout_sgd_b8() -> Task:
    x, y = make_classification(
        n_samples=2400,
        n_features=30,
        n_informative=16,
        n_redundant=6,
        n_classes=12,
        n_clusters_per_class=1,
        class_sep=1.5,
        random_state=43,
    )
    data = _class_split(x, y, 43, standardise=True)

    def mlp() -> nn.Module:
        def block(i: int, o: int) -> list[nn.Module]:
            return [nn.Linear(i, o), nn.LayerNorm(o), nn.ReLU(), nn.Dropout(0.2)]

        return nn.Sequential(*block(30, 128), *block(128, 128), nn.Linear(128, 12))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "tabular_ln_dropout_sgd_b8",
        data,
        mlp,
        opt,
        _ce,
        steps=400,
        batch=8,
        chance=_prior_chance(data, 12),
        grid=(-16, 4),
        what="make_classification 30 features (16 informative), 12 classes: MLP 128-128 with LayerNorm and "
        "dropout 0.2, SGD momentum 0.9, batch 8, 400 steps",
        chance_what="predict the training class frequencies",
    )


# ----- o. multilabel_nadam_cosine: multi-label classification (BCE) under NAdam and a cosine schedule
def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, y)


def _label_prior_chance(data: Data) -> float:
    """Held-out binary cross-entropy (mean over the labels) of predicting each label's training frequency."""
    ytr, yva = data[1], data[3]
    p = ((ytr.sum(0) + 1.0) / (len(ytr) + 2.0)).double()  # add-one: no label has probability 0 or 1
    return float(-(yva * torch.log(p) + (1 - yva) * torch.log(1 - p)).mean())


def multilabel_nadam_cosine() -> Task:
    x, y = make_multilabel_classification(
        n_samples=2400, n_features=40, n_classes=15, n_labels=3, length=60, random_state=47
    )
    xtr, xva, ytr, yva = train_test_split(np.log1p(x), y, test_size=0.25, random_state=47)
    xtr, xva = _standardise(xtr, xva)
    f = np.float32
    data = (torch.tensor(xtr), torch.tensor(ytr.astype(f)), torch.tensor(xva), torch.tensor(yva.astype(f)))

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 15))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.NAdam(p, lr=lr)

    return Task(
        "multilabel_nadam_cosine",
        data,
        mlp,
        opt,
        _bce,
        steps=250,
        batch=64,
        chance=_label_prior_chance(data),
        grid=(-20, 0),
        schedule=Cosine,
        what="make_multilabel_classification 40 count features (log1p, standardised), 15 labels (3 on "
        "average): MLP 256, NAdam, BCE with logits, cosine to 0 per step, batch 64, 250 steps; a suggestion "
        "is the peak LR",
        chance_what="predict each label's training frequency",
    )


HELD_OUT_3 = {
    "sorted_transformer_adamw": sorted_transformer_adamw,
    "resnet_bn_nesterov_step": resnet_bn_nesterov_step,
    "gru_forecast_adam_clip": gru_forecast_adam_clip,
    "tabular_ln_dropout_sgd_b8": tabular_ln_dropout_sgd_b8,
    "multilabel_nadam_cosine": multilabel_nadam_cosine,
}


# ------------------------------------------------------------------------------------------- held-out set 4
# Written as a fourth check on ourselves, before any result of ours on it was seen (only the grid and the two
# third-party finders were run): evaluated once (``--set heldout4``), never used to choose a rule. Each task
# is a common recipe of a model family none of the 23 above has: a depthwise-separable CNN (GroupNorm) under
# AdamW with label smoothing and warm-up + cosine, a pre-LN transformer tagger under the "Attention is all
# you need" recipe (Adam (0.9, 0.98), inverse square root decay after a warm-up), a convolutional VAE under
# Adam with exponential decay, a Poisson GLM under SGD momentum with the "poly" decay, and a
# matrix-factorisation recommender under SparseAdam.
class InverseSqrt:
    """LR multiplier: linear warm-up over ``warmup`` of ``total`` steps, then decay as the inverse square root
    of the step (the "Attention is all you need" schedule, fairseq's ``inverse_sqrt``), 1 at the warm-up's
    end."""

    def __init__(self, total: int, warmup: float = 0.1) -> None:
        self.total = total
        self.warm = max(1, round(warmup * total))

    def __call__(self, step: int) -> float:
        return min((step + 1) / self.warm, math.sqrt(self.warm / (step + 1)))

    def __repr__(self) -> str:
        return f"InverseSqrt(total={self.total}, warm={self.warm})"


class ExpDecay:
    """LR multiplier: ``gamma ** step`` with ``gamma`` such that the LR ends at ``final`` of its start
    (``ExponentialLR``, stepped per step)."""

    def __init__(self, total: int, final: float = 0.1) -> None:
        self.total = total
        self.gamma = final ** (1.0 / max(1, total))

    def __call__(self, step: int) -> float:
        return float(self.gamma**step)

    def __repr__(self) -> str:
        return f"ExpDecay(total={self.total}, gamma={self.gamma:.6f})"


class PolyDecay:
    """LR multiplier: ``(1 - step / total) ** power`` (``PolynomialLR``; power 0.9: DeepLab's "poly")."""

    def __init__(self, total: int, power: float = 0.9) -> None:
        self.total = total
        self.power = power

    def __call__(self, step: int) -> float:
        return max(0.0, 1.0 - step / max(1, self.total)) ** self.power

    def __repr__(self) -> str:
        return f"PolyDecay(total={self.total}, power={self.power})"


# ----- p. mobilenet_gn_adamw_smooth: a MobileNet-style CNN on digits, AdamW, label smoothing, warm-up, cosine
SMOOTHING = 0.1


def _ce_smooth(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, label_smoothing=SMOOTHING)


def _smoothed_prior_chance(data: Data, classes: int) -> float:
    """Held-out label-smoothed cross-entropy of predicting the training class frequencies (add-one)."""
    ytr, yva = data[1], data[3]
    counts = torch.bincount(ytr, minlength=classes).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-((1 - SMOOTHING) * logp[yva] + SMOOTHING * logp.mean()).mean())


def _sep(cin: int, cout: int, stride: int) -> list[nn.Module]:
    """A depthwise 3x3 conv and a pointwise 1x1 conv, each followed by GroupNorm (4 groups) and ReLU6."""
    return [
        nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
        nn.GroupNorm(4, cin),
        nn.ReLU6(),
        nn.Conv2d(cin, cout, 1, bias=False),
        nn.GroupNorm(4, cout),
        nn.ReLU6(),
    ]


class SepCNN(nn.Module):
    """A MobileNet-v1-style CNN on 8x8 digits: a 3x3 conv stem of 16, three depthwise-separable blocks
    (16-32, 32-64 at stride 2, 64-64), GroupNorm, global average pool, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1, bias=False),
            nn.GroupNorm(4, 16),
            nn.ReLU6(),
            *_sep(16, 32, 1),
            *_sep(32, 64, 2),
            *_sep(64, 64, 1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mobilenet_gn_adamw_smooth() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.05)

    return Task(
        "mobilenet_gn_adamw_smooth",
        data,
        SepCNN,
        opt,
        _ce_smooth,
        steps=200,
        batch=64,
        chance=_smoothed_prior_chance(data, 10),
        grid=(-18, 0),
        schedule=WarmupCosine,
        what="digits: MobileNet-style CNN (stem 16, 3 depthwise-separable blocks to 64, GroupNorm, ReLU6), "
        f"AdamW wd 0.05, label smoothing {SMOOTHING}, 10 % warm-up + cosine, batch 64, 200 steps; a "
        "suggestion is the peak LR",
        chance_what="predict the training class frequencies (label-smoothed cross-entropy)",
    )


# ----- q. preln_tagger_inverse_sqrt: per-token tagging with a pre-LN transformer, Vaswani et al.'s recipe
TAG_LEN, TAG_VOCAB = 16, 20


def _duplicate_data() -> Data:
    """Sequences of 16 tokens drawn from 20; each token's tag: whether the same token occurs elsewhere in
    the sequence."""
    rng = np.random.default_rng(53)
    x = rng.integers(0, TAG_VOCAB, size=(3000, TAG_LEN))
    same = x[:, :, None] == x[:, None, :]
    y = (same.sum(-1) > 1).astype(np.int64)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=53)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class PreLNTagger(nn.Module):
    """Token embedding + learned positions, 2 pre-LN blocks d32 h4 (no mask), a final LayerNorm, a linear
    head per token."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(TAG_VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(TAG_LEN, d))
        self.blocks = nn.Sequential(*[_Block(d, heads, causal=False) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x) + self.pos)))


def preln_tagger_inverse_sqrt() -> Task:
    data = _duplicate_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr, betas=(0.9, 0.98), eps=1e-9)

    return Task(
        "preln_tagger_inverse_sqrt",
        data,
        PreLNTagger,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 2),
        grid=(-16, 0),
        schedule=InverseSqrt,
        what=f"tag each of {TAG_LEN} tokens (of {TAG_VOCAB}) by whether it occurs elsewhere in the sequence: "
        "pre-LN transformer 2 blocks d32 h4, Adam (0.9, 0.98) eps 1e-9, 10 % linear warm-up then inverse "
        "square root decay, batch 32, 300 steps; a suggestion is the peak LR",
        chance_what="predict the training tag frequencies",
    )


# ----- r. conv_vae_adam_exp: a convolutional VAE on digits under Adam and exponential decay
VAE_LATENT = 8


class ConvVAE(nn.Module):
    """A convolutional VAE of 8x8 digits: conv 16, conv 32 at stride 2, a linear map to the posterior's mean
    and log-variance (8 latents); a linear map back, a transposed conv, a conv to the pixels' logits. Its
    output: the 64 logits, the mean and the log-variance, side by side; the latent is sampled in training,
    its mean in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 16, 2 * VAE_LATENT),
        )
        self.dec = nn.Sequential(
            nn.Linear(VAE_LATENT, 32 * 16),
            nn.ReLU(),
            nn.Unflatten(1, (32, 4, 4)),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 1, 3, padding=1),
            nn.Flatten(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu) if self.training else mu
        return torch.cat([self.dec(z), mu, logvar], dim=-1)


def _pixel_entropy(y: torch.Tensor) -> torch.Tensor:
    """Each image's summed Bernoulli entropy of its pixel intensities: the least cross-entropy any
    reconstruction of it can reach."""
    return -(torch.xlogy(y, y) + torch.xlogy(1 - y, 1 - y)).sum(-1)


def _vae_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The negative ELBO per image, less the pixels' own entropy (a constant of the data, so that 0 is a
    perfect reconstruction with the prior as posterior): the Bernoulli cross-entropy of the 64 pixels
    (intensities in [0, 1]) summed, plus the KL divergence of the posterior from the standard normal; mean
    over the batch."""
    logits, mu, logvar = out[:, :64], out[:, 64 : 64 + VAE_LATENT], out[:, 64 + VAE_LATENT :]
    rec = nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none").sum(-1)
    kl = 0.5 * (mu**2 + logvar.exp() - 1.0 - logvar).sum(-1)
    return (rec - _pixel_entropy(y) + kl).mean()


def conv_vae_adam_exp() -> Task:
    xtr, _, xva, _ = _digits()
    xtr, xva = (xtr > 0.5).float(), (xva > 0.5).float()
    data = (xtr, xtr, xva, xva)
    mean = xtr.mean(0).clamp(1e-3, 1 - 1e-3)  # a pixel that is 0 in every training image: probability 1e-3

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    bce = nn.functional.binary_cross_entropy(mean.expand_as(xva), xva, reduction="none").sum(-1)
    chance = float((bce - _pixel_entropy(xva)).mean())
    return Task(
        "conv_vae_adam_exp",
        data,
        ConvVAE,
        opt,
        _vae_loss,
        steps=300,
        batch=128,
        chance=chance,
        grid=(-18, 0),
        schedule=ExpDecay,
        what=f"VAE of digits (pixels / 16): conv encoder 16-32, {VAE_LATENT} latents, transposed-conv "
        "decoder, Adam, negative ELBO (Bernoulli pixels + KL) less the pixels' entropy, ExponentialLR to 0.1 "
        "of the LR over the run (per step), batch 128, 300 steps; a suggestion is the initial LR",
        chance_what="predict the mean training image, posterior = prior (KL 0)",
    )


# ----- s. poisson_glm_sgd_poly: Poisson regression (log link) of counts, SGD momentum, poly decay
def _count_regression_data() -> Data:
    """Counts: 4000 rows of 13 features (8 Gaussian, a one-hot of a 4-level category, log-exposure), the
    log-rate linear in them plus log-exposure (exposure 0.5..2); standardised features, raw counts."""
    rng = np.random.default_rng(59)
    n = 4000
    gauss = rng.normal(size=(n, 8))
    cat = np.eye(4)[rng.integers(0, 4, size=n)]
    exposure = rng.uniform(0.5, 2.0, size=n)
    w = np.array([0.6, -0.4, 0.3, 0.2, -0.2, 0.1, 0.0, 0.0])
    log_rate = 0.8 + gauss @ w + cat @ np.array([0.0, 0.4, -0.3, 0.7]) + np.log(exposure)
    y = rng.poisson(np.exp(log_rate)).astype(np.float32)
    x = np.concatenate([gauss, cat, np.log(exposure)[:, None]], axis=1)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=59)
    xtr, xva = _standardise(xtr, xva)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _poisson_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Poisson negative log-likelihood of the counts ``y`` under the log-rate ``out`` (exact, with log y!)."""
    f = out.squeeze(-1)
    return (torch.exp(f) - y * f + torch.lgamma(y + 1.0)).mean()


def poisson_glm_sgd_poly() -> Task:
    data = _count_regression_data()
    ytr, yva = data[1], data[3]
    rate = float(ytr.mean())

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "poisson_glm_sgd_poly",
        data,
        lambda: nn.Linear(13, 1),
        opt,
        _poisson_nll,
        steps=200,
        batch=64,
        chance=float((rate - yva * math.log(rate) + torch.lgamma(yva + 1.0)).mean()),
        grid=(-20, 0),
        schedule=PolyDecay,
        what="Poisson regression of synthetic counts (8 Gaussian features, a 4-level category, "
        "log-exposure): a linear log-rate, SGD momentum 0.9, Poisson NLL, poly decay (power 0.9) to 0, "
        "batch 64, 200 steps; a suggestion is the initial LR",
        chance_what="predict the training mean count",
    )


# ----- t. mf_recommender_sparseadam: matrix factorisation of synthetic ratings, sparse embeddings
MF_USERS, MF_ITEMS, MF_DIM = 400, 300, 16


def _ratings_data() -> Data:
    """Ratings 1..5 (rounded) of a rank-4 model with user and item biases, 20 % of the 400 x 300 pairs
    observed; the inputs, (user, item) pairs; the target, the rating centred on the training mean."""
    rng = np.random.default_rng(61)
    u, v = rng.normal(0.0, 0.6, size=(MF_USERS, 4)), rng.normal(0.0, 0.6, size=(MF_ITEMS, 4))
    bu, bi = rng.normal(0.0, 0.5, size=MF_USERS), rng.normal(0.0, 0.5, size=MF_ITEMS)
    pairs = rng.permutation(MF_USERS * MF_ITEMS)[: MF_USERS * MF_ITEMS // 5]
    users, items = pairs // MF_ITEMS, pairs % MF_ITEMS
    score = 3.2 + bu[users] + bi[items] + (u[users] * v[items]).sum(1) + rng.normal(0.0, 0.5, size=len(pairs))
    rating = np.clip(np.round(score), 1, 5)
    x = np.stack([users, items], axis=1)
    xtr, xva, ytr, yva = train_test_split(x, rating, test_size=0.25, random_state=61)
    mu = ytr.mean()
    f = np.float32
    return (
        torch.tensor(xtr),
        torch.tensor((ytr - mu).astype(f)),
        torch.tensor(xva),
        torch.tensor((yva - mu).astype(f)),
    )


class MatrixFactorisation(nn.Module):
    """User and item embeddings (16, initialised N(0, 0.1)) and biases (0), all ``sparse=True``; the rating:
    the dot product plus both biases."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(MF_USERS, MF_DIM, sparse=True)
        self.item = nn.Embedding(MF_ITEMS, MF_DIM, sparse=True)
        self.user_bias = nn.Embedding(MF_USERS, 1, sparse=True)
        self.item_bias = nn.Embedding(MF_ITEMS, 1, sparse=True)
        for e in (self.user, self.item):
            nn.init.normal_(e.weight, 0.0, 0.1)
        for e in (self.user_bias, self.item_bias):
            nn.init.zeros_(e.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = x[:, 0], x[:, 1]
        dot = (self.user(u) * self.item(i)).sum(-1)
        return dot + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1)


def mf_recommender_sparseadam() -> Task:
    data = _ratings_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SparseAdam(list(p), lr=lr)

    return Task(
        "mf_recommender_sparseadam",
        data,
        MatrixFactorisation,
        opt,
        _mse,
        steps=300,
        batch=256,
        chance=_mse_chance(data),
        grid=(-16, 2),
        what=f"ratings 1..5 of {MF_USERS} users x {MF_ITEMS} items (rank 4 + biases, 20 % observed): matrix "
        f"factorisation (dim {MF_DIM}, sparse embeddings and biases), SparseAdam, MSE, batch 256, 300 steps",
        chance_what="predict the training mean rating",
    )


HELD_OUT_4 = {
    "mobilenet_gn_adamw_smooth": mobilenet_gn_adamw_smooth,
    "preln_tagger_inverse_sqrt": preln_tagger_inverse_sqrt,
    "conv_vae_adam_exp": conv_vae_adam_exp,
    "poisson_glm_sgd_poly": poisson_glm_sgd_poly,
    "mf_recommender_sparseadam": mf_recommender_sparseadam,
}


# ------------------------------------------------------------------------------------------- held-out set 5
# Written as a fifth check on ourselves, before any result of ours on it was seen (only the grid and the two
# third-party finders were run): evaluated once (``--set heldout5``), never used to choose a rule. Each task
# is a common recipe of a model family or training setting none of the 28 above has: a graph convolutional
# network under Kipf and Welling's recipe (Adam, L2 weight decay 5e-4, dropout 0.5, a constant LR), a
# SimCLR-style contrastive encoder (NT-Xent) under SGD momentum at batch 256 with warm-up + cosine, a
# distilled student (soft targets at temperature 4) under SGD Nesterov with LR / 10 steps, a fastText-style
# bag-of-embeddings text classifier under plain SGD with a linear decay to 0, and a 1-D U-Net denoiser
# (Huber loss) under RAdam.
def _loss_at_prior(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], data: Data, k: int
) -> float:
    """Held-out ``loss_fn`` of predicting the training class frequencies (add-one) as the logits of every
    sample."""
    ytr, yva = data[1], data[3]
    labels = ytr[:, -1].long() if ytr.dim() > 1 else ytr
    counts = torch.bincount(labels, minlength=k).double() + 1.0
    logits = torch.log(counts / counts.sum()).float()
    return float(loss_fn(logits.expand(len(yva), k), yva))


# ----- u. gcn_csbm_adam_l2: node classification in contextual stochastic block model graphs, a 2-layer GCN
GCN_NODES, GCN_CLASSES, GCN_FEATURES = 20, 3, 8


def _csbm_data() -> Data:
    """2000 graphs of 20 nodes in 3 communities (edge probability 0.3 within, 0.03 across), each node's
    features its community's mean (fixed, norm 1) plus Gaussian noise 1: a node's label, its community. A
    graph's input: its symmetrically normalised adjacency with self-loops (20 columns) beside the features."""
    rng = np.random.default_rng(67)
    n = 2000
    means = rng.normal(size=(GCN_CLASSES, GCN_FEATURES))
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    y = rng.integers(0, GCN_CLASSES, size=(n, GCN_NODES))
    same = y[:, :, None] == y[:, None, :]
    upper = np.triu(rng.random((n, GCN_NODES, GCN_NODES)) < np.where(same, 0.3, 0.03), 1)
    adj = upper | upper.transpose(0, 2, 1) | np.eye(GCN_NODES, dtype=bool)
    inv_sqrt = 1.0 / np.sqrt(adj.sum(-1))
    norm = adj * inv_sqrt[:, :, None] * inv_sqrt[:, None, :]
    feats = means[y] + rng.normal(size=(n, GCN_NODES, GCN_FEATURES))
    x = np.concatenate([norm, feats], axis=-1).astype(np.float32)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=67)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class GCN(nn.Module):
    """Kipf and Welling's two-layer GCN, batched over graphs: dropout 0.5, A X W (hidden 32), ReLU, dropout
    0.5, A H W to the class logits of every node."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Linear(GCN_FEATURES, hidden)
        self.w2 = nn.Linear(hidden, GCN_CLASSES)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adj, feats = x[..., :GCN_NODES], x[..., GCN_NODES:]
        h = torch.relu(adj @ self.w1(self.drop(feats)))
        return adj @ self.w2(self.drop(h))


def gcn_csbm_adam_l2() -> Task:
    data = _csbm_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr, weight_decay=5e-4)

    return Task(
        "gcn_csbm_adam_l2",
        data,
        GCN,
        opt,
        _ce,
        steps=300,
        batch=16,
        chance=_prior_chance(data, GCN_CLASSES),
        grid=(-20, 4),
        what=f"node classification in contextual SBM graphs ({GCN_NODES} nodes, {GCN_CLASSES} communities, "
        "noisy community features): 2-layer GCN (hidden 32, dropout 0.5), Adam with L2 weight decay 5e-4, "
        "constant LR, per-node cross-entropy, batch 16 graphs, 300 steps",
        chance_what="predict the training community frequencies",
    )


# ----- v. simclr_ntxent_sgd: a contrastive encoder of digits, NT-Xent, SGD momentum at batch 256
NTXENT_TEMPERATURE = 0.2


def _augment(x: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
    """A random view of flat 8x8 digits: shifted by up to a pixel each way (zeros in), 20 % of the pixels
    dropped, Gaussian noise 0.1."""
    b = x.shape[0]
    padded = nn.functional.pad(x.view(b, 8, 8), (1, 1, 1, 1))
    offset = torch.randint(0, 3, (b, 2), generator=g)
    rows = (offset[:, :1] + torch.arange(8))[:, :, None]
    cols = (offset[:, 1:] + torch.arange(8))[:, None, :]
    out = padded[torch.arange(b)[:, None, None], rows, cols]
    out = out * (torch.rand(out.shape, generator=g) > 0.2) + 0.1 * torch.randn(out.shape, generator=g)
    return out.reshape(b, 64)


class SimCLR(nn.Module):
    """Two random views of each digit (drawn afresh at every step in training; in evaluation, the same
    views every time: a fixed generator), an MLP encoder (64-256-128, ReLU) and a projection head (128-64)
    on both; the output, the two views' projections, L2-normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = None if self.training else torch.Generator().manual_seed(71)
        views = torch.stack([_augment(x, g), _augment(x, g)], dim=1)
        return nn.functional.normalize(self.head(self.encoder(views)), dim=-1)


def _ntxent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SimCLR's NT-Xent over the batch: each of the 2n views must pick its partner among the other 2n - 1
    by cosine similarity / temperature (cross-entropy); ``y`` is unused."""
    n = out.shape[0]
    z = torch.cat([out[:, 0], out[:, 1]])
    sim = (z @ z.T) / NTXENT_TEMPERATURE
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    partner = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return nn.functional.cross_entropy(sim, partner)


def simclr_ntxent_sgd() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=1e-6)

    n_val = len(data[2])
    return Task(
        "simclr_ntxent_sgd",
        data,
        SimCLR,
        opt,
        _ntxent,
        steps=300,
        batch=256,
        chance=math.log(2 * n_val - 1),
        grid=(-16, 8),
        schedule=WarmupCosine,
        what="contrastive learning on two random views of each digit (shift, 20 % pixel dropout, noise "
        f"0.1): MLP encoder 256-128 + projection 64, NT-Xent (temperature {NTXENT_TEMPERATURE}; "
        f"held out: all {n_val} pairs at once), SGD momentum 0.9 wd 1e-6, 10 % warm-up + cosine, batch 256, "
        "300 steps; a suggestion is the peak LR",
        chance_what=f"a constant embedding: log({2 * n_val - 1}) (every candidate equally likely)",
    )


# ----- w. kd_student_sgd_step: a small student distilled from a digits MLP teacher, the KD recipe
KD_TEMPERATURE, KD_ALPHA = 4.0, 0.9


def _teacher_data() -> Data:
    """Digits; the target, the teacher's 10 logits beside the label. The teacher: an MLP 256-256 trained here
    once on the training split (Adam 1e-3, batches of 64 drawn with replacement, 600 steps, seed 73)."""
    xtr, ytr, xva, yva = _digits()
    torch.manual_seed(73)
    teacher = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(teacher.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(73)
    for _ in range(600):
        idx = torch.randint(len(xtr), (64,), generator=g)
        loss = nn.functional.cross_entropy(teacher(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        ttr, tva = teacher(xtr), teacher(xva)
    return xtr, torch.cat([ttr, ytr[:, None].float()], 1), xva, torch.cat([tva, yva[:, None].float()], 1)


def _distill(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hinton et al.'s loss: ``alpha`` T^2 KL(teacher || student) of the softmaxes at temperature T, plus
    ``1 - alpha`` times the cross-entropy with the label (``y``: the teacher's logits, then the label)."""
    t = KD_TEMPERATURE
    teacher, label = y[:, :-1], y[:, -1].long()
    log_s = nn.functional.log_softmax(out / t, dim=-1)
    log_t = nn.functional.log_softmax(teacher / t, dim=-1)
    kl = nn.functional.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
    return KD_ALPHA * t * t * kl + (1 - KD_ALPHA) * nn.functional.cross_entropy(out, label)


def kd_student_sgd_step() -> Task:
    data = _teacher_data()

    def student() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    return Task(
        "kd_student_sgd_step",
        data,
        student,
        opt,
        _distill,
        steps=300,
        batch=64,
        chance=_loss_at_prior(_distill, data, 10),
        grid=(-16, 4),
        schedule=TenthSteps,
        what="digits: an MLP 32 student distilled from an MLP 256-256 teacher (trained once, fixed), "
        f"{KD_ALPHA} T^2 KL at T = {KD_TEMPERATURE:g} + {1 - KD_ALPHA:.1f} cross-entropy, SGD Nesterov "
        "momentum 0.9 wd 5e-4, LR / 10 at 50 % and 75 %, batch 64, 300 steps; a suggestion is the initial LR",
        chance_what="predict the training class frequencies (the same loss)",
    )


# ----- x. fasttext_sgd_linear: a bag-of-embeddings text classifier, fastText's recipe
FT_VOCAB, FT_LEN, FT_CLASSES, FT_DIM, FT_KEYWORDS = 5000, 32, 5, 32, 50


def _documents_data() -> Data:
    """5000 documents of 8..32 tokens (id 0: padding) over 5000 words, in 5 topics: each token one of its
    topic's 50 keywords with probability 0.15, otherwise a Zipf-distributed word of any topic; the label, the
    topic."""
    rng = np.random.default_rng(79)
    n = 5000
    y = rng.integers(0, FT_CLASSES, size=n)
    words = np.arange(1, FT_VOCAB)
    keywords = rng.permutation(words)[: FT_CLASSES * FT_KEYWORDS].reshape(FT_CLASSES, FT_KEYWORDS)
    zipf = 1.0 / words
    common = rng.choice(words, size=(n, FT_LEN), p=zipf / zipf.sum())
    topical = keywords[y[:, None], rng.integers(0, FT_KEYWORDS, size=(n, FT_LEN))]
    x = np.where(rng.random((n, FT_LEN)) < 0.15, topical, common)
    x[np.arange(FT_LEN)[None, :] >= rng.integers(8, FT_LEN + 1, size=(n, 1))] = 0
    return _class_split(x, y, 79)


class FastText(nn.Module):
    """fastText's classifier: the mean of the words' embeddings (``EmbeddingBag``, padding excluded; init
    uniform +-1/dim), a linear layer to the topics (init 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(FT_VOCAB, FT_DIM, mode="mean", padding_idx=0)
        self.out = nn.Linear(FT_DIM, FT_CLASSES)
        nn.init.uniform_(self.embed.weight, -1.0 / FT_DIM, 1.0 / FT_DIM)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x))


def fasttext_sgd_linear() -> Task:
    data = _documents_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "fasttext_sgd_linear",
        data,
        FastText,
        opt,
        _ce,
        steps=400,
        batch=16,
        chance=_prior_chance(data, FT_CLASSES),
        grid=(-12, 12),
        schedule=partial(PolyDecay, power=1.0),
        what=f"topic of synthetic documents ({FT_CLASSES} topics, {FT_VOCAB} words, 8..{FT_LEN} tokens, "
        f"{FT_KEYWORDS} keywords per topic among Zipf words): fastText-style mean of embeddings (dim "
        f"{FT_DIM}) + linear, plain SGD, linear decay to 0, batch 16, 400 steps; a suggestion is the "
        "initial LR",
        chance_what="predict the training topic frequencies",
    )


# ----- y. unet1d_radam_huber: denoising 1-D signals with impulse noise, a small U-Net, Huber loss, RAdam
UNET_LEN = 64


def _signals_data() -> Data:
    """3000 signals of 64 samples: piecewise constant (2 to 4 jumps, levels N(0, 1)) plus a sine (amplitude
    0..0.5, period 8..32); the input, the signal plus Gaussian noise 0.2 and, at 5 % of the samples, an
    impulse of +-2..4; the target, the clean signal."""
    rng = np.random.default_rng(83)
    n = 3000
    t = np.arange(UNET_LEN)
    clean = np.zeros((n, UNET_LEN))
    for i in range(n):
        cuts = np.sort(rng.choice(np.arange(4, UNET_LEN - 4), size=rng.integers(2, 5), replace=False))
        clean[i] = rng.normal(size=len(cuts) + 1)[np.searchsorted(cuts, t, side="right")]
    period, phase = rng.uniform(8, 32, size=(n, 1)), rng.uniform(0, 2 * np.pi, size=(n, 1))
    clean += rng.uniform(0, 0.5, size=(n, 1)) * np.sin(2 * np.pi * t / period + phase)
    impulses = rng.choice([-1.0, 1.0], size=clean.shape) * rng.uniform(2, 4, size=clean.shape)
    noisy = clean + rng.normal(0.0, 0.2, size=clean.shape) + (rng.random(clean.shape) < 0.05) * impulses
    xtr, xva, ytr, yva = train_test_split(noisy, clean, test_size=0.25, random_state=83)
    return tuple(torch.tensor(a.astype(np.float32)) for a in (xtr, ytr, xva, yva))  # type: ignore[return-value]


def _double_conv(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv1d(cout, cout, 3, padding=1), nn.ReLU()
    )


class UNet1d(nn.Module):
    """A 1-D U-Net: two levels of double 3-convs (16, 32) and max-pooling, a bottom of 64, transposed-conv
    upsampling with skip connections back up, a 1x1 conv out."""

    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2, self.bottom = _double_conv(1, 16), _double_conv(16, 32), _double_conv(32, 64)
        self.up2, self.dec2 = nn.ConvTranspose1d(64, 32, 2, stride=2), _double_conv(64, 32)
        self.up1, self.dec1 = nn.ConvTranspose1d(32, 16, 2, stride=2), _double_conv(32, 16)
        self.out = nn.Conv1d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.down1(x.unsqueeze(1))
        e2 = self.down2(nn.functional.max_pool1d(e1, 2))
        b = self.bottom(nn.functional.max_pool1d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1).squeeze(1)


def _huber(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.huber_loss(out, y, delta=1.0)


def unet1d_radam_huber() -> Task:
    data = _signals_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RAdam(p, lr=lr)

    ytr, yva = data[1], data[3]
    return Task(
        "unet1d_radam_huber",
        data,
        UNet1d,
        opt,
        _huber,
        steps=300,
        batch=32,
        chance=float(_huber(ytr.mean(0).expand_as(yva), yva)),
        grid=(-20, 2),
        what=f"denoising 1-D signals of {UNET_LEN} (steps + a sine; Gaussian noise 0.2 and 5 % impulses): "
        "U-Net 16-32-64 with skips, RAdam, Huber loss (delta 1), constant LR, batch 32, 300 steps",
        chance_what="predict the mean training signal",
    )


HELD_OUT_5 = {
    "gcn_csbm_adam_l2": gcn_csbm_adam_l2,
    "simclr_ntxent_sgd": simclr_ntxent_sgd,
    "kd_student_sgd_step": kd_student_sgd_step,
    "fasttext_sgd_linear": fasttext_sgd_linear,
    "unet1d_radam_huber": unet1d_radam_huber,
}


# ------------------------------------------------------------------------------------------- held-out set 6
# Written as a sixth check on ourselves, before any result of ours on it was seen (only the grid and the two
# third-party finders were run): it judged the next rule change once (``--set heldout6``: a probe of the
# chosen LR held at its peak, not adopted), never to choose a rule, and is in ``SETS["all"]`` since. Each task
# is a common recipe of a model family or training setting none of the 33 above has: a tabular MLP with
# BatchNorm and dropout under fastai's fit_one_cycle (SGD Nesterov, ``OneCycleLR``) at batch 128, a
# bidirectional LSTM tagger under Adam with clipping 1.0 and warm-up + linear decay, a deep residual MLP
# regressor (L1 loss) under Adamax with an exponential decay at batch 16, a siamese embedding network (triplet
# margin loss) under SGD momentum with LR halvings, and a quantile regressor (pinball loss) of a
# heteroscedastic target under AdamW with a cosine decay at batch 256.


# ----- z1. tabular_bn_onecycle_nesterov: a BatchNorm + dropout MLP on tabular data, fit_one_cycle
def tabular_bn_onecycle_nesterov() -> Task:
    x, y = make_classification(
        n_samples=4000,
        n_features=24,
        n_informative=10,
        n_redundant=6,
        n_classes=4,
        n_clusters_per_class=2,
        flip_y=0.05,
        class_sep=0.8,
        random_state=89,
    )
    data = _class_split(x, y, 89, standardise=True)

    def mlp() -> nn.Module:
        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Linear(cin, cout), nn.BatchNorm1d(cout), nn.ReLU(), nn.Dropout(0.3)]

        return nn.Sequential(*block(24, 256), *block(256, 128), nn.Linear(128, 4))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)

    return Task(
        "tabular_bn_onecycle_nesterov",
        data,
        mlp,
        opt,
        _ce,
        steps=300,
        batch=128,
        chance=_prior_chance(data, 4),
        grid=(-16, 8),
        one_cycle=True,
        what="make_classification (24 features, 4 classes, 5 % labels flipped): MLP 256-128 with BatchNorm "
        "and dropout 0.3, SGD Nesterov momentum 0.9 wd 1e-4, OneCycleLR (momentum cycled 0.95-0.85), "
        "batch 128, 300 steps; a suggestion is max_lr",
        chance_what="predict the training class frequencies",
    )


# ----- z2. bilstm_tagger_adam_clip: a bidirectional LSTM sequence tagger, Adam, clipping, warm-up + decay
TAG_VOCAB, TAG_LEN, TAG_CLASSES = 40, 16, 4


def _tagging_data() -> Data:
    """3000 sequences of 16 tokens (ids 0..39); a token's tag: its parity, and whether the next token is
    larger (the last token: whether the previous one is smaller), 4 tags; 10 % of the tags replaced by a
    random one."""
    rng = np.random.default_rng(97)
    n = 3000
    x = rng.integers(0, TAG_VOCAB, size=(n, TAG_LEN))
    nxt = np.concatenate([x[:, 1:] > x[:, :-1], x[:, -1:] > x[:, -2:-1]], axis=1)
    y = 2 * (x % 2) + nxt
    noise = rng.random(y.shape) < 0.1
    y = np.where(noise, rng.integers(0, TAG_CLASSES, size=y.shape), y)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=97)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class BiLSTMTagger(nn.Module):
    """Embedding 32, a one-layer bidirectional LSTM (hidden 32 each way), a linear layer to the tags."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TAG_VOCAB, 32)
        self.lstm = nn.LSTM(32, 32, batch_first=True, bidirectional=True)
        self.out = nn.Linear(64, TAG_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.embed(x))[0])


def bilstm_tagger_adam_clip() -> Task:
    data = _tagging_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "bilstm_tagger_adam_clip",
        data,
        BiLSTMTagger,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, TAG_CLASSES),
        grid=(-18, 4),
        clip=1.0,
        schedule=WarmupLinear,
        what=f"tagging sequences of {TAG_LEN} tokens ({TAG_VOCAB} ids; tag: parity and whether the next "
        "token is larger, 10 % noise): bidirectional LSTM 32 + linear, Adam, gradient clipping 1.0, 10 % "
        "warm-up + linear decay to 0, per-token cross-entropy, batch 32, 300 steps; a suggestion is the peak "
        "LR",
        chance_what="predict the training tag frequencies",
    )


# ----- z3. resmlp_adamax_exp_l1: a deep residual MLP regressor, L1 loss, Adamax, exponential decay
class _ResidualMLP(nn.Module):
    """Linear to width 64, 6 residual blocks (LayerNorm, Linear, GELU, Linear, added back), a linear head."""

    def __init__(self, features: int, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _l1(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.l1_loss(out.squeeze(-1), y)


def resmlp_adamax_exp_l1() -> Task:
    x, y = make_friedman3(n_samples=3000, noise=0.1, random_state=101)
    data = _regression_data(x, y, 101)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adamax(p, lr=lr)

    ytr, yva = data[1], data[3]
    return Task(
        "resmlp_adamax_exp_l1",
        data,
        partial(_ResidualMLP, 4),
        opt,
        _l1,
        steps=400,
        batch=16,
        chance=float((yva - ytr.median()).abs().mean()),
        grid=(-20, 2),
        schedule=partial(ExpDecay, final=0.05),
        what="make_friedman3 (noise 0.1, target standardised): residual MLP (width 64, 6 pre-LN blocks, "
        "GELU), Adamax, exponential decay to 5 % of the initial LR, L1 loss, batch 16, 400 steps; a "
        "suggestion is the initial LR",
        chance_what="predict the training median",
    )


# ----- z4. triplet_siamese_sgd: a siamese embedding network of digits, triplet margin loss, SGD momentum
TRIPLET_MARGIN = 1.0


def _triplet_data() -> Data:
    """Digits as (anchor, positive, negative) triplets: 8000 drawn from the training split, 2000 from the
    held-out split (the positive of the anchor's class, the negative of another); the targets unused (0)."""
    xtr, ytr, xva, yva = _digits()
    rng = np.random.default_rng(103)

    def triplets(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
        labels = y.numpy()
        by_class = [np.flatnonzero(labels == c) for c in range(10)]
        anchor = rng.integers(0, len(labels), size=n)
        other = (labels[anchor] + rng.integers(1, 10, size=n)) % 10
        pos = np.array([rng.choice(by_class[c]) for c in labels[anchor]])
        neg = np.array([rng.choice(by_class[c]) for c in other])
        return torch.stack([x[anchor], x[pos], x[neg]], dim=1)

    ttr, tva = triplets(xtr, ytr, 8000), triplets(xva, yva, 2000)
    return ttr, torch.zeros(len(ttr)), tva, torch.zeros(len(tva))


def _triplet(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The triplet margin loss of the three embeddings (``y`` unused)."""
    return nn.functional.triplet_margin_loss(out[:, 0], out[:, 1], out[:, 2], margin=TRIPLET_MARGIN)


def triplet_siamese_sgd() -> Task:
    data = _triplet_data()

    def embedder() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 16))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "triplet_siamese_sgd",
        data,
        embedder,
        opt,
        _triplet,
        steps=300,
        batch=64,
        chance=float(_triplet(torch.zeros(len(data[2]), 3, 16), data[3])),
        grid=(-16, 4),
        schedule=StepDecay,
        what="digits triplets (anchor, same-class positive, other-class negative): a shared MLP embedder "
        f"128-64-16, triplet margin loss (margin {TRIPLET_MARGIN:g}), SGD momentum 0.9, LR halved at 50 % "
        "and 75 %, batch 64, 300 steps; a suggestion is the initial LR",
        chance_what=f"a constant embedding: the margin, {TRIPLET_MARGIN:g}",
    )


# ----- z5. quantile_mlp_adamw_cosine: quantile regression (P10, P50, P90) of a heteroscedastic target, AdamW
# (the grid, once run: from 0.3 up to 1.8 no better than chance; at 3 to 10 AdamW's decoupled decay and the
# cosine's tail partly recover, to about twice the best loss, never near it)
QUANTILES = (0.1, 0.5, 0.9)


def _hetero_data() -> Data:
    """6000 points x ~ U(-2, 2)^4; y = sin(2 x0) + x1^2 / 2 - x2 x3 / 2 plus Gaussian noise of standard
    deviation 0.1 + 0.2 |x0 + x1| (input-dependent)."""
    rng = np.random.default_rng(107)
    x = rng.uniform(-2, 2, size=(6000, 4))
    mean = np.sin(2 * x[:, 0]) + x[:, 1] ** 2 / 2 - x[:, 2] * x[:, 3] / 2
    y = mean + rng.normal(size=len(x)) * (0.1 + 0.2 * np.abs(x[:, 0] + x[:, 1]))
    return _regression_data(x, y, 107)


def _pinball(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The pinball (quantile) loss of the output's columns as the ``QUANTILES`` of ``y``, summed over the
    quantiles."""
    q = torch.tensor(QUANTILES)
    err = y[:, None] - out
    return torch.maximum(q * err, (q - 1) * err).mean(0).sum()


def quantile_mlp_adamw_cosine() -> Task:
    data = _hetero_data()

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 3))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=1e-2)

    ytr, yva = data[1], data[3]
    prior = torch.quantile(ytr, torch.tensor(QUANTILES)).expand(len(yva), 3)
    return Task(
        "quantile_mlp_adamw_cosine",
        data,
        mlp,
        opt,
        _pinball,
        steps=300,
        batch=256,
        chance=float(_pinball(prior, yva)),
        grid=(-20, 4),
        schedule=Cosine,
        what="quantile regression (4 features, smooth mean, noise sd depending on the input): MLP 128-128 "
        "(SiLU) to the 10 %, 50 % and 90 % quantiles, pinball loss summed over them, AdamW wd 0.01, cosine "
        "decay to 0, batch 256, 300 steps; a suggestion is the initial LR",
        chance_what="predict the training quantiles",
    )


HELD_OUT_6 = {
    "tabular_bn_onecycle_nesterov": tabular_bn_onecycle_nesterov,
    "bilstm_tagger_adam_clip": bilstm_tagger_adam_clip,
    "resmlp_adamax_exp_l1": resmlp_adamax_exp_l1,
    "triplet_siamese_sgd": triplet_siamese_sgd,
    "quantile_mlp_adamw_cosine": quantile_mlp_adamw_cosine,
}


# ------------------------------------------------------------------------------------------- held-out set 7
# Written as a seventh check on ourselves, before any result of ours on it was seen (only the grid and the two
# third-party finders were run): it judged the next rule change once (``--set heldout7``: the search's default
# budget raised to 600 steps), never to choose a rule, and is in ``SETS["all"]`` since. Each task is a common
# recipe of a model family, optimizer or schedule none of the 38 above has: a DeepSets model (the sum of a set
# of digits) under SGD momentum with a triangular cyclic LR, a character CNN (which stdlib module a snippet of
# source comes from) under SGD Nesterov with weight decay, dropout, label smoothing and cosine warm restarts,
# an encoder-decoder transformer (reversing a sequence) under Adafactor at a constant LR, the PyTorch
# examples' MNIST recipe (a CNN with dropout under Adadelta and an LR x 0.7 every epoch) on digits, and an
# ordinal regressor (CORAL: shared score, ordered thresholds, binary cross-entropies) under Adam at batch 256.
class CyclicTriangular:
    """LR multiplier of ``CyclicLR(mode="triangular")`` with ``base_lr = floor * max_lr``: ``cycles`` cycles
    in ``total`` steps, each rising linearly from ``floor`` to 1 over its first half and back over its second
    (the LR only: the momentum is not cycled)."""

    def __init__(self, total: int, cycles: int = 3, floor: float = 0.1) -> None:
        self.total, self.cycles, self.floor = total, cycles, floor

    def __call__(self, step: int) -> float:
        period = self.total / self.cycles
        phase = (step % period) / period
        return self.floor + (1.0 - self.floor) * (1.0 - abs(2.0 * phase - 1.0))

    def __repr__(self) -> str:
        return f"CyclicTriangular(total={self.total}, cycles={self.cycles}, floor={self.floor})"


class WarmRestarts:
    """LR multiplier of ``CosineAnnealingWarmRestarts(T_0, T_mult=2)`` (SGDR, eta_min 0): a cosine from 1 to 0
    over ``T_0`` steps, a restart, one over ``2 T_0``, and so on; ``T_0`` such that ``cycles`` cycles fill
    ``total`` steps."""

    def __init__(self, total: int, cycles: int = 3) -> None:
        self.total, self.cycles = total, cycles
        self.t0 = total / (2**cycles - 1)

    def __call__(self, step: int) -> float:
        t, length = float(step), self.t0
        while t >= length:
            t, length = t - length, 2 * length
        return 0.5 * (1.0 + math.cos(math.pi * t / length))

    def __repr__(self) -> str:
        return f"WarmRestarts(total={self.total}, cycles={self.cycles})"


class EpochDecay:
    """LR multiplier: ``gamma`` to the power of the epoch (``StepLR(step_size=1, gamma)`` stepped once an
    epoch of ``per_epoch`` optimizer steps)."""

    def __init__(self, total: int, per_epoch: int, gamma: float = 0.7) -> None:
        self.total, self.per_epoch, self.gamma = total, per_epoch, gamma

    def __call__(self, step: int) -> float:
        return float(self.gamma ** (step // self.per_epoch))

    def __repr__(self) -> str:
        return f"EpochDecay(total={self.total}, per_epoch={self.per_epoch}, gamma={self.gamma})"


# ----- h1. deepsets_sum_sgd_cyclic: the sum of a set of digit images, a DeepSets model, SGD momentum, CLR
SET_SIZE = 5


def _digit_sets_data() -> Data:
    """Sets of 5 digit images: 6000 drawn from the training split, 1500 from the held-out split; the target,
    the sum of their 5 labels (0..45), standardised with the training sets' mean and deviation."""
    xtr, ytr, xva, yva = _digits()
    rng = np.random.default_rng(109)

    def sets(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(rng.integers(0, len(y), size=(n, SET_SIZE)))
        return x[idx], y[idx].sum(1).float()

    (s_tr, ttr), (s_va, tva) = sets(xtr, ytr, 6000), sets(xva, yva, 1500)
    mu, sd = ttr.mean(), ttr.std()
    return s_tr, (ttr - mu) / sd, s_va, (tva - mu) / sd


class DeepSets(nn.Module):
    """Zaheer et al.'s sum-decomposition: phi (an MLP 64-128-64 applied to each element), a sum over the set,
    rho (an MLP 64-64-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.rho = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rho(self.phi(x).sum(1))


def deepsets_sum_sgd_cyclic() -> Task:
    data = _digit_sets_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "deepsets_sum_sgd_cyclic",
        data,
        DeepSets,
        opt,
        _mse,
        steps=300,
        batch=32,
        chance=_mse_chance(data),
        grid=(-18, 2),
        schedule=CyclicTriangular,
        what=f"sets of {SET_SIZE} digit images, target the sum of their labels (standardised): DeepSets (phi "
        "64-128-64 per element, sum, rho 64-64-1), SGD momentum 0.9, triangular cyclic LR (3 cycles between "
        "0.1x and 1x), MSE, batch 32, 300 steps; a suggestion is max_lr",
        chance_what="predict the training mean",
    )


# ----- h2. charcnn_nesterov_sgdr: which stdlib module a snippet of its source is from, a character CNN
SNIPPET_FILES = ("heapq.py", "fractions.py", "calendar.py", "pprint.py", "tokenize.py")
SNIPPET_LEN = 64


def _snippets_data() -> Data:
    """Snippets of 64 characters (code points above 127 as 0) of five stdlib modules, labelled by module:
    from each module's first 80 % for training (every 32 characters, overlapping), from its last 20 % held
    out (disjoint)."""
    root = sysconfig.get_paths()["stdlib"]
    cols: list[list[torch.Tensor]] = [[], [], [], []]  # training windows, labels, held-out windows, labels
    for label, name in enumerate(SNIPPET_FILES):
        with open(os.path.join(root, name), encoding="utf-8") as fh:
            ids = torch.tensor([ord(c) if ord(c) < 128 else 0 for c in fh.read()], dtype=torch.long)
        cut = int(0.8 * len(ids))
        for i, (part, stride) in enumerate(((ids[:cut], SNIPPET_LEN // 2), (ids[cut:], SNIPPET_LEN))):
            starts = torch.arange(0, len(part) - SNIPPET_LEN + 1, stride)
            windows = part[starts[:, None] + torch.arange(SNIPPET_LEN)[None, :]]
            cols[2 * i].append(windows)
            cols[2 * i + 1].append(torch.full((len(windows),), label))
    xtr, ytr, xva, yva = (torch.cat(c) for c in cols)
    return xtr, ytr, xva, yva


class CharCNN(nn.Module):
    """Character embedding 32, two convolutions (64 filters of width 5, ReLU, max-pooling by 2 after the
    first), a max over the positions, dropout 0.5, a linear layer to the modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.convs = nn.Sequential(
            nn.Conv1d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(64, 64, 5, padding=2),
            nn.ReLU(),
        )
        self.out = nn.Sequential(nn.Dropout(0.5), nn.Linear(64, len(SNIPPET_FILES)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.convs(self.embed(x).transpose(1, 2))
        return self.out(h.amax(-1))


def charcnn_nesterov_sgdr() -> Task:
    data = _snippets_data()
    classes = len(SNIPPET_FILES)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    return Task(
        "charcnn_nesterov_sgdr",
        data,
        CharCNN,
        opt,
        _ce_smooth,
        steps=350,
        batch=64,
        chance=_smoothed_prior_chance(data, classes),
        grid=(-16, 4),
        schedule=WarmRestarts,
        what=f"which of {classes} stdlib modules a {SNIPPET_LEN}-character snippet of source is from: "
        "character CNN (embedding 32, 2 convolutions of 64 filters of width 5, max over positions, dropout "
        f"0.5), SGD Nesterov momentum 0.9 wd 5e-4, label smoothing {SMOOTHING:g}, cosine warm restarts "
        "(SGDR, T_mult 2, 3 cycles), batch 64, 350 steps; a suggestion is the cycles' peak LR",
        chance_what="predict the training class frequencies (label-smoothed)",
    )


# ----- h3. reverse_seq2seq_adafactor: reversing digits, an encoder-decoder transformer, Adafactor
# (the grid, once run: Adafactor's step is min(lr, 1/sqrt(t)) of the parameters' RMS, so every LR from 1 up
# trains the same, bit for bit, no better than chance; the best, 0.1, is a narrow valley below 0.3)
REV_LEN, REV_BOS = 10, 10


def _reversal_data() -> Data:
    """Sequences of 10 random digits and the same reversed. The input: the source and the decoder's input
    (BOS, then the target but its last), side by side; 6000 training pairs, 1500 held out."""
    rng = np.random.default_rng(113)
    n = 7500
    src = rng.integers(0, 10, size=(n, REV_LEN))
    target = src[:, ::-1]
    dec = np.concatenate([np.full((n, 1), REV_BOS), target[:, :-1]], axis=1)
    x, y = torch.tensor(np.concatenate([src, dec], axis=1)), torch.tensor(target.copy())
    return x[:6000], y[:6000], x[6000:], y[6000:]


class Reverser(nn.Module):
    """``nn.Transformer`` (pre-LN, d 32, 4 heads, 1 encoder and 1 decoder layer, feed-forward 64, dropout
    0.1) over shared token embeddings and learned positions, a causal decoder, a linear head to the digits."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, d)
        self.pos = nn.Parameter(0.02 * torch.randn(2 * REV_LEN, d))
        self.net = nn.Transformer(d, 4, 1, 1, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, 10)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(REV_LEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        src, tgt = h[:, :REV_LEN], h[:, REV_LEN:]
        return self.head(self.net(src, tgt, tgt_mask=self.mask, tgt_is_causal=True))


def reverse_seq2seq_adafactor() -> Task:
    data = _reversal_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(p, lr=lr)

    return Task(
        "reverse_seq2seq_adafactor",
        data,
        Reverser,
        opt,
        _ce,
        steps=300,
        batch=64,
        chance=_prior_chance(data, 10),
        grid=(-16, 4),
        what=f"reversing {REV_LEN} random digits (teacher forcing): nn.Transformer pre-LN d32 h4, 1 + 1 "
        "layers, ff 64, dropout 0.1, Adafactor (its relative step min(lr, 1/sqrt(t)) times the parameters' "
        "RMS), constant LR, per-digit cross-entropy, batch 64, 300 steps",
        chance_what="predict the training digit frequencies",
    )


# ----- h4. mnist_example_adadelta: the PyTorch examples' MNIST recipe on digits, Adadelta, LR x 0.7 an epoch
def mnist_example_adadelta() -> Task:
    data = _digits()
    per_epoch = math.ceil(len(data[0]) / 64)

    def cnn() -> nn.Module:
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(64 * 2 * 2, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, 10),
        )

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adadelta(p, lr=lr)

    return Task(
        "mnist_example_adadelta",
        data,
        cnn,
        opt,
        _ce,
        steps=14 * per_epoch,
        batch=64,
        chance=_prior_chance(data, 10),
        grid=(-16, 8),
        schedule=partial(EpochDecay, per_epoch=per_epoch),
        what="digits, pytorch/examples' MNIST recipe: CNN conv 32-64 (3x3), max-pool, dropout 0.25, fc 128, "
        f"dropout 0.5, Adadelta, LR x 0.7 every epoch ({per_epoch} steps), batch 64, 14 epochs "
        f"({14 * per_epoch} steps); a suggestion is the initial LR (the recipe's: 1.0)",
        chance_what="predict the training class frequencies",
    )


# ----- h5. ordinal_coral_adam: ordinal regression of a 6-level rating, CORAL (rank-consistent), Adam
ORDINAL_LEVELS = 6


def _ordinal_data() -> Data:
    """8000 points of 10 features (x ~ N(0, 1)); a latent score (a smooth nonlinear function of 6 of them,
    plus logistic noise) cut at its quantiles 10, 30, 55, 75 and 90 % into 6 ordered levels 0..5."""
    rng = np.random.default_rng(127)
    x = rng.normal(size=(8000, 10))
    score = np.tanh(x[:, 0] + x[:, 1]) + 0.5 * x[:, 2] * x[:, 3] + np.sin(x[:, 4]) - 0.3 * x[:, 5] ** 2
    score = score + rng.logistic(scale=0.3, size=len(x))
    y = np.searchsorted(np.quantile(score, [0.1, 0.3, 0.55, 0.75, 0.9]), score)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=127)
    xtr, xva = _standardise(xtr, xva)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class Coral(nn.Module):
    """Cao et al.'s CORAL head on an MLP 64-64 (ReLU): one score (a linear layer without bias) and 5 biases,
    the logits of P(level > k) for k = 0..4."""

    def __init__(self, features: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.score = nn.Linear(64, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(ORDINAL_LEVELS - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x)) + self.bias


def _coral(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The binary cross-entropies of the levels' thresholds (is the level above k?), summed over k, mean over
    the batch."""
    above = (y[:, None] > torch.arange(ORDINAL_LEVELS - 1)).float()
    return nn.functional.binary_cross_entropy_with_logits(out, above, reduction="none").sum(1).mean()


def ordinal_coral_adam() -> Task:
    data = _ordinal_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    ytr, yva = data[1], data[3]
    frac = ((ytr[:, None] > torch.arange(ORDINAL_LEVELS - 1)).float().sum(0) + 1) / (len(ytr) + 2)
    prior = torch.log(frac / (1 - frac)).expand(len(yva), ORDINAL_LEVELS - 1)
    return Task(
        "ordinal_coral_adam",
        data,
        Coral,
        opt,
        _coral,
        steps=300,
        batch=256,
        chance=float(_coral(prior, yva)),
        grid=(-20, 2),
        what=f"ordinal regression, {ORDINAL_LEVELS} levels of a noisy nonlinear score of 10 features: MLP "
        "64-64 with a CORAL head (shared score, 5 thresholds), the thresholds' binary cross-entropies "
        "summed, Adam, constant LR, batch 256, 300 steps",
        chance_what="predict the training frequency of each threshold (add-one)",
    )


HELD_OUT_7 = {
    "deepsets_sum_sgd_cyclic": deepsets_sum_sgd_cyclic,
    "charcnn_nesterov_sgdr": charcnn_nesterov_sgdr,
    "reverse_seq2seq_adafactor": reverse_seq2seq_adafactor,
    "mnist_example_adadelta": mnist_example_adadelta,
    "ordinal_coral_adam": ordinal_coral_adam,
}


# ------------------------------------------------------------------------------------------- held-out set 8
# An eighth check on ourselves, written before any result of ours on it was seen (only the grid and the two
# third-party finders were run on it). It judged the next rule change once (a rise below 1 % of the loss's
# level never stops a sweep), never to choose a rule, and is in ``SETS["all"]`` since. Each task is a recipe
# of a family, an optimizer, a schedule or a loss none of the 43 above has: a digits MLP whose output layer
# starts at zero (every batch's first loss is log 10) under plain SGD with LR / 10 at 30, 60 and 90 %, an
# undercomplete MLP autoencoder of digits under SGD Nesterov with a quadratic decay, a two-tower retrieval
# model (in-batch softmax) under Adagrad, a temporal convolutional network forecasting a series under AdamW
# with warm-up then a constant LR, and a classifier trained on noisy labels with the symmetric cross-entropy
# under AMSGrad.
class MultiStep:
    """LR multiplier of ``MultiStepLR(gamma)`` with milestones at the given fractions of ``total`` steps."""

    def __init__(self, total: int, at: tuple[float, ...] = (0.3, 0.6, 0.9), gamma: float = 0.1) -> None:
        self.total, self.at, self.gamma = total, at, gamma
        self.milestones = tuple(round(f * total) for f in at)

    def __call__(self, step: int) -> float:
        return float(self.gamma ** sum(step >= m for m in self.milestones))

    def __repr__(self) -> str:
        return f"MultiStep(total={self.total}, milestones={self.milestones}, gamma={self.gamma})"


# ----- i1. zeroinit_mlp_sgd_multistep: digits MLP, its output layer zero at first, plain SGD, LR / 10 x 3
class ZeroHeadMLP(nn.Module):
    """MLP 64-128-128-10 (ReLU) whose last layer's weight and bias start at zero, a common trick so that the
    initial prediction is uniform (and the loss the same on every batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def zeroinit_mlp_sgd_multistep() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "zeroinit_mlp_sgd_multistep",
        data,
        ZeroHeadMLP,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, 10),
        grid=(-16, 4),
        schedule=MultiStep,
        what="digits: MLP 64-128-128-10 with its output layer initialised to zero (uniform first "
        "prediction), plain SGD, LR / 10 at 30, 60 and 90 % of the steps, batch 32, 300 steps; a suggestion "
        "is the initial LR",
        chance_what="predict the training class frequencies",
    )


# ----- i2. autoencoder_nesterov_poly: an undercomplete MLP autoencoder of digits, SGD Nesterov, poly decay
class DigitsAutoencoder(nn.Module):
    """Encoder 64-48-12 (ReLU), decoder 12-48-64 (ReLU, then a sigmoid on the pixels)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 12))
        self.decode = nn.Sequential(nn.ReLU(), nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 64), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def autoencoder_nesterov_poly() -> Task:
    xtr, _, xva, _ = _digits()
    xtr, xva = (xtr > 0.5).float(), (xva > 0.5).float()
    data = (xtr, xtr, xva, xva)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True)

    return Task(
        "autoencoder_nesterov_poly",
        data,
        DigitsAutoencoder,
        opt,
        _image_mse,
        steps=300,
        batch=64,
        chance=float(((xva - xtr.mean(0)) ** 2).mean()),
        grid=(-12, 8),
        schedule=partial(PolyDecay, power=2.0),
        what="digits reconstructed through a 12-unit bottleneck: MLP autoencoder 64-48-12-48-64 (sigmoid "
        "output), pixel MSE, SGD Nesterov momentum 0.9, polynomial decay (power 2) to 0, batch 64, 300 "
        "steps; a suggestion is the initial LR",
        chance_what="predict the training mean image",
    )


# ----- i3. twotower_adagrad: retrieval of a query's item among the batch's items, two towers, Adagrad
TOWER_BLOCK = 128


def _pairs_data() -> Data:
    """Query-item pairs sharing a latent vector z (8 dimensions, N(0, 1)): a query is a random linear map of
    tanh(z) into 24 features plus noise, an item another map of z into 16 features plus noise; 6144 training
    pairs, 1536 held out (48 and 12 blocks of 128). The input is both side by side; the target is unused."""
    rng = np.random.default_rng(131)
    n = 7680
    z = rng.normal(size=(n, 8))
    q = np.tanh(z) @ rng.normal(size=(8, 24)) + 0.5 * rng.normal(size=(n, 24))
    v = z @ rng.normal(size=(8, 16)) + 0.5 * rng.normal(size=(n, 16))
    x = np.concatenate([q / q.std(0), v / v.std(0)], axis=1).astype(np.float32)
    x, y = torch.tensor(x), torch.zeros(n)
    return x[:6144], y[:6144], x[6144:], y[6144:]


class TwoTower(nn.Module):
    """A query tower (MLP 24-64-32) and an item tower (MLP 16-64-32); the output stacks both embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 32))
        self.item = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.query(x[:, :24]), self.item(x[:, 24:])], 1)


def _in_batch_softmax(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each query's own item among the items of its block of 128 (dot-product scores); the
    held-out set is scored in blocks of the training batch's size, so chance is log 128 on both."""
    n = len(out)
    blocks = out.reshape(-1, min(n, TOWER_BLOCK), 2, out.shape[-1])
    scores = blocks[:, :, 0] @ blocks[:, :, 1].transpose(1, 2)
    target = torch.arange(scores.shape[1]).expand(scores.shape[0], -1)
    return nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1))


def twotower_adagrad() -> Task:
    data = _pairs_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(p, lr=lr)

    return Task(
        "twotower_adagrad",
        data,
        TwoTower,
        opt,
        _in_batch_softmax,
        steps=300,
        batch=TOWER_BLOCK,
        chance=math.log(TOWER_BLOCK),
        grid=(-16, 4),
        what="retrieval of a query's item among 128: two towers (MLP 24-64-32, 16-64-32), dot-product "
        "scores, in-batch softmax cross-entropy, Adagrad, constant LR, batch 128, 300 steps",
        chance_what="equal scores for every item (log 128)",
    )


# ----- i4. tcn_forecast_adamw_warmup: the next values of a noisy periodic series, a temporal conv net
TCN_CONTEXT, TCN_HORIZON = 32, 4


def _tcn_series_data() -> Data:
    """One series of 12000 points: a sum of three sines (periods 24, 7 and 91 steps) whose amplitudes drift,
    plus AR(1) noise (0.7, 0.3); windows of 32 points predict the next 4 (every 2 steps, first 75 % for
    training, the rest held out), standardised with the training part's mean and deviation."""
    rng = np.random.default_rng(137)
    t = np.arange(12000)
    drift = 1.0 + 0.3 * np.sin(2 * np.pi * t / 2000)
    s = drift * (
        np.sin(2 * np.pi * t / 24) + 0.5 * np.sin(2 * np.pi * t / 7) + 0.8 * np.sin(2 * np.pi * t / 91)
    )
    noise = np.zeros(len(t))
    eps = 0.3 * rng.normal(size=len(t))
    for i in range(1, len(t)):
        noise[i] = 0.7 * noise[i - 1] + eps[i]
    s = s + noise
    cut = int(0.75 * len(t))
    s = ((s - s[:cut].mean()) / s[:cut].std()).astype(np.float32)
    span = TCN_CONTEXT + TCN_HORIZON

    def windows(part: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.tensor(np.lib.stride_tricks.sliding_window_view(part, span)[::2].copy())
        return w[:, :TCN_CONTEXT], w[:, TCN_CONTEXT:]

    (xtr, ytr), (xva, yva) = windows(s[:cut]), windows(s[cut:])
    return xtr, ytr, xva, yva


class _CausalBlock(nn.Module):
    """Two causal convolutions (width 3, the given dilation, left padding), ReLU, a residual connection."""

    def __init__(self, ch: int, dilation: int) -> None:
        super().__init__()
        self.pad = 2 * dilation
        self.c1 = nn.Conv1d(ch, ch, 3, dilation=dilation)
        self.c2 = nn.Conv1d(ch, ch, 3, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(nn.functional.pad(x, (self.pad, 0))))
        h = torch.relu(self.c2(nn.functional.pad(h, (self.pad, 0))))
        return torch.relu(x + h)


class TCN(nn.Module):
    """Bai et al.'s temporal convolutional network: a 1x1 convolution to 16 channels, residual causal blocks
    at dilations 1, 2 and 4 (a receptive field of 29 steps), a linear head from the last position to the next
    4 values."""

    def __init__(self, ch: int = 16) -> None:
        super().__init__()
        self.inp = nn.Conv1d(1, ch, 1)
        self.blocks = nn.Sequential(*(_CausalBlock(ch, d) for d in (1, 2, 4)))
        self.head = nn.Linear(ch, TCN_HORIZON)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x[:, None]))[:, :, -1])


def tcn_forecast_adamw_warmup() -> Task:
    data = _tcn_series_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=1e-2)

    ytr, yva = data[1], data[3]
    return Task(
        "tcn_forecast_adamw_warmup",
        data,
        TCN,
        opt,
        _image_mse,
        steps=300,
        batch=32,
        chance=float(((yva - ytr.mean()) ** 2).mean()),
        grid=(-20, 4),
        schedule=partial(WarmupConstant, warmup=0.1),
        what=f"the next {TCN_HORIZON} values of a noisy series of drifting sines from {TCN_CONTEXT}: TCN "
        "(1x1 to 16 channels, 3 residual blocks of 2 causal convolutions of width 3, dilations 1, 2, 4), "
        "AdamW wd 1e-2, linear warm-up over 10 % then constant, MSE, batch 32, 300 steps",
        chance_what="predict the training mean",
    )


# ----- i5. noisy_labels_sce_amsgrad: 40 % of the training labels flipped, symmetric cross-entropy, AMSGrad
SCE_ALPHA, SCE_BETA, SCE_LOG_ZERO = 0.1, 1.0, -4.0


def _noisy_labels_data() -> Data:
    """make_classification (20 features, 12 informative, 6 classes, 2 clusters each), 6000 training points of
    which 40 % have a label drawn uniformly from the other classes, 2000 held-out points with clean labels."""
    x, y = make_classification(
        8000, 20, n_informative=12, n_redundant=4, n_classes=6, n_clusters_per_class=2, random_state=139
    )
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=139)
    rng = np.random.default_rng(139)
    flip = rng.random(len(ytr)) < 0.4
    ytr = np.where(flip, (ytr + rng.integers(1, 6, size=len(ytr))) % 6, ytr)
    xtr, xva = _standardise(xtr, xva)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _sce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Wang et al.'s symmetric cross-entropy: alpha CE + beta reverse CE, the reverse one taking log 0 as -4
    (so it is 4 (1 - p of the label))."""
    ce = nn.functional.cross_entropy(out, y)
    p = torch.softmax(out, -1).clamp_min(1e-7)
    rce = -(SCE_LOG_ZERO * (1.0 - p.gather(1, y[:, None]).squeeze(1))).mean()
    return SCE_ALPHA * ce + SCE_BETA * rce


def noisy_labels_sce_amsgrad() -> Task:
    data = _noisy_labels_data()

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 6))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr, amsgrad=True)

    return Task(
        "noisy_labels_sce_amsgrad",
        data,
        mlp,
        opt,
        _sce,
        steps=300,
        batch=128,
        chance=_loss_at_prior(_sce, data, 6),
        grid=(-20, 4),
        what="6 classes of make_classification with 40 % of the training labels flipped at random (held out "
        f"clean): MLP 128-128, symmetric cross-entropy (alpha {SCE_ALPHA:g}, beta {SCE_BETA:g}, log 0 = "
        f"{SCE_LOG_ZERO:g}), Adam with AMSGrad, constant LR, batch 128, 300 steps",
        chance_what="predict the training class frequencies (of the noisy labels)",
    )


HELD_OUT_8 = {
    "zeroinit_mlp_sgd_multistep": zeroinit_mlp_sgd_multistep,
    "autoencoder_nesterov_poly": autoencoder_nesterov_poly,
    "twotower_adagrad": twotower_adagrad,
    "tcn_forecast_adamw_warmup": tcn_forecast_adamw_warmup,
    "noisy_labels_sce_amsgrad": noisy_labels_sce_amsgrad,
}


# ------------------------------------------------------------------------------------------- held-out set 9
# A ninth check on ourselves, written before any result of ours on it was seen (only the grid and the two
# third-party finders were run on it). It judged the next rule changes once (a step decay's last level held as
# long as the one before; the sweep's end where the optimizer caps its step), never to choose a rule, and is
# in ``SETS["all"]`` since. Each task is a recipe of a family, an optimizer, a schedule or a loss none of the
# 48 above has: an MLP-Mixer on digits under NAdam with decoupled weight decay and a warm-up-stable-decay
# schedule, a linear multiclass SVM (multi-class hinge loss) under ASGD, a classifier of imbalanced classes
# with the focal loss under Graves's centered RMSprop with momentum, a heteroscedastic regressor (Gaussian
# negative log-likelihood, a predicted variance) under Adam with Goyal et al.'s gradual warm-up then LR / 10
# steps, and a RealNVP normalising flow of two moons (exact log-likelihood) under Adam with a cosine decay.
class WarmupStableDecay:
    """LR multiplier of the warm-up-stable-decay ("trapezoidal") schedule: linear warm-up over ``warmup`` of
    ``total`` steps, constant, then a linear decay to 0 over the last ``decay`` of them."""

    def __init__(self, total: int, warmup: float = 0.05, decay: float = 0.2) -> None:
        self.total = total
        self.warm = max(1, round(warmup * total))
        self.cool = max(1, round(decay * total))

    def __call__(self, step: int) -> float:
        return max(0.0, min(1.0, (step + 1) / self.warm, (self.total - step) / self.cool))

    def __repr__(self) -> str:
        return f"WarmupStableDecay(total={self.total}, warm={self.warm}, cool={self.cool})"


class WarmupMultiStep:
    """LR multiplier of Goyal et al.'s large-batch recipe: a linear warm-up over ``warmup`` of ``total``
    steps, then ``gamma`` at each of the milestones (fractions of ``total``)."""

    def __init__(
        self, total: int, warmup: float = 0.05, at: tuple[float, ...] = (0.5, 0.75), gamma: float = 0.1
    ) -> None:
        self.total, self.gamma = total, gamma
        self.warm = max(1, round(warmup * total))
        self.milestones = tuple(round(f * total) for f in at)

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warm) * float(self.gamma ** sum(step >= m for m in self.milestones))

    def __repr__(self) -> str:
        return f"WarmupMultiStep(total={self.total}, warm={self.warm}, milestones={self.milestones})"


# ----- j1. mixer_nadamw_wsd: an MLP-Mixer on digits, NAdam with decoupled weight decay, warm-up-stable-decay
class _MixerBlock(nn.Module):
    """Token mixing (an MLP across the 16 patches) then channel mixing (an MLP across the features), each
    pre-LayerNorm, GELU and residual."""

    def __init__(self, tokens: int, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    """Tolstikhin et al.'s MLP-Mixer: 8x8 digits cut into 2x2 patches (16 tokens) embedded in 32 dimensions,
    2 mixer blocks, a LayerNorm, the mean over the tokens, a linear head."""

    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.patch = nn.Linear(4, d)
        self.blocks = nn.Sequential(*(_MixerBlock(16, d) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        patches = x.view(b, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(b, 16, 4)
        return self.head(self.norm(self.blocks(self.patch(patches))).mean(1))


def mixer_nadamw_wsd() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.NAdam(p, lr=lr, weight_decay=0.05, decoupled_weight_decay=True)

    return Task(
        "mixer_nadamw_wsd",
        data,
        Mixer,
        opt,
        _ce,
        steps=300,
        batch=64,
        chance=_prior_chance(data, 10),
        grid=(-20, 0),
        schedule=WarmupStableDecay,
        what="digits: MLP-Mixer (16 patches of 2x2 embedded in 32 dimensions, 2 blocks of token and channel "
        "MLPs, LayerNorm, GELU, mean pooling), NAdam with decoupled weight decay 0.05, warm-up-stable-decay "
        "(linear warm-up over 5 %, constant, linear decay to 0 over the last 20 %), batch 64, 300 steps; a "
        "suggestion is the peak LR",
        chance_what="predict the training class frequencies",
    )


# ----- j2. svm_multimargin_asgd: a linear multiclass SVM (Crammer-Singer-style hinge), averaged SGD
def _multimargin(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.multi_margin_loss(out, y)


def svm_multimargin_asgd() -> Task:
    x, y = make_classification(
        6000, 40, n_informative=16, n_redundant=8, n_classes=8, n_clusters_per_class=1, random_state=151
    )
    data = _class_split(x, y, 151, standardise=True)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.ASGD(p, lr=lr, weight_decay=1e-4)

    return Task(
        "svm_multimargin_asgd",
        data,
        partial(nn.Linear, 40, 8),
        opt,
        _multimargin,
        steps=400,
        batch=16,
        chance=_loss_at_prior(_multimargin, data, 8),
        grid=(-20, 4),
        what="make_classification (40 features, 8 classes): a linear SVM (one nn.Linear, the multi-class "
        "hinge loss nn.MultiMarginLoss, margin 1), ASGD at torch's defaults (its LR decaying as (1 + 1e-4 "
        "LR t)^-0.75, averaging from step 1e6: the last iterate is scored) wd 1e-4, batch 16, 400 steps",
        chance_what="predict the training class frequencies' logarithms as the scores",
    )


# ----- j3. focal_imbalanced_rmsprop: 5 imbalanced classes, the focal loss, centered RMSprop with momentum
FOCAL_GAMMA = 2.0


def _focal(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Lin et al.'s focal loss ``-(1 - p_t)^gamma log p_t`` (no class weights), the mean over the batch."""
    logp = torch.log_softmax(out, -1).gather(1, y[:, None]).squeeze(1)
    return -(((1.0 - logp.exp()) ** FOCAL_GAMMA) * logp).mean()


def focal_imbalanced_rmsprop() -> Task:
    x, y = make_classification(
        8000,
        24,
        n_informative=10,
        n_redundant=6,
        n_classes=5,
        n_clusters_per_class=2,
        weights=[0.55, 0.25, 0.1, 0.06, 0.04],
        flip_y=0.02,
        random_state=157,
    )
    data = _class_split(x, y, 157, standardise=True)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(24, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 5))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(p, lr=lr, alpha=0.95, eps=1e-4, momentum=0.9, centered=True)

    return Task(
        "focal_imbalanced_rmsprop",
        data,
        mlp,
        opt,
        _focal,
        steps=300,
        batch=64,
        chance=_loss_at_prior(_focal, data, 5),
        grid=(-20, 0),
        what="make_classification (24 features, 5 classes of 55, 25, 10, 6 and 4 %): MLP 128-64, focal loss "
        f"(gamma {FOCAL_GAMMA:g}), Graves's centered RMSprop (alpha 0.95, eps 1e-4, momentum 0.9), constant "
        "LR, batch 64, 300 steps",
        chance_what="predict the training class frequencies",
    )


# ----- j4. gaussian_nll_adam_warmup_steps: a mean and a variance of a heteroscedastic target, Gaussian NLL
def _gaussian_data() -> Data:
    """8000 points x ~ N(0, 1)^6; y = 2 sin(x0) + x1 x2 + x3^2 / 2 plus Gaussian noise whose standard
    deviation exp(0.6 x4 + 0.4 sin(2 x5)) spans about two decades."""
    rng = np.random.default_rng(163)
    x = rng.normal(size=(8000, 6))
    mean = 2 * np.sin(x[:, 0]) + x[:, 1] * x[:, 2] + x[:, 3] ** 2 / 2
    y = mean + rng.normal(size=len(x)) * np.exp(0.6 * x[:, 4] + 0.4 * np.sin(2 * x[:, 5]))
    return _regression_data(x, y, 163)


def _gaussian_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``nn.GaussianNLLLoss(full=True)`` (nats per point: positive here, the noise's entropy being) of a mean
    (the first output) and a variance (softplus of the second)."""
    var = nn.functional.softplus(out[:, 1])
    return nn.functional.gaussian_nll_loss(out[:, 0], y, var, full=True, eps=1e-6)


def gaussian_nll_adam_warmup_steps() -> Task:
    data = _gaussian_data()

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    ytr, yva = data[1], data[3]
    var = math.log(math.expm1(float(ytr.var())))  # the softplus inverse of the training variance
    prior = torch.tensor([float(ytr.mean()), var]).expand(len(yva), 2)
    return Task(
        "gaussian_nll_adam_warmup_steps",
        data,
        mlp,
        opt,
        _gaussian_nll,
        steps=400,
        batch=64,
        chance=float(_gaussian_nll(prior, yva)),
        grid=(-20, 0),
        schedule=WarmupMultiStep,
        what="a heteroscedastic synthetic regression (6 features, noise deviation spanning two decades): MLP "
        "64-64 (tanh) predicting a mean and a variance (softplus), Gaussian NLL (nn.GaussianNLLLoss), Adam, "
        "Goyal et al.'s gradual warm-up over 5 % then LR / 10 at 50 and 75 %, batch 64, 400 steps; a "
        "suggestion is the peak LR",
        chance_what="predict the training mean and variance",
    )


# ----- j5. realnvp_moons_adam_cosine: a RealNVP normalising flow of two moons, exact NLL, Adam, cosine
def _moons_data() -> Data:
    """make_moons (8000 points, noise 0.05), standardised with the training part's statistics, 75/25; the
    target is unused."""
    x, _ = make_moons(8000, noise=0.05, random_state=167)
    xtr, xva = _standardise(x[:6000], x[6000:])
    return torch.tensor(xtr), torch.zeros(6000), torch.tensor(xva), torch.zeros(2000)


class _Coupling(nn.Module):
    """An affine coupling layer of 2-D points: the ``keep`` coordinate sets the scale (tanh) and shift of the
    other through an MLP 1-64-64-2."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.net = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x[:, self.keep : self.keep + 1], x[:, 1 - self.keep : 2 - self.keep]
        s, t = self.net(a).chunk(2, -1)
        s = torch.tanh(s)
        b = b * s.exp() + t
        z = torch.cat([a, b], 1) if self.keep == 0 else torch.cat([b, a], 1)
        return z, s.squeeze(-1)


class RealNVP(nn.Module):
    """Dinh et al.'s RealNVP in 2-D: 6 affine couplings, alternating the coordinate they keep; the output is
    the latent point and the log-determinant of the Jacobian, side by side."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Coupling(i % 2) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logdet = torch.zeros(len(x))
        for layer in self.layers:
            x, s = layer(x)
            logdet = logdet + s
        return torch.cat([x, logdet[:, None]], 1)


def _flow_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the points (nats per point) under a standard normal latent."""
    z, logdet = out[:, :2], out[:, 2]
    return (0.5 * (z**2).sum(1) + math.log(2 * math.pi) - logdet).mean()


def realnvp_moons_adam_cosine() -> Task:
    data = _moons_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    xtr, xva = data[0].double(), data[2].double()
    dist = torch.distributions.MultivariateNormal(xtr.mean(0), torch.cov(xtr.T))
    return Task(
        "realnvp_moons_adam_cosine",
        data,
        RealNVP,
        opt,
        _flow_nll,
        steps=400,
        batch=128,
        chance=float(-dist.log_prob(xva).mean()),
        grid=(-20, 0),
        schedule=Cosine,
        what="two moons (make_moons, noise 0.05, standardised): RealNVP normalising flow (6 affine "
        "couplings, tanh scales, MLPs 1-64-64-2), exact negative log-likelihood under a standard normal "
        "latent, Adam, cosine decay to 0, batch 128, 400 steps; a suggestion is the initial LR",
        chance_what="a Gaussian fitted to the training points (their mean and covariance)",
    )


HELD_OUT_9 = {
    "mixer_nadamw_wsd": mixer_nadamw_wsd,
    "svm_multimargin_asgd": svm_multimargin_asgd,
    "focal_imbalanced_rmsprop": focal_imbalanced_rmsprop,
    "gaussian_nll_adam_warmup_steps": gaussian_nll_adam_warmup_steps,
    "realnvp_moons_adam_cosine": realnvp_moons_adam_cosine,
}


# ------------------------------------------------------------------------------------------ held-out set 10
# A tenth check on ourselves, written before any result of ours on it was seen (only the grid and the two
# third-party finders were run on it). It judged the code the ninth judged once more (ours 3.39,
# torch-lr-finder 2.44), never to choose a rule, and is in ``SETS["all"]`` since. Each task is a recipe of a
# family, an optimizer, a schedule or a loss none of the 53 above has: a vanilla (Elman) RNN recalling the
# first values of a sequence under SGD momentum without clipping (a plateau, then a cliff just above the best
# LR), a convolutional-recurrent recogniser of symbol sequences (CTC loss) under Adam with Ma and Yarats's
# exponential warm-up, a BatchNorm CNN of digits trained on mixup's soft targets under AdamW with ``StepLR``,
# GloVe word vectors of the stdlib's source (weighted least squares of log co-occurrences, sparse embeddings)
# under Adagrad, and a DeepSurv-style survival model (Cox partial likelihood, a large constant offset) under
# NAdam with an inverse-time decay at batch 512.
class ExpWarmup:
    """LR multiplier of Ma and Yarats's "untuned exponential warm-up" for Adam: ``1 - exp(-(step + 1) / tau)``
    with ``tau = 1 / (1 - beta2)`` steps, then the constant LR it tends to."""

    def __init__(self, total: int, tau: float = 50.0) -> None:
        self.total, self.tau = total, tau

    def __call__(self, step: int) -> float:
        return 1.0 - math.exp(-(step + 1) / self.tau)

    def __repr__(self) -> str:
        return f"ExpWarmup(total={self.total}, tau={self.tau})"


class StepEvery:
    """LR multiplier of ``StepLR(step_size, gamma)``: ``gamma`` every ``every`` of ``total`` steps."""

    def __init__(self, total: int, every: float = 0.25, gamma: float = 0.5) -> None:
        self.total, self.gamma = total, gamma
        self.size = max(1, round(every * total))

    def __call__(self, step: int) -> float:
        return float(self.gamma ** (step // self.size))

    def __repr__(self) -> str:
        return f"StepEvery(total={self.total}, step_size={self.size}, gamma={self.gamma})"


class InverseTime:
    """LR multiplier of an inverse-time decay ``1 / (1 + k step)``, ``k`` such that the last step's LR is
    ``final`` of the first's."""

    def __init__(self, total: int, final: float = 0.25) -> None:
        self.total = total
        self.k = (1.0 / final - 1.0) / max(1, total)

    def __call__(self, step: int) -> float:
        return 1.0 / (1.0 + self.k * step)

    def __repr__(self) -> str:
        return f"InverseTime(total={self.total}, k={self.k:.6f})"


# ----- k1. rnn_recall_sgd_momentum: a delayed recall, a vanilla tanh RNN, SGD momentum, no clipping
RECALL_LEN = 12


def _recall_data() -> Data:
    """A memory task of the kind of Hochreiter and Schmidhuber's adding problem: sequences of ``RECALL_LEN``
    values U(-1, 1); the target, the sum of the first two, read after the last. 6000 training, 2000 held
    out."""
    rng = np.random.default_rng(173)
    v = rng.uniform(-1.0, 1.0, size=(8000, RECALL_LEN)).astype(np.float32)
    x, y = torch.tensor(v[:, :, None]), torch.tensor(v[:, 0] + v[:, 1])
    return x[:6000], y[:6000], x[6000:], y[6000:]


class ElmanRNN(nn.Module):
    """``nn.RNN`` (tanh, 64 units, one layer), a linear head on the last state."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.rnn = nn.RNN(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def rnn_recall_sgd_momentum() -> Task:
    data = _recall_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "rnn_recall_sgd_momentum",
        data,
        ElmanRNN,
        opt,
        _mse,
        steps=600,
        batch=32,
        chance=_mse_chance(data),
        grid=(-16, 4),
        what=f"a delayed recall (the sum of the first two of {RECALL_LEN} values U(-1, 1), read after the "
        "last): a vanilla tanh RNN (nn.RNN 64, last state), SGD momentum 0.9 without clipping, constant LR, "
        "MSE, batch 32, 600 steps",
        chance_what="predict the training mean",
    )


# ----- k2. crnn_ctc_adam_expwarmup: sequences of symbols in noisy frames, conv + GRU, CTC, Adam, exp warm-up
CTC_SYMBOLS, CTC_FRAMES, CTC_FEATURES, CTC_MAX = 5, 40, 8, 5


def _ctc_data() -> Data:
    """Sequences of 2..5 symbols (of 5; 0 is CTC's blank), each drawn as its fixed random template (4 frames
    of 8 features) after a gap of 1..3 frames of silence, in 40 frames of Gaussian noise (0.6); the target,
    the symbols padded with 0. 6000 training, 2000 held out."""
    rng = np.random.default_rng(179)
    n, width = 8000, 4
    templates = rng.normal(size=(CTC_SYMBOLS + 1, width, CTC_FEATURES))
    x = 0.6 * rng.normal(size=(n, CTC_FRAMES, CTC_FEATURES))
    y = np.zeros((n, CTC_MAX), dtype=np.int64)
    for i in range(n):
        at = int(rng.integers(0, 4))
        for j in range(int(rng.integers(2, CTC_MAX + 1))):
            s = int(rng.integers(1, CTC_SYMBOLS + 1))
            at += int(rng.integers(1, 4))
            x[i, at : at + width] += templates[s]
            y[i, j] = s
            at += width
    x = x.astype(np.float32)
    return torch.tensor(x[:6000]), torch.tensor(y[:6000]), torch.tensor(x[6000:]), torch.tensor(y[6000:])


class CRNN(nn.Module):
    """Shi et al.'s convolutional-recurrent recogniser in 1-D: two convolutions (32 filters of width 3, ReLU)
    over the frames, a GRU 64, a linear layer to the symbols and the blank at every frame."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(CTC_FEATURES, 32, 3, padding=1), nn.ReLU(), nn.Conv1d(32, 32, 3, padding=1), nn.ReLU()
        )
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, CTC_SYMBOLS + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.head(self.rnn(h)[0])


def _ctc(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``nn.CTCLoss`` (blank 0, the mean over the batch of each sequence's loss over its length)."""
    logp = torch.log_softmax(out, -1).transpose(0, 1)
    frames = torch.full((len(y),), out.shape[1], dtype=torch.long)
    return nn.functional.ctc_loss(logp, y, frames, (y > 0).sum(1), zero_infinity=True)


def crnn_ctc_adam_expwarmup() -> Task:
    data = _ctc_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr, betas=(0.9, 0.98))

    ytr, yva = data[1], data[3]
    counts = torch.bincount(ytr.reshape(-1), minlength=CTC_SYMBOLS + 1).double()
    counts[0] = CTC_FRAMES * len(ytr) - counts[1:].sum()  # frames not a symbol's: the blank's
    prior = torch.log(counts / counts.sum()).float()
    return Task(
        "crnn_ctc_adam_expwarmup",
        data,
        CRNN,
        opt,
        _ctc,
        steps=400,
        batch=32,
        chance=float(_ctc(prior.expand(len(yva), CTC_FRAMES, -1), yva)),
        grid=(-16, -2),
        schedule=ExpWarmup,
        what=f"sequences of 2..{CTC_MAX} of {CTC_SYMBOLS} symbols drawn as noisy templates in {CTC_FRAMES} "
        f"frames of {CTC_FEATURES} features: CRNN (2 convolutions 32, GRU 64, per-frame linear), CTC loss, "
        "Adam (0.9, 0.98), Ma and Yarats's exponential warm-up (1 - exp(-t / 50), 50 = 1 / (1 - beta2)) to a "
        "constant LR, batch 32, 400 steps; a suggestion is the LR it tends to",
        chance_what="predict at every frame the training frequencies of the symbols and the blank",
    )


# ----- k3. mixup_bncnn_adamw_step: digits, a BatchNorm CNN trained on mixup's soft targets, AdamW, StepLR
MIXUP_ALPHA = 0.4


def _labelled_digits() -> Data:
    """The digits split with each input's one-hot label after its 64 pixels (the model mixes both when it
    trains, and reads only the pixels)."""
    xtr, ytr, xva, yva = _digits()
    eye = torch.eye(10)
    return torch.cat([xtr, eye[ytr]], 1), ytr, torch.cat([xva, eye[yva]], 1), yva


class MixupCNN(nn.Module):
    """A digits CNN (conv 32-32-64, each with BatchNorm and ReLU, max-pooling twice, a linear head). In
    training mode it applies Zhang et al.'s mixup: each batch is mixed with a shuffled copy of itself at a
    weight ~ Beta(0.4, 0.4), pixels and one-hot labels alike; the output is the logits and the (mixed)
    one-hot labels, side by side."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            *block(1, 32),
            *block(32, 32),
            nn.MaxPool2d(2),
            *block(32, 64),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            lam = float(torch.distributions.Beta(MIXUP_ALPHA, MIXUP_ALPHA).sample())
            x = lam * x + (1.0 - lam) * x[torch.randperm(len(x))]
        return torch.cat([self.net(x[:, :64]), x[:, 64:]], 1)


def _soft_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the (mixed) one-hot labels the model passed along."""
    return -(out[:, 10:] * torch.log_softmax(out[:, :10], -1)).sum(-1).mean()


def mixup_bncnn_adamw_step() -> Task:
    data = _labelled_digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.05)

    return Task(
        "mixup_bncnn_adamw_step",
        data,
        MixupCNN,
        opt,
        _soft_ce,
        steps=300,
        batch=32,
        chance=_prior_chance(_digits(), 10),
        grid=(-20, 4),
        schedule=StepEvery,
        what=f"digits: CNN 32-32-64 with BatchNorm trained on mixup (Beta({MIXUP_ALPHA:g}, {MIXUP_ALPHA:g}) "
        "mixes of pixels and one-hot labels, soft-target cross-entropy; held out: plain cross-entropy), "
        "AdamW wd 0.05, StepLR (LR / 2 every 25 % of the steps), batch 32, 300 steps; a suggestion is the "
        "initial LR",
        chance_what="predict the training class frequencies",
    )


# ----- k4. glove_adagrad_sparse: GloVe word vectors of the stdlib's source, sparse embeddings, Adagrad
GLOVE_VOCAB, GLOVE_DIM, GLOVE_WINDOW, GLOVE_XMAX = 400, 32, 5, 10.0


def _cooccurrence_data() -> Data:
    """GloVe's co-occurrences of the 400 most frequent words (lower-cased runs of letters and underscores) of
    the LM's text, in a symmetric window of 5 weighted 1 / distance; the non-zero cells, 80 % for training
    (at random), the rest held out. The input: (word, context); the target: log X and the weight
    min(1, (X / 10)^0.75), side by side."""
    words = re.findall(r"[a-z_]+", _stdlib_text().lower())
    vocab = [w for w, _ in Counter(words).most_common(GLOVE_VOCAB)]
    index = {w: i for i, w in enumerate(vocab)}
    ids = np.array([index.get(w, -1) for w in words])
    counts = np.zeros((GLOVE_VOCAB, GLOVE_VOCAB))
    for d in range(1, GLOVE_WINDOW + 1):
        a, b = ids[:-d], ids[d:]
        keep = (a >= 0) & (b >= 0)
        np.add.at(counts, (a[keep], b[keep]), 1.0 / d)
        np.add.at(counts, (b[keep], a[keep]), 1.0 / d)
    rows, cols = np.nonzero(counts)
    xc = counts[rows, cols]
    target = np.stack([np.log(xc), np.minimum(1.0, (xc / GLOVE_XMAX) ** 0.75)], 1).astype(np.float32)
    order = np.random.default_rng(181).permutation(len(rows))
    cut = int(0.8 * len(rows))
    x, y = torch.tensor(np.stack([rows, cols], 1)[order]), torch.tensor(target[order])
    return x[:cut], y[:cut], x[cut:], y[cut:]


class GloVe(nn.Module):
    """Pennington et al.'s model: word and context vectors (32) and biases, sparse embeddings initialised
    U(-0.5, 0.5) / 32 as GloVe's code does; the output, w_i . w~_j + b_i + b~_j."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.c = (nn.Embedding(GLOVE_VOCAB, GLOVE_DIM, sparse=True) for _ in range(2))
        self.bw, self.bc = (nn.Embedding(GLOVE_VOCAB, 1, sparse=True) for _ in range(2))
        for e in (self.w, self.c, self.bw, self.bc):
            nn.init.uniform_(e.weight, -0.5 / GLOVE_DIM, 0.5 / GLOVE_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i, j = x[:, 0], x[:, 1]
        return (self.w(i) * self.c(j)).sum(-1) + self.bw(i).squeeze(-1) + self.bc(j).squeeze(-1)


def _glove_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GloVe's weighted least squares of log X, the mean over the cells."""
    return (y[:, 1] * (out - y[:, 0]) ** 2).mean()


def glove_adagrad_sparse() -> Task:
    data = _cooccurrence_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(list(p), lr=lr)

    ytr, yva = data[1], data[3]
    mean = float((ytr[:, 0] * ytr[:, 1]).sum() / ytr[:, 1].sum())
    return Task(
        "glove_adagrad_sparse",
        data,
        GloVe,
        opt,
        _glove_loss,
        steps=400,
        batch=256,
        chance=float(_glove_loss(torch.full((len(yva),), mean), yva)),
        grid=(-16, 4),
        what=f"GloVe of the {GLOVE_VOCAB} most frequent words of the LM's text (window {GLOVE_WINDOW}, 1 / "
        f"distance; 20 % of the non-zero co-occurrences held out): vectors and biases of dim {GLOVE_DIM} as "
        f"sparse embeddings, weighted least squares of log X (x_max {GLOVE_XMAX:g}, 0.75), Adagrad, constant "
        "LR, batch 256, 400 steps",
        chance_what="predict the training cells' weighted mean log X",
    )


# ----- k5. deepsurv_cox_nadam_invtime: survival times, a DeepSurv-style MLP, Cox partial likelihood, NAdam
def _survival_data() -> Data:
    """8000 subjects x ~ N(0, 1)^10; a log-hazard x0^2 / 2 - x1 x2 + sin(2 x3) + 0.8 x4 (Weibull times of
    shape 1.5), censored by independent exponential times (about 35 % censored); 6000 for training, 2000
    held out. The target: the time and whether the event was observed, side by side."""
    rng = np.random.default_rng(191)
    x = rng.normal(size=(8000, 10))
    risk = x[:, 0] ** 2 / 2 - x[:, 1] * x[:, 2] + np.sin(2 * x[:, 3]) + 0.8 * x[:, 4]
    event_time = (rng.exponential(size=len(x)) * np.exp(-risk)) ** (1 / 1.5)
    censor_time = rng.exponential(2.0, size=len(x))
    time_ = np.minimum(event_time, censor_time)
    y = np.stack([time_, (event_time <= censor_time).astype(float)], 1).astype(np.float32)
    xtr, xva = _standardise(x[:6000], x[6000:])
    return torch.tensor(xtr), torch.tensor(y[:6000]), torch.tensor(xva), torch.tensor(y[6000:])


def _cox(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The negative Cox partial log-likelihood of the batch (no ties), per observed event: each event's
    risk against the log-sum-exp of the risks of all still at risk then (its risk set within the batch)."""
    order = torch.argsort(y[:, 0], descending=True)
    risk, event = out.reshape(-1)[order], y[order, 1]
    at_risk = torch.logcumsumexp(risk, 0)
    return -((risk - at_risk) * event).sum() / event.sum().clamp_min(1.0)


def deepsurv_cox_nadam_invtime() -> Task:
    data = _survival_data()

    def mlp() -> nn.Module:
        return nn.Sequential(
            nn.Linear(10, 64), nn.SELU(), nn.AlphaDropout(0.1), nn.Linear(64, 64), nn.SELU(), nn.Linear(64, 1)
        )

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.NAdam(p, lr=lr)

    yva = data[3]
    return Task(
        "deepsurv_cox_nadam_invtime",
        data,
        mlp,
        opt,
        _cox,
        steps=300,
        batch=512,
        chance=float(_cox(torch.zeros(len(yva)), yva)),
        grid=(-20, 0),
        schedule=InverseTime,
        what="survival times (10 features, a nonlinear log-hazard, about 35 % censored): a DeepSurv-style "
        "MLP 64-64 (SELU, alpha dropout 0.1), the Cox partial likelihood per event (risk sets within the "
        "batch; held out: all 2000 at once, so a large constant offset), NAdam, inverse-time decay to 1/4 of "
        "the LR, batch 512, 300 steps; a suggestion is the initial LR",
        chance_what="equal risks for everyone (the log of each event's risk set's size)",
    )


HELD_OUT_10 = {
    "rnn_recall_sgd_momentum": rnn_recall_sgd_momentum,
    "crnn_ctc_adam_expwarmup": crnn_ctc_adam_expwarmup,
    "mixup_bncnn_adamw_step": mixup_bncnn_adamw_step,
    "glove_adagrad_sparse": glove_adagrad_sparse,
    "deepsurv_cox_nadam_invtime": deepsurv_cox_nadam_invtime,
}


# ------------------------------------------------------------------------------------------ held-out set 11
# An eleventh check on ourselves, written before any result of ours on it was seen (only the grid and the two
# third-party finders were run on it). It judged the blind search and the warm-up margin once (ours 1.48,
# torch-lr-finder 1.51), never to choose a rule, and is in ``SETS["all"]`` since. Each task
# is a recipe of a family, an optimizer, a schedule or a loss none of the 58 above has: a WaveNet-style
# dilated causal convolutional character LM (gated activations, residual and skip connections) under Adam
# with a triangular2 cyclic LR, a mixture density network of Bishop's inverse problem (the negative
# log-likelihood of a Gaussian mixture) under AdamW with cosine warm restarts (Loshchilov and Hutter's
# AdamWR), a small U-Net segmenting synthetic blobs with the soft Dice loss under SGD momentum 0.99 at a
# constant LR (the V-Net recipe; a cliff just above the best LR, to worse than chance), a tiny DDPM-style
# diffusion model of a 2-D swiss roll (the noise-prediction MSE over random noise levels) under RAdam at a
# constant LR (a noisy curve: the loss's level is mostly the noise it cannot predict), and TransE embeddings
# of a synthetic knowledge graph (the margin ranking loss against corrupted triples) under plain SGD (a
# plateau near chance over three decades, a narrow good range, then a cliff).
class Triangular2:
    """LR multiplier of ``CyclicLR(mode="triangular2")`` from ``base`` of the LR up to the LR and back, each
    half cycle ``half`` of ``total`` steps, the amplitude halved every cycle."""

    def __init__(self, total: int, half: float = 0.25, base: float = 0.1) -> None:
        self.total, self.base = total, base
        self.size = max(1, round(half * total))

    def __call__(self, step: int) -> float:
        cycle = step // (2 * self.size)
        x = abs(step / self.size - 2 * cycle - 1)
        return self.base + (1.0 - self.base) * max(0.0, 1.0 - x) / 2.0**cycle

    def __repr__(self) -> str:
        return f"Triangular2(total={self.total}, step_size={self.size}, base={self.base})"


# ----- l1. wavenet_lm_adam_tri2: a WaveNet-style dilated causal conv char LM, Adam, triangular2 cyclic LR
WAVENET_DILATIONS = (1, 2, 4, 8, 16)


class WaveNetLM(nn.Module):
    """van den Oord et al.'s WaveNet over characters: an embedding (32), causal convolutions of width 2
    dilated 1, 2, 4, 8, 16 (receptive field 32), each gated (tanh x sigmoid) with a residual and a skip
    1x1 convolution; the sum of the skips through ReLU, 1x1, ReLU, 1x1 to the characters."""

    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.convs = nn.ModuleList(nn.Conv1d(d, 2 * d, 2, dilation=k) for k in WAVENET_DILATIONS)
        self.res = nn.ModuleList(nn.Conv1d(d, d, 1) for _ in WAVENET_DILATIONS)
        self.skip = nn.ModuleList(nn.Conv1d(d, d, 1) for _ in WAVENET_DILATIONS)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(d, d, 1), nn.ReLU(), nn.Conv1d(d, vocab, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)
        skips = torch.zeros_like(h)
        for conv, res, skip, k in zip(self.convs, self.res, self.skip, WAVENET_DILATIONS, strict=True):
            a, b = conv(nn.functional.pad(h, (k, 0))).chunk(2, 1)
            z = torch.tanh(a) * torch.sigmoid(b)
            h, skips = h + res(z), skips + skip(z)
        return self.head(skips).transpose(1, 2)


def wavenet_lm_adam_tri2() -> Task:
    data, vocab = _lm_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "wavenet_lm_adam_tri2",
        data,
        lambda: WaveNetLM(vocab),
        opt,
        _ce,
        steps=300,
        batch=16,
        chance=_prior_chance(data, vocab),
        grid=(-16, -2),
        schedule=Triangular2,
        what=f"char LM ({vocab} chars, context {LM_CONTEXT}) on the LM's text: WaveNet (gated causal "
        f"convolutions 32 dilated {', '.join(map(str, WAVENET_DILATIONS))}, residual and skip), Adam, "
        "CyclicLR triangular2 (LR / 10 to LR, half cycles of 75 steps, amplitude halved each cycle), batch "
        "16, 300 steps; a suggestion is the peak LR",
        chance_what="predict the training character frequencies",
    )


# ----- l2. mdn_adamw_sgdr: Bishop's inverse problem, a mixture density network, AdamW, warm restarts
MDN_COMPONENTS = 5


def _inverse_data() -> Data:
    """Bishop's inverse problem: t ~ U(0, 1), x = t + 0.3 sin(2 pi t) + U(-0.1, 0.1); predict t from x (up
    to three branches). 3000 training, 1000 held out, both standardised by the training statistics."""
    rng = np.random.default_rng(193)
    t = rng.uniform(0.0, 1.0, size=4000)
    x = t + 0.3 * np.sin(2 * np.pi * t) + rng.uniform(-0.1, 0.1, size=len(t))
    return _regression_data(x[:, None], t, 193)


class MDN(nn.Module):
    """Bishop's mixture density network: an MLP 64-64 (tanh) to the logits, means and log standard
    deviations of 5 Gaussians, side by side."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(64, 3 * MDN_COMPONENTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _mixture_nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of the target under the predicted Gaussian mixture, the mean."""
    logits, mu, log_sd = out.chunk(3, -1)
    z = (y[:, None] - mu) / log_sd.exp()
    logp = torch.log_softmax(logits, -1) - 0.5 * z**2 - log_sd - 0.5 * math.log(2 * math.pi)
    return -torch.logsumexp(logp, -1).mean()


def mdn_adamw_sgdr() -> Task:
    data = _inverse_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=1e-4)

    ytr, yva = data[1], data[3]
    mu, sd = float(ytr.mean()), float(ytr.std())
    return Task(
        "mdn_adamw_sgdr",
        data,
        MDN,
        opt,
        _mixture_nll,
        steps=600,
        batch=64,
        chance=float(0.5 * math.log(2 * math.pi * sd**2) + ((yva - mu) ** 2).mean() / (2 * sd**2)),
        grid=(-20, 0),
        schedule=partial(WarmRestarts, cycles=2),
        what=f"Bishop's inverse problem (t from t + 0.3 sin(2 pi t) + noise): a mixture density network "
        f"(MLP 64-64 tanh, {MDN_COMPONENTS} Gaussians), mixture NLL, AdamW wd 1e-4, cosine warm restarts "
        "(T_0 200 steps, T_mult 2, to 0), batch 64, 600 steps; a suggestion is the peak LR",
        chance_what="one Gaussian of the training mean and standard deviation",
    )


# ----- l3. unet_dice_sgd_m99: synthetic blobs in noise, a small U-Net, soft Dice loss, SGD momentum 0.99
BLOB_SIZE = 16


def _blob_data() -> Data:
    """16x16 images of 1..3 ellipses (random centres, radii 1.5..4, brightness 0.5..1.5) on a random linear
    gradient, in Gaussian noise (0.5); the target, the ellipses' mask. 3000 training, 1000 held out."""
    rng = np.random.default_rng(197)
    n, s = 4000, BLOB_SIZE
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float64)
    x = np.zeros((n, s, s))
    mask = np.zeros((n, s, s), dtype=bool)
    for i in range(n):
        gx, gy = rng.normal(scale=0.05, size=2)
        x[i] = gx * (xx - s / 2) + gy * (yy - s / 2)
        for _ in range(int(rng.integers(1, 4))):
            cy, cx = rng.uniform(2, s - 2, size=2)
            ry, rx = rng.uniform(1.5, 4.0, size=2)
            inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
            x[i][inside & ~mask[i]] += rng.uniform(0.5, 1.5)
            mask[i] |= inside
    x = (x + 0.5 * rng.normal(size=x.shape)).astype(np.float32)[:, None]
    m = mask.astype(np.float32)[:, None]
    return torch.tensor(x[:3000]), torch.tensor(m[:3000]), torch.tensor(x[3000:]), torch.tensor(m[3000:])


class TinyUNet(nn.Module):
    """A two-level U-Net: two 3x3 convolutions (16, ReLU), max-pooling, two (32), a transposed convolution
    up, the skip concatenated, two (16), a 1x1 convolution to the mask's logit."""

    def __init__(self) -> None:
        super().__init__()

        def double(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU()
            )

        self.down, self.mid, self.out = double(1, 16), double(16, 32), double(32, 16)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.head = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.down(x)
        m = self.mid(nn.functional.max_pool2d(d, 2))
        return self.head(self.out(torch.cat([d, self.up(m)], 1)))


def _dice(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Milletari et al.'s soft Dice loss, 1 - 2 sum(p g) / (sum(p^2) + sum(g^2)) per image, the mean."""
    p = torch.sigmoid(out).flatten(1)
    g = y.flatten(1)
    return (1.0 - 2.0 * (p * g).sum(1) / ((p * p).sum(1) + (g * g).sum(1) + 1e-6)).mean()


def unet_dice_sgd_m99() -> Task:
    data = _blob_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.99)

    frac = float(data[1].mean())
    return Task(
        "unet_dice_sgd_m99",
        data,
        TinyUNet,
        opt,
        _dice,
        steps=300,
        batch=16,
        chance=float(_dice(torch.full_like(data[3], math.log(frac / (1 - frac))), data[3])),
        grid=(-20, 0),
        what=f"{BLOB_SIZE}x{BLOB_SIZE} images of 1..3 ellipses on a gradient in noise: a two-level U-Net "
        "(16-32), soft Dice loss, SGD momentum 0.99 (V-Net's), constant LR, batch 16, 300 steps",
        chance_what="predict the training foreground fraction at every pixel",
    )


# ----- l4. ddpm_swissroll_radam: a tiny diffusion model of a 2-D swiss roll, noise prediction, RAdam
DDPM_T = 100


def _ddpm_alpha_bar(t: torch.Tensor) -> torch.Tensor:
    """Nichol and Dhariwal's cosine schedule of the signal's share at step t of ``DDPM_T`` (clipped)."""
    f = torch.cos((t / DDPM_T + 0.008) / 1.008 * math.pi / 2) ** 2
    return (f / math.cos(0.008 / 1.008 * math.pi / 2) ** 2).clamp(1e-4, 0.9999)


def _swissroll_data() -> Data:
    """A 2-D swiss roll (sklearn's, its x and z, standardised), 6000 training, 2000 held out; each held-out
    point with a fixed step t ~ U{1..100} and noise, side by side (x, t, noise); the targets unused."""
    rng = np.random.default_rng(199)
    from sklearn.datasets import make_swiss_roll

    pts, _ = make_swiss_roll(8000, noise=0.3, random_state=199)
    xtr, xva = _standardise(pts[:6000, [0, 2]], pts[6000:, [0, 2]])
    t = rng.integers(1, DDPM_T + 1, size=(2000, 1)).astype(np.float32)
    xva = np.concatenate([xva, t, rng.normal(size=(2000, 2)).astype(np.float32)], 1)
    xtr = np.concatenate([xtr, np.zeros((6000, 3), np.float32)], 1)
    return torch.tensor(xtr), torch.zeros(6000), torch.tensor(xva), torch.zeros(2000)


class DDPMMLP(nn.Module):
    """Ho et al.'s noise predictor for 2-D points: the noised point and a sinusoidal embedding of the step
    (8 frequencies) through an MLP 128-128-128 (SiLU) to the noise. In training mode each point draws a
    fresh step and noise (in eval mode, the fixed ones after it); the output: the predicted and the true
    noise, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.exp(torch.linspace(0.0, math.log(100.0), 8)))
        w = 128
        layers = [nn.Linear(18, w), nn.SiLU(), nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(w, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0, t, eps = x[:, :2], x[:, 2:3], x[:, 3:]
        if self.training:
            t = torch.randint(1, DDPM_T + 1, (len(x), 1)).float()
            eps = torch.randn_like(x0)
        ab = _ddpm_alpha_bar(t)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        phase = t / DDPM_T * self.freqs
        return torch.cat([self.net(torch.cat([xt, phase.sin(), phase.cos()], 1)), eps], 1)


def _eps_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """DDPM's simple loss: the MSE of the predicted noise (the targets are unused)."""
    return ((out[:, :2] - out[:, 2:]) ** 2).mean()


def ddpm_swissroll_radam() -> Task:
    data = _swissroll_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RAdam(p, lr=lr)

    return Task(
        "ddpm_swissroll_radam",
        data,
        DDPMMLP,
        opt,
        _eps_mse,
        steps=500,
        batch=128,
        chance=float((data[2][:, 3:] ** 2).mean()),
        grid=(-20, 0),
        what=f"a 2-D swiss roll: a DDPM noise predictor (MLP 128x3 SiLU, sinusoidal step embedding, "
        f"{DDPM_T} steps of a cosine schedule, fresh steps and noise every batch; held out: fixed ones), "
        "noise-prediction MSE, RAdam, constant LR, batch 128, 500 steps",
        chance_what="predict zero noise",
    )


# ----- l5. transe_margin_sgd: a synthetic knowledge graph, TransE, margin ranking loss, plain SGD
KG_ENTITIES, KG_RELATIONS, KG_LATENT, KG_DIM, KG_MARGIN = 200, 16, 3, 32, 1.0


def _kg_data() -> Data:
    """A knowledge graph of 300 entities (latent points N(0, 1)^8) and 12 relations (latent translations
    N(0, 0.5^2)^8): each (head, relation)'s tail is the entity nearest the head's point plus the relation's
    translation (not the head itself); 3600 triples, 2700 for training, 900 held out. The input: (head,
    relation, tail) and a corrupted (head, tail), its head or its tail replaced by a random entity (fixed
    for the held-out triples; training draws fresh ones)."""
    rng = np.random.default_rng(211)
    ent = rng.normal(size=(KG_ENTITIES, KG_LATENT))
    rel = 0.5 * rng.normal(size=(KG_RELATIONS, KG_LATENT))
    h = np.repeat(np.arange(KG_ENTITIES), KG_RELATIONS)
    r = np.tile(np.arange(KG_RELATIONS), KG_ENTITIES)
    dist = (((ent[h] + rel[r])[:, None, :] - ent[None]) ** 2).sum(-1)
    dist[np.arange(len(h)), h] = np.inf
    t = dist.argmin(1)
    corrupt = rng.integers(0, KG_ENTITIES, size=len(h))
    head = rng.random(len(h)) < 0.5
    x = np.stack([h, r, t, np.where(head, corrupt, h), np.where(head, t, corrupt)], 1)
    x, cut = torch.tensor(x[rng.permutation(len(h))], dtype=torch.long), 3 * len(x) // 4
    return x[:cut], torch.zeros(cut), x[cut:], torch.zeros(len(x) - cut)


class TransE(nn.Module):
    """Bordes et al.'s TransE: entity and relation vectors (32, initialised U(-6 / sqrt(32), 6 / sqrt(32))),
    entities normalised to unit length; a triple's distance, ||h + r - t||_1. In training mode the
    corrupted entity is drawn afresh. The output: the true and the corrupted triple's distances."""

    def __init__(self) -> None:
        super().__init__()
        self.ent = nn.Embedding(KG_ENTITIES, KG_DIM)
        self.rel = nn.Embedding(KG_RELATIONS, KG_DIM)
        bound = 6.0 / math.sqrt(KG_DIM)
        for e in (self.ent, self.rel):
            nn.init.uniform_(e.weight, -bound, bound)
        with torch.no_grad():
            self.rel.weight.div_(self.rel.weight.norm(dim=-1, keepdim=True))

    def _dist(self, h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        e = nn.functional.normalize(self.ent.weight, dim=-1)
        return (e[h] + self.rel(r) - e[t]).abs().sum(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, r, t, hc, tc = x.unbind(1)
        if self.training:
            corrupt = torch.randint(0, KG_ENTITIES, (len(x),))
            head = torch.rand(len(x)) < 0.5
            hc, tc = torch.where(head, corrupt, h), torch.where(head, t, corrupt)
        return torch.stack([self._dist(h, r, t), self._dist(hc, r, tc)], 1)


def _margin_ranking(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The margin ranking loss max(0, margin + d(true) - d(corrupted)), the mean (the targets unused)."""
    return nn.functional.relu(KG_MARGIN + out[:, 0] - out[:, 1]).mean()


def transe_margin_sgd() -> Task:
    data = _kg_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    return Task(
        "transe_margin_sgd",
        data,
        TransE,
        opt,
        _margin_ranking,
        steps=600,
        batch=128,
        chance=KG_MARGIN,
        grid=(-12, 8),
        what=f"a synthetic knowledge graph ({KG_ENTITIES} entities, {KG_RELATIONS} relations, tails the "
        f"nearest to head + relation in a latent space): TransE (dim {KG_DIM}, L1, unit entities), margin "
        f"ranking loss (margin {KG_MARGIN:g}, one corrupted head or tail per triple), plain SGD, constant "
        "LR, batch 128, 600 steps",
        chance_what="the same distance for every triple (the margin)",
    )


HELD_OUT_11 = {
    "wavenet_lm_adam_tri2": wavenet_lm_adam_tri2,
    "mdn_adamw_sgdr": mdn_adamw_sgdr,
    "unet_dice_sgd_m99": unet_dice_sgd_m99,
    "ddpm_swissroll_radam": ddpm_swissroll_radam,
    "transe_margin_sgd": transe_margin_sgd,
}


# ------------------------------------------------------------------------------------------ held-out set 12
# A twelfth check on ourselves, written before any result of ours on it was seen (only the grid and the two
# third-party finders were run on it). It judged the code the eleventh judged once more (ours 1.03,
# torch-lr-finder 2.66), never to choose a rule, and is in ``SETS["all"]`` since. Each task is a recipe of a
# family, an optimizer, a schedule or a loss none of the 63 above has: a PointNet classifying synthetic 2-D
# point clouds (a shared per-point MLP, max-pooled) under AdamW with fastai's one-cycle policy annealed
# linearly, a SIREN (sine activations, omega_0 30) fitting a synthetic image from a random three quarters of
# its pixels under Adam at a constant LR (Sitzmann et al.'s recipe; a narrow good range, then a cliff just
# above the best LR), a NeuMF neural collaborative filter of implicit feedback (BCE against sampled negatives)
# under SGD momentum with an exp_range cyclic LR (good LRs up to 3, the best at 1), a Keras-style LSTM
# autoencoder of noisy sequences (an encoder's last state repeated into a decoder) under RMSprop with an
# exponential decay (a plateau at the mean before it breaks away), and a sparse top-2 mixture-of-experts MLP
# classifier with the Switch Transformer's load-balancing loss under NAdam with a linear warm-up and decay.
class OneCycleLinear:
    """LR multiplier of ``OneCycleLR(anneal_strategy="linear")`` (fastai's ``fit_one_cycle`` as first
    written): linear from ``1 / div`` of the LR up to the LR over ``pct`` of ``total`` steps, then linear down
    to ``1 / (div * final_div)`` (the LR only: the momentum is not cycled)."""

    def __init__(self, total: int, pct: float = 0.3, div: float = 25.0, final_div: float = 1e4) -> None:
        self.total, self.div, self.final_div = total, div, final_div
        self.up = max(1, round(pct * total))

    def __call__(self, step: int) -> float:
        lo, end = 1.0 / self.div, 1.0 / (self.div * self.final_div)
        if step < self.up:
            return lo + (1.0 - lo) * step / self.up
        t = min(1.0, (step - self.up) / max(1, self.total - self.up))
        return 1.0 + (end - 1.0) * t

    def __repr__(self) -> str:
        return f"OneCycleLinear(total={self.total}, up={self.up}, div={self.div}, final_div={self.final_div})"


class ExpRange:
    """LR multiplier of ``CyclicLR(mode="exp_range", gamma)`` from ``base`` of the LR up to the LR and back,
    each half cycle ``half`` of ``total`` steps, the amplitude scaled by ``gamma ** step``, ``gamma`` such
    that it ends at ``final`` of its start."""

    def __init__(self, total: int, half: float = 0.125, base: float = 0.1, final: float = 0.1) -> None:
        self.total, self.base = total, base
        self.size = max(1, round(half * total))
        self.gamma = final ** (1.0 / max(1, total))

    def __call__(self, step: int) -> float:
        cycle = step // (2 * self.size)
        x = abs(step / self.size - 2 * cycle - 1)
        return self.base + (1.0 - self.base) * max(0.0, 1.0 - x) * self.gamma**step

    def __repr__(self) -> str:
        return f"ExpRange(total={self.total}, size={self.size}, base={self.base}, gamma={self.gamma:.6f})"


# ----- m1. pointnet_adamw_onecycle_lin: synthetic 2-D point clouds, a PointNet, AdamW, one-cycle (linear)
CLOUD_POINTS, CLOUD_SHAPES = 32, 5


def _cloud_data() -> Data:
    """Clouds of 32 points on the outline of a circle, a square, a triangle, a cross or an ellipse (axes 1 and
    0.5), each randomly rotated, scaled (0.6..1.4), shifted (N(0, 0.3^2)) and jittered (N(0, 0.1^2)), in a
    random order; 3000 training, 1000 held out."""
    rng = np.random.default_rng(223)
    n, k = 4000, CLOUD_POINTS
    y = rng.integers(0, CLOUD_SHAPES, size=n)
    u = rng.uniform(0.0, 1.0, size=(n, k))
    angle = 2 * np.pi * u
    circle = np.stack([np.cos(angle), np.sin(angle)], -1)
    ellipse = circle * np.array([1.0, 0.5])
    side, s = np.floor(4 * u), 4 * u % 1 * 2 - 1
    square = np.stack(
        [
            np.choose(side.astype(int), [s, -s, -np.ones_like(s), np.ones_like(s)]),
            np.choose(side.astype(int), [np.ones_like(s), -np.ones_like(s), s, -s]),
        ],
        -1,
    )
    corners = np.array([[0.0, 1.0], [-0.87, -0.5], [0.87, -0.5], [0.0, 1.0]])
    e, f = np.floor(3 * u).astype(int), (3 * u % 1)[..., None]
    triangle = corners[e] * (1 - f) + corners[e + 1] * f
    cross = np.where((u < 0.5)[..., None], np.stack([4 * u - 1, 0 * u], -1), np.stack([0 * u, 4 * u - 3], -1))
    pts = np.stack([circle, square, triangle, cross, ellipse], 1)[np.arange(n), y]
    theta = rng.uniform(0, 2 * np.pi, size=n)
    rot = np.stack([np.cos(theta), -np.sin(theta), np.sin(theta), np.cos(theta)], -1).reshape(n, 2, 2)
    pts = np.einsum("nkd,nde->nke", pts, rot) * rng.uniform(0.6, 1.4, size=(n, 1, 1))
    pts = pts + rng.normal(scale=0.3, size=(n, 1, 2)) + rng.normal(scale=0.1, size=pts.shape)
    x = torch.tensor(pts.astype(np.float32))
    return x[:3000], torch.tensor(y[:3000]), x[3000:], torch.tensor(y[3000:])


class PointNet(nn.Module):
    """Qi et al.'s PointNet (without the input transforms): a shared per-point MLP 64-64-128 (ReLU), the max
    over the points, an MLP 64 (ReLU) to the classes."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU()]
        self.point = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, CLOUD_SHAPES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.point(x).amax(1))


def pointnet_adamw_onecycle_lin() -> Task:
    data = _cloud_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=1e-2)

    return Task(
        "pointnet_adamw_onecycle_lin",
        data,
        PointNet,
        opt,
        _ce,
        steps=300,
        batch=32,
        chance=_prior_chance(data, CLOUD_SHAPES),
        grid=(-20, 0),
        schedule=OneCycleLinear,
        what=f"clouds of {CLOUD_POINTS} 2-D points on 5 outlines (rotated, scaled, shifted, jittered): "
        "PointNet (shared MLP 64-64-128, max-pool, MLP 64), AdamW wd 1e-2, one-cycle with a linear anneal "
        "(LR / 25 up to LR over 30 %, down to LR / 2.5e5), batch 32, 300 steps; a suggestion is the peak LR",
        chance_what="predict the training class frequencies",
    )


# ----- m2. siren_image_adam: a synthetic image from three quarters of its pixels, a SIREN, Adam
SIREN_SIZE, SIREN_OMEGA = 48, 30.0


def _image_data() -> Data:
    """A 48x48 synthetic grey image (a bright disk, a dark rotated bar, two Gaussian blobs and a sinusoidal
    texture on a gradient); each pixel's (x, y) in [-1, 1] and its intensity (standardised by the training
    pixels); a random 3/4 of the pixels for training, the rest held out."""
    rng = np.random.default_rng(227)
    s = np.linspace(-1.0, 1.0, SIREN_SIZE)
    yy, xx = np.meshgrid(s, s, indexing="ij")
    img = 0.3 * xx - 0.2 * yy + 0.15 * np.sin(9 * xx + 4 * yy)
    img += 1.0 * (((xx - 0.35) ** 2 + (yy + 0.3) ** 2) < 0.12)
    u, v = 0.8 * xx + 0.6 * yy, -0.6 * xx + 0.8 * yy
    img -= 0.8 * ((np.abs(u + 0.3) < 0.5) & (np.abs(v - 0.35) < 0.1))
    img += 0.7 * np.exp(-((xx + 0.5) ** 2 + (yy + 0.5) ** 2) / 0.02) - 0.5 * np.exp(-(xx**2 + yy**2) / 0.05)
    coords = np.stack([xx.ravel(), yy.ravel()], 1).astype(np.float32)
    order = rng.permutation(len(coords))
    cut = 3 * len(coords) // 4
    tr, va = order[:cut], order[cut:]
    z = img.ravel()
    mu, sd = z[tr].mean(), z[tr].std()
    z = ((z - mu) / sd).astype(np.float32)
    return torch.tensor(coords[tr]), torch.tensor(z[tr]), torch.tensor(coords[va]), torch.tensor(z[va])


class Siren(nn.Module):
    """Sitzmann et al.'s SIREN: three hidden layers of 64 with sin(omega_0 x), omega_0 30, their init (the
    first layer U(-1 / n, 1 / n), the others U(-sqrt(6 / n) / omega_0, +)), a linear output."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, width), nn.Linear(width, width), nn.Linear(width, width)])
        self.out = nn.Linear(width, 1)
        with torch.no_grad():
            for i, layer in enumerate([*self.layers, self.out]):
                n = layer.in_features
                bound = 1.0 / n if i == 0 else math.sqrt(6.0 / n) / SIREN_OMEGA
                layer.weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.sin(SIREN_OMEGA * layer(x))
        return self.out(x)


def siren_image_adam() -> Task:
    data = _image_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "siren_image_adam",
        data,
        Siren,
        opt,
        _mse,
        steps=400,
        batch=128,
        chance=_mse_chance(data),
        grid=(-24, -4),
        what=f"a {SIREN_SIZE}x{SIREN_SIZE} synthetic image, 3/4 of its pixels to fit, the rest held out: a "
        f"SIREN (3 x 64 sine layers, omega_0 {SIREN_OMEGA:g}, its init), MSE, Adam, constant LR, batch 128, "
        "400 steps",
        chance_what="predict the training mean",
    )


# ----- m3. ncf_bce_sgd_exprange: implicit feedback, a NeuMF collaborative filter, BCE, SGD, exp_range CLR
NCF_USERS, NCF_ITEMS, NCF_NEGATIVES = 400, 300, 4


def _implicit_data() -> Data:
    """Implicit feedback of 400 users on 300 items (scores: 3 x the product of latent factors N(0, 1)^6 /
    6^0.25, plus an item popularity N(0, 1.5^2)): each user's 12 positives drawn without replacement by the
    softmax of their scores, each positive with 4 negatives drawn uniformly from the items the user has not;
    (user, item) and 1 or 0, 3/4 of the rows for training, the rest held out."""
    rng = np.random.default_rng(229)
    pu = rng.normal(size=(NCF_USERS, 6)) / 6**0.25
    qi = rng.normal(size=(NCF_ITEMS, 6)) / 6**0.25
    score = 3.0 * pu @ qi.T + 1.5 * rng.normal(size=NCF_ITEMS)
    rows = []
    for u in range(NCF_USERS):
        p = np.exp(score[u] - score[u].max())
        pos = rng.choice(NCF_ITEMS, size=12, replace=False, p=p / p.sum())
        rest = np.setdiff1d(np.arange(NCF_ITEMS), pos)
        neg = rng.choice(rest, size=12 * NCF_NEGATIVES, replace=False)
        rows += [(u, i, 1.0) for i in pos] + [(u, i, 0.0) for i in neg]
    arr = np.array(rows)[rng.permutation(len(rows))]
    x, y = torch.tensor(arr[:, :2], dtype=torch.long), torch.tensor(arr[:, 2], dtype=torch.float32)
    cut = 3 * len(x) // 4
    return x[:cut], y[:cut], x[cut:], y[cut:]


class NeuMF(nn.Module):
    """He et al.'s NeuMF: a GMF branch (user and item embeddings of 8, their product) and an MLP branch
    (embeddings of 16, concatenated, MLP 32-16 ReLU), side by side into one logit; the embeddings at
    PyTorch's default N(0, 1) (He et al.'s N(0, 0.01^2) leaves plain SGD at a saddle for the whole budget)."""

    def __init__(self) -> None:
        super().__init__()
        self.gu, self.gi = nn.Embedding(NCF_USERS, 8), nn.Embedding(NCF_ITEMS, 8)
        self.mu, self.mi = nn.Embedding(NCF_USERS, 16), nn.Embedding(NCF_ITEMS, 16)
        self.mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.out = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = x[:, 0], x[:, 1]
        mlp = self.mlp(torch.cat([self.mu(u), self.mi(i)], 1))
        return self.out(torch.cat([self.gu(u) * self.gi(i), mlp], 1)).squeeze(-1)


def ncf_bce_sgd_exprange() -> Task:
    data = _implicit_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    return Task(
        "ncf_bce_sgd_exprange",
        data,
        NeuMF,
        opt,
        _bce,
        steps=600,
        batch=256,
        chance=_label_prior_chance(data),
        grid=(-12, 8),
        schedule=ExpRange,
        what=f"implicit feedback of {NCF_USERS} users on {NCF_ITEMS} items (12 positives a user, "
        f"{NCF_NEGATIVES} sampled negatives each): NeuMF (GMF 8 + MLP 32-16 on embeddings of 16), BCE, SGD "
        "momentum 0.9, CyclicLR exp_range (LR / 10 to LR, half cycles of 75 steps, amplitude to 0.1x), batch "
        "256, 600 steps; a suggestion is max_lr",
        chance_what="predict the training share of positives",
    )


# ----- m4. lstm_autoencoder_rmsprop_exp: noisy sequences, a Keras-style LSTM autoencoder, RMSprop, exp decay
AE_LEN = 24


def _wave_data() -> Data:
    """Sequences of 24 steps: the sum of two sinusoids (frequencies U(0.2, 1.2) rad a step, amplitudes
    U(0.3, 1), random phases) in Gaussian noise (0.1); the target, the sequence itself. 3000 training, 1000
    held out."""
    rng = np.random.default_rng(233)
    n, t = 4000, np.arange(AE_LEN)
    w, a, ph = (
        rng.uniform(0.2, 1.2, (n, 2, 1)),
        rng.uniform(0.3, 1.0, (n, 2, 1)),
        rng.uniform(0, 7, (n, 2, 1)),
    )
    x = (a * np.sin(w * t + ph)).sum(1) + 0.1 * rng.normal(size=(n, AE_LEN))
    x = torch.tensor(x.astype(np.float32))
    return x[:3000, :, None], x[:3000], x[3000:, :, None], x[3000:]


class LSTMAutoencoder(nn.Module):
    """The Keras LSTM autoencoder: an LSTM encoder (16), its last hidden state repeated over the steps
    (``RepeatVector``) into an LSTM decoder (32), a linear layer per step (``TimeDistributed(Dense(1))``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.LSTM(1, 16, batch_first=True)
        self.dec = nn.LSTM(16, 32, batch_first=True)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.enc(x)
        z = h[-1][:, None, :].expand(-1, x.shape[1], -1)
        return self.out(self.dec(z)[0])


def lstm_autoencoder_rmsprop_exp() -> Task:
    data = _wave_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(p, lr=lr, alpha=0.9)

    return Task(
        "lstm_autoencoder_rmsprop_exp",
        data,
        LSTMAutoencoder,
        opt,
        _mse,
        steps=600,
        batch=32,
        chance=_mse_chance(data),
        grid=(-20, 0),
        schedule=ExpDecay,
        what=f"sequences of {AE_LEN} steps (two sinusoids in noise): a Keras-style LSTM autoencoder (encoder "
        "16, RepeatVector, decoder 32, a linear layer per step), reconstruction MSE, RMSprop (rho 0.9, "
        "Keras's), exponential decay to LR / 10, batch 32, 600 steps",
        chance_what="predict the training mean",
    )


# ----- m5. moe_balance_nadam_warmlin: a sparse top-2 mixture of experts, a load-balancing loss, NAdam
MOE_EXPERTS, MOE_CLASSES, MOE_BALANCE = 4, 6, 0.01


class MoEClassifier(nn.Module):
    """An MLP with a sparse mixture-of-experts layer: 16 features to 64 (ReLU), a router to 4 experts (MLP
    64-128-64, ReLU), each row sent to its top 2 (their softmax weights renormalised), added to the residual,
    ReLU, to the classes. The output: the logits and the Switch Transformer's load-balancing loss (experts x
    the sum over them of the share of rows whose first choice they are x their mean router probability; 1
    when balanced), side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.router = nn.Linear(64, MOE_EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(MOE_EXPERTS)
        )
        self.head = nn.Linear(64, MOE_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        probs = torch.softmax(self.router(h), -1)
        top, idx = probs.topk(2, -1)
        gate = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True))
        mixed = sum(gate[:, e : e + 1] * expert(h) for e, expert in enumerate(self.experts))
        share = nn.functional.one_hot(idx[:, 0], MOE_EXPERTS).float().mean(0)
        balance = MOE_EXPERTS * (share * probs.mean(0)).sum()
        logits = self.head(torch.relu(h + mixed))
        return torch.cat([logits, balance.expand(len(x), 1)], 1)


def _moe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus 0.01 x the load-balancing loss."""
    return nn.functional.cross_entropy(out[:, :-1], y) + MOE_BALANCE * out[0, -1]


def moe_balance_nadam_warmlin() -> Task:
    x, y = make_classification(
        n_samples=4000,
        n_features=16,
        n_informative=12,
        n_redundant=2,
        n_classes=MOE_CLASSES,
        n_clusters_per_class=3,
        flip_y=0.02,
        class_sep=1.0,
        random_state=239,
    )
    data = _class_split(x, y, 239, standardise=True)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.NAdam(p, lr=lr)

    return Task(
        "moe_balance_nadam_warmlin",
        data,
        MoEClassifier,
        opt,
        _moe_loss,
        steps=400,
        batch=64,
        chance=_prior_chance(data, MOE_CLASSES) + MOE_BALANCE,
        grid=(-20, 0),
        schedule=WarmupLinear,
        what=f"make_classification (16 features, {MOE_CLASSES} classes, 3 clusters each): an MLP with a "
        f"sparse top-2 mixture of {MOE_EXPERTS} experts, cross-entropy + {MOE_BALANCE:g} x the Switch "
        "load-balancing loss, NAdam, linear warm-up over 10 % then linear decay to 0, batch 64, 400 steps; a "
        "suggestion is the peak LR",
        chance_what="predict the training class frequencies (plus the balancing loss of a balanced router)",
    )


HELD_OUT_12 = {
    "pointnet_adamw_onecycle_lin": pointnet_adamw_onecycle_lin,
    "siren_image_adam": siren_image_adam,
    "ncf_bce_sgd_exprange": ncf_bce_sgd_exprange,
    "lstm_autoencoder_rmsprop_exp": lstm_autoencoder_rmsprop_exp,
    "moe_balance_nadam_warmlin": moe_balance_nadam_warmlin,
}


# ------------------------------------------------------------------------------------------ held-out set 13
# A thirteenth check on ourselves, written before any result of ours on it was seen (only the grid and the
# two third-party finders were run on it), to judge the next rule change once; it is not in ``SETS["all"]``
# until then. Each task is a recipe of a family, an optimizer, a schedule or a loss none of the 68 above has:
# a Perceiver-style classifier of digits (learned latents cross-attending to the pixels, then self-attention
# among the latents) under AdamW with a warm-up-stable-decay schedule, a physics-informed network solving a
# 1-D Poisson equation (the residual of its second derivative plus the boundary conditions) under Adam with
# DeepXDE's inverse-time decay (a plateau where only the boundary is fitted up to 3e-3, a narrow good range
# 0.01-0.03, then a blow-up from 0.18), a Gumbel-softmax discrete VAE of binarised digits (categorical
# latents, the relaxed ELBO) under Adam with a cosine decay, an N-BEATS forecaster of seasonal series
# (generic blocks, backcast residual stacking) with the sMAPE loss under Adam with LR / 10 steps (a noisy
# curve and a cliff just above the best LR: best at 0.01, a dead network from 0.03), and a deep & cross
# network (DCN-V2) of synthetic click-through data (categorical embeddings, BCE) under Adagrad with
# TensorFlow's initial accumulator (the best LR at 0.056).
# ----- n1. perceiver_digits_adamw_wsd: digits, a Perceiver (latents cross-attend to pixels), AdamW, WSD
class Perceiver(nn.Module):
    """Jaegle et al.'s Perceiver, small: the 64 pixels as tokens (the value and 4 Fourier features of the row
    and of the column, projected to 32), 8 learned latents of 32 cross-attending to them (pre-LN, one head,
    a GELU MLP), one pre-LN self-attention block among the latents (4 heads), their mean, a linear head."""

    def __init__(self, d: int = 32, latents: int = 8) -> None:
        super().__init__()
        pos = torch.arange(8.0) / 7.0 * 2 - 1
        bands = torch.cat([torch.sin(math.pi * k * pos[:, None]) for k in (1, 2)], 1)
        feats = torch.cat([bands[:, None, :].expand(8, 8, 2), bands[None, :, :].expand(8, 8, 2)], -1)
        self.register_buffer("pos", feats.reshape(64, 4))
        self.embed = nn.Linear(5, d)
        self.latents = nn.Parameter(0.02 * torch.randn(latents, d))
        self.ln_q, self.ln_kv, self.ln_mlp = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.cross = nn.MultiheadAttention(d, 1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, 0.0, "gelu", batch_first=True, norm_first=True)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([x[:, :, None], self.pos.expand(len(x), 64, 4)], -1)
        kv = self.ln_kv(self.embed(tokens))
        z = self.latents.expand(len(x), -1, -1)
        q = self.ln_q(z)
        z = z + self.cross(q, kv, kv, need_weights=False)[0]
        z = z + self.mlp(self.ln_mlp(z))
        return self.head(self.block(z).mean(1))


def perceiver_digits_adamw_wsd() -> Task:
    data = _digits()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.05)

    return Task(
        "perceiver_digits_adamw_wsd",
        data,
        Perceiver,
        opt,
        _ce,
        steps=400,
        batch=64,
        chance=_prior_chance(data, 10),
        grid=(-16, -4),
        schedule=WarmupStableDecay,
        what="digits, the 64 pixels as tokens (value + Fourier position): a Perceiver (8 latents of 32 "
        "cross-attending to the pixels, one self-attention block among them, mean, linear head), AdamW wd "
        "0.05, warm-up-stable-decay (5 % up, 20 % down to 0), batch 64, 400 steps; a suggestion is the "
        "peak LR",
        chance_what="predict the training class frequencies",
    )


# ----- n2. pinn_poisson_adam_invtime: u'' = f on [-1, 1], a physics-informed tanh MLP, Adam, inverse time
PINN_K = 2.5  # the exact solution sin(PINN_K pi x) + x / 2


def _collocation_data() -> Data:
    """Collocation points of u'' = f on [-1, 1], u(-1) = -1/2 - sin(k pi) and u(1) = 1/2 + sin(k pi), whose
    solution is sin(k pi x) + x / 2 (k 2.5): 1000 uniform training points and 500 held out, each with its
    source f(x) / (k pi)^2 = -sin(k pi x)."""
    rng = np.random.default_rng(241)
    x = rng.uniform(-1.0, 1.0, size=1500).astype(np.float32)
    f = -np.sin(PINN_K * np.pi * x).astype(np.float32)
    x, f = torch.tensor(x[:, None]), torch.tensor(f)
    return x[:1000], f[:1000], x[1000:], f[1000:]


class PINN(nn.Module):
    """A physics-informed network (Raissi et al.): u(x) by a tanh MLP 1-48-48-48-1; the output, per point,
    u''(x) / (k pi)^2 (by autograd, with graph) and the mean squared error of u at the two boundaries, side
    by side (gradients are enabled inside, so that a held-out loss can be computed under ``no_grad``)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(1, 48), nn.Tanh()]
        for _ in range(2):
            layers += [nn.Linear(48, 48), nn.Tanh()]
        self.u = nn.Sequential(*layers, nn.Linear(48, 1))
        edge = 0.5 + math.sin(PINN_K * math.pi)
        self.register_buffer("ends", torch.tensor([[-1.0], [1.0]]))
        self.register_buffer("edge", torch.tensor([-edge, edge]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            u = self.u(x)
            du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
            d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
        boundary = ((self.u(self.ends).squeeze(-1) - self.edge) ** 2).mean()
        return torch.cat([d2u / (PINN_K * math.pi) ** 2, boundary.expand(len(x), 1)], 1)


def _pinn_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean squared residual of u'' / (k pi)^2 = f / (k pi)^2 plus the boundary conditions' MSE."""
    return ((out[:, 0] - y) ** 2).mean() + out[0, 1]


def pinn_poisson_adam_invtime() -> Task:
    data = _collocation_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    edge = 0.5 + math.sin(PINN_K * math.pi)
    return Task(
        "pinn_poisson_adam_invtime",
        data,
        PINN,
        opt,
        _pinn_loss,
        steps=400,
        batch=64,
        chance=float((data[3] ** 2).mean()) + edge**2,
        grid=(-16, -2),
        schedule=InverseTime,
        what=f"u'' = f on [-1, 1] with Dirichlet ends (solution sin({PINN_K:g} pi x) + x / 2), 1000 "
        "collocation points: a PINN (tanh MLP 48-48-48), the residual's MSE (scaled by (k pi)^2) plus the "
        "boundary MSE, Adam, inverse-time decay to LR / 4 (DeepXDE's), batch 64, 400 steps",
        chance_what="u = 0 everywhere (the residual is the source, the boundary error the boundary values)",
    )


# ----- n3. gumbel_dvae_adam_cosine: binarised digits, a discrete VAE (Gumbel-softmax), relaxed ELBO, Adam
DVAE_LATENTS, DVAE_CATS, DVAE_TAU = 8, 8, 1.0


class GumbelVAE(nn.Module):
    """Jang et al.'s categorical VAE: an MLP encoder 64-128 to 8 latents of 8 categories, a Gumbel-softmax
    sample of each (temperature 1, soft), an MLP decoder 128 to the 64 pixels' logits. The output: the
    logits and the KL of the posteriors from the uniform prior (summed, per row), side by side."""

    def __init__(self) -> None:
        super().__init__()
        k = DVAE_LATENTS * DVAE_CATS
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, k))
        self.dec = nn.Sequential(nn.Linear(k, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.enc(x).reshape(len(x), DVAE_LATENTS, DVAE_CATS)
        z = nn.functional.gumbel_softmax(logits, tau=DVAE_TAU, hard=False)
        logq = torch.log_softmax(logits, -1)
        kl = (logq.exp() * (logq + math.log(DVAE_CATS))).sum((1, 2))
        return torch.cat([self.dec(z.reshape(len(x), -1)), kl[:, None]], 1)


def _dvae_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The negative relaxed ELBO per pixel: the binarised pixels' BCE plus the KL / 64."""
    bce = nn.functional.binary_cross_entropy_with_logits(out[:, :-1], x, reduction="none").sum(1)
    return ((bce + out[:, -1]) / 64).mean()


def gumbel_dvae_adam_cosine() -> Task:
    xtr, _, xva, _ = _digits()
    xtr, xva = (xtr > 0.5).float(), (xva > 0.5).float()
    data = (xtr, xtr, xva, xva)

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    p = xtr.mean(0).clamp(1e-3, 1 - 1e-3)
    chance = float(-(xva * torch.log(p) + (1 - xva) * torch.log(1 - p)).mean())
    return Task(
        "gumbel_dvae_adam_cosine",
        data,
        GumbelVAE,
        opt,
        _dvae_loss,
        steps=500,
        batch=64,
        chance=chance,
        grid=(-16, -4),
        schedule=Cosine,
        what=f"binarised digits (pixel > 1/2): a discrete VAE ({DVAE_LATENTS} latents of {DVAE_CATS} "
        f"categories, Gumbel-softmax at temperature {DVAE_TAU:g}, MLP 128 each way), the negative relaxed "
        "ELBO per pixel (BCE + KL to the uniform prior), Adam, cosine decay to 0, batch 64, 500 steps",
        chance_what="predict each pixel's training mean (the prior: KL 0)",
    )


# ----- n4. nbeats_smape_adam_multistep: seasonal series, an N-BEATS forecaster, the sMAPE loss, Adam
NB_BACK, NB_HORIZON = 36, 12


def _seasonal_data() -> Data:
    """Windows of monthly-like series: a level U(2, 20), a trend N(0, 0.05^2) of the level a step, a season of
    period 12 (amplitude U(0, 0.3) of the level, a random phase and shape), multiplicative noise N(0, 0.05^2);
    36 steps in, the next 12 to forecast; 3000 series for training, 1000 held out."""
    rng = np.random.default_rng(251)
    n, t = 4000, np.arange(NB_BACK + NB_HORIZON)
    level = rng.uniform(2.0, 20.0, (n, 1))
    trend = rng.normal(0.0, 0.05, (n, 1)) * t / 12
    ph = rng.uniform(0, 2 * np.pi, (n, 2))
    season = np.sin(2 * np.pi * t / 12 + ph[:, :1]) + 0.5 * np.sin(4 * np.pi * t / 12 + ph[:, 1:])
    s = level * (1 + trend + rng.uniform(0, 0.3, (n, 1)) * season) * (1 + rng.normal(0, 0.05, (n, len(t))))
    s = torch.tensor(np.maximum(s, 0.1).astype(np.float32))
    x, y = s[:, :NB_BACK], s[:, NB_BACK:]
    return x[:3000], y[:3000], x[3000:], y[3000:]


class NBeats(nn.Module):
    """Oreshkin et al.'s N-BEATS (generic): 3 blocks, each an MLP of 4 ReLU layers of 128 to linear backcast
    (36) and forecast (12) heads; each block sees what the previous backcasts left of the input, the forecasts
    are summed. The input is divided by its last 12 steps' mean and the forecast multiplied back."""

    def __init__(self, blocks: int = 3, width: int = 128) -> None:
        super().__init__()

        def block() -> nn.Module:
            layers: list[nn.Module] = [nn.Linear(NB_BACK, width), nn.ReLU()]
            for _ in range(3):
                layers += [nn.Linear(width, width), nn.ReLU()]
            return nn.Sequential(*layers, nn.Linear(width, NB_BACK + NB_HORIZON))

        self.blocks = nn.ModuleList(block() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x[:, -12:].mean(1, keepdim=True)
        residual, forecast = x / scale, 0.0
        for b in self.blocks:
            theta = b(residual)
            residual = residual - theta[:, :NB_BACK]
            forecast = forecast + theta[:, NB_BACK:]
        return forecast * scale


def _smape(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The symmetric mean absolute percentage error (M4's, as a fraction: 0..2)."""
    return (2 * (out - y).abs() / (out.abs() + y.abs() + 1e-8)).mean()


def nbeats_smape_adam_multistep() -> Task:
    data = _seasonal_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    return Task(
        "nbeats_smape_adam_multistep",
        data,
        NBeats,
        opt,
        _smape,
        steps=400,
        batch=128,
        chance=float(_smape(data[1].mean().expand_as(data[3]), data[3])),
        grid=(-16, -4),
        schedule=partial(MultiStep, at=(0.5, 0.75)),
        what=f"seasonal series (level, trend, period-12 season, noise), {NB_BACK} steps in, {NB_HORIZON} "
        "out: N-BEATS generic (3 blocks of 4 x 128, backcast residual stacking, input scaled by its last "
        "year's mean), sMAPE, Adam, LR / 10 at 50 and 75 %, batch 128, 400 steps",
        chance_what="forecast the training mean of every target",
    )


# ----- n5. dcn_ctr_adagrad: synthetic click-through data, a deep & cross network (DCN-V2), BCE, Adagrad
DCN_FIELDS, DCN_VALUES, DCN_DENSE, DCN_EMB = 8, 20, 4, 8


def _ctr_data() -> Data:
    """Clicks on 24000 impressions: 8 categorical fields of 40 values (Zipf-like frequencies), 4 dense
    features N(0, 1); the click's logit -1.5 + a per-value weight N(0, 0.5^2) of each field + the dot products
    of 3-d per-value factors N(0, 0.5^2) of every pair of fields + a linear term and a product of the dense
    features; the fields as integer ids after the dense features (float); 3/4 for training, the rest held
    out."""
    rng = np.random.default_rng(257)
    n = 24000
    freq = 1.0 / np.arange(1, DCN_VALUES + 1) ** 0.8
    cats = np.stack([rng.choice(DCN_VALUES, n, p=freq / freq.sum()) for _ in range(DCN_FIELDS)], 1)
    w = rng.normal(0, 0.7, (DCN_FIELDS, DCN_VALUES))
    v = rng.normal(0, 0.3, (DCN_FIELDS, DCN_VALUES, 3))
    dense = rng.normal(size=(n, DCN_DENSE))
    f = v[np.arange(DCN_FIELDS), cats]  # (n, fields, 3)
    pair = (f.sum(1) ** 2 - (f**2).sum(1)).sum(1) / 2
    logit = (
        -1.5
        + w[np.arange(DCN_FIELDS), cats].sum(1)
        + pair
        + 0.5 * dense[:, 0]
        + 0.5 * dense[:, 1] * dense[:, 2]
    )
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    x = torch.tensor(np.concatenate([dense, cats], 1).astype(np.float32))
    cut = 3 * n // 4
    return x[:cut], torch.tensor(y[:cut]), x[cut:], torch.tensor(y[cut:])


class DCN(nn.Module):
    """Wang et al.'s DCN-V2 (parallel): the fields' embeddings (8 each) and the dense features as x0 (68), 3
    full-rank cross layers x0 * (W x + b) + x, beside an MLP 128-64 (ReLU), both concatenated into a logit."""

    def __init__(self) -> None:
        super().__init__()
        d = DCN_FIELDS * DCN_EMB + DCN_DENSE
        self.emb = nn.Embedding(DCN_FIELDS * DCN_VALUES, DCN_EMB)
        self.register_buffer("offset", torch.arange(DCN_FIELDS) * DCN_VALUES)
        self.cross = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.deep = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.out = nn.Linear(d + 64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x[:, DCN_DENSE:].long() + self.offset
        x0 = torch.cat([x[:, :DCN_DENSE], self.emb(ids).flatten(1)], 1)
        xl = x0
        for layer in self.cross:
            xl = x0 * layer(xl) + xl
        return self.out(torch.cat([xl, self.deep(x0)], 1)).squeeze(-1)


def dcn_ctr_adagrad() -> Task:
    data = _ctr_data()

    def opt(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(p, lr=lr, initial_accumulator_value=0.1)

    return Task(
        "dcn_ctr_adagrad",
        data,
        DCN,
        opt,
        _bce,
        steps=500,
        batch=256,
        chance=_label_prior_chance(data),
        grid=(-12, 2),
        what=f"clicks on impressions ({DCN_FIELDS} categorical fields of {DCN_VALUES} values, {DCN_DENSE} "
        "dense features, pairwise field interactions): DCN-V2 (embeddings of 8, 3 cross layers beside an MLP "
        "128-64), BCE, Adagrad (initial accumulator 0.1, TensorFlow's), constant LR, batch 256, 500 steps",
        chance_what="predict the training click rate",
    )


HELD_OUT_13 = {
    "perceiver_digits_adamw_wsd": perceiver_digits_adamw_wsd,
    "pinn_poisson_adam_invtime": pinn_poisson_adam_invtime,
    "gumbel_dvae_adam_cosine": gumbel_dvae_adam_cosine,
    "nbeats_smape_adam_multistep": nbeats_smape_adam_multistep,
    "dcn_ctr_adagrad": dcn_ctr_adagrad,
}


# ----- f. the easy tasks of benchmarks/lr_finder.py
def easy_tasks() -> list[Task]:
    from lr_finder import BATCH, tasks  # imported here: only these two tasks need that script

    grids = {"cnn_bn": (-16, 4), "logreg": (-16, 8)}  # plain SGD on logreg is still learning at 10
    out = []
    for t in tasks():
        if t.name not in ("cnn_bn", "logreg"):
            continue
        per_epoch = math.ceil(len(t.data[0]) / BATCH)
        out.append(
            Task(
                t.name,
                t.data,
                t.make_model,
                t.make_opt,
                t.loss_fn,
                steps=t.epochs * per_epoch,
                batch=BATCH,
                chance=_prior_chance(t.data, 10),
                grid=grids[t.name],
                what=f"benchmarks/lr_finder.py's {t.name}, batch {BATCH}, {t.epochs} epochs",
                chance_what="predict the training class frequencies",
            )
        )
    return out


HARD = {
    "linreg_sgd": linreg_sgd,
    "regression_noisy_40": regression_noisy_40,
    "mlp_adam_b4": mlp_adam_b4,
    "lm_warmup_cosine": lm_warmup_cosine,
    "deep_tanh": deep_tanh,
    "gru_lm_sgd_clip": gru_lm_sgd_clip,
    "vit_onecycle": vit_onecycle,
    "linreg_unscaled_sgd": linreg_unscaled_sgd,
    "mlp_adam_b4_cls": mlp_adam_b4_cls,
}
EASY = ("cnn_bn", "logreg")
TASK_NAMES = (*HARD, *EASY)
SETS = {
    "main": TASK_NAMES,
    "heldout": tuple(HELD_OUT),
    "heldout2": tuple(HELD_OUT_2),
    "heldout3": tuple(HELD_OUT_3),
    "heldout4": tuple(HELD_OUT_4),
    "heldout5": tuple(HELD_OUT_5),
    "heldout6": tuple(HELD_OUT_6),
    "heldout7": tuple(HELD_OUT_7),
    "heldout8": tuple(HELD_OUT_8),
    "heldout9": tuple(HELD_OUT_9),
    "heldout10": tuple(HELD_OUT_10),
    "heldout11": tuple(HELD_OUT_11),
    "heldout12": tuple(HELD_OUT_12),
    "heldout13": tuple(HELD_OUT_13),
    "all": (
        *TASK_NAMES,
        *HELD_OUT,
        *HELD_OUT_2,
        *HELD_OUT_3,
        *HELD_OUT_4,
        *HELD_OUT_5,
        *HELD_OUT_6,
        *HELD_OUT_7,
        *HELD_OUT_8,
        *HELD_OUT_9,
        *HELD_OUT_10,
        *HELD_OUT_11,
        *HELD_OUT_12,
    ),
}


def build_tasks(names: list[str]) -> list[Task]:
    builders = {
        **HARD,
        **HELD_OUT,
        **HELD_OUT_2,
        **HELD_OUT_3,
        **HELD_OUT_4,
        **HELD_OUT_5,
        **HELD_OUT_6,
        **HELD_OUT_7,
        **HELD_OUT_8,
        **HELD_OUT_9,
        **HELD_OUT_10,
        **HELD_OUT_11,
        **HELD_OUT_12,
        **HELD_OUT_13,
    }
    out = [builders[n]() for n in names if n in builders]
    if any(n in EASY for n in names):
        out += [t for t in easy_tasks() if t.name in names]
    return sorted(out, key=lambda t: names.index(t.name))


def fingerprint(task: Task) -> str:
    """What a cached training depends on: data, model, optimizer, schedule, budget, batch, torch."""
    h = hashlib.sha256()
    for t in task.data:
        h.update(t.numpy().tobytes())
    torch.manual_seed(0)
    model = task.make_model()
    sched = task.schedule(task.steps) if task.schedule is not None else None
    extra = []  # only when set, so the older tasks keep their cached trainings
    if task.clip is not None:
        extra.append(f"clip={task.clip}")
    if task.one_cycle:
        extra.append("OneCycleLR")
    h.update(
        "|".join(
            [
                repr(model),
                repr(task.make_opt(model.parameters(), 0.1)),
                repr(sched),
                str(task.steps),
                str(task.batch),
                torch.__version__,
                *extra,
            ]
        ).encode()
    )
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- training
def loader(task: Task, seed: int) -> torch.utils.data.DataLoader:
    xtr, ytr, _, _ = task.data
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xtr, ytr), batch_size=task.batch, shuffle=True, generator=g
    )


def train(task: Task, lr: float, seed: int) -> float:
    """Held-out loss after ``task.steps`` optimizer steps at ``lr`` (the peak LR under a schedule); inf
    when the training loss became non-finite."""
    torch.manual_seed(seed)
    model = task.make_model()
    opt = task.make_opt(model.parameters(), lr)
    sched = make_scheduler(task, opt)
    data = loader(task, seed)
    model.train()
    step = 0
    while step < task.steps:
        for x, y in data:
            loss = task.loss_fn(model(x), y)
            if not torch.isfinite(loss):
                return math.inf
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if task.clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            opt.step()
            if sched is not None:
                sched.step()
            step += 1
            if step == task.steps:
                break
    model.eval()
    with torch.no_grad():
        _, _, xva, yva = task.data
        val = float(task.loss_fn(model(xva), yva))
    return val if math.isfinite(val) else math.inf


def make_scheduler(task: Task, opt: torch.optim.Optimizer) -> Any:
    """The task's per-step scheduler (``None``: a constant LR): ``LambdaLR`` of ``task.schedule``, or
    ``OneCycleLR`` peaking at the optimizer's LR."""
    if task.one_cycle:
        lr = opt.param_groups[0]["lr"]
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=task.steps)
    if task.schedule is not None:
        return torch.optim.lr_scheduler.LambdaLR(opt, task.schedule(task.steps))
    return None


class Module(pl.LightningModule):
    """The task as a user's LightningModule: same model, optimizer and (per-step) schedule as ``train``."""

    def __init__(self, task: Task, lr: float = 1e-3) -> None:
        super().__init__()
        self.task = task
        self.lr = lr
        self.model = task.make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.task.loss_fn(self.model(x), y)

    def configure_optimizers(self) -> Any:
        opt = self.task.make_opt(self.parameters(), self.lr)
        sched = make_scheduler(self.task, opt)
        if sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ---------------------------------------------------------------------------------------------- cache
def _merge_into(mine: dict[str, Any], other: dict[str, Any]) -> None:
    """Add to ``mine`` what only ``other`` holds, at every depth (``mine`` wins where both hold a value)."""
    for key, value in other.items():
        if isinstance(mine.get(key), dict) and isinstance(value, dict):
            _merge_into(mine[key], value)
        else:
            mine.setdefault(key, value)


class Cache:
    """Held-out losses by task fingerprint, LR and seed, and the third-party finders' results, in JSON."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"runs": {}, "finders": {}}
        if path and os.path.exists(path):
            with open(path) as fh:
                self.data = json.load(fh)
        self.hits = 0
        self.trained = 0

    def save(self) -> None:
        """Write the cache, merged with what other runs saved to the same file meanwhile (under a lock, from a
        file of this process's own: two runs sharing one temporary name once crashed one of them)."""
        if not self.path:
            return
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(self.path):
                with open(self.path) as fh:
                    on_disk = json.load(fh)
                _merge_into(self.data, on_disk)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(self.data, fh)
            os.replace(tmp, self.path)

    def loss(self, task: Task, key: str, lr: float, seed: int) -> float:
        runs = self.data["runs"].setdefault(f"{task.name}|{key}", {}).setdefault(repr(float(lr)), {})
        if str(seed) in runs:
            self.hits += 1
            return float(runs[str(seed)])
        value = train(task, lr, seed)
        self.trained += 1
        runs[str(seed)] = value
        return value

    def finder(self, key: str, seed: int) -> dict[str, Any] | None:
        return self.data["finders"].get(key, {}).get(str(seed))

    def put_finder(self, key: str, seed: int, record: dict[str, Any]) -> None:
        self.data["finders"].setdefault(key, {})[str(seed)] = record


# ---------------------------------------------------------------------------------------------- finders
def _quiet() -> Any:
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    return stack


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return repr(value)


def _clip(task: Task) -> dict[str, Any]:
    """The Trainer's clipping setting of a task (none when it does not clip)."""
    return {} if task.clip is None else {"gradient_clip_val": task.clip}


def run_ours(task: Task, seed: int, search: bool = True) -> dict[str, Any]:
    """``lr_find`` at its defaults (``search=False``: ``search_steps=0``, the range test alone)."""
    torch.manual_seed(seed)
    module = Module(task)
    extra: dict[str, Any] = {} if task.num_training == 100 else {"num_training": task.num_training}
    if not search:
        extra["search_steps"] = 0
    elif SEARCH_STEPS is not None:
        extra["search_steps"] = SEARCH_STEPS
    if search and SEARCH_RETRIES is not None:
        extra["search_retries"] = SEARCH_RETRIES
    started = time.perf_counter()
    # a temporary root dir only so that the refusal alerts' JSONL does not land in the working directory
    with tempfile.TemporaryDirectory(prefix="lr-hard-") as root, _quiet():
        result = lr_find(
            module,
            loader(task, seed),
            trainer_kwargs=dict(accelerator="cpu", default_root_dir=root, **_clip(task)),
            progress=False,
            **extra,
        )
    seconds = time.perf_counter() - started
    assert result is not None
    search_result = result.search
    return {
        "sweep_suggestion": result.sweep_suggestion,
        "search": _jsonable(search_result),
        "search_seconds": search_result.seconds if search_result is not None else 0.0,
        "search_steps": search_result.steps if search_result is not None else 0,
        "extended_to": result.extended_to,
        "suggestion": result.suggestion,
        "reason": result.reason,
        "stop_reason": result.stop_reason,
        "rule": _jsonable(getattr(result, "rule", None)),
        "method": result.method,
        "suggestions": _jsonable(dict(result.suggestions)),
        "descent": _jsonable(result.descent),
        "lrs": list(result.lrs),
        "losses": list(result.losses),
        "smoothed": list(result.smoothed),
        "curve": list(result.curve),
        "seconds": seconds,
    }


def run_lightning(task: Task, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    module = Module(task)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lr-hard-") as root, _quiet():
        trainer = pl.Trainer(  # its sweep ends with the epochs: allow enough of them for num_training
            accelerator="cpu",
            devices=1,
            max_epochs=1000,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            **_clip(task),
        )
        finder = Tuner(trainer).lr_find(
            module, train_dataloaders=loader(task, seed), num_training=task.num_training, update_attr=False
        )
        suggestion = finder.suggestion() if finder is not None else None
    seconds = time.perf_counter() - started
    results = finder.results if finder is not None else {"lr": [], "loss": []}
    return {
        "suggestion": suggestion,
        "lrs": [float(v) for v in results["lr"]],
        "losses": [float(v) for v in results["loss"]],  # Lightning's smoothed (EMA) losses
        "seconds": seconds,
    }


def run_torch_lr_finder(task: Task, seed: int) -> dict[str, Any]:
    import matplotlib.pyplot as plt
    from torch_lr_finder import LRFinder

    torch.manual_seed(seed)
    model = task.make_model()
    # the user builds the optimizer without its scheduler for the range test (the package refuses one)
    opt = task.make_opt(model.parameters(), 1e-7)
    finder = LRFinder(model, opt, task.loss_fn)
    started = time.perf_counter()
    with _quiet():
        finder.range_test(loader(task, seed), start_lr=1e-7, end_lr=10, num_iter=task.num_training)
        fig, ax = plt.subplots()
        try:
            _, suggestion = finder.plot(ax=ax, suggest_lr=True)
        except RuntimeError:  # too few points before it stopped: no suggestion
            suggestion = None
        plt.close(fig)
    finder.reset()
    seconds = time.perf_counter() - started
    return {
        "suggestion": None if suggestion is None else float(suggestion),
        "lrs": [float(v) for v in finder.history["lr"]],
        "losses": [float(v) for v in finder.history["loss"]],  # its smoothed losses
        "seconds": seconds,
    }


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "missing"


# the leading points the third-party suggestion rules skip (Lightning's skip_begin, torch-lr-finder's
# skip_start): their smoothed curves' first points are not what the rules look at
SKIP_START = {"lightning": 10, "torch_lr_finder": 10}

RUNNERS: dict[str, Callable[[Task, int], dict[str, Any]]] = {
    "ours": run_ours,
    "ours_sweep": lambda task, seed: run_ours(task, seed, search=False),
    "lightning": run_lightning,
    "torch_lr_finder": run_torch_lr_finder,
}


def finder_key(finder: str, task: Task, fp: str) -> str | None:
    """The cache key of a third-party finder's result (``None`` for ours: never cached)."""
    if finder == "lightning":
        return f"lightning|{lightning.__version__}|{task.name}|{task.num_training}|{fp}"
    if finder == "torch_lr_finder":
        return f"torch_lr_finder|{_version('torch-lr-finder')}|{task.name}|{task.num_training}|{fp}"
    return None


# ---------------------------------------------------------------------------------------------- stats
def geomean(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    return float(np.exp(np.mean(np.log(got)))) if got else None


def curve_stats(losses: list[float]) -> dict[str, float]:
    """A sweep's start (median of its first tenth, at least 3 points: robust to a first point that an
    EMA's start distorts), lowest and last finite loss, and the fall from the start to the lowest."""
    finite = [v for v in losses if math.isfinite(v)]
    if not finite:
        return {"points": len(losses)}
    start, low = float(np.median(finite[: max(3, len(finite) // 10)])), min(finite)
    return {
        "points": len(losses),
        "first": start,
        "min": low,
        "last": finite[-1],
        "fall": (start - low) / abs(start) if start else 0.0,
    }


# ---------------------------------------------------------------------------------------------- the run
def grid_loss_at(lrs: list[float], means: list[float], lr: float, chance: float) -> float | None:
    """The grid's mean loss over its seeds at ``lr`` (linear in log-LR between the two grid points around
    it; a non-finite or worse-than-chance mean counts as chance): what training at ``lr`` gives on average,
    without the chaos of the one seed a finder's suggestion is trained with. ``None`` outside the grid."""
    if not (lrs[0] <= lr <= lrs[-1]) or not math.isfinite(lr):
        return None
    capped = [min(m, chance) if math.isfinite(m) else chance for m in means]
    return float(np.interp(math.log(lr), [math.log(v) for v in lrs], capped))


def grid_keys(task: Task, quick: bool) -> list[int]:
    step = 2 if quick else 1
    lo, hi = task.grid
    return list(range(lo, hi + 1, step))


def grid_lr(key: int) -> float:
    return float(10.0 ** (key / PER_DECADE))


def run_task(
    task: Task,
    seeds: list[int],
    finders: list[str],
    cache: Cache,
    quick: bool,
    rerun_baselines: bool,
    finder_seeds: list[int] | None = None,
) -> dict[str, Any]:
    """The grid on ``seeds``; each finder on ``finder_seeds`` (default: ``seeds``), each scored against
    the grid's best mean."""
    t0 = time.perf_counter()
    fp = fingerprint(task)
    grid: dict[str, list[float]] = {}
    for key in grid_keys(task, quick):
        lr = grid_lr(key)
        grid[f"{lr:.4g}"] = [cache.loss(task, fp, lr, s) for s in seeds]
        cache.save()
    lrs = [grid_lr(k) for k in grid_keys(task, quick)]
    means = [float(np.mean(v)) for v in grid.values()]
    best = int(np.argmin(means))
    t_grid = time.perf_counter() - t0
    row: dict[str, Any] = {
        "task": task.name,
        "what": task.what,
        "fingerprint": fp,
        "steps": task.steps,
        "batch": task.batch,
        "num_training": task.num_training,
        "scheduled": task.schedule is not None,
        "chance": task.chance,
        "chance_what": task.chance_what,
        "grid": grid,
        "best_lr": lrs[best],
        "best": means[best],
        "best_seed_sd": float(np.std(list(grid.values())[best], ddof=1)) if len(seeds) > 1 else 0.0,
        "seconds_grid": t_grid,
        "finders": {},
    }
    for name in finders:
        t1 = time.perf_counter()
        key = finder_key(name, task, fp)
        sweeps = []
        for s in finder_seeds or seeds:
            record = cache.finder(key, s) if key is not None and not rerun_baselines else None
            if record is None:
                record = RUNNERS[name](task, s)
                if key is not None:
                    cache.put_finder(key, s, record)
            sweeps.append(record)
        t_sweeps = time.perf_counter() - t1
        suggestions = [r["suggestion"] for r in sweeps]
        raw = [
            cache.loss(task, fp, lr, s) if lr is not None and math.isfinite(lr) and lr > 0 else None
            for lr, s in zip(suggestions, finder_seeds or seeds, strict=True)
        ]
        cache.save()
        # a training no better than chance (a blow-up, finite or not) scores as a refusal does
        scored = [min(v, task.chance) if v is not None and math.isfinite(v) else task.chance for v in raw]
        uncapped = [v if v is not None and math.isfinite(v) else task.chance for v in raw]
        expected = [
            grid_loss_at(lrs, means, lr, task.chance) if lr is not None and lr > 0 else None
            for lr in suggestions
        ]
        # a refusal, or a suggestion outside the grid: the training at it (a refusal scores chance)
        expected = [v if e is None else e for e, v in zip(expected, scored, strict=True)]
        row["finders"][name] = {
            "suggestions": suggestions,
            "expected": expected,
            "ratio_expected": float(np.mean(expected)) / means[best],
            "geomean": geomean(suggestions),
            "refusals": sum(v is None for v in suggestions),
            "losses": raw,
            "scored": scored,
            "ratio": float(np.mean(scored)) / means[best],
            "ratio_uncapped": float(np.mean(uncapped)) / means[best],
            "seconds_sweeps": t_sweeps,
            "seconds": time.perf_counter() - t1,
            "sweeps": sweeps,
            "stats": [curve_stats(r["losses"][SKIP_START.get(name, 0) :]) for r in sweeps],
        }
    row["seconds"] = time.perf_counter() - t0
    return row


def run_real(entries: tuple[str, ...] = ("mobilenet_v2", "vit")) -> list[dict[str, Any]]:
    """Whether ours suggests anything on real_models.py's entries with their recipes (not scored)."""
    import real_models as rm

    out = []
    for name in entries:
        entry = next(e for e in rm.ENTRIES if e.name == name)
        module, data = rm.build(entry, entry.steps)
        kwargs: dict[str, Any] = dict(accelerator="cpu")
        if entry.recipe.clip is not None:
            kwargs["gradient_clip_val"] = entry.recipe.clip
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="lr-hard-") as root, _quiet():
            result = lr_find(
                module, data, trainer_kwargs={**kwargs, "default_root_dir": root}, progress=False
            )
        assert result is not None
        out.append(
            {
                "entry": name,
                "recipe": entry.recipe.describe(),
                "recipe_lr": entry.recipe.lr,
                "suggestion": result.suggestion,
                "reason": result.reason,
                "stop_reason": result.stop_reason,
                "rule": _jsonable(getattr(result, "rule", None)),
                "suggestions": _jsonable(dict(result.suggestions)),
                "stats": curve_stats(list(result.losses)),
                "lrs": list(result.lrs),
                "losses": list(result.losses),
                "seconds": time.perf_counter() - started,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- report
def _lr(v: float | None) -> str:
    return "none" if v is None else f"{v:.2g}"


def search_cost(rows: list[dict[str, Any]]) -> None:
    """What the search after the sweep cost (mean over the seeds), and what it chose against the sweep."""
    print("\n## The search after the sweep (ours; mean over the seeds)\n")
    print(
        "| task | sweep suggestion | search chose | search steps | retried | search s "
        "| lr_find s (with search) | extended to |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        sweeps = r["finders"]["ours"]["sweeps"]
        steps = np.mean([sw.get("search_steps", 0) for sw in sweeps])
        retries = [(sw.get("search") or {}).get("retries") or 0 for sw in sweeps]
        retried = ", ".join(str(n) for n in retries) if any(retries) else "-"
        secs = np.mean([sw.get("search_seconds", 0.0) for sw in sweeps])
        total = np.mean([sw["seconds"] for sw in sweeps])
        before = geomean([sw.get("sweep_suggestion") for sw in sweeps])
        extended = [sw.get("extended_to") for sw in sweeps]
        ext = ", ".join(_lr(v) for v in extended) if any(v is not None for v in extended) else "-"
        print(
            f"| {r['task']} | {_lr(before)} | {_lr(r['finders']['ours']['geomean'])} | {steps:.0f} | "
            f"{retried} | {secs:.1f} | {total:.1f} | {ext} |"
        )


def report(rows: list[dict[str, Any]], finders: list[str], real: list[dict[str, Any]], info: str) -> None:
    print(f"# LR finders on hard tasks\n\n{info}\n")
    print("| task | chance | grid best LR | best loss (sd) | " + " | ".join(finders) + " |")
    print("|---" * (4 + len(finders)) + "|")
    for r in rows:
        cells = []
        for f in finders:
            d = r["finders"][f]
            ref = f", {d['refusals']} refused" if d["refusals"] else ""
            cells.append(f"{_lr(d['geomean'])}: **{d['ratio']:.2f}**{ref}")
        print(
            f"| {r['task']} | {r['chance']:.3f} | {r['best_lr']:.2g} | {r['best']:.3f} "
            f"({r['best_seed_sd']:.3f}) | " + " | ".join(cells) + " |"
        )
    print(
        "\nCells: geometric-mean suggestion over the seeds: **ratio** of the mean held-out loss at the "
        "suggestions to the grid best. A refusal, and a training that ends no better than chance (a blow-up, "
        "non-finite or not), score the chance loss. The summary also scores each suggestion by the grid's "
        "mean loss there (interpolated in log-LR, over the grid's seeds): the same question without the "
        "chaos of the one seed a suggestion is trained with.\n"
    )
    for f in finders:
        ratios = [r["finders"][f]["ratio"] for r in rows]
        within = sum(v <= 1.10 for v in ratios)
        refusals = sum(r["finders"][f]["refusals"] for r in rows)
        uncapped = np.mean([r["finders"][f]["ratio_uncapped"] for r in rows])
        expected = [r["finders"][f]["ratio_expected"] for r in rows]
        print(
            f"- {f}: mean ratio {np.mean(ratios):.3f}, worst {max(ratios):.2f}, within 10 % on "
            f"{within}/{len(rows)} tasks, {refusals} refusals (uncapped mean ratio {uncapped:.3f}); at the "
            f"grid's mean loss at the suggestions: {np.mean(expected):.3f}, within 10 % on "
            f"{sum(v <= 1.10 for v in expected)}/{len(rows)}"
        )
    if "ours" in finders:
        search_cost(rows)
    print("\n## Tasks\n")
    for r in rows:
        print(f"- {r['task']}: {r['what']}; chance {r['chance']:.3f} ({r['chance_what']})")
    print("\n## Our sweeps (per seed)\n")
    print("| task | seed | suggestion | stop | points | start | min | last | fall | rule | reason |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["finders"].get("ours")
        if d is None:
            continue
        for s, (sw, st) in enumerate(zip(d["sweeps"], d["stats"], strict=True)):
            vals = " | ".join(f"{st[k]:.3g}" if k in st else "-" for k in ("first", "min", "last"))
            fall = f"{100 * st['fall']:.0f}%" if "fall" in st else "-"
            rule = "" if sw.get("rule") is None else str(sw["rule"])[:40]
            print(
                f"| {r['task']} | {s} | {_lr(sw['suggestion'])} | {sw['stop_reason']} | {st['points']} "
                f"| {vals} | {fall} | {rule} | {sw['reason']} |"
            )
    print(
        "\n## Sweep curves of the other finders (points; fall of their smoothed loss to its minimum, "
        "after the 10 leading points their rules skip)\n"
    )
    others = [f for f in finders if f != "ours"]
    if others:
        print("| task | " + " | ".join(others) + " |")
        print("|---" * (1 + len(others)) + "|")
        for r in rows:
            cells = []
            for f in others:
                sts = r["finders"][f]["stats"]
                cells.append(
                    ", ".join(
                        f"{st['points']} pts {100 * st['fall']:.0f}%"
                        if "fall" in st
                        else f"{st['points']} pts"
                        for st in sts
                    )
                )
            print(f"| {r['task']} | " + " | ".join(cells) + " |")
    print("\n## Grids (mean held-out loss over the seeds per LR; inf: a seed's loss became non-finite)\n")
    for r in rows:
        cells = ", ".join(f"{lr}: {np.mean(v):.3g}" for lr, v in r["grid"].items())
        print(f"- {r['task']}: {cells}")
    if real:
        print("\n## Ours on real_models.py entries (not scored)\n")
        print("| entry | recipe | suggestion | stop | points | fall | reason |")
        print("|---|---|---|---|---|---|---|")
        for e in real:
            st = e["stats"]
            fall = f"{100 * st['fall']:.0f}%" if "fall" in st else "-"
            print(
                f"| {e['entry']} | {e['recipe']} | {_lr(e['suggestion'])} | {e['stop_reason']} "
                f"| {st['points']} | {fall} | {e['reason']} |"
            )
    print("\n## Wall time\n")
    print("| task | grid | " + " | ".join(f"{f} (sweeps / all)" for f in finders) + " | total |")
    print("|---" * (3 + len(finders)) + "|")
    for r in rows:
        cells = [
            f"{r['finders'][f]['seconds_sweeps']:.0f}s / {r['finders'][f]['seconds']:.0f}s" for f in finders
        ]
        print(
            f"| {r['task']} | {r['seconds_grid']:.0f}s | " + " | ".join(cells) + f" | {r['seconds']:.0f}s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set", default="main", choices=tuple(SETS), help="the 11 tasks (main), a held-out set, or all"
    )
    parser.add_argument("--tasks", default="", help="comma-separated task names (any set's)")
    parser.add_argument("--finders", default=",".join(FINDERS), help="comma-separated subset of the finders")
    parser.add_argument("--quick", action="store_true", help="2 grid points per decade, 2 seeds")
    parser.add_argument(
        "--out",
        default=os.path.join(HERE, "results", "lr_hard.json"),
        help="JSON with every number and curve",
    )
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="JSON cache of the trainings")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    parser.add_argument(
        "--rerun-baselines", action="store_true", help="rerun Lightning's and torch-lr-finder's sweeps"
    )
    parser.add_argument("--real", action="store_true", help="also ours on real_models.py's mobilenet_v2, vit")
    parser.add_argument("--search-steps", type=int, default=None, help="ours' search_steps (default 300)")
    parser.add_argument("--search-retries", type=int, default=None, help="ours' search_retries (default 2)")
    parser.add_argument(
        "--finder-seeds",
        type=int,
        default=None,
        help="run each finder on this many seeds (default: the grid's 3); the grid keeps its seeds",
    )
    args = parser.parse_args()
    global SEARCH_STEPS, SEARCH_RETRIES
    SEARCH_STEPS, SEARCH_RETRIES = args.search_steps, args.search_retries
    torch.set_num_threads(1)
    started = time.perf_counter()
    names = [n for n in args.tasks.split(",") if n] or list(SETS[args.set])
    known = dict.fromkeys(n for names_ in SETS.values() for n in names_)
    unknown = [n for n in names if n not in known]
    finders = [f for f in args.finders.split(",") if f]
    if unknown or any(f not in FINDERS for f in finders):
        parser.error(f"tasks are {', '.join(known)}; finders are {', '.join(FINDERS)}")
    seeds = list(SEEDS[:2] if args.quick else SEEDS)
    cache = Cache(None if args.no_cache else args.cache)
    rows = []
    for task in build_tasks(names):
        finder_seeds = list(range(args.finder_seeds)) if args.finder_seeds else None
        rows.append(run_task(task, seeds, finders, cache, args.quick, args.rerun_baselines, finder_seeds))
        r = rows[-1]
        summary = ", ".join(f"{f} {r['finders'][f]['ratio']:.2f}" for f in finders)
        print(
            f"# {task.name}: best {r['best']:.3f} at {r['best_lr']:.2g}; {summary} ({r['seconds']:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    real = run_real() if args.real else []
    wall = time.perf_counter() - started
    per = 2 if args.quick else PER_DECADE
    info = (
        f"{len(seeds)} seeds (finders: {args.finder_seeds or len(seeds)}); grid {per} points per decade; "
        f"one thread; wall {wall / 60:.1f} min "
        f"({cache.trained} trainings run, {cache.hits} read from the cache); "
        f"lightning {lightning.__version__}, torch-lr-finder {_version('torch-lr-finder')}, "
        f"torch {torch.__version__}"
    )
    report(rows, finders, real, info)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(
            {"info": info, "wall_s": wall, "environment": environment(1), "tasks": rows, "real": real},
            fh,
            indent=1,
        )


if __name__ == "__main__":
    main()
