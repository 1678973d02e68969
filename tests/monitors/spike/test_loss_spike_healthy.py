"""LossSpikeGuard at its DEFAULTS leaves healthy runs alone, and still drops a real loss spike.

Healthy runs of several kinds (real Trainers on the scikit-learn digits): a deep MLP with a small init that
sits on a plateau and then learns (its gradient norm jumps 5-13x in a few steps while the loss falls:
before gradient-norm spikes needed the loss to confirm them, the guard skipped those updates and rolled
the run back onto the plateau), a row transformer with warm-up and cosine decay, batch-4 SGD. Every skip
and every rollback there is a false intervention. The longer version: ``benchmarks/spike_healthy.py``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import ROOT, make_trainer, reference_total_norm
from torch import nn

from lightning_gradguard import LossSpikeGuard
from lightning_gradguard.functional.spikes import SpikeScore
from lightning_gradguard.monitors.spike.rules import LOSS_CONFIRMS_Z, step_verdict

sys.path.insert(0, str(ROOT / "examples"))

from zoo import digits


class Healthy(pl.LightningModule):
    """One of the healthy set-ups; records its losses and true total gradient norms, step by step.

    With ``poison`` the batches of those optimizer steps get their inputs x20 and their labels rolled by
    one (a corrupt batch: a loss many times the usual).
    """

    def __init__(self, kind: str, poison: frozenset[int] = frozenset()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.poison = kind, poison
        if kind == "plateau":  # 4 ReLU layers, weights x0.3: ~100 steps at ln 10 before it learns
            self.net: nn.Module = nn.Sequential(
                *(m for _ in range(3) for m in (nn.LazyLinear(64), nn.ReLU())), nn.LazyLinear(10)
            )
            self.net(torch.zeros(1, 64))
            with torch.no_grad():
                for m in self.net.modules():
                    if isinstance(m, nn.Linear):
                        m.weight.mul_(0.3)
                        m.bias.zero_()
        elif kind == "transformer":  # each digit as 8 rows: a one-layer pre-LN encoder
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
            self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 10)
            self.net = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        else:
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step in self.poison:
            x, y = 20 * x, (y + 1) % 10
        if self.kind == "transformer":
            out = self.head(self.net(self.embed(x.view(-1, 8, 8))).mean(1))
        else:
            out = self.net(x)
        loss = nn.functional.cross_entropy(out, y)
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(reference_total_norm(grads)))

    def configure_optimizers(self) -> Any:
        if self.kind == "plateau":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.kind == "small_batch":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3 if self.kind == "transformer" else 1e-3)
        if self.kind != "transformer":
            return opt

        def warm_cosine(t: int) -> float:
            return (t + 1) / 50 if t < 50 else 0.5 * (1 + math.cos(math.pi * min(1.0, (t - 50) / 100)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warm_cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(model: Healthy, guard: LossSpikeGuard, tmp_path: Path, steps: int, batch: int) -> None:
    trainer = make_trainer([guard], max_steps=steps, max_epochs=-1, default_root_dir=str(tmp_path))
    trainer.fit(model, digits(batch_size=batch))


def _robust_z(value: float, window: list[float]) -> tuple[float, float]:
    """(ratio to the median, robust z-score) in log space, by hand (NumPy)."""
    logs = np.log(window)
    center = float(np.median(logs))
    scale = max(1.4826 * float(np.median(np.abs(logs - center))), 0.01)
    return value / math.exp(center), (math.log(value) - center) / scale


def test_a_model_leaving_a_plateau_is_not_skipped_or_rolled_back(tmp_path: Path) -> None:
    model, guard = Healthy("plateau"), LossSpikeGuard()
    _fit(model, guard, tmp_path, steps=150, batch=64)
    assert (guard.dropped_steps, guard.rollbacks, guard.records, guard.alerts) == (0, 0, [], [])
    # the run is what the test claims: on the plateau, then learning
    assert min(model.losses[:90]) > 2.2 and float(np.median(model.losses[-10:])) < 1.5
    # and, by hand, the guard's own gradient-norm rule fired in it (z >= 6, >= 2x the median of the last
    # 128 steps) while the loss fell (below its median): the steps the guard once skipped
    excursions = []
    for t in range(50, len(model.norms)):
        norm_ratio, norm_z = _robust_z(model.norms[t], model.norms[max(0, t - 128) : t])
        _, loss_z = _robust_z(model.losses[t], model.losses[max(0, t - 128) : t])
        if norm_z >= 6.0 and norm_ratio >= 2.0:
            excursions.append(loss_z)
    assert len(excursions) >= 3 and max(excursions) < 0.0


@pytest.mark.parametrize(("kind", "steps", "batch"), [("transformer", 80, 16), ("small_batch", 80, 4)])
def test_healthy_runs_get_no_intervention(kind: str, steps: int, batch: int, tmp_path: Path) -> None:
    model, guard = Healthy(kind), LossSpikeGuard()
    _fit(model, guard, tmp_path, steps=steps, batch=batch)
    assert (guard.dropped_steps, guard.rollbacks, guard.alerts) == (0, 0, [])
    assert guard.judged == steps and np.mean(model.losses[-10:]) < 0.7 * np.mean(model.losses[:10])


def test_a_poisoned_batch_is_still_skipped_and_a_lasting_one_rolled_back(tmp_path: Path) -> None:
    """At the defaults: the corrupt batches at steps 60 and 70-73 spike the loss (and the norm)."""
    model, guard = Healthy("mlp", poison=frozenset({60, 70, 71, 72, 73})), LossSpikeGuard()
    _fit(model, guard, tmp_path, steps=80, batch=32)
    assert [(r.step, r.action) for r in guard.records] == [
        (60, "skip"),
        (70, "skip"),
        (71, "skip"),
        (72, "skip"),
        (73, "rollback"),
    ]
    assert (guard.dropped_steps, guard.rollbacks) == (5, 1)
    for record in guard.records:
        median = float(np.median(model.losses[max(0, record.step - 128) : record.step]))
        assert record.loss == pytest.approx(model.losses[record.step], rel=1e-6) and record.loss > 5 * median


def _score(z: float, ratio: float) -> SpikeScore:
    return SpikeScore(value=ratio, level=1.0, zscore=z, ratio=ratio, log_space=True)


@pytest.mark.parametrize(
    ("loss", "norm", "verdict"),
    [
        ((9.0, 3.0), (1.0, 1.1), "spike"),  # the loss spiked
        ((9.0, 3.0), (8.0, 4.0), "spike"),
        ((LOSS_CONFIRMS_Z, 1.2), (6.5, 3.1), "spike"),  # the loss confirms the norm's spike
        ((1.9, 1.2), (6.5, 3.1), "excursion"),  # an ordinary loss: the norm alone is no reason
        ((-40.0, 0.7), (9.0, 13.0), "excursion"),  # a falling loss (a model leaving a plateau)
        (None, (6.5, 3.1), "spike"),  # the loss is not judged: the norm decides alone
        ((1.0, 1.1), (6.5, 1.5), "calm"),  # under min_ratio
    ],
)
def test_step_verdict(loss: tuple[float, float] | None, norm: tuple[float, float], verdict: str) -> None:
    scores = {"grad_norm": _score(*norm)} | ({"loss": _score(*loss)} if loss else {})
    assert step_verdict(scores, {"loss": 6.0, "grad_norm": 6.0}, 2.0) == verdict
