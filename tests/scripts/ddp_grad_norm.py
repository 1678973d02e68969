"""2-process CPU DDP run (gloo) for tests/integration/test_ddp.py: ``python ddp_grad_norm.py OUTDIR``.

Every rank records the gradient norm it sees in ``on_before_optimizer_step`` (after DDP's all-reduce);
rank 0's GradientNormLogger writes to a CSV and a TensorBoard logger in OUTDIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lightning_gradguard import GradientNormLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: testkit's reference norm
from testkit import reference_total_norm


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.seen: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.seen[self.trainer.global_step] = float(reference_total_norm(grads))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path) -> None:
    pl.seed_everything(0)
    x = torch.randn(96, 8)
    y = torch.randint(0, 3, (96,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        log_every_n_steps=2,
        logger=[CSVLogger(out, name="csv", version=0), TensorBoardLogger(out, name="tb", version=0)],
        callbacks=[GradientNormLogger(histogram_every_n_steps=0)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(model.seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
