"""A dropped update is a fact of the step (``StepStats.dropped``), and every monitor that measured the step
reads it there: GradientNormLogger, OptimizerMonitor and StallDetector judge no dropped update.

The dropping callback runs *first*, before the monitors take their sample of the step: a monitor that
compared the Trainer's skip counters before and after its own sample (the old way) would see nothing
change and judge the dropped step; one that ignores the drop altogether judges it too.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from conftest import make_trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import GradientNormLogger, OptimizerMonitor, StallDetector
from lightning_gradguard.core.skips import skip_update, skipped_updates
from lightning_gradguard.core.stats import step_stats

DROPPED = {3, 5}
STEPS = 8


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Dropper(Callback):
    """Drops the update of the steps in ``DROPPED`` (as NaNSentinel and LossSpikeGuard do), and notes
    every step's weights before and after the update, and what the step's statistics say."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.changed: dict[int, bool] = {}
        self.fact: dict[int, str | None] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        step = trainer.global_step
        self.before[step] = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        if step in DROPPED:
            skip_update(trainer, optimizer, "loss_spike")
        self.fact[step] = step_stats(trainer, pl_module, optimizer).dropped

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step - 1
        after = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        self.changed[step] = not torch.equal(after, self.before[step])


class Logger(GradientNormLogger):
    judged: list[int]

    def _judge_ratio(self, trainer: pl.Trainer, p: Any, reading: Any) -> None:
        self.judged.append(p.at)
        super()._judge_ratio(trainer, p, reading)


class Optimizer(OptimizerMonitor):
    judged: list[int]

    def _judge(self, trainer: pl.Trainer, reading: Any, suffix: str, layers: bool) -> None:
        self.judged.append(trainer.global_step - 1)
        super()._judge(trainer, reading, suffix, layers)


class Stall(StallDetector):
    judged: list[int]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        check = self.last_check
        if check is not None and check.step == trainer.global_step - 1 and check.update_ratios:
            self.judged.append(check.step)


def test_a_dropped_update_is_seen_as_dropped_by_every_monitor_from_the_one_fact() -> None:
    torch.manual_seed(0)
    dropper = Dropper()
    monitors = [Logger(), Optimizer(), Stall(check_every_n_steps=1)]
    for m in monitors:
        m.judged = []
    data = TensorDataset(torch.randn(16 * STEPS, 6), torch.randint(0, 4, (16 * STEPS,)))
    trainer = make_trainer([dropper, *monitors], max_steps=STEPS)
    trainer.fit(Net(), DataLoader(data, batch_size=16))

    # the independent record: the dropped steps left the weights as they were, the others changed them
    assert {s for s, changed in dropper.changed.items() if not changed} == DROPPED
    assert {s for s, cause in dropper.fact.items() if cause is not None} == DROPPED
    assert skipped_updates(trainer) == {"loss_spike": len(DROPPED)}
    for m in monitors:
        assert set(m.judged) == set(range(STEPS)) - DROPPED, (type(m).__name__, m.judged)
