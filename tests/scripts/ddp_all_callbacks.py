"""2-process CPU DDP run (gloo) with all seven callbacks, for tests/integration/test_integration.py.

``python ddp_all_callbacks.py OUTDIR`` runs two fits in the same process group:

1. a healthy one with TensorBoard and CSV loggers under OUTDIR: every rank records the callbacks'
   verdicts and what its own optimizer steps saw;
2. a plain one (no callbacks) started with the LR the finder suggested in 1: its weights must equal 1's;
3. one whose rank 1 gets a NaN in its batch at optimizer step ``NAN_AT``: every rank records what
   ``trainer.fit`` raised.

Each rank writes OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lightning_gradguard import LRFinderPlus
from lightning_gradguard.alerts import NonFiniteError
from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor
from lightning_gradguard.monitors.gradcheck.callback import GradientCheck
from lightning_gradguard.monitors.gradients.callback import GradientNormLogger
from lightning_gradguard.monitors.nan.callback import NaNSentinel
from lightning_gradguard.monitors.overfit.callback import OverfitBatchSanity
from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: testkit's reference norm
from testkit import SEARCH_STEPS, reference_total_norm

NAN_AT = 3
N_SAMPLES, BATCH = 192, 8  # 12 optimizer steps per rank and epoch


class Model(pl.LightningModule):
    def __init__(self, nan_at: int | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.nan_at = nan_at
        self.steps: list[int] = []
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.nan_at is not None and self.global_rank == 1 and self.trainer.global_step == self.nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.steps.append(int(self.trainer.global_step))
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(reference_total_norm(grads)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def callbacks() -> list[Any]:
    return [
        OverfitBatchSanity(),
        GradientCheck(),
        LRFinderPlus(
            min_lr=1e-4, max_lr=10.0, num_training=20, search_steps=SEARCH_STEPS, progress=False, plot=False
        ),
        GradientNormLogger(histogram_every_n_steps=4),
        VanishingExplodingDetector(),
        DeadReLUMonitor(sample_every_n_steps=3),
        NaNSentinel(),
    ]


def loader() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def trainer(out: Path, cbs: list[Any], logger: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        log_every_n_steps=2,
        gradient_clip_val=1.0,
        logger=logger,
        default_root_dir=str(out),
        callbacks=cbs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    cbs = callbacks()
    overfit, gcheck, finder, gnl, vx, relu, sentinel = cbs
    model = Model()
    healthy = trainer(
        out, cbs, [TensorBoardLogger(out, name="tb", version=0), CSVLogger(out, name="csv", version=0)]
    )
    healthy.fit(model, loader())
    result: dict[str, Any] = {
        "steps": model.steps,
        "norms": model.norms,
        "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "lr": healthy.optimizers[0].param_groups[0]["lr"],
        "overfit": [overfit.result.passed, overfit.result.steps, overfit.result.final_loss],
        "gradient_check": gcheck.result.passed,
        "finder": [finder.result.suggestion, finder.result.lrs, finder.result.losses],
        "sentinel_history_steps": sentinel.norm_history.steps,
        "vx_history": vx.history.get(0, []),
        "relu_sampled": relu.sampled_batches,
        "relu_dead": relu.dead_fractions,
        "clip_seen": gnl._clip_seen,
        "alerts": {type(cb).__name__: [a.kind for a in cb.alerts] for cb in cbs},
    }

    pl.seed_everything(0, verbose=False)
    plain = Model(lr=result["lr"])
    trainer(out / "plain", [], False).fit(plain, loader())
    result["plain_weights"] = [p.detach().reshape(-1).tolist() for p in plain.parameters()]

    pl.seed_everything(0, verbose=False)
    cbs = callbacks()
    failing = trainer(out / "nan", cbs, False)
    try:
        failing.fit(Model(nan_at=NAN_AT), loader())
        result["nan"] = {"error": None}
    except NonFiniteError as err:
        result["nan"] = {
            "error": type(err).__name__,
            "message": str(err),
            "report": err.report,
            "time": time.time(),
            "alerts": {type(cb).__name__: [a.kind for a in cb.alerts] for cb in cbs},
        }
    except Exception as err:  # anything else is a failure the test shows
        result["nan"] = {"error": f"{type(err).__name__}: {err}"}
    (out / f"rank{healthy.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
