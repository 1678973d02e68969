"""How good are the learning rates LRFinderPlus suggests? A benchmark on small real tasks.

For each task a log grid of constant learning rates is trained to find the oracle (the best final
validation loss on the grid). Then LRFinderPlus (every suggestion method) and Lightning's
``Tuner(trainer).lr_find`` each suggest a learning rate from the same sweep range and the same
``num_training``; the task is trained again at each suggestion and its final validation loss compared
with the oracle's. The two finders' wall times are measured too.

Tasks (all offline, data bundled with scikit-learn):

* ``mlp_sgd``: digits, MLP, SGD with momentum 0.9
* ``mlp_adam``: digits, MLP, Adam
* ``cnn_bn``: digits as 8x8 images, small CNN with BatchNorm, SGD with momentum 0.9
* ``regression``: diabetes, MLP regression (MSE on the standardised target), Adam
* ``transformer``: digits, each image row is a token (8 tokens of 8 features), a one-layer transformer
  encoder, AdamW

Run: ``python benchmarks/lr_finder.py`` (about 5 min on one core) or ``--quick`` (coarser grid, one seed).
Writes a Markdown table to stdout and JSON with every number to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.tuner import Tuner
from sklearn.datasets import load_diabetes, load_digits
from sklearn.model_selection import train_test_split
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_gradguard.callbacks.lr_finder import lr_find
from lightning_gradguard.functional.lr_suggest import SUGGESTION_METHODS

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

MIN_LR, MAX_LR, NUM_TRAINING = 1e-6, 10.0, 100
BATCH = 64


@dataclass
class Task:
    name: str
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    make_model: Callable[[], nn.Module]
    make_opt: Callable[[Any, float], torch.optim.Optimizer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    epochs: int


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    xtr, xva, ytr, yva = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _diabetes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = load_diabetes()
    xtr, xva, ytr, yva = train_test_split(d.data, d.target, test_size=0.25, random_state=0)
    mu, sd = xtr.mean(0), xtr.std(0)
    ymu, ysd = ytr.mean(), ytr.std()
    f = np.float32
    return (
        torch.tensor(((xtr - mu) / sd).astype(f)),
        torch.tensor(((ytr - ymu) / ysd).astype(f)),
        torch.tensor(((xva - mu) / sd).astype(f)),
        torch.tensor(((yva - ymu) / ysd).astype(f)),
    )


class _Rows(nn.Module):
    """A one-layer transformer encoder over the 8 rows of a digit image."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(8, 32))
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.encoder(h).mean(1))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y)


def tasks() -> list[Task]:
    digits = _digits()
    diabetes = _diabetes()
    ce = nn.functional.cross_entropy

    def sgd(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr, momentum=0.9)

    def adam(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=lr)

    def adamw(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=lr, weight_decay=0.01)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def cnn() -> nn.Module:
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def reg() -> nn.Module:
        return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    return [
        Task("mlp_sgd", digits, mlp, sgd, ce, 10),
        Task("mlp_adam", digits, mlp, adam, ce, 10),
        Task("cnn_bn", digits, cnn, sgd, ce, 6),
        Task("regression", diabetes, reg, adam, _mse, 30),
        Task("transformer", digits, _Rows, adamw, ce, 8),
    ]


def _loader(task: Task, seed: int) -> torch.utils.data.DataLoader:
    xtr, ytr, _, _ = task.data
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xtr, ytr), batch_size=BATCH, shuffle=True, generator=g
    )


def train(task: Task, lr: float, seed: int) -> float:
    """Final validation loss after ``task.epochs`` epochs at a constant ``lr`` (inf when it blew up)."""
    torch.manual_seed(seed)
    model = task.make_model()
    opt = task.make_opt(model.parameters(), lr)
    model.train()
    for _ in range(task.epochs):
        for x, y in _loader(task, seed):
            loss = task.loss_fn(model(x), y)
            if not torch.isfinite(loss):
                return math.inf
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        _, _, xva, yva = task.data
        val = float(task.loss_fn(model(xva), yva))
    return val if math.isfinite(val) else math.inf


def mean_val(task: Task, lr: float | None, seeds: list[int]) -> float:
    if lr is None or not math.isfinite(lr) or lr <= 0:
        return math.inf
    return float(np.mean([train(task, lr, s) for s in seeds]))


