"""2-process CPU DDP run for tests/test_overfit_batch.py: ``python ddp_preflight.py OUTDIR``.

GradientCheck passes on both ranks; OverfitBatchSanity fails on rank 1 only (its labels are reshuffled on
every pass). Every rank must reach the same verdict and raise SanityCheckError, without a hang. Every
rank writes what it saw to OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gradguard.callbacks.gradient_check import GradientCheck
from lightning_gradguard.callbacks.overfit_batch import OverfitBatchSanity, SanityCheckError


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1:
            y = y[torch.randperm(y.shape[0])]
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: Path) -> None:
    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 4, (128,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    grad_check = GradientCheck()
    overfit = OverfitBatchSanity(max_steps=100)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        default_root_dir=str(out),
        callbacks=[grad_check, overfit],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    result: dict[str, Any] = {"error": None}
    try:
        trainer.fit(Model(), loader)
    except SanityCheckError as err:
        result = {"error": type(err).__name__, "message": str(err), "kinds": [a.kind for a in err.alerts]}
    result["time"] = time.time()
    result["global_step"] = trainer.global_step
    result["gradient_check_passed"] = grad_check.result.passed if grad_check.result else None
    result["overfit_passed"] = overfit.result.passed if overfit.result else None
    result["overfit_steps"] = overfit.result.steps if overfit.result else None
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
