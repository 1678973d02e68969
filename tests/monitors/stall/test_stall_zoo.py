"""Smoke test of the stalled-learning scenarios (benchmarks/stall_zoo.py): a few short real runs.

Each fault is checked to do what its description says against a computation made here, not by the zoo:
the LR schedule from its closed form, the targets and the batch order from the loaders of the twin and
the raw labels, the applied update from the raw gradient. The full proof that the faults stall and the
twins learn is ``python benchmarks/stall_zoo.py --twins`` (minutes, not part of the test suite).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from conftest import ROOT
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(ROOT / "benchmarks"))

import stall_zoo as zoo
from stall_zoo import SCENARIOS

CAUSES = {
    "lr_decayed",
    "chance_level",
    "sorted_labels",
    "lr_jump",
    "no_update",
    "warmup_never_ends",
    "clipped_updates",
}


class Weights(Callback):
    """Every parameter at the start of fit and at its end."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after = [p.detach().clone() for p in pl_module.parameters()]


class Updates(Callback):
    """Raw gradients (before any clipping) and the weights before and after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        params = list(pl_module.parameters())
        grads = [p.grad.detach().clone() for p in params if p.grad is not None]
        self._pending = (grads, [p.detach().clone() for p in params])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._pending is not None
        grads, before = self._pending
        self.steps.append((grads, before, [p.detach().clone() for p in pl_module.parameters()]))


class Reporter(Callback):
    """Stands in for a detector: one alert at step 3."""

    def __init__(self) -> None:
        self.alerts: list[Any] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 3 and not self.alerts:
            alert = type("A", (), {"kind": "stall", "step": 3, "message": "no_update seen", "data": {}})
            self.alerts.append(alert())


def test_the_registry_holds_the_seven_faults_of_the_issue_and_their_twins() -> None:
    faults = [s for s in SCENARIOS.values() if s.kind == "fault"]
    assert sorted(s.issue for s in faults if s.issue is not None) == list(range(1, 8))
    assert {s.cause for s in faults} == CAUSES
    for sc in faults:
        twin = SCENARIOS[str(sc.twin)]
        assert twin.kind == "healthy" and twin.twin == sc.name and twin.cause is None
        if sc.issue is not None:
            assert sc.onset == (150 if sc.cause == "lr_jump" else 0)
    healthy = {s.name for s in SCENARIOS.values() if s.kind == "healthy" and s.twin is None}
    assert healthy >= {"cosine_to_zero", "warm_restarts", "one_cycle", "early_convergence"}
    assert healthy >= {"frozen_backbone", "small_batch_noisy", "adamw_warmup"}


def test_steplr_stepped_per_step_decays_the_lr_to_nothing_and_its_twin_does_not() -> None:
    sc = SCENARIOS["steplr_interval_step"]
    rec = zoo.run(sc, steps=40, callbacks=[Reporter()])
    assert len(rec.losses) == len(rec.lrs) == rec.steps == 40
    assert all(math.isfinite(v) for v in rec.losses) and 0 <= rec.val_acc <= 1
    expected = [sc.lr * 0.1 ** (t // 3) for t in range(40)]
    assert np.allclose(rec.lrs, expected, rtol=1e-9, atol=0)
    assert max(rec.lrs[30:]) < 1e-3 * sc.lr
    assert [(a.kind, a.step) for a in rec.alerts] == [("stall", 3)]
    twin = zoo.run(SCENARIOS[str(sc.twin)], steps=40)
    assert twin.lrs == [sc.lr] * 40  # 42 batches an epoch: the first StepLR step is after step 41


def test_zero_grad_between_backward_and_step_never_moves_a_weight() -> None:
    fault, twin = Weights(), Weights()
    rec = zoo.run(SCENARIOS["zero_grad_before_step"], steps=8, callbacks=[fault])
    assert rec.steps == 8 and len(rec.losses) == len(rec.lrs) == 8
    assert all(torch.equal(a, b) for a, b in zip(fault.before, fault.after, strict=True))
    zoo.run(SCENARIOS["zero_grad_before_backward"], steps=8, callbacks=[twin])
    assert all(not torch.equal(a, b) for a, b in zip(twin.before, twin.after, strict=True))


def test_sorted_loader_gives_single_class_batches_in_class_order() -> None:
    sc = SCENARIOS["sorted_by_class"]
    labels = np.sort(zoo.digits().y_train.numpy())
    for _ in range(2):  # every epoch the same order
        batches = [y.numpy() for _, y in sc.train_loader(seed=0)]
        assert len(batches) == len(labels) // sc.batch
        for i, y in enumerate(batches):
            assert np.array_equal(y, labels[i * sc.batch : (i + 1) * sc.batch])
        classes = [len(set(y.tolist())) for y in batches]
        assert max(classes) <= 2 and classes.count(1) >= len(batches) - 9
    twin = SCENARIOS[str(sc.twin)]
    assert np.mean([len(set(y.tolist())) for _, y in twin.train_loader(seed=0)]) > 8


def test_off_by_one_pipeline_hands_each_batch_the_previous_batch_targets() -> None:
    fault, twin = SCENARIOS["targets_off_by_one"], SCENARIOS["targets_aligned"]
    f_loader, t_loader = fault.train_loader(seed=1), twin.train_loader(seed=1)
    got = [b for _ in range(2) for b in f_loader]  # two epochs: the buffer carries over the boundary
    ref = [b for _ in range(2) for b in t_loader]
    assert len(got) == len(ref) == 2 * 42
    assert torch.equal(got[0][1], ref[0][1])
    for t in range(1, len(got)):
        assert torch.equal(got[t][0], ref[t][0])
        assert torch.equal(got[t][1], ref[t - 1][1])


def test_tiny_custom_clipping_shrinks_every_update_to_1e_3_over_the_gradient_norm() -> None:
    sc = SCENARIOS["clip_tiny"]
    assert sc.optimizer == "sgd" and sc.momentum == 0 and sc.clip_norm == 1e-3
    updates = Updates()
    rec = zoo.run(sc, steps=5, callbacks=[updates])
    assert rec.steps == 5 and len(updates.steps) == 5
    for grads, before, after in updates.steps:
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        assert norm > 0.05  # the raw gradient is not small: the clip is what shrinks the update
        for g, w0, w1 in zip(grads, before, after, strict=True):
            raw_step = -sc.lr * g
            # float32 weights of ~0.1 hold a change of ~1e-7 to about 1e-8
            assert torch.allclose(w1 - w0, raw_step * (1e-3 / (norm + 1e-6)), rtol=1e-2, atol=3e-8)
        applied = math.sqrt(
            sum(float(((w1 - w0).double() ** 2).sum()) for w0, w1 in zip(before, after, strict=True))
        )
        assert math.isclose(applied / (sc.lr * norm), 1e-3 / norm, rel_tol=1e-2)


def test_lr_jump_and_warmup_in_samples_follow_their_closed_forms() -> None:
    jump = SCENARIOS["lr_jump_100x"]
    rec = zoo.run(jump, steps=jump.onset + 5)
    assert rec.lrs == [jump.lr] * jump.onset + [100 * jump.lr] * 5
    warm = SCENARIOS["warmup_in_samples"]
    rec = zoo.run(warm, steps=20)
    assert np.allclose(rec.lrs, [warm.lr * (t + 1) / (100 * warm.batch) for t in range(20)], rtol=1e-9)
    assert warm.steps / (100 * warm.batch) < 0.02  # the whole run stays under 2 % of the base LR


def test_detect_mode_scores_an_existing_callback(tmp_path: Path) -> None:
    out = tmp_path / "detect.json"
    code = zoo.main(
        [
            "--detect",
            "lightning_gradguard:VanishingExplodingDetector",
            "--seeds",
            "1",
            "--scenarios",
            "zero_grad_before_step",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["callback"] == "lightning_gradguard:VanishingExplodingDetector"
    (det,) = result["detections"]["zero_grad_before_step"]
    assert set(det) >= {"first_kind", "first_step", "delay", "names_cause", "false_alarms"}
    (run,) = result["runs"]
    assert len(run["losses"]) == len(run["lrs"]) == SCENARIOS["zero_grad_before_step"].steps
