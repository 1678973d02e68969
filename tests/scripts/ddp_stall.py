"""2-process CPU DDP run (gloo) for tests/monitors/stall/test_stall.py: ``python ddp_stall.py OUTDIR``.

A digits classifier whose targets come from the previous batch (an off-by-one in the data pipeline: the
loss stays at the chance level). ``DistributedSampler`` shuffles, so the two ranks see different batches:
only losses and label counts pooled across the ranks give both the same chance level and the same
verdict. Every rank records the labels and the loss of each of its batches, what ``StallDetector``
logged at each check (``last_logged``), its label counts and its alerts; each writes
OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from sklearn.datasets import load_digits
from torch import Tensor, nn

from lightning_gradguard import StallDetector


class ShiftedTargets(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.previous: Tensor | None = None
        self.seen: list[tuple[int, list[int], float]] = []  # (step, the batch's own labels, loss)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, labels = batch
        y, self.previous = (self.previous if self.previous is not None else labels), labels
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.seen.append((int(self.trainer.global_step), labels.tolist(), float(loss)))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Record(Callback):
    def __init__(self, detector: StallDetector) -> None:
        self.detector, self.logged = detector, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.detector.last_logged:
            self.logged[trainer.global_step - 1] = self.detector.last_logged
            self.detector.last_logged = {}


def main(out: Path) -> None:
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    data = torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, drop_last=True)
    detector = StallDetector()
    record = Record(detector)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=100,
        log_every_n_steps=10,
        logger=False,
        callbacks=[detector, record],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = ShiftedTargets()
    trainer.fit(model, loader)
    result = {
        "seen": model.seen,
        "logged": record.logged,
        "label_counts": detector.state.label_counts,
        "alerts": [[a.kind, a.step] for a in detector.alerts],
        "world_size": trainer.world_size,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
