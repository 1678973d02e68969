"""LRFinderPlus on scikit-learn's digits: find the learning rate, apply it, train, and look again later.

Run it from the repository root (CPU: about 6 s, most of it spent importing; each range test
takes under half a second)::

    .venv/bin/python examples/lr_find.py
    tensorboard --logdir runs

It does two things:

1. ``lr_find(model, loader)``: the plain function. A range test in a throwaway Trainer writes the
   suggestion to ``model.lr`` and leaves the weights untouched.
2. ``LRFinderPlus`` as a callback: a range test at fit start (suggestion applied to the optimizer and
   the scheduler) and again at the start of epoch 4 (milestone), in the middle of training, with the
   run continuing exactly as if it had been started with the suggested learning rate.

The curves go to TensorBoard (``lr_finder/loss``, ``lr_finder/smoothed_loss``, ``lr_finder/lr`` and the
``_epoch4`` variants; the figure under Images) and to ``lr_finder*.csv`` / ``lr_finder*.png`` in the log
directory; each applied learning rate goes to the run's hyperparameters (``hparams.yaml``:
``lr_finder/applied_lr``, ``lr_finder/applied_lr_epoch4``). A sweep shows a progress bar on stderr while it
runs, then one summary line; "applied" is printed only for a learning rate that was really set.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import LRFinderPlus, lr_find
from lightning_gradguard.report import build_report

SEED = 0
BATCH_SIZE = 64


class DigitsMLP(pl.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
        }


def loaders() -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    train = DataLoader(TensorDataset(xtr, ytr), batch_size=BATCH_SIZE, shuffle=True)
    val = DataLoader(TensorDataset(xva, yva), batch_size=512)
    return train, val


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    train, val = loaders()

    # 1. the plain function, before training
    pl.seed_everything(SEED)
    model = DigitsMLP(lr=1e-3)
    result = lr_find(
        model, train, min_lr=1e-6, max_lr=10.0, progress=False, trainer_kwargs={"accelerator": "cpu"}
    )
    assert result is not None  # None only under fast_dev_run
    if result.suggestion is not None:
        print(f"lr_find: suggestion {result.suggestion:.3e} -> model.lr = {model.lr:.3e}")
    else:
        print(f"lr_find: no suggestion ({result.reason}); model.lr stays {model.lr}")
    print(
        "         all methods:", {k: None if v is None else f"{v:.2e}" for k, v in result.suggestions.items()}
    )

    # 2. the callback: at fit start and again at epoch 4
    pl.seed_everything(SEED)
    model = DigitsMLP(lr=1e-3)
    finder = LRFinderPlus(min_lr=1e-6, max_lr=10.0, num_training=100, milestones=[0, 4])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=8,
        logger=TensorBoardLogger("runs", name="lr_find"),
        callbacks=[finder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, train, val)
    for r in finder.results:
        suggestion = f"{r.suggestion:.3e}" if r.suggestion is not None else f"none ({r.reason})"
        trained_with = f", the run trains with lr {r.applied_lr:.3e}" if r.applied_lr is not None else ""
        print(
            f"epoch {r.epoch}: {len(r.lrs)} points ({r.stop_reason}), suggestion ({r.method}) "
            f"{suggestion}, applied={r.applied}{trained_with}, {r.seconds:.2f}s"
        )
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    print("final metrics:", metrics)
    print("curves, CSV and figures in", trainer.log_dir, "(the applied LRs in hparams.yaml)")
    print("health report (HTML):", build_report(trainer.log_dir or "runs"))


if __name__ == "__main__":
    main()
