"""2-process CPU DDP run (gloo) for tests/monitors/spike/test_loss_spike.py

Run: ``python ddp_loss_spike.py OUTDIR``.

Only rank 1's data spike, at optimizer step 12 (its inputs x30). Fit 1 (``action="skip"``): the guard judges
the all-reduced numbers, so both ranks must skip step 12; the weights must stay identical across ranks,
and ``spikes.json`` must be written by rank 0 alone (every write is logged, per rank). Fit 2
(``action="raise"``): both ranks must raise ``LossSpikeError`` at step 12. Every rank writes what it saw
to OUTDIR/rank<r>.json and its final weights of fit 1 to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

import lightning_gradguard.monitors.spike.records as spike_records
from lightning_gradguard import LossSpikeError, LossSpikeGuard

THRESHOLDS: dict[str, Any] = dict(
    loss_threshold=6.0, grad_norm_threshold=6.0, min_ratio=2.0, window_steps=16, warmup_steps=8
)
WRITES: list[str] = []
_write = spike_records.write_spikes


def _logged_write(path: str, records: list[Any]) -> None:
    WRITES.append(path)
    _write(path, records)


spike_records.write_spikes = _logged_write  # record_spike looks the name up in its module


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1 and self.trainer.global_step == 12:
            x = x * 30.0
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses[self.trainer.global_step] = float(loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Probe(pl.Callback):
    """Weights before and after step 12; the steps whose gradients were all dropped (after the guard)."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.dropped: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 12:
            self.weights["before"] = copy.deepcopy(pl_module.state_dict())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if all(p.grad is None for p in pl_module.parameters()):
            self.dropped.append(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 13:
            self.weights["after"] = copy.deepcopy(pl_module.state_dict())


def main(out: Path) -> None:
    pl.seed_everything(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,))), batch_size=8
    )
    common: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    guard, probe, model = LossSpikeGuard(action="skip", **THRESHOLDS), Probe(), Model()
    trainer = pl.Trainer(**common, default_root_dir=str(out / "skip"), callbacks=[guard, probe])
    trainer.fit(model, loader)
    rank = trainer.global_rank
    same = all(
        torch.equal(probe.weights["before"][k], probe.weights["after"][k]) for k in probe.weights["before"]
    )
    result: dict[str, Any] = {
        "records": [r.to_dict() for r in guard.records],
        "alerts": [[a.step, a.message] for a in guard.alerts],
        "dropped": probe.dropped,
        "unchanged_at_12": same,
        "losses": model.losses,
        "steps": trainer.global_step,
        "writes": list(WRITES),
    }
    torch.save(model.state_dict(), out / f"rank{rank}.pt")

    raising = LossSpikeGuard(action="raise", **THRESHOLDS)
    trainer = pl.Trainer(**common, default_root_dir=str(out / "raise"), callbacks=[raising])
    try:
        trainer.fit(Model(), loader)
        result["raised"] = None
    except LossSpikeError as err:
        result["raised"] = [
            type(err).__name__,
            [a.step for a in err.alerts],
            trainer.global_step,
            time.time(),
        ]
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
