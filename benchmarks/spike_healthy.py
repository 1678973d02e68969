"""How often does LossSpikeGuard intervene on healthy runs, and how early does it see a run diverge?

Real ``Trainer.fit`` runs on scikit-learn's digits (no download), LossSpikeGuard at its DEFAULT
arguments (``action="skip"``), several seeds each. Two parts:

**Healthy runs** (every skip and every rollback is a false intervention): a BatchNorm CNN with SGD, a
two-layer pre-LN transformer over the image rows with AdamW (at batch 32 and 128), an MLP with batch-4 SGD,
the transformer with a linear warm-up and cosine decay, an MLP with SGD at a high LR that still trains,
and a deep MLP with a small init that sits on a plateau before it learns. For each run:
the skipped updates, the rollbacks, and every spike the guard saw with its loss and gradient-norm ratios
to the recent median and their robust z-scores (the guard's own ``last_scores``, read right after it).

**Early divergence** (``early_divergence`` alerts): runs whose learning rate is far too high from the
first step (SGD on an MLP and a wide MLP, fine-tuning a trained MLP at SGD lr 5, the loss offset below
zero), and healthy early starts a naive rule would flag (a catapult that rises 2.6x then falls, batch-4
fine-tunes whose loss sits near zero, a loss offset that crosses zero, warm-up, high but working LRs).
For each: the step of the alert, and the largest "last 5 losses above k x the start" factor seen.

Run: ``python benchmarks/spike_healthy.py`` (about 4 minutes on one core) or ``--quick`` (one seed,
shorter runs). Prints Markdown tables, writes every number to
``benchmarks/results/spike_healthy-<time>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from sklearn.datasets import load_digits
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_gradguard import LossSpikeError, LossSpikeGuard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import digits_cnn, digits_mlp
from common import environment as common_environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------------- data, models
def digits_tensors() -> tuple[Tensor, Tensor]:
    d = load_digits()
    x = torch.tensor(d.data.astype(np.float32) / 16.0)
    return (x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(d.target)


def loader(batch: int, seed: int) -> torch.utils.data.DataLoader[Any]:
    x, y = digits_tensors()
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, generator=g, drop_last=True)


class RowTransformer(nn.Module):
    """Each digit as 8 tokens (its rows): a two-layer pre-LN GELU encoder, mean pool, linear head."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 8, d))
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(x.view(-1, 8, 8)) + self.pos).mean(dim=1))


def wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def warmup_cosine(warm: int, total: int) -> Callable[[torch.optim.Optimizer], Any]:
    def factor(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / max(1, total - warm))))

    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


_PRETRAINED: dict[str, Tensor] = {}


def pretrained_mlp() -> nn.Module:
    """``small_mlp`` trained 400 steps with Adam (once per process): a fine-tune starts near zero loss."""
    net = small_mlp()
    if not _PRETRAINED:
        torch.manual_seed(0)
        opt = torch.optim.Adam(net.parameters(), lr=3e-3)
        batches = iter(loader(32, 0))
        for _ in range(400):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader(32, 0))
                x, y = next(batches)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        _PRETRAINED.update({k: v.clone() for k, v in net.state_dict().items()})
    net.load_state_dict(_PRETRAINED)
    return net


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: int
    steps: int
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None
    offset: float = 0.0  # added to the loss (a loss that is negative, or crosses zero)
    diverges: bool = False  # an early-divergence case: the alert is expected


def sgd(lr: float, momentum: float = 0.0) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum)


def adamw(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01)


def plateau_mlp() -> nn.Module:
    """A 4-layer ReLU MLP with its weights scaled by 0.3: the loss sits at ln 10 for ~100 steps, then the
    model leaves the plateau and the gradient norm grows 5-13x in a few steps while the loss falls."""
    net = nn.Sequential(
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):
                m.weight.mul_(0.3)
                m.bias.zero_()
    return net


