"""Stalled learning: runs that neither crash nor go NaN but stop learning, and their healthy twins.

The public benchmark for a stalled-learning detector (issue 16). Every scenario is a real
``Trainer.fit`` of a 64-128-64-10 ReLU MLP on scikit-learn's digits (1797 8x8 images bundled with
scikit-learn, standardized; a fixed stratified split of 1347 training and 450 validation images), on
the CPU, a few hundred optimizer steps, a few seconds a run.

Faults (``kind="fault"``; ``onset`` is the optimizer step from which the fault acts, ``cause`` the label
a detector's alert should name), numbered as in the issue:

1. ``steplr_interval_step`` (``lr_decayed``): ``StepLR(step_size=3, gamma=0.1)`` meant per epoch but
   configured with ``"interval": "step"``: the LR is 1e-6 of its base after 20 steps.
2. ``targets_off_by_one`` (``chance_level``): a data pipeline hands each batch the targets of the batch
   before it (a one-batch buffer in the collate function); any single batch can still be overfit.
3. ``sorted_by_class`` (``sorted_labels``): the training loader is sorted by class and not shuffled:
   every batch holds one class (two at a boundary), the net forgets each class for the next.
4. ``lr_jump_100x`` (``lr_jump``): a schedule bug multiplies Adam's LR by 100 at step 150
   (``onset=150``): the ReLUs die and the loss goes back to chance, without a NaN.
5. ``zero_grad_before_step`` (``no_update``): manual optimization calling ``opt.zero_grad()`` between
   ``manual_backward`` and ``opt.step()``: the gradients are ``None`` at the step, no weight ever moves.
6. ``warmup_in_samples`` (``warmup_never_ends``): a linear warm-up of 100 steps given as its number of
   samples (100 x 256 = 25600) to a ``LambdaLR`` that counts steps: the LR never exceeds 1.2 % of base.
7. ``clip_tiny`` (``clipped_updates``): a custom ``configure_gradient_clipping`` clips the gradient norm
   to 1e-3 (plain SGD): every update is 1e-3/||g|| of the raw gradient step, hundreds of times smaller;
   ``Trainer(gradient_clip_val)`` is unset, so nothing that reads it sees the clipping.

Each fault has a fixed twin (``twin``): the same run, seed and data without the bug. Together with
healthy runs that a naive rule would flag (the LR decayed to ~0 by a cosine, warm restarts, one-cycle,
early convergence to a tiny training loss, a frozen backbone, batch-4 SGD, AdamW with a proper
warm-up), the twins are ``kind="healthy"``: any alert on them is a false alarm.

Usage::

    python benchmarks/stall_zoo.py --twins    # the labels' proof: bug vs twin, 3 seeds (make bench-stall-zoo)
    python benchmarks/stall_zoo.py --detect lightning_gradguard:VanishingExplodingDetector
    python benchmarks/stall_zoo.py --detect some.module:Class --kwargs '{"action": "warn"}' --seeds 1

Plugging in the detector: ``--detect "module.path:ClassName"`` imports the class, builds it with
``--kwargs`` (JSON, default ``{}``: its defaults) and adds it, fresh, to every run of every scenario.
Whatever it appends to its ``alerts`` list (objects with ``kind``, ``step`` and ``message``, like
:class:`lightning_gradguard.Alert`) is scored: on a fault, the first alert at or after ``onset`` is the
detection (delay = its step - onset) and alerts before ``onset`` are false alarms; on a healthy run
every alert is a false alarm. An alert "names the cause" when the scenario's ``cause`` appears in its
kind, message or ``data`` keys. If the callback raises (``action="raise"``), the run ends there and the
exception is recorded. From Python: ``run(SCENARIOS["clip_tiny"], callbacks=[MyDetector()], seed=0)``.

What a detector can read: the loss as ``self.log("train_loss")`` every step (``trainer.callback_metrics``)
and as the return of ``training_step`` (``outputs["loss"]`` in ``on_train_batch_end`` under automatic
optimization, the tensor itself under manual); the batch is ``(x, y)`` with the targets as training
uses them; the LR in ``trainer.optimizers[0].param_groups``; schedulers in
``trainer.lr_scheduler_configs``. The benchmark itself reads the loss from the module and the LR at
``on_train_batch_start`` (the LR the step will use); results go to ``benchmarks/results/`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import digits_mlp
from common import environment as common_environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CHANCE_LOSS = math.log(10)  # cross-entropy of a uniform guess over the 10 digits
Batch = tuple[Tensor, Tensor]
Schedule = Callable[[torch.optim.Optimizer, int], Any]


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Digits:
    """The standardized digits, split once: 1347 training and 450 validation images."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor


