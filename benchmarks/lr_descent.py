"""Does LRFinderPlus refuse every sweep whose loss cannot fall, and suggest on every sweep that learns?

Real sweeps (``lr_find`` at its defaults but the number of points, one thread) of small models on the
scikit-learn digits, in two families:

* **no descent**: the loss cannot fall, whatever the LR: the logits detached from the weights (their
  loss is the batch's noise only), a bias-only model (the loss can fall by about 2e-4 of itself), and a
  loss ``1 + noise`` that does not depend on the weights at all; at batch sizes 32 to 1, with SGD and
  Adam, 20 to 100 points. Each must give no suggestion, also after the averaged repeats;
* **descent**: the same MLP learning, at batch sizes 32 to 4, SGD and Adam, 20 to 100 points. Each
  should give one.

Prints, per case, the sweeps, how many gave a suggestion, the largest / smallest descent ratio and the
sweeps averaged; writes every number to ``--out``. ``python benchmarks/lr_descent.py`` (about 10 minutes
on one core); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_gradguard import lr_find

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
logging.getLogger("lightning_gradguard").setLevel(logging.ERROR)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(d.target)


class Sweep(pl.LightningModule):
    """A digits MLP whose loss is ``kind``: ``learns``, ``detached``, ``bias_only`` or ``constant``."""

    def __init__(self, kind: str, optimizer: str) -> None:
        super().__init__()
        self.kind, self.optimizer, self.lr = kind, optimizer, 1e-3
        if kind == "bias_only":
            self.net: nn.Module = nn.Linear(64, 10)
            self.net.weight.requires_grad_(False)
        else:
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.noise = torch.Generator().manual_seed(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if self.kind == "detached":
            return nn.functional.cross_entropy(out.detach(), y) + 0.0 * out.sum()
        if self.kind == "constant":
            return 1.0 + 0.05 * torch.randn((), generator=self.noise) + 0.0 * out.sum()
        return nn.functional.cross_entropy(out, y)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)


def sweep(kind: str, optimizer: str, batch: int, points: int, seed: int) -> dict[str, Any]:
    x, y = _digits()
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g
    )
    pl.seed_everything(seed, verbose=False)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        result = lr_find(
            Sweep(kind, optimizer),
            loader,
            num_training=points,
            progress=False,
            trainer_kwargs=dict(accelerator="cpu"),
        )
    assert result is not None
    return {
        "suggestion": result.suggestion,
        "ratio": result.descent.ratio if result.descent is not None else 0.0,
        "sweeps": getattr(result, "sweeps", 1),  # 1 before the repeats
        "points": len(result.lrs),
    }


def cases(quick: bool) -> list[tuple[str, str, int, int, int]]:
    seeds = 2 if quick else 5
    out = []
    for kind in ("detached", "bias_only", "constant", "learns"):
        for optimizer in ("sgd", "adam"):
            for batch in (32, 8, 4, 1) if kind != "learns" else (32, 8, 4):
                for points in (100, 40, 20):
                    if kind in ("bias_only", "constant") and batch == 8:
                        continue
                    out.extend((kind, optimizer, batch, points, s) for s in range(seeds))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="lr_descent.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {}
    for kind, optimizer, batch, points, seed in cases(args.quick):
        key = f"{kind} {optimizer} batch {batch}, {points} points"
        rows.setdefault(key, []).append(sweep(kind, optimizer, batch, points, seed))
    print("| case | sweeps | suggested | ratio: largest / smallest | sweeps averaged (most) |")
    print("|---|---:|---:|---|---:|")
    for key, found in rows.items():
        ratios = [r["ratio"] for r in found]
        suggested = sum(r["suggestion"] is not None for r in found)
        most = max(r["sweeps"] for r in found)
        print(f"| {key} | {len(found)} | {suggested} | {max(ratios):.2f} / {min(ratios):.2f} | {most} |")
    for family in ("detached", "bias_only", "constant", "learns"):
        found = [r for k, v in rows.items() if k.startswith(family) for r in v]
        suggested = sum(r["suggestion"] is not None for r in found)
        print(f"\n{family}: {suggested} of {len(found)} sweeps gave a suggestion", end="")
    print(f"\n\nwall {time.perf_counter() - started:.0f} s")
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
