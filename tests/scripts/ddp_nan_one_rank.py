"""2-process CPU DDP run for tests/integration/test_ddp.py: NaN in rank 1's data only, at optimizer step 3.

Every rank catches what ``trainer.fit`` raises and writes it to OUTDIR/rank<r>.json.
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

from lightning_gradguard import NaNSentinel, NonFiniteError


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1 and self.trainer.global_step == 3:
            x = x.clone()
            x[0, 0] = float("nan")
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path) -> None:
    pl.seed_everything(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randint(0, 3, (160,))), batch_size=8
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        default_root_dir=str(out),
        callbacks=[NaNSentinel()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    result: dict[str, Any] = {"error": None}
    try:
        trainer.fit(Model(), loader)
    except NonFiniteError as err:
        result = {"error": type(err).__name__, "message": str(err), "report": err.report, "time": time.time()}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