@lru_cache(maxsize=1)
def digits() -> Digits:
    d = load_digits()
    x = d.data.astype(np.float32)
    xtr, xva, ytr, yva = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    mean, std = xtr.mean(0), xtr.std(0)
    std[std == 0] = 1.0  # pixels that are 0 in every training image stay 0
    return Digits(
        torch.tensor((xtr - mean) / std),
        torch.tensor(ytr, dtype=torch.long),
        torch.tensor((xva - mean) / std),
        torch.tensor(yva, dtype=torch.long),
    )


class PreviousBatchTargets:
    """A collate function with an off-by-one: each batch gets the targets of the batch before it.

    The very first batch keeps its own targets (there is no previous one); the buffer carries over the
    epoch boundary. Every batch must have the same size (the loaders use ``drop_last=True``).
    """

    def __init__(self) -> None:
        self.previous: Tensor | None = None

    def __call__(self, samples: list[tuple[Tensor, Tensor]]) -> Batch:
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        targets = y if self.previous is None else self.previous
        self.previous = y
        return x, targets


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """One training set-up. Steps are ``trainer.global_step`` of the optimizer step (0-based).

    Attributes:
        name: the key in :data:`SCENARIOS`.
        kind: ``"fault"`` (learning stops or stalls) or ``"healthy"`` (every alert is a false alarm).
        what: the set-up, and for a fault what it breaks, in words.
        onset: the first optimizer step at which the fault acts (0: from the start); 0 for healthy runs.
        cause: the label the detector's alert should name (``None`` for healthy runs).
        issue: the fault's number in issue 16.
        twin: a fault's fixed twin (the same run without the bug); a twin's ``twin`` names its fault.
        steps: optimizer steps of a run.
        optimizer, lr, momentum: ``"sgd"``, ``"adam"`` or ``"adamw"``, its base LR, SGD's momentum.
        weight_decay: AdamW's (decoupled) weight decay.
        batch: the batch size (every loader drops the last, incomplete batch).
        schedule, interval: an LR scheduler built from (optimizer, steps) and Lightning's interval.
        order: ``"shuffle"`` or ``"sorted"`` (by class, not shuffled).
        targets: ``"aligned"`` or ``"previous_batch"``.
        manual: ``None`` (automatic optimization) or where manual optimization calls ``zero_grad``.
        clip_norm: the norm a custom ``configure_gradient_clipping`` clips to (``None``: no override).
        freeze_backbone: only the last layer trains.
    """

    name: str
    kind: Literal["fault", "healthy"]
    what: str
    onset: int = 0
    cause: str | None = None
    issue: int | None = None
    twin: str | None = None
    steps: int = 300
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.01
    batch: int = 32
    schedule: Schedule | None = None
    interval: Literal["step", "epoch"] = "step"
    order: Literal["shuffle", "sorted"] = "shuffle"
    targets: Literal["aligned", "previous_batch"] = "aligned"
    manual: Literal["zero_grad_before_backward", "zero_grad_before_step"] | None = None
    clip_norm: float | None = None
    freeze_backbone: bool = False

    def module(self) -> DigitsClassifier:
        """A fresh LightningModule (seed the RNG first for reproducible weights)."""
        return ManualDigitsClassifier(self) if self.manual is not None else DigitsClassifier(self)

    def train_loader(self, seed: int, data: Digits | None = None) -> DataLoader[Any]:
        data = data if data is not None else digits()
        x, y = data.x_train, data.y_train
        if self.order == "sorted":
            order = torch.tensor(np.argsort(y.numpy(), kind="stable"))
            x, y = x[order], y[order]
        collate = PreviousBatchTargets() if self.targets == "previous_batch" else None
        return DataLoader(
            TensorDataset(x, y),
            batch_size=self.batch,
            shuffle=self.order == "shuffle",
            generator=torch.Generator().manual_seed(seed),
            drop_last=True,
            collate_fn=collate,
        )

    def trainer_kwargs(self, steps: int | None = None) -> dict[str, Any]:
        """What the scenario itself asks of the Trainer (``run`` adds the quiet settings)."""
        return {"max_steps": self.steps if steps is None else steps, "max_epochs": -1}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedule"] = getattr(self.schedule, "__name__", None)
        return d


def build_optimizer(sc: Scenario, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if sc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=sc.lr, momentum=sc.momentum)
    if sc.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=sc.lr, weight_decay=sc.weight_decay)
    return torch.optim.Adam(params, lr=sc.lr)


