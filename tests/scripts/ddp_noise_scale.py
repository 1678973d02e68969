"""2-process CPU DDP run (gloo) for tests/monitors/gradients/test_noise_scale.py

Run: ``python ddp_noise_scale.py OUTDIR``.

Least squares on fixed synthetic data (lr=0: the weights, and so the true gradient and its covariance,
stay put), ``accumulate_grad_batches=2`` of 8 samples per rank: b = 8 (one rank's micro-batch), B = 32.
Every rank records which samples each of its micro-batches held; rank 0 records what
``GradientNormLogger(log_noise_scale=True)`` logged at each step; every rank records its EMA state at the
end (equal on both after the last logging step's all-reduce). Each rank writes OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_gradguard import GradientNormLogger

FEATURES, BETA = 6, 0.9


def dataset(n: int = 640, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``(x, y, index)``: y = x @ w* + noise (sd 5); the index lets a test rebuild every micro-batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, generator=g) + 5.0 * torch.randn(n, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


class LeastSquares(pl.LightningModule):
    """A linear model on the mean squared error; records the samples of every micro-batch by step."""

    def __init__(self, lr: float = 0.0, seed: int = 1) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, 1)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # the same start in every process and run, away from the optimum
            self.lin.weight.copy_(torch.randn(1, FEATURES, generator=g))
            self.lin.bias.fill_(0.5)
        self.lr = lr
        self.batches: list[tuple[int, Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index = batch
        self.batches.append((int(self.trainer.global_step), index.clone()))
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Record(Callback):
    def __init__(self, gnl: GradientNormLogger) -> None:
        self.gnl, self.logged = gnl, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        noise = {k: v for k, v in self.gnl.last_logged.items() if k.startswith("noise_scale/")}
        if noise:
            self.logged[trainer.global_step - 1] = noise
            self.gnl.last_logged = {}


def main(out: Path) -> None:
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False)
    model = LeastSquares()
    gnl = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0, log_noise_scale=True,
                             noise_scale_beta=BETA)  # fmt: skip
    record = Record(gnl)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        logger=False,
        callbacks=[gnl, record],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader)
    result = {
        "batches": [[step, idx.tolist()] for step, idx in model.batches],
        "logged": record.logged,
        "ema": gnl._noise.ema.state.tolist(),
        "world_size": trainer.world_size,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