def healthy(steps: int) -> list[Scenario]:
    short = max(steps // 3, 150)
    return [
        Scenario(
            "cnn", "BatchNorm CNN, SGD 0.05 + momentum 0.9, batch 32", digits_cnn, sgd(0.05, 0.9), 32, steps
        ),
        Scenario(
            "transformer",
            "2-layer pre-LN row transformer, AdamW 1e-3, batch 32",
            RowTransformer,
            adamw(1e-3),
            32,
            steps,
        ),
        Scenario(
            "transformer_b128",
            "the same at batch 128 (steadier norms: a rise after the warm-up scores z 5)",
            RowTransformer,
            adamw(1e-3),
            128,
            short,
        ),
        Scenario(
            "small_batch", "MLP, SGD 0.01 + momentum 0.9, batch 4", digits_mlp, sgd(0.01, 0.9), 4, steps
        ),
        Scenario(
            "warmup_cosine",
            "row transformer, AdamW to 3e-3, 100-step warm-up, cosine; batch 32",
            RowTransformer,
            adamw(3e-3),
            32,
            steps,
            schedule=warmup_cosine(100, steps),
        ),
        Scenario(
            "high_lr",
            "MLP, SGD 0.5 without momentum (1.0 diverges), batch 32",
            digits_mlp,
            sgd(0.5),
            32,
            steps,
        ),
        Scenario(
            "plateau",
            "4-layer MLP, weights x0.3, SGD 0.1 + momentum 0.9, batch 64: a plateau, then learning",
            plateau_mlp,
            sgd(0.1, 0.9),
            64,
            short,
        ),
    ]


def early(steps: int) -> list[Scenario]:
    return [
        Scenario(
            "sgd_lr3", "MLP 64-64-10, SGD lr 3 (no momentum)", small_mlp, sgd(3.0), 32, steps, diverges=True
        ),
        Scenario("sgd_lr2.5", "MLP 64-64-10, SGD lr 2.5", small_mlp, sgd(2.5), 32, steps, diverges=True),
        Scenario(
            "sgdm_lr1",
            "MLP 64-64-10, SGD lr 1 + momentum 0.9",
            small_mlp,
            sgd(1.0, 0.9),
            32,
            steps,
            diverges=True,
        ),
        Scenario(
            "sgd_lr3_offset",
            "MLP, SGD lr 3, loss - 5 (starts negative)",
            small_mlp,
            sgd(3.0),
            32,
            steps,
            offset=-5.0,
            diverges=True,
        ),
        Scenario("wide_sgd_lr2", "MLP 64-1024-10, SGD lr 2", wide_mlp, sgd(2.0), 32, steps, diverges=True),
        Scenario(
            "finetune_sgd_lr5",
            "trained MLP, SGD lr 5 (loss starts ~0.01)",
            pretrained_mlp,
            sgd(5.0),
            32,
            steps,
            diverges=True,
        ),
        Scenario("sane_sgd", "MLP 64-64-10, SGD lr 0.1", small_mlp, sgd(0.1), 32, steps),
        Scenario(
            "high_working_sgd", "MLP 64-64-10, SGD lr 1.5 (rough but trains)", small_mlp, sgd(1.5), 32, steps
        ),
        Scenario(
            "catapult",
            "MLP 64-1024-10, SGD lr 1: the loss rises 2.6x, then falls",
            wide_mlp,
            sgd(1.0),
            32,
            steps,
        ),
        Scenario(
            "adam_warmup",
            "MLP, Adam 3e-3, 20-step linear warm-up",
            small_mlp,
            lambda p: torch.optim.Adam(p, lr=3e-3),
            32,
            steps,
            schedule=warmup_cosine(20, 10**6),
        ),
        Scenario(
            "batch4_sgd", "MLP, SGD 0.03 + momentum 0.9, batch 4 (noisy)", small_mlp, sgd(0.03, 0.9), 4, steps
        ),
        Scenario("offset_negative", "MLP, SGD 0.1, loss - 5", small_mlp, sgd(0.1), 32, steps, offset=-5.0),
        Scenario(
            "offset_crosses_zero",
            "MLP, SGD 0.01 + momentum, batch 4, loss - 2.3",
            small_mlp,
            sgd(0.01, 0.9),
            4,
            steps,
            offset=-2.3,
        ),
        Scenario(
            "finetune_batch4",
            "trained MLP, SGD 0.05 + momentum, batch 4 (loss ~0.004, tail to 0.3)",
            pretrained_mlp,
            sgd(0.05, 0.9),
            4,
            steps,
        ),
        Scenario(
            "finetune_adam",
            "trained MLP, Adam 1e-2 (loss rises 0.01 -> ~0.05)",
            pretrained_mlp,
            lambda p: torch.optim.Adam(p, lr=1e-2),
            32,
            steps,
        ),
        Scenario(
            "finetune_batch4_offset",
            "trained MLP, batch 4, loss - 0.05 (crosses zero)",
            pretrained_mlp,
            sgd(0.05, 0.9),
            4,
            steps,
            offset=-0.05,
        ),
    ]


# ---------------------------------------------------------------------------------------------- one run
class Net(pl.LightningModule):
    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        self.sc = sc
        self.net = sc.model()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y) + self.sc.offset
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = self.sc.optimizer(self.parameters())
        if self.sc.schedule is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sc.schedule(opt), "interval": "step"}}


class Scores(Callback):
    """Placed after the guard: what it saw at each step (its ``last_scores``) and whether it spiked."""

    def __init__(self, guard: LossSpikeGuard) -> None:
        self.guard = guard
        self.spikes: list[dict[str, float]] = []
        self._records = 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if len(self.guard.records) == self._records:
            return
        self._records = len(self.guard.records)
        seen = {"step": float(trainer.global_step)}
        for key, s in self.guard.last_scores.items():
            seen |= {f"{key}_ratio": s.ratio, f"{key}_z": s.zscore}
        self.spikes.append(seen)


@dataclass
class Run:
    scenario: str
    seed: int
    steps: int
    skipped: int = 0
    rollbacks: int = 0
    spikes: list[dict[str, float]] = field(default_factory=list)
    early_alert_step: int | None = None
    first_losses: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    raised_at: int | None = None  # LossSpikeError ended the run at this step