class DigitsClassifier(pl.LightningModule):
    """The MLP, its optimizer and schedule as the scenario says; logs ``train_loss`` every step."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        self.scenario = scenario
        self.net = digits_mlp()
        if scenario.freeze_backbone:
            for layer in list(self.net.children())[:-1]:
                layer.requires_grad_(False)
        self.losses: list[float] = []  # the training loss of every step, read by `run`

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, batch: Batch) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        self.losses.append(float(loss.detach()))
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        sc = self.scenario
        opt = build_optimizer(sc, [p for p in self.parameters() if p.requires_grad])
        if sc.schedule is None:
            return opt
        scheduler = sc.schedule(opt, sc.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": sc.interval}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if self.scenario.clip_norm is not None:  # the user's own clipping: Trainer(gradient_clip_val) unset
            nn.utils.clip_grad_norm_(
                [p for p in self.parameters() if p.grad is not None], self.scenario.clip_norm
            )
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class ManualDigitsClassifier(DigitsClassifier):
    """Manual optimization; ``zero_grad`` where the scenario puts it."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.automatic_optimization = False

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
        if self.scenario.manual == "zero_grad_before_backward":
            opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        if self.scenario.manual == "zero_grad_before_step":
            opt.zero_grad()  # the bug: the gradients just computed are dropped (set to None)
        opt.step()
        return loss.detach()


# ---------------------------------------------------------------------------------------------- schedules
def step_lr(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)


def jump_at_150(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 100.0 if t >= 150 else 1.0)


WARMUP_STEPS = 100


def linear_warmup(length: int) -> Schedule:
    def schedule(opt: torch.optim.Optimizer, steps: int) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / length))

    schedule.__name__ = f"linear_warmup_{length}"
    return schedule


def cosine_to_zero(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=0.0)


def warm_restarts(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=40, T_mult=2)


def one_cycle(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)


def warmup_then_constant(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, end_factor=1.0, total_iters=50)


def exponential_decay(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)


