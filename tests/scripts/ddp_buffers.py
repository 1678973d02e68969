"""2-process CPU DDP run for tests/integration/test_ddp.py: a NaN in rank 1's batch at optimizer step 3 of
a BatchNorm CNN, ``NaNSentinel(action="skip")``. (SyncBatchNorm, whose forward would mix the NaN into both
ranks' statistics, runs on CUDA only.)

Each rank writes OUTDIR/<kind>/rank<r>.json: whether the buffers at the end of step 3 equal those at its
start, whether every buffer is finite at the end of the run, and the sentinel's alerts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gradguard import NaNSentinel

FITS = ("batchnorm",)
NAN_STEP = 3


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1 and self.trainer.global_step == NAN_STEP:
            x = x.clone()
            x[0, 0, 0, 0] = float("nan")
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Buffers(pl.Callback):
    """The module's buffers at the start and at the end of step ``NAN_STEP``."""

    def __init__(self) -> None:
        self.start: list[torch.Tensor] = []
        self.end: list[torch.Tensor] = []

    def _copy(self, module: nn.Module) -> list[torch.Tensor]:
        return [b.detach().clone() for b in module.buffers()]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == NAN_STEP:  # one epoch, no step skipped before: the batch index is the step
            self.start = self._copy(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        if i == NAN_STEP:
            self.end = self._copy(pl_module)


def main(out: Path, fits: list[str]) -> None:
    for kind in fits:
        pl.seed_everything(0)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(96, 1, 6, 6), torch.randint(0, 3, (96,))), batch_size=8
        )
        seen, sentinel = Buffers(), NaNSentinel(action="skip")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=5,
            logger=False,
            default_root_dir=str(out / kind),
            callbacks=[seen, sentinel],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        model = Model()
        trainer.fit(model, loader)
        result = {
            "restored": bool(seen.start)
            and len(seen.start) == len(seen.end)
            and all(map(torch.equal, seen.start, seen.end)),
            "finite": all(bool(b.float().isfinite().all()) for b in model.buffers()),
            "alerts": [[a.kind, a.step] for a in sentinel.alerts],
        }
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), list(FITS))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
