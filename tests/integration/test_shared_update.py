"""One update sample per step: every monitor reads the same ||delta w|| / ||w|| for the same layer and step.

GradientNormLogger (``update_ratio/<layer>``), OptimizerMonitor (its outlier rule's ratios) and
StallDetector (its check's ratios) measure the update of a step from the one sample the shared step
statistics take; the numbers must be identical, and within the sample's error of the exact update
measured by brute force (whole weights copied before and after the step).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, make_trainer
from torch import nn

from lightning_gradguard import GradientNormLogger, OptimizerMonitor, StallDetector
from lightning_gradguard.core import stats as core_stats
from lightning_gradguard.monitors.optimizer import measure as optimizer_sample


class WideNet(pl.LightningModule):
    """A 320 x 320 layer (102 400 entries: over the 65 536-entry sample limit) and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 320)
        self.wide = nn.Linear(320, 320)
        self.head = nn.Linear(320, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(torch.relu(self.wide(torch.relu(self.body(x))))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ExactUpdates(pl.Callback):
    """Whole copies of the weights before and after every step: the exact per-layer update ratio."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.ratios: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        layers: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for n, p in pl_module.named_parameters():
            upd, w = layers.setdefault(n.rsplit(".", 1)[0], ([], []))
            upd.append((p.detach() - self.before[n]).reshape(-1))
            w.append(self.before[n].reshape(-1))
        step = trainer.global_step - 1
        self.ratios[step] = {
            k: float(torch.linalg.vector_norm(torch.cat(u)) / torch.linalg.vector_norm(torch.cat(w)))
            for k, (u, w) in layers.items()
        }


def test_the_logger_the_optimizer_monitor_and_the_stall_detector_read_one_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    samples: list[int] = []
    real = core_stats.weight_snapshot
    monkeypatch.setattr(core_stats, "weight_snapshot", lambda ps, *a: samples.append(len(ps)) or real(ps, *a))
    readings: dict[int, dict[str, float]] = {}
    read = optimizer_sample.OptimizerSample.read

    def spy(self: Any, host: Any, key: Any) -> Any:
        reading = read(self, host, key)
        readings[reading.step] = dict(reading.geometry.update_ratio)
        return reading

    monkeypatch.setattr(optimizer_sample.OptimizerSample, "read", spy)
    exact, logger = ExactUpdates(), MemoryLogger()
    stall = StallDetector(check_every_n_steps=5)
    checks: dict[int, dict[str, float]] = {}
    end = stall.on_train_batch_end

    def keep(*args: Any, **kwargs: Any) -> None:
        end(*args, **kwargs)
        if stall.last_check is not None:
            checks[stall.last_check.step] = dict(stall.last_check.update_ratios)

    monkeypatch.setattr(stall, "on_train_batch_end", keep)
    callbacks = [exact, GradientNormLogger(log_every_n_steps=5), OptimizerMonitor(log_every_n_steps=5), stall]
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(80, 16, generator=g), torch.randint(0, 4, (80,), generator=g)
    )
    make_trainer(callbacks, logger, max_steps=10).fit(
        WideNet(), torch.utils.data.DataLoader(data, batch_size=8)
    )
    # the logging steps, and the optimizer monitor's and the stall detector's dense start (steps 0-4)
    assert sorted(readings) == sorted(checks) == [0, 1, 2, 3, 4, 9]
    assert len(samples) == 6  # one sample per measured step, shared by the three monitors
    for step in (0, 4, 9):  # the logging steps, where the logger measures too
        for layer in ("body", "wide", "head"):
            logged = logger.series(f"update_ratio/{layer}")[step]
            assert logged == readings[step][layer] == checks[step][layer], (step, layer)
            tolerance = 0.02 if layer == "wide" else 1e-5  # the wide layer is sampled, the others whole
            assert logged == pytest.approx(exact.ratios[step][layer], rel=tolerance), (step, layer)
