"""2-process CPU DDP run (gloo) for tests/monitors/dead_units/test_dead_relu.py

Run: ``python ddp_detectors.py OUTDIR``.

The data differ by rank on purpose: feature 0 is +1 in every sample rank 0 sees and -1 in every sample
rank 1 sees. Twelve of the sixteen units of ``act1`` fire only on +1, so
rank 1 alone would call 75 % of them dead; after the all-reduce of the activity counts both ranks see
them alive. ``act2`` is dead everywhere. From step 6 the loss is multiplied by 1e4 (lr=0 keeps the
weights fixed), which the VanishingExplodingDetector must report on both ranks at the same step; a
second fit with ``action="raise"`` must raise on both ranks at that step. A third fit takes a branch
without any ReLU on rank 1 only: on its sampled steps rank 0 has activations to reduce and rank 1 none,
which must skip those steps on both ranks instead of leaving rank 0 waiting in a collective. The loss adds
``0 * F.relu(logits)``: loss code in ``training_step``, which is no layer under DDP either (the DDP wrapper
runs ``training_step`` inside the module's forward). Every rank writes what its detectors said to
OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gradguard.alerts import GradGuardError
from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor
from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(16, 8)
        self.act2 = nn.ReLU()
        self.out = nn.Linear(8, 3)
        with torch.no_grad():
            self.fc1.weight.zero_()
            self.fc1.weight[:12, 0] = 10.0
            self.fc1.bias[:12] = -5.0  # active only when feature 0 is +1 (rank 0's samples)
            self.fc1.bias[12:] = 100.0
            self.fc2.bias.fill_(-1000.0)  # dead everywhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))) + 0.1 * x[:, :8].sum(1, keepdim=True))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.clone()
        x[:, 0] = 1.0 if self.global_rank == 0 else -1.0  # what each rank's data says about feature 0
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y) + 0.0 * nn.functional.relu(logits).mean()
        return loss * (1e4 if self.trainer.global_step >= 6 else 1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Branching(Model):
    """Rank 1's data take a branch without activations (the same parameters, so DDP is content)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        net = self.net
        if self.global_rank == 1:
            return nn.functional.cross_entropy(net.out(net.fc2(net.fc1(x))), y)
        return nn.functional.cross_entropy(net(x), y)


def main(out: Path) -> None:
    pl.seed_everything(0)
    x = torch.randn(96, 8)
    y = torch.randint(0, 3, (96,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    ve, dr = VanishingExplodingDetector(), DeadReLUMonitor()
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        default_root_dir=str(out),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer = pl.Trainer(**common, callbacks=[ve, dr])
    trainer.fit(Model(), loader)
    result: dict[str, Any] = {
        "alerts": [[a.kind, a.where, a.step] for a in ve.alerts + dr.alerts],
        "dead_fractions": dr.dead_fractions,
        "sampled_batches": dr.sampled_batches,
        "steps": trainer.global_step,
    }
    # the same run with action="raise": both ranks must raise at the same step
    raising = VanishingExplodingDetector(action="raise")
    trainer = pl.Trainer(**{**common, "callbacks": [raising]})
    try:
        trainer.fit(Model(), loader)
        result["raised"] = None
    except GradGuardError as err:
        result["raised"] = [type(err).__name__, [a.step for a in err.alerts]]
    branching = DeadReLUMonitor(check_saturation=False)
    trainer = pl.Trainer(**{**common, "max_epochs": 1, "callbacks": [branching]})
    trainer.fit(Branching(), loader)
    result["branching"] = [trainer.global_step, branching.sampled_batches]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
