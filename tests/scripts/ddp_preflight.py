"""2-process CPU DDP run for tests/monitors/overfit/test_overfit_batch.py: ``python ddp_preflight.py OUTDIR``.

On rank 1 only, a hand-written layer has a wrong backward and the labels are reshuffled on every pass.
GradientCheck (action="warn") must report a mismatch on both ranks (rank 0: "on another rank") and let
training go on; OverfitBatchSanity must then raise SanityCheckError on both ranks, without a hang.
Every rank writes what it saw to OUTDIR/rank<r>.json.
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

from lightning_gradguard import GradientCheck, OverfitBatchSanity, SanityCheckError


class ScaleFn(torch.autograd.Function):
    """y = x * s with a hand-written backward; ``wrong`` drops the factor x from the gradient of s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: torch.Tensor, wrong: bool) -> torch.Tensor:
        ctx.save_for_backward(x, s)
        ctx.wrong = wrong
        return x * s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, s = ctx.saved_tensors
        grad_s = grad.sum(0) if ctx.wrong else (grad * x).sum(0)
        return grad * s, grad_s, None


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.wrong = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleFn.apply(x, self.s, self.wrong)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), Scale(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.net[2].wrong = self.global_rank == 1
        if self.global_rank == 1:
            y = y[torch.randperm(y.shape[0])]
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: Path) -> None:
    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 4, (128,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    grad_check = GradientCheck(action="warn")
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
    result["gradient_alerts"] = [(a.kind, a.where, a.message) for a in grad_check.alerts]
    result["overfit_passed"] = overfit.result.passed if overfit.result else None
    result["overfit_steps"] = overfit.result.steps if overfit.result else None
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
