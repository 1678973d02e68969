"""NaN fail-fast: a digits run goes NaN, NaNSentinel stops it at once, says where, and nothing is lost.

Run it with ``.venv/bin/python examples/nan_failfast.py`` from the repository root (a few seconds).

The model standardises every image by its own mean and standard deviation in a custom layer,
``PerImageStandardize``, which divides without an epsilon. The training set holds one blank scan (all
pixels 0, as a scanner glitch would give): its standard deviation is 0, so the layer computes 0/0 = NaN
in the batch that contains it. What happens:

1. ``NaNSentinel`` sees the NaN loss before backward and raises ``NonFiniteError`` before any
   optimizer step applies a poisoned update;
2. the error message and ``nan_report/step_<k>/report.json`` name the step, the batch and the origin:
   replaying the batch with forward hooks finds that ``standardize`` turned finite inputs into NaN;
3. ``batch.pt`` holds the offending batch (we find the blank image in it) and ``last_good.ckpt`` the
   weights after the last good step;
4. we fix the layer (``eps=1e-5``) and resume from ``last_good.ckpt``: training finishes normally.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import GradientNormLogger, NaNSentinel, NonFiniteError
from lightning_gradguard.report import build_report

SEED = 0
RUNS_DIR = "runs"
RUN_NAME = "nan_failfast"
BLANK_INDEX = 1187  # the blank scan; with this seed it lands in the 4th batch of the first epoch


class PerImageStandardize(nn.Module):
    """``(x - mean) / std`` per image. With ``eps=0`` a constant image gives 0/0 = NaN."""

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=1, keepdim=True)
        std = x.std(dim=1, keepdim=True)
        return (x - mean) / (std + self.eps)


class DigitsNet(pl.LightningModule):
    def __init__(self, eps: float = 0.0, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.standardize = PerImageStandardize(eps)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.standardize(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digits_with_a_blank_scan() -> DataLoader[Any]:
    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16.0
    x[BLANK_INDEX] = 0.0  # the glitch
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(SEED))


def make_trainer(max_epochs: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=TensorBoardLogger(RUNS_DIR, name=RUN_NAME),
        callbacks=[NaNSentinel(), GradientNormLogger(log_every_n_steps=5)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
    )


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("lightning_gradguard").setLevel(logging.CRITICAL + 1)  # we print the error ourselves
    for pattern in (".*does not have many workers.*", ".*LeafSpec.*", ".*resuming from a checkpoint.*"):
        warnings.filterwarnings("ignore", message=pattern)


def main() -> None:
    quiet()
    pl.seed_everything(SEED, verbose=False)
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    loader = digits_with_a_blank_scan()

    print("=== 1. training with a layer that divides by a per-image std (no eps) ===")
    try:
        make_trainer(max_epochs=2).fit(DigitsNet(eps=0.0), loader)
    except NonFiniteError as err:
        print(f"NonFiniteError: {err}\n")
        report, folder = err.report, err.report_dir
    else:
        raise SystemExit("expected the run to fail: the blank scan was not reached")
    assert folder is not None

    print("=== 2. the forensic report ===")
    with open(os.path.join(folder, "report.json"), encoding="utf-8") as fh:
        saved = json.load(fh)
    for key in ("kind", "step", "epoch", "batch_idx", "loss", "learning_rates", "precision", "weights"):
        print(f"{key:16s} {saved[key]}")
    print(f"{'origin':16s} {saved['origin']['description']}")
    norms = [round(h["total_grad_norm"], 3) for h in saved["recent_total_grad_norms"][-5:]]
    print(f"{'last grad norms':16s} {norms}")
    for name, path in sorted(saved["files"].items()):
        print(f"{'file ' + name:16s} {path}")

    x, _ = torch.load(os.path.join(folder, "batch.pt"))
    blank = [i for i in range(len(x)) if float(x[i].abs().sum()) == 0.0]
    print(f"\nbatch.pt: sample(s) {blank} of the offending batch are blank images -> std 0 -> 0/0")
    page = build_report(os.path.dirname(os.path.dirname(folder)))  # the failed run: version_<n>/nan_report/..
    print(f"health report (HTML): {page}   (gradguard report <its folder>)")

    print("\n=== 3. fix the layer (eps=1e-5) and resume from last_good.ckpt ===")
    fixed = DigitsNet(eps=1e-5)
    trainer = make_trainer(max_epochs=2)
    trainer.fit(fixed, loader, ckpt_path=saved["files"]["checkpoint"])
    print(
        f"resumed at step {report['step']} and finished at step {trainer.global_step} "
        f"with train/loss {float(trainer.callback_metrics['train/loss']):.3f}"
    )
    print(f"\ntensorboard --logdir {RUNS_DIR}")


if __name__ == "__main__":
    main()
