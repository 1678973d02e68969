"""How good are the learning rates LRFinderPlus suggests? A benchmark on small real tasks.

For each task a log grid of constant learning rates is trained to find the oracle (the best final
validation loss on the grid): 1e-5..10 at 4 points per decade with 3 seeds, then 8 points per decade with
8 seeds within 3/4 of a decade of the best. Then LRFinderPlus (every suggestion method) and Lightning's
``Tuner(trainer).lr_find`` each suggest a learning rate from the same sweep range and the same
``num_training``, once per seed (8 seeds); the task is trained at each seed's suggestion with that seed.

Two comparisons, because a single grid point's mean is noisy (the seed-to-seed spread of the final
validation loss is up to a fifth of it, and the minimum over many noisy means is biased low):

* trained: the mean validation loss of the 8 trainings at the suggestions against the raw oracle (the
  best 8-seed grid mean);
* pooled: each grid point's mean pooled with its two neighbours (weight 1/2 each), the suggestion read
  off that curve (interpolated in log-LR) against the pooled curve's best.

Tasks (all offline, data bundled with scikit-learn); the last two are held out: no suggestion was scored
on them until the suggestion rules and the default method had been chosen on the first five:

* ``mlp_sgd``: digits, MLP, SGD with momentum 0.9
* ``mlp_adam``: digits, MLP, Adam
* ``cnn_bn``: digits as 8x8 images, small CNN with BatchNorm, SGD with momentum 0.9
* ``regression``: diabetes, MLP regression (MSE on the standardised target), Adam
* ``transformer``: digits, each image row is a token (8 tokens of 8 features), a one-layer transformer
  encoder, AdamW
* ``logreg`` (held out): digits, multinomial logistic regression, plain SGD
* ``cancer_dropout`` (held out): breast cancer, wide MLP with dropout 0.3, RMSprop

It also reads rules that were considered and not adopted off the pooled curve (no extra training).

Run: ``python benchmarks/lr_finder.py`` (about 5 min on one core) or ``--quick`` (coarse grid, 2 seeds).
Writes Markdown tables to stdout and JSON with every number to ``--out``.
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
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.model_selection import train_test_split
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_gradguard import lr_find
from lightning_gradguard.functional.lr_suggest import (
    SUGGESTION_METHODS,
    centered_smooth,
    ema_smooth,
    suggest_minimum,
    suggest_steep,
    suggest_valley,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import adam, adamw, digits_cnn, digits_mlp, sgd

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
    held_out: bool = False


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    xtr, xva, ytr, yva = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


def _cancer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = load_breast_cancer()
    xtr, xva, ytr, yva = train_test_split(d.data, d.target, test_size=0.25, random_state=0, stratify=d.target)
    mu, sd = xtr.mean(0), xtr.std(0)
    f = np.float32
    return (
        torch.tensor(((xtr - mu) / sd).astype(f)),
        torch.tensor(ytr),
        torch.tensor(((xva - mu) / sd).astype(f)),
        torch.tensor(yva),
    )


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

    mlp, cnn = digits_mlp, digits_cnn

    def reg() -> nn.Module:
        return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def plain_sgd(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=lr)

    def rmsprop(p: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(p, lr=lr)

    def logreg() -> nn.Module:
        return nn.Linear(64, 10)

    def wide_dropout() -> nn.Module:
        return nn.Sequential(
            nn.Linear(30, 256),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(256, 2),
        )

    return [
        Task("mlp_sgd", digits, mlp, sgd, ce, 10),
        Task("mlp_adam", digits, mlp, adam, ce, 10),
        Task("cnn_bn", digits, cnn, sgd, ce, 6),
        Task("regression", diabetes, reg, adam, _mse, 30),
        Task("transformer", digits, _Rows, adamw, ce, 8),
        # held out: not looked at while the suggestion rules and the default were chosen
        Task("logreg", digits, logreg, plain_sgd, ce, 10, held_out=True),
        Task("cancer_dropout", _cancer(), wide_dropout, rmsprop, ce, 20, held_out=True),
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


def ours(
    task: Task, seed: int, full: bool = False
) -> tuple[dict[str, float | None], float, list[list[float]]]:
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
    return dict(result.suggestions), seconds, [result.lrs, result.losses]


def _old_valley(lrs: list[float], curve: list[float]) -> float | None:
    """The previous ``valley``: middle of the longest run of strictly decreasing points."""
    best, start = (0, 0), 0
    for i in range(1, len(curve) + 1):
        if i == len(curve) or not curve[i] < curve[i - 1]:
            if i - 1 - start > best[1] - best[0]:
                best = (start, i - 1)
            start = i
    if best[1] - best[0] < 2:
        return None
    return float(10.0 ** (0.5 * (math.log10(lrs[best[0]]) + math.log10(lrs[best[1]]))))


def _half_drop(lrs: list[float], curve: list[float]) -> float | None:
    """Where the curve has fallen half-way from its highest point before the minimum to the minimum."""
    y = np.asarray(curve)
    low = int(np.argmin(y))
    top = int(np.argmax(y[: low + 1]))
    below = np.nonzero(y[top : low + 1] <= 0.5 * (y[top] + y[low]))[0]
    return float(lrs[top + int(below[0])]) if low > 0 and below.size else None


def alternatives(lrs: list[float], losses: list[float]) -> dict[str, float | None]:
    """Rules that were considered and not adopted, on the same sweep (read off the pooled curve only)."""
    curve = centered_smooth(losses)
    steep, minimum = suggest_steep(lrs, curve), suggest_minimum(lrs, curve)
    return {
        "steep on the lagging EMA (beta 0.9)": suggest_steep(lrs, ema_smooth(losses, 0.9)),
        "previous valley (any decreasing run)": _old_valley(lrs, curve),
        "valley, tolerance 0.25": suggest_valley(lrs, curve, tolerance=0.25),
        "valley, tolerance 0.75": suggest_valley(lrs, curve, tolerance=0.75),
        "geometric mean of steep and minimum": (
            math.sqrt(steep * minimum) if steep is not None and minimum is not None else None
        ),
        "half of the drop": _half_drop(lrs, curve),
    }


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


def timing(task: Task, repeats: int = 5) -> dict[str, float]:
    """Wall time of both finders doing the same work (all NUM_TRAINING steps, no early stop), called in
    turn so that a change of load on a shared machine hits both alike; medians over ``repeats`` calls."""
    mine, theirs = [], []
    for s in range(repeats):
        mine.append(ours(task, s, full=True)[1])
        theirs.append(lightning(task, s, full=True)[1])
    return {"time_full_ours": float(np.median(mine)), "time_full_lightning": float(np.median(theirs))}


class Grid:
    """Final validation losses of one task on a log grid of LRs, keyed by ``round(STEPS * log10(lr))``.

    Trainings are cached by (grid key or exact LR, seed), so a suggestion that falls on the grid reuses it.
    """

    STEPS = 8  # the finest grid: 8 points per decade

    def __init__(self, task: Task) -> None:
        self.task = task
        self.runs: dict[int, dict[int, float]] = {}
        self.exact: dict[tuple[float, int], float] = {}

    @classmethod
    def lr(cls, key: int) -> float:
        return float(10.0 ** (key / cls.STEPS))

    def add(self, key: int, seeds: list[int]) -> None:
        done = self.runs.setdefault(key, {})
        for s in seeds:
            if s not in done:
                done[s] = train(self.task, self.lr(key), s)

    def at(self, lr: float | None, seed: int) -> float:
        """One training at ``lr`` with ``seed`` (inf for no LR)."""
        if lr is None or not math.isfinite(lr) or lr <= 0:
            return math.inf
        key = round(self.STEPS * math.log10(lr))
        if abs(self.lr(key) / lr - 1) < 1e-9:
            self.add(key, [seed])
            return self.runs[key][seed]
        if (lr, seed) not in self.exact:
            self.exact[(lr, seed)] = train(self.task, lr, seed)
        return self.exact[(lr, seed)]

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Grid keys, the mean over seeds at each, and the number of seeds."""
        keys = np.array(sorted(self.runs))
        mean = np.array([np.mean(list(self.runs[k].values())) for k in keys])
        count = np.array([len(self.runs[k]) for k in keys], dtype=float)
        return keys, mean, count

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """Each grid point's mean pooled with its nearest neighbours on either side (weight 1/2 each,
        times their seed counts): less noise than one point's mean, at the price of a resolution of about
        a neighbour's distance. A diverged neighbour makes the point diverged too."""
        keys, mean, count = self.means()
        out = np.empty_like(mean)
        for i in range(keys.size):
            idx = [j for j in (i - 1, i, i + 1) if 0 <= j < keys.size]
            w = np.array([count[j] * (1.0 if j == i else 0.5) for j in idx])
            v = mean[idx]
            out[i] = float((w * v).sum() / w.sum()) if np.all(np.isfinite(v)) else math.inf
        return keys, out

    def read(self, lr: float | None) -> float:
        """The pooled curve at ``lr``, interpolated linearly in log-LR (inf for no LR)."""
        if lr is None or not math.isfinite(lr) or lr <= 0:
            return math.inf
        keys, curve = self.pooled()
        x = np.log10([self.lr(int(k)) for k in keys])
        t = math.log10(lr)
        if t <= x[0]:
            return float(curve[0])
        if t >= x[-1]:
            return float(curve[-1])
        j = int(np.searchsorted(x, t)) - 1
        a, b = curve[j], curve[j + 1]
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        return float(a + (t - x[j]) / (x[j + 1] - x[j]) * (b - a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="coarse grid only, fewer seeds")
    parser.add_argument("--tasks", default="", help="comma-separated subset of task names")
    parser.add_argument("--out", default="lr_finder_benchmark.json")
    parser.add_argument("--timing-only", action="store_true", help="only the wall-time comparison")
    args = parser.parse_args()
    logging.getLogger("lightning_gradguard").setLevel(logging.WARNING)  # no per-sweep summary lines
    torch.set_num_threads(1)
    if args.timing_only:
        ours(tasks()[0], 0)  # untimed warm-up of both finders
        lightning(tasks()[0], 0)
        print("| task | LRFinderPlus / Lightning, all 100 steps (median of 5) |\n|---|---|")
        for task in tasks():
            if not args.tasks or task.name in args.tasks.split(","):
                t = timing(task)
                print(
                    f"| {task.name} | {t['time_full_ours']:.2f}s / {t['time_full_lightning']:.2f}s |",
                    flush=True,
                )
        return
    seeds = [0, 1] if args.quick else list(range(8))  # sweeps, trainings at suggestions, fine grid
    coarse_seeds = seeds[:1] if args.quick else seeds[:3]
    coarse_step = 4 if args.quick else 2  # in grid steps of 1/8 decade: 2 or 4 points per decade
    fine_half = 0 if args.quick else 6  # fine grid: +-6 steps (3/4 decade) around the coarse best
    chosen = [t for t in tasks() if not args.tasks or t.name in args.tasks.split(",")]
    methods = [*SUGGESTION_METHODS, "lightning"]
    rows: list[dict[str, Any]] = []
    ours(chosen[0], 0)  # untimed warm-up of both finders (lazy imports, first Trainer)
    lightning(chosen[0], 0)
    started = time.perf_counter()
    for task in chosen:
        t0 = time.perf_counter()
        grid = Grid(task)
        for key in range(-5 * Grid.STEPS, 1, coarse_step):  # 1e-5 .. 1
            grid.add(key, coarse_seeds)
        grid.add(Grid.STEPS, coarse_seeds)  # 10
        keys, mean, _ = grid.means()
        best = int(keys[int(np.argmin(mean))])
        for key in range(best - fine_half, best + fine_half + 1):
            if -5 * Grid.STEPS <= key <= Grid.STEPS:
                grid.add(key, seeds)
        keys, mean, count = grid.means()
        fine = count == len(seeds)  # the raw oracle: only points with every seed
        i = int(np.argmin(np.where(fine, mean, math.inf)))
        oracle_key, oracle = int(keys[i]), float(mean[i])
        pooled_keys, pooled = grid.pooled()
        j = int(np.argmin(np.where(fine, pooled, math.inf)))
        row: dict[str, Any] = {
            "task": task.name,
            "held_out": task.held_out,
            "oracle_lr": Grid.lr(oracle_key),
            "oracle": oracle,
            "oracle_seed_sd": float(np.std(list(grid.runs[oracle_key].values()), ddof=1)),
            "oracle_neighbours": [
                float(np.mean(list(grid.runs[k].values())))
                for k in (oracle_key - 1, oracle_key + 1)
                if k in grid.runs
            ],
            "pooled_oracle_lr": Grid.lr(int(pooled_keys[j])),
            "pooled_oracle": float(pooled[j]),
        }
        mine = [ours(task, s) for s in seeds]
        theirs = [lightning(task, s) for s in seeds]
        suggestions = {m: [sugg[m] for sugg, _, _ in mine] for m in SUGGESTION_METHODS}
        suggestions["lightning"] = [lr for lr, _ in theirs]
        for m in methods:  # one training per seed at that seed's own suggestion
            lrs = suggestions[m]
            trained = [grid.at(lr, s) for lr, s in zip(lrs, seeds, strict=True)]
            row[m] = {
                "lrs": lrs,
                "trained": float(np.mean(trained)),
                "pooled": float(np.mean([grid.read(lr) for lr in lrs])),
            }
        alt = [alternatives(*sweep) for _, _, sweep in mine]
        row["alternatives"] = {
            name: {"lrs": [a[name] for a in alt], "pooled": float(np.mean([grid.read(a[name]) for a in alt]))}
            for name in alt[0]
        }
        row["grid"] = {f"{Grid.lr(int(k)):.4g}": list(grid.runs[int(k)].values()) for k in keys}
        row["time_ours"] = float(np.mean([m[1] for m in mine]))
        row["time_lightning"] = float(np.mean([t[1] for t in theirs]))
        row.update(timing(task))
        rows.append(row)
        print(f"# {task.name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    report(rows, methods, seeds, coarse_step, fine_half, time.perf_counter() - started)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1, default=str)


def _gap(v: float, ref: float) -> str:
    return "fail" if not math.isfinite(v) else f"{100 * (v / ref - 1):+.0f}%"


def report(
    rows: list[dict[str, Any]], methods: list[str], seeds: list[int], coarse: int, half: int, wall: float
) -> None:
    print(
        f"sweep {MIN_LR:g}..{MAX_LR:g}, num_training={NUM_TRAINING}, {len(seeds)} seeds; grid 1e-5..10 at "
        f"{Grid.STEPS // coarse}/decade, {Grid.STEPS}/decade within {half / Grid.STEPS:g} decade of the "
        f"best; wall {wall / 60:.1f} min\n"
    )
    print("Oracle and its noise (raw: best grid mean; pooled: each point pooled with its neighbours)\n")
    print(
        "| task | oracle LR | oracle val loss | seed sd there | neighbours (-1/8, +1/8 decade) "
        "| pooled oracle |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        nb = ", ".join(_gap(v, r["oracle"]) for v in r["oracle_neighbours"])
        name = r["task"] + (" (held out)" if r["held_out"] else "")
        print(
            f"| {name} | {r['oracle_lr']:.2g} | {r['oracle']:.3f} | {r['oracle_seed_sd']:.3f} "
            f"({100 * r['oracle_seed_sd'] / r['oracle']:.0f}%) | {nb} | {r['pooled_oracle']:.3f} at "
            f"{r['pooled_oracle_lr']:.2g} |"
        )
    print("\nGap to the pooled oracle, read off the pooled curve (trained at the suggestion vs raw oracle)\n")
    print("| task | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for r in rows:
        cells = []
        for m in methods:
            lrs = [v for v in r[m]["lrs"] if v is not None]
            where = f"{np.exp(np.mean(np.log(lrs))):.1e}" if lrs else "none"
            pooled, trained = _gap(r[m]["pooled"], r["pooled_oracle"]), _gap(r[m]["trained"], r["oracle"])
            cells.append(f"{pooled} ({trained}) at {where}")
        name = r["task"] + (" (held out)" if r["held_out"] else "")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    for group, label in ((False, "development tasks"), (True, "held-out tasks")):
        sel = [r for r in rows if r["held_out"] == group]
        if not sel:
            continue
        for m in methods:
            on_curve = [r[m]["pooled"] / r["pooled_oracle"] for r in sel]
            at_lr = [r[m]["trained"] / r["oracle"] for r in sel]
            print(
                f"- {label}, {m}: pooled mean {np.mean(on_curve):.3f} worst {max(on_curve):.3f}; "
                f"trained mean {np.mean(at_lr):.3f} worst {max(at_lr):.3f}"
            )
    dev = [r for r in rows if not r["held_out"]]
    if len(dev) > 2:
        print("\nLeave-one-task-out over the development tasks (pick by pooled mean on the others)\n")
        picked = []
        for left in dev:
            rest = [r for r in dev if r is not left]
            best = min(
                SUGGESTION_METHODS,
                key=lambda m: float(np.mean([r[m]["pooled"] / r["pooled_oracle"] for r in rest])),
            )
            picked.append(left[best]["pooled"] / left["pooled_oracle"])
            print(f"- without {left['task']}: {best}, on {left['task']} {_gap(picked[-1], 1.0)}")
        print(f"- mean on the left-out tasks {np.mean(picked):.3f}, worst {max(picked):.3f}")
    names = list(rows[0]["alternatives"])
    print("\nRules considered and not adopted (gap to the pooled oracle, read off the pooled curve)\n")
    print("| task | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        alt = r["alternatives"]
        name = r["task"] + (" (held out)" if r["held_out"] else "")
        print(f"| {name} | " + " | ".join(_gap(alt[n]["pooled"], r["pooled_oracle"]) for n in names) + " |")
    print("\n| task | time ours / Lightning (as run) | time, all 100 steps (median of 5) |\n|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['time_ours']:.2f}s / {r['time_lightning']:.2f}s | "
            f"{r['time_full_ours']:.2f}s / {r['time_full_lightning']:.2f}s |"
        )


if __name__ == "__main__":
    main()