def halve_per_epoch(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def multistep(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[200, 400], gamma=0.1)


def step_lr_10(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.1)


def jump_50x_at_100(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 50.0 if t >= 100 else 1.0)


def one_cycle_adam(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> Any:
    def factor(t: int) -> float:
        return min(1.0, (t + 1) / 60) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _extra_scenarios() -> list[Scenario]:
    """Written after the detector's first tuning round on the scenarios above: the same seven failures
    with other optimizers, steps and strengths (each with its twin), and eleven more healthy runs."""
    sgdm = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
    pairs = [
        ("steplr10_adam", "steplr10_adam_epoch", "lr_decayed", 0,
         "Adam 1e-3; StepLR(step_size=10, gamma=0.1) stepped per step: 1e-6 of base by step 60",
         {"schedule": step_lr_10}, {"interval": "epoch"}),
        ("targets_off_by_one_sgd", "targets_aligned_sgd", "chance_level", 0,
         "SGD 0.05 + momentum 0.9; each batch gets the previous batch's targets",
         {**sgdm, "targets": "previous_batch"}, {"targets": "aligned"}),
        ("lr_jump_50x_sgd", "lr_constant_sgd", "lr_jump", 100,
         "SGD 0.01 + momentum 0.9; the LR x50 from step 100",
         {**sgdm, "lr": 0.01, "schedule": jump_50x_at_100}, {"schedule": None}),
        ("zero_grad_before_step_sgd", "zero_grad_before_backward_sgd", "no_update", 0,
         "SGD 0.05 + momentum 0.9, manual optimization: zero_grad() between manual_backward and step",
         {**sgdm, "manual": "zero_grad_before_step"}, {"manual": "zero_grad_before_backward"}),
        ("warmup_in_samples_sgd", "warmup_in_steps_sgd", "warmup_never_ends", 0,
         "SGD 0.1, batch 64; a 200-step warm-up given in samples (12 800)",
         {"optimizer": "sgd", "lr": 0.1, "batch": 64, "schedule": linear_warmup(200 * 64)},
         {"schedule": linear_warmup(200)}),
        ("clip_tiny_sgd_momentum", "clip_sane_sgd_momentum", "clipped_updates", 0,
         "SGD 0.05 + momentum 0.9; configure_gradient_clipping clips the norm to 1e-4",
         {**sgdm, "clip_norm": 1e-4}, {"clip_norm": 1.0}),
    ]  # fmt: skip
    out = []
    for fault, twin, cause, onset, what, kwargs, fixed in pairs:
        out.append(Scenario(fault, "fault", what, onset=onset, cause=cause, twin=twin, **kwargs))
        out.append(Scenario(twin, "healthy", f"twin of `{fault}`", twin=fault, **{**kwargs, **fixed}))
    healthy = [
        ("exponential_decay", "SGD 0.1 + momentum 0.9, ExponentialLR(0.99) per step: 1/100 of base by step "
         "460 of 600", {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": exponential_decay}),
        ("halve_per_epoch", "SGD 0.1, StepLR halving the LR every epoch (1/100 of base by step 280 of 600)",
         {"optimizer": "sgd", "lr": 0.1, "schedule": halve_per_epoch, "interval": "epoch"}),
        ("multistep", "Adam 1e-3, MultiStepLR: x0.1 at steps 200 and 400", {"schedule": multistep}),
        ("adam_small_lr", "Adam 1e-4: a slow but steady learner", {"lr": 1e-4}),
        ("sgd_slow", "plain SGD 0.01: a slow but steady learner", {"optimizer": "sgd", "lr": 0.01}),
        ("big_batch", "Adam 3e-3, batch 256", {"lr": 3e-3, "batch": 256}),
        ("one_cycle_adam", "Adam, OneCycleLR up to 3e-3", {"schedule": one_cycle_adam}),
        ("warmup_cosine", "AdamW 3e-3, 60-step warm-up, then a cosine to 0",
         {"optimizer": "adamw", "lr": 3e-3, "schedule": warmup_cosine}),
        ("frozen_backbone_sgd", "SGD 0.1 + momentum 0.9 on the last layer only",
         {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "freeze_backbone": True}),
        ("clip_sane_adam", "Adam 1e-3, configure_gradient_clipping to norm 1", {"clip_norm": 1.0}),
        ("warmup_half_run", "Adam 1e-3, a linear warm-up over the first 300 of 600 steps",
         {"schedule": linear_warmup(300)}),
        ("adamw_strong_decay", "AdamW 3e-3, weight_decay 1: the decay removes 0.3 % of every weight per step "
         "and outweighs the gradient's part of some layers' updates, yet the run learns",
         {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 1.0}),
    ]  # fmt: skip
    out += [Scenario(name, "healthy", what, steps=600, **kwargs) for name, what, kwargs in healthy]
    return out


def _scenarios() -> dict[str, Scenario]:
    out = [
        # 1: StepLR meant per epoch, stepped per optimizer step
        Scenario(
            "steplr_interval_step",
            "fault",
            "SGD 0.1; StepLR(step_size=3, gamma=0.1) meant per epoch, configured with interval 'step': "
            "the LR is 1e-6 of base after 20 steps",
            cause="lr_decayed",
            issue=1,
            twin="steplr_interval_epoch",
            schedule=step_lr,
            optimizer="sgd",
            lr=0.1,
        ),
        Scenario(
            "steplr_interval_epoch",
            "healthy",
            "twin of 1: the same StepLR with interval 'epoch' (LR /10 every 3 epochs)",
            twin="steplr_interval_step",
            schedule=step_lr,
            interval="epoch",
            optimizer="sgd",
            lr=0.1,
        ),
        # 2: targets from the previous batch
        Scenario(
            "targets_off_by_one",
            "fault",
            "Adam 1e-3; the collate function gives each batch the targets of the previous batch",
            cause="chance_level",
            issue=2,
            twin="targets_aligned",
            targets="previous_batch",
        ),
        Scenario(
            "targets_aligned",
            "healthy",
            "twin of 2: each batch with its own targets",
            twin="targets_off_by_one",
        ),
        # 3: sorted by class, not shuffled
        Scenario(
            "sorted_by_class",
            "fault",
            "SGD 0.04 + momentum 0.9, 294 steps (7 epochs); training loader sorted by class, "
            "shuffle=False: single-class batches",
            cause="sorted_labels",
            issue=3,
            twin="shuffled_loader",
            order="sorted",
            optimizer="sgd",
            lr=0.04,
            momentum=0.9,
            steps=294,  # 7 epochs of 42 batches: ends right after the sorted loader's class-9 batches
        ),
        Scenario(
            "shuffled_loader",
            "healthy",
            "twin of 3: the loader shuffled",
            twin="sorted_by_class",
            optimizer="sgd",
            lr=0.04,
            momentum=0.9,
            steps=294,  # 7 epochs of 42 batches: ends right after the sorted loader's class-9 batches
        ),
        # 4: LR x100 mid-run
        Scenario(
            "lr_jump_100x",
            "fault",
            "Adam 1e-3; a schedule bug multiplies the LR by 100 from step 150",
            onset=150,
            cause="lr_jump",
            issue=4,
            twin="lr_constant",
            schedule=jump_at_150,
        ),
        Scenario("lr_constant", "healthy", "twin of 4: Adam 1e-3, constant", twin="lr_jump_100x"),
        # 5: zero_grad between manual_backward and step
        Scenario(
            "zero_grad_before_step",
            "fault",
            "Adam 1e-3, manual optimization: zero_grad() between manual_backward and step",
            cause="no_update",
            issue=5,
            twin="zero_grad_before_backward",
            manual="zero_grad_before_step",
        ),
        Scenario(
            "zero_grad_before_backward",
            "healthy",
            "twin of 5: zero_grad() before manual_backward",
            twin="zero_grad_before_step",
            manual="zero_grad_before_backward",
        ),
        # 6: warm-up length in samples
        Scenario(
            "warmup_in_samples",
            "fault",
            f"Adam 1e-3, batch 256; linear warm-up of {WARMUP_STEPS} steps given in samples "
            f"({WARMUP_STEPS * 256}): the LR stays under 1.2 % of base",
            cause="warmup_never_ends",
            issue=6,
            twin="warmup_in_steps",
            batch=256,
            schedule=linear_warmup(WARMUP_STEPS * 256),
        ),
        Scenario(
            "warmup_in_steps",
            "healthy",
            f"twin of 6: the warm-up over {WARMUP_STEPS} steps",
            twin="warmup_in_samples",
            batch=256,
            schedule=linear_warmup(WARMUP_STEPS),
        ),
        # 7: clipping to 1e-3 in a custom hook
        Scenario(
            "clip_tiny",
            "fault",
            "SGD 0.1; configure_gradient_clipping clips the norm to 1e-3 (Trainer(gradient_clip_val) unset)",
            cause="clipped_updates",
            issue=7,
            twin="clip_sane",
            clip_norm=1e-3,
            optimizer="sgd",
            lr=0.1,
        ),
        Scenario(
            "clip_sane",
            "healthy",
            "twin of 7: the same hook clipping to 1.0",
            twin="clip_tiny",
            clip_norm=1.0,
            optimizer="sgd",
            lr=0.1,
        ),
        # healthy runs a naive stall rule would flag
        Scenario(
            "cosine_to_zero",
            "healthy",
            "SGD 0.05 + momentum 0.9, CosineAnnealingLR over the whole run: the LR ends at 0",
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            schedule=cosine_to_zero,
        ),
        Scenario(
            "warm_restarts",
            "healthy",
            "SGD 0.05 + momentum 0.9, CosineAnnealingWarmRestarts(T_0=40, T_mult=2): the LR falls to "
            "0.15 % of base, then back (x650)",
            optimizer="sgd",
            lr=0.05,
            momentum=0.9,
            schedule=warm_restarts,
        ),
        Scenario(
            "one_cycle",
            "healthy",
            "SGD + momentum, OneCycleLR up to 0.1 (from max/25 up, then down to max/2.5e5)",
            optimizer="sgd",
            lr=0.1,
            momentum=0.9,
            schedule=one_cycle,
        ),
        Scenario(
            "early_convergence",
            "healthy",
            "Adam 3e-3, 600 steps: the training loss reaches ~1e-3 early and stays flat",
            lr=3e-3,
            steps=600,
        ),
        Scenario(
            "frozen_backbone",
            "healthy",
            "Adam 1e-2 on the last layer only (the two hidden layers frozen at their random init)",
            lr=1e-2,
            freeze_backbone=True,
        ),
        Scenario(
            "small_batch_noisy",
            "healthy",
            "SGD 0.01 + momentum 0.9, batch 4: a noisy per-step loss",
            optimizer="sgd",
            lr=0.01,
            momentum=0.9,
            batch=4,
            steps=600,
        ),
        Scenario(
            "adamw_warmup",
            "healthy",
            "AdamW 2e-3, LinearLR warm-up from 1 % over 50 steps, then constant",
            optimizer="adamw",
            lr=2e-3,
            schedule=warmup_then_constant,
        ),
        *_extra_scenarios(),
    ]
    return {s.name: s for s in out}


#: every scenario by name: the seven faults of issue 16, their fixed twins and the other healthy runs
SCENARIOS: dict[str, Scenario] = _scenarios()


# ---------------------------------------------------------------------------------------------- one run
@dataclass
class AlertRecord:
    """One alert a callback recorded during a run."""

    source: str  # the callback's class
    kind: str
    step: int
    message: str
    data_keys: list[str] = field(default_factory=list)


@dataclass
class RunRecord:
    """What one run did: per-step training losses and LRs, the final validation numbers, the alerts."""

    scenario: str
    seed: int
    losses: list[float]  # training loss of every optimizer step
    lrs: list[float]  # the LR of the first param group at every optimizer step
    val_loss: float  # cross-entropy of the final weights on the 450 validation images (inf: not finite)
    val_acc: float
    alerts: list[AlertRecord]
    steps: int  # trainer.global_step at the end
    seconds: float
    error: str | None = None  # an exception that ended the run (a callback's raise)


class LRRecorder(Callback):
    """The LR each optimizer step will use, read at the start of its batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


def evaluate(module: DigitsClassifier, data: Digits) -> tuple[float, float]:
    was_training = module.training
    module.eval()
    with torch.no_grad():
        logits = module(data.x_val)
        loss = float(nn.functional.cross_entropy(logits, data.y_val))
        acc = float((logits.argmax(1) == data.y_val).float().mean())
    module.train(was_training)
    return (loss if math.isfinite(loss) else math.inf), acc


def alerts_of(callbacks: Iterable[Any]) -> list[AlertRecord]:
    out = []
    for cb in callbacks:
        for a in getattr(cb, "alerts", None) or []:
            data = getattr(a, "data", None)
            out.append(
                AlertRecord(
                    source=type(cb).__name__,
                    kind=str(getattr(a, "kind", "?")),
                    step=int(getattr(a, "step", -1)),
                    message=str(getattr(a, "message", a)),
                    data_keys=sorted(map(str, data)) if isinstance(data, Mapping) else [],
                )
            )
    return out


def run(
    scenario: Scenario,
    callbacks: Sequence[Callback] = (),
    seed: int = 0,
    steps: int | None = None,
    logger: bool | str = False,
) -> RunRecord:
    """Fit ``scenario`` once and return what happened.

    Args:
        scenario: what to train (a value of :data:`SCENARIOS`).
        callbacks: extra callbacks (fresh instances); the alerts of those with an ``alerts`` list are kept.
        seed: seeds the weights (``seed_everything``) and the loader's shuffling.
        steps: optimizer steps (default: the scenario's); schedules are still built for the scenario's.
        logger: ``False`` (none), ``True`` (TensorBoard into a temporary folder, removed after the run)
            or a folder for TensorBoard's event files.
    """
    data = digits()
    pl.seed_everything(seed, workers=False, verbose=False)
    module = scenario.module()
    recorder = LRRecorder()
    error = None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-stall-") as tmp:
        tb: TensorBoardLogger | bool = False
        if logger:
            tb = TensorBoardLogger(logger if isinstance(logger, str) else tmp, name=scenario.name)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            logger=tb,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            log_every_n_steps=1,
            default_root_dir=tmp,
            callbacks=[recorder, *callbacks],
            **scenario.trainer_kwargs(steps),
        )
        try:
            trainer.fit(module, train_dataloaders=scenario.train_loader(seed, data))
        except Exception as exc:  # a callback's raise ends the run; it is part of the record
            error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - started
    val_loss, val_acc = evaluate(module, data)
    return RunRecord(
        scenario=scenario.name,
        seed=seed,
        losses=list(module.losses),
        lrs=recorder.lrs[: len(module.losses)],
        val_loss=val_loss,
        val_acc=val_acc,
        alerts=alerts_of(callbacks),
        steps=int(trainer.global_step),
        seconds=seconds,
        error=error,
    )


# ---------------------------------------------------------------------------------------------- twin proof
#: a fault is proven when, on every seed, its accuracy is this far below the worst seed of its twin
FAULT_MARGIN = 0.4
#: a healthy run is proven when every seed reaches this validation accuracy (chance: 0.1)
HEALTHY_ACC = 0.7


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.inf


def _cell(runs: Sequence[RunRecord]) -> str:
    """Mean validation loss / accuracy over the seeds, with the accuracy's range."""
    accs = [r.val_acc for r in runs]
    return f"{_mean([r.val_loss for r in runs]):.3f} / {_mean(accs):.3f} ({min(accs):.2f}-{max(accs):.2f})"


@dataclass
class TwinRow:
    """A fault against its twin, or a healthy run on its own (``bug`` empty)."""

    scenario: Scenario
    bug: list[RunRecord]
    fixed: list[RunRecord]

    @property
    def proven(self) -> bool:
        if self.scenario.kind == "fault":
            return max(r.val_acc for r in self.bug) <= min(r.val_acc for r in self.fixed) - FAULT_MARGIN
        return min(r.val_acc for r in self.fixed) >= HEALTHY_ACC

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "twin": self.scenario.twin,
            "proven": self.proven,
            "bug": [{"seed": r.seed, "val_loss": r.val_loss, "val_acc": r.val_acc} for r in self.bug],
            "fixed": [{"seed": r.seed, "val_loss": r.val_loss, "val_acc": r.val_acc} for r in self.fixed],
        }


def twin_rows(by_name: Mapping[str, list[RunRecord]]) -> list[TwinRow]:
    """Each fault that ran with its twin, then each other healthy scenario that ran."""
    rows = []
    for sc in SCENARIOS.values():
        if sc.kind == "fault" and sc.name in by_name and sc.twin in by_name:
            rows.append(TwinRow(sc, by_name[sc.name], by_name[str(sc.twin)]))
    for sc in SCENARIOS.values():
        if sc.kind == "healthy" and sc.twin is None and sc.name in by_name:
            rows.append(TwinRow(sc, [], by_name[sc.name]))
    return rows


def twins_markdown(rows: Sequence[TwinRow], seeds: int) -> str:
    out = [
        f"Validation loss / accuracy at the end of the run, mean of {seeds} seeds (the accuracy's range over "
        f"the seeds in brackets). Chance: loss ln 10 = {CHANCE_LOSS:.3f}, accuracy 0.10. A fault is proven "
        f"when every seed's accuracy is at least {FAULT_MARGIN:.1f} below the twin's worst seed; a healthy "
        f"run when every seed reaches {HEALTHY_ACC:.1f}.",
        "",
        "| # | fault (cause, onset) | with the bug | fixed twin | twin | proven |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        sc = row.scenario
        if sc.kind == "fault":
            cells = [
                str(sc.issue or "-"),
                f"`{sc.name}` ({sc.cause}, {sc.onset})",
                _cell(row.bug),
                _cell(row.fixed),
            ]
            out.append("| " + " | ".join([*cells, f"`{sc.twin}`", "yes" if row.proven else "**NO**"]) + " |")
    healthy = [row for row in rows if row.scenario.kind == "healthy"]
    if healthy:
        out += ["", "| healthy | what | val loss / accuracy | proven |", "|---|---|---|---|"]
        for row in healthy:
            sc = row.scenario
            out.append(
                f"| `{sc.name}` | {sc.what} | {_cell(row.fixed)} | {'yes' if row.proven else '**NO**'} |"
            )
    return "\n".join(out)


def run_all(
    names: Iterable[str], seeds: Sequence[int], make_callbacks: Callable[[], list[Callback]]
) -> dict[str, list[RunRecord]]:
    by_name: dict[str, list[RunRecord]] = {}
    for name in names:
        sc = SCENARIOS[name]
        by_name[name] = [run(sc, callbacks=make_callbacks(), seed=s) for s in seeds]
        for r in by_name[name]:
            if r.error:
                print(f"# {name} seed {r.seed} ended by {r.error}", file=sys.stderr, flush=True)
        took = sum(r.seconds for r in by_name[name])
        print(f"# {name}: {len(seeds)} runs, {took:.1f} s", file=sys.stderr, flush=True)
    return by_name


def with_twins(names: Sequence[str]) -> list[str]:
    """The named scenarios (all when none) and the twin of every fault among them, in registry order."""
    wanted = set(names or SCENARIOS)
    wanted |= {str(SCENARIOS[n].twin) for n in list(wanted) if SCENARIOS[n].kind == "fault"}
    return [n for n in SCENARIOS if n in wanted]


# ---------------------------------------------------------------------------------------------- detection
@dataclass
class Detection:
    """How one run of a scenario went for the detector under test."""

    seed: int
    first_kind: str | None  # the first alert at or after onset (faults)
    first_step: int | None
    delay: int | None  # first_step - onset
    names_cause: bool  # the scenario's cause appears in that alert's kind, message or data keys
    false_alarms: int  # healthy: every alert; fault: alerts before onset
    kinds: list[str]  # every alert kind of the run, in order, without repeats
    error: str | None


def score(sc: Scenario, record: RunRecord) -> Detection:
    alerts = sorted(record.alerts, key=lambda a: a.step)
    kinds = list(dict.fromkeys(a.kind for a in alerts))
    if sc.kind == "healthy":
        return Detection(record.seed, None, None, None, False, len(alerts), kinds, record.error)
    early = [a for a in alerts if a.step < sc.onset]
    hits = [a for a in alerts if a.step >= sc.onset]
    first = hits[0] if hits else None
    named = (
        first is not None
        and sc.cause is not None
        and any(sc.cause in text for text in (first.kind, first.message, *first.data_keys))
    )
    return Detection(
        seed=record.seed,
        first_kind=first.kind if first else None,
        first_step=first.step if first else None,
        delay=first.step - sc.onset if first else None,
        names_cause=named,
        false_alarms=len(early),
        kinds=kinds,
        error=record.error,
    )


def load_callback(spec: str) -> type[Callback]:
    """``"package.module:ClassName"`` -> the class."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise SystemExit(f"--detect wants 'module:Class', got {spec!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise SystemExit(f"{spec} is not a Lightning Callback class")
    return cls


def _join(values: Iterable[object]) -> str:
    return ", ".join("-" if v is None else str(v) for v in values)


def detect_markdown(results: Mapping[str, list[Detection]], spec: str) -> str:
    out = [
        f"`{spec}` at the given arguments. Faults: detected = seeds with an alert at or after onset; first "
        "alert step and delay after onset per seed; false alarms = alerts before onset. Healthy: every "
        "alert is a false alarm.",
        "",
        "| # | fault | cause | onset | detected | first alert kind | first step | delay | names cause "
        "| false alarms |",
        "|---|---|---|---:|---:|---|---|---|---|---:|",
    ]
    for name, dets in results.items():
        sc = SCENARIOS[name]
        if sc.kind != "fault":
            continue
        found = sum(d.first_step is not None for d in dets)
        cells = [
            str(sc.issue or "-"),
            f"`{name}`",
            str(sc.cause),
            str(sc.onset),
            f"{found}/{len(dets)}",
            _join(dict.fromkeys(d.first_kind for d in dets if d.first_kind)) or "-",
            _join(d.first_step for d in dets),
            _join(d.delay for d in dets),
            _join("yes" if d.names_cause else "no" for d in dets if d.first_step is not None) or "-",
            str(sum(d.false_alarms for d in dets)),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "| healthy | false alarms (all seeds) | runs with any | kinds |", "|---|---:|---:|---|"]
    for name, dets in results.items():
        if SCENARIOS[name].kind == "healthy":
            kinds = _join(dict.fromkeys(k for d in dets for k in d.kinds)) or "-"
            fired = sum(d.false_alarms > 0 for d in dets)
            out.append(f"| `{name}` | {sum(d.false_alarms for d in dets)} | {fired}/{len(dets)} | {kinds} |")
    faults = [d for n, ds in results.items() if SCENARIOS[n].kind == "fault" for d in ds]
    healthy = [d for n, ds in results.items() if SCENARIOS[n].kind == "healthy" for d in ds]
    errors = [f"{n} seed {d.seed}: {d.error}" for n, ds in results.items() for d in ds if d.error]
    out += [
        "",
        f"Detected {sum(d.first_step is not None for d in faults)}/{len(faults)} fault runs "
        f"({sum(d.names_cause for d in faults)} naming the cause); false alarms: "
        f"{sum(d.false_alarms > 0 for d in healthy)}/{len(healthy)} healthy runs, "
        f"{sum(d.false_alarms for d in faults)} alerts before onset on fault runs.",
    ]
    if errors:
        out += ["", "Runs ended by an exception:", *(f"- {e}" for e in errors)]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- main
def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        logging.getLogger(name).setLevel(logging.ERROR)


def write_json(kind: str, content: Mapping[str, Any], path: Path | None) -> Path:
    path = path or RESULTS_DIR / f"stall_zoo-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1, default=str))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--twins", action="store_true", help="every fault against its fixed twin, and the healthy runs"
    )
    mode.add_argument("--detect", metavar="MODULE:CLASS", help="score this callback on every scenario")
    mode.add_argument("--list", action="store_true", help="list the scenarios")
    p.add_argument(
        "--kwargs", default="{}", help="JSON arguments for the --detect callback (default: its defaults)"
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per scenario (default 3)")
    p.add_argument(
        "--scenarios", default="", help="comma-separated subset (a fault brings its twin with --twins)"
    )
    p.add_argument("--json", type=Path, default=None, help="output path (default: benchmarks/results/)")
    args = p.parse_args(argv)
    if args.list:
        for sc in SCENARIOS.values():
            print(f"{sc.name:28s} {sc.kind:8s} onset {sc.onset:4d}  {sc.cause or '-':18s} {sc.what}")
        return 0
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; --list shows them")
    quiet()
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **common_environment(1),
    }
    scenarios = [SCENARIOS[n].to_json() for n in (with_twins(names) if args.twins else names or SCENARIOS)]
    started = time.perf_counter()
    if args.twins:
        by_name = run_all(with_twins(names), seeds, list)
        rows = twin_rows(by_name)
        print(twins_markdown(rows, len(seeds)))
        env["wall_s"] = round(time.perf_counter() - started, 1)
        content = {
            "environment": env,
            "seeds": seeds,
            "scenarios": scenarios,
            "rows": [r.to_json() for r in rows],
            "runs": [asdict(r) for runs in by_name.values() for r in runs],
        }
        path = write_json("twins", content, args.json)
        print(f"\nwall {env['wall_s']:.0f} s; JSON: {path}")
        return 0 if all(r.proven for r in rows) else 1
    cls = load_callback(args.detect)
    kwargs = json.loads(args.kwargs)
    by_name = run_all(names or list(SCENARIOS), seeds, lambda: [cls(**kwargs)])
    results = {n: [score(SCENARIOS[n], r) for r in runs] for n, runs in by_name.items()}
    print(detect_markdown(results, args.detect))
    env["wall_s"] = round(time.perf_counter() - started, 1)
    content = {
        "environment": env,
        "callback": args.detect,
        "kwargs": kwargs,
        "seeds": seeds,
        "scenarios": scenarios,
        "detections": {n: [asdict(d) for d in ds] for n, ds in results.items()},
        "runs": [asdict(r) for runs in by_name.values() for r in runs],
    }
    path = write_json("detect", content, args.json)
    print(f"\nwall {env['wall_s']:.0f} s; JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