def run(sc: Scenario, seed: int) -> Run:
    torch.manual_seed(seed)
    module = Net(sc)
    guard = LossSpikeGuard()
    scores = Scores(guard)
    raised = None
    with tempfile.TemporaryDirectory(prefix="gradguard-healthy-") as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=sc.steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=tmp,
            callbacks=[guard, scores],
        )
        try:
            trainer.fit(module, loader(sc.batch, seed))
        except LossSpikeError:
            raised = int(trainer.global_step)
    early_steps = [a.step for a in guard.alerts if a.kind == "early_divergence"]
    tail = module.losses[-20:]
    return Run(
        sc.name,
        seed,
        int(trainer.global_step),
        skipped=guard.dropped_steps,
        rollbacks=guard.rollbacks,
        spikes=scores.spikes,
        early_alert_step=early_steps[0] if early_steps else None,
        first_losses=module.losses[:60],
        final_loss=statistics.fmean(tail) if tail else math.nan,
        raised_at=raised,
    )


# ---------------------------------------------------------------------------------------------- report
def _spike_cell(spikes: list[dict[str, float]]) -> str:
    if not spikes:
        return "-"
    return "; ".join(
        f"{int(s['step'])}: loss {s.get('loss_ratio', math.nan):.2g}x z {s.get('loss_z', math.nan):.1f}, "
        f"norm {s.get('grad_norm_ratio', math.nan):.2g}x z {s.get('grad_norm_z', math.nan):.1f}"
        for s in spikes[:4]
    ) + (f" (+{len(spikes) - 4})" if len(spikes) > 4 else "")


def healthy_table(runs: list[Run], scenarios: list[Scenario]) -> str:
    out = [
        "| scenario | steps x seeds | skipped | rolled back | raised "
        "| spikes seen (step: ratio to the median, z) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for sc in scenarios:
        rs = [r for r in runs if r.scenario == sc.name]
        spikes = [s | {"seed": r.seed} for r in rs for s in r.spikes]
        cells = [
            sc.name,
            f"{sc.steps} x {len(rs)}",
            str(sum(r.skipped for r in rs)),
            str(sum(r.rollbacks for r in rs)),
            str(sum(r.raised_at is not None for r in rs)),
            _spike_cell(spikes),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def sustained_factor(losses: list[float], horizon: int = 50) -> float:
    """The largest k such that 5 losses in a row lay k x the start above it (start: median of the first 3;
    the scale is |start| or, when larger, the middle deviation of the first 3), over the first
    ``horizon`` steps: the margin a healthy run leaves below the rule's factor."""
    first = losses[:3]
    if len(first) < 3:
        return math.nan
    start = statistics.median(first)
    scale = max(abs(start), min(abs(v - start) for v in first if v != start) if len(set(first)) > 1 else 0.0)
    scale = scale or 1e-12
    best = -math.inf
    for t in range(7, min(horizon, len(losses))):
        best = max(best, 1.0 + (min(losses[t - 4 : t + 1]) - start) / scale)
    return best


def early_table(runs: list[Run], scenarios: list[Scenario]) -> str:
    out = [
        "| scenario | expected | alert at step (per seed) | largest sustained factor, first 50 steps "
        "| spike rule after the warm-up: skipped / rolled back / raised |",
        "|---|---|---|---|---|",
    ]
    for sc in scenarios:
        rs = [r for r in runs if r.scenario == sc.name]
        cells = [
            f"{sc.name}: {sc.what}",
            "alert" if sc.diverges else "quiet",
            " / ".join("-" if r.early_alert_step is None else str(r.early_alert_step) for r in rs),
            " / ".join(f"{sustained_factor(r.first_losses):.3g}" for r in rs),
            f"{sum(r.skipped for r in rs)} / {sum(r.rollbacks for r in rs)} / "
            f"{sum(r.raised_at is not None for r in rs)}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 300-step healthy runs")
    parser.add_argument("--part", choices=("healthy", "early", "both"), default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_gradguard").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    seeds = (0,) if args.quick else (0, 1, 2)
    parts: dict[str, list[Scenario]] = {}
    if args.part in ("healthy", "both"):
        parts["healthy"] = healthy(300 if args.quick else 1000)
    if args.part in ("early", "both"):
        parts["early"] = early(60)
    results: dict[str, Any] = {"environment": common_environment(1), "seeds": list(seeds)}
    for part, scenarios in parts.items():
        runs = []
        for sc in scenarios:
            for seed in seeds:
                runs.append(run(sc, seed))
                r = runs[-1]
                print(
                    f"  {sc.name} seed {seed}: skipped {r.skipped}, rolled back {r.rollbacks}, raised at "
                    f"{r.raised_at}, early alert {r.early_alert_step}, last loss {r.final_loss:.3g}",
                    flush=True,
                )
        results[part] = [asdict(r) for r in runs]
        print(healthy_table(runs, scenarios) if part == "healthy" else early_table(runs, scenarios), "\n")
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"spike_healthy-{stamp}.json"
    path.write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