class Module(pl.LightningModule):
    def __init__(self, task: Task, lr: float = 1e-3) -> None:
        super().__init__()
        self.task = task
        self.lr = lr
        self.model = task.make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.task.loss_fn(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return self.task.make_opt(self.parameters(), self.lr)


def _quiet() -> Any:
    return contextlib.redirect_stderr(io.StringIO())


def ours(task: Task, seed: int, full: bool = False) -> tuple[dict[str, float | None], float]:
    torch.manual_seed(seed)
    module = Module(task)
    started = time.perf_counter()
    with _quiet():
        result = lr_find(
            module,
            _loader(task, seed),
            min_lr=MIN_LR,
            max_lr=MAX_LR,
            num_training=NUM_TRAINING,
            progress=False,
            divergence_threshold=None if full else 1.0,
            trainer_kwargs=dict(accelerator="cpu"),
        )
    seconds = time.perf_counter() - started
    assert result is not None
    return dict(result.suggestions), seconds


def lightning(task: Task, seed: int, full: bool = False) -> tuple[float | None, float]:
    torch.manual_seed(seed)
    module = Module(task)
    trainer = pl.Trainer(  # Lightning's sweep ends with the epochs: allow enough of them for num_training
        accelerator="cpu",
        devices=1,
        max_epochs=1000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    with _quiet():
        finder = Tuner(trainer).lr_find(
            module,
            train_dataloaders=_loader(task, seed),
            min_lr=MIN_LR,
            max_lr=MAX_LR,
            num_training=NUM_TRAINING,
            update_attr=False,
            early_stop_threshold=None if full else 4.0,
        )
    seconds = time.perf_counter() - started
    suggestion = finder.suggestion() if finder is not None else None
    for name in os.listdir("."):  # Lightning's finder leaves its checkpoint behind on failure
        if name.startswith(".lr_find_") and name.endswith(".ckpt"):
            os.remove(name)
    return suggestion, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="coarser grid, one seed")
    parser.add_argument("--tasks", default="", help="comma-separated subset of task names")
    parser.add_argument("--out", default="lr_finder_benchmark.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [0] if args.quick else [0, 1, 2]
    per_decade = 2 if args.quick else 4
    grid = [10.0**e for e in np.arange(-5, 1.0 + 1e-9, 1.0 / per_decade)]
    chosen = [t for t in tasks() if not args.tasks or t.name in args.tasks.split(",")]
    rows: list[dict[str, Any]] = []
    for task in chosen:
        t0 = time.perf_counter()
        curve = {lr: mean_val(task, lr, seeds) for lr in grid}
        oracle_lr = min(curve, key=lambda k: curve[k])
        oracle = curve[oracle_lr]
        mine = [ours(task, s) for s in seeds]
        theirs = [lightning(task, s) for s in seeds]
        row: dict[str, Any] = {"task": task.name, "oracle_lr": oracle_lr, "oracle": oracle, "grid": curve}
        for method in SUGGESTION_METHODS:  # one training per seed at that seed's own suggestion
            lrs = [m[0][method] for m in mine]
            losses = [mean_val(task, lr, [s]) for lr, s in zip(lrs, seeds, strict=True)]
            row[method] = {"lrs": lrs, "val": float(np.mean(losses))}
        pl_lrs = [t[0] for t in theirs]
        pl_losses = [mean_val(task, lr, [s]) for lr, s in zip(pl_lrs, seeds, strict=True)]
        row["lightning"] = {"lrs": pl_lrs, "val": float(np.mean(pl_losses))}
        row["time_ours"] = float(np.mean([m[1] for m in mine]))
        row["time_lightning"] = float(np.mean([t[1] for t in theirs]))
        # the same work for both: all NUM_TRAINING steps, no early stop; median of three
        row["time_full_ours"] = float(np.median([ours(task, s, full=True)[1] for s in (0, 1, 2)]))
        row["time_full_lightning"] = float(np.median([lightning(task, s, full=True)[1] for s in (0, 1, 2)]))
        rows.append(row)
        print(f"# {task.name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    def gap(v: float) -> str:
        return "fail" if not math.isfinite(v) else f"{100 * (v / oracle - 1):+.1f}%"

    methods = [*SUGGESTION_METHODS, "lightning"]
    print(
        f"sweep {MIN_LR:g}..{MAX_LR:g}, num_training={NUM_TRAINING}, seeds={seeds}, "
        f"grid {per_decade}/decade\n"
    )
    print(
        "| task | oracle LR | oracle val loss | "
        + " | ".join(methods)
        + " | time ours / Lightning (as run) | time, all 100 steps |"
    )
    print("|---" * (len(methods) + 5) + "|")
    for row in rows:
        oracle = row["oracle"]
        cells = []
        for m in methods:
            lrs = ", ".join("none" if v is None else f"{v:.1e}" for v in row[m]["lrs"])
            cells.append(f"{row[m]['val']:.3f} ({gap(row[m]['val'])}; {lrs})")
        print(
            f"| {row['task']} | {row['oracle_lr']:.1e} | {oracle:.3f} | "
            + " | ".join(cells)
            + f" | {row['time_ours']:.2f}s / {row['time_lightning']:.2f}s"
            + f" | {row['time_full_ours']:.2f}s / {row['time_full_lightning']:.2f}s |"
        )
    print()
    for m in methods:
        ratios = [row[m]["val"] / row["oracle"] for row in rows]
        finite = [r for r in ratios if math.isfinite(r)]
        worst = max(ratios) if ratios else math.nan
        mean = float(np.mean(finite)) if finite else math.nan
        print(
            f"- {m}: mean val loss / oracle {mean:.3f} over {len(finite)}/{len(ratios)} tasks, "
            f"worst {worst:.3f}"
        )
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
