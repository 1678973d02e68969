"""2-process CPU DDP run (gloo) for tests/monitors/lr_finder/test_lr_finder.py

Run: ``python ddp_lr_finder.py OUTDIR``.

Both ranks run LRFinderPlus at fit start and again at the start of epoch 1; each writes what it saw (the
curves, the suggestions, the LR its optimizer got, its own first sweep loss) to ``rank<r>.json``. Then a fit
of a model that meets its own labels late, whose search runs again: ``retry_rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gradguard import LRFinderPlus
from tests.testkit import LateLabels


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.first_loss: float | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.first_loss is None:
            self.first_loss = float(loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class LateStarter(Model):
    """Meets its own labels only after its first 30 training steps (``tests.testkit.LateLabels``): the
    search's first trials learn nothing it can rank by, and it runs again with longer ones."""

    def __init__(self) -> None:
        super().__init__()
        self.late = LateLabels(after=30)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), self.late(y, self.training))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _digits_loader() -> Any:
    # 512 scikit-learn digits: 8 batches a rank an epoch; the 40-step sweeps start the loader over, and so
    # do the search's 10-step trials (its held-out samples are then a quarter of the data). (Random data of
    # 64 samples in batches of 8 gave sweeps whose fall did not stand out of their noise.)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:512], dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    y = torch.tensor(digits.target[:512], dtype=torch.long)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)


def retried(out: Path) -> None:
    """A fit whose search runs again: both ranks must take the same decision, or one would wait forever."""
    pl.seed_everything(0)
    # trials of 10 and 20 steps, shorter than the 30 steps LateLabels takes: the search must run again
    finder = LRFinderPlus(min_lr=1e-4, max_lr=10.0, num_training=40, plot=False, search_steps=110)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        logger=False,
        callbacks=[finder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(LateStarter(), _digits_loader())
    search = finder.results[0].search
    assert search is not None
    (out / f"retry_rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "retries": search.retries,
                "trials": [[t.round, t.lr, t.steps, t.loss] for t in search.trials],
                "winner": search.winner,
                "reason": search.reason,
                "applied_lr": trainer.optimizers[0].param_groups[0]["lr"],
            }
        )
    )


def main(out: Path) -> None:
    pl.seed_everything(0)
    loader = _digits_loader()
    model = Model()
    finder = LRFinderPlus(
        min_lr=1e-4,
        max_lr=10.0,
        num_training=40,
        plot=False,
        milestones=[0, 1],
        search_steps=45,
        search_candidates=3,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=CSVLogger(out, name="csv", version=0),
        callbacks=[finder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader)
    result = finder.results[0]
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "epochs": [r.epoch for r in finder.results],
                "later": [[r.lrs, r.losses, r.suggestion] for r in finder.results[1:]],
                "lrs": result.lrs,
                "losses": result.losses,
                "suggestions": result.suggestions,
                "sweep_suggestion": result.sweep_suggestion,
                "search": [[t.lr, t.steps, t.loss] for t in result.search.trials] if result.search else None,
                "evaluated_on": result.search.evaluated_on if result.search else None,
                "winner": result.search.winner if result.search else None,
                "stop_reason": result.stop_reason,
                "applied_lr": trainer.optimizers[0].param_groups[0]["lr"],
                "first_applied": result.suggestion if result.applied else None,
                "applied_lrs": [r.applied_lr for r in finder.results],
                "global_step": trainer.global_step,
                "first_loss": model.first_loss,
            }
        )
    )
    retried(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
