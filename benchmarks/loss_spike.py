"""Does LossSpikeGuard catch injected spikes, stay quiet on healthy noise, and does recovery pay off?

Real ``Trainer.fit`` runs on scikit-learn's digits (1347 training and 450 validation images, bundled
with scikit-learn: no download), several seeds each. Seven scenarios:

spiked (a known fault injected at known optimizer steps):

* ``corrupt_batches``: MLP, Adam; four corrupted batches: inputs x20, labels shuffled within the batch,
  inputs x100, labels shuffled;
* ``lr_burst``: MLP, Adam; the learning rate x100 for 3 steps, later x50 for 2 steps (a callback sets
  it at the start of those steps: an external event a rollback cannot replay);

a real divergence (no single bad step):

* ``divergence``: MLP, SGD with momentum; from step 300 the scheduled learning rate grows 2 % per step
  (a ``LambdaLR``, restored with everything else by a rollback); the right answer is to say so and
  stop (escalate to ``raise``), or at least to keep refusing the updates and say so;

healthy (every alert is a false alarm):

* ``small_batch_sgd``: MLP, SGD with momentum, batch 4 (the loss of a batch swings over decades);
* ``warmup``: a one-layer transformer over the image rows, AdamW, linear warm-up over 100 steps to a
  high peak then cosine decay: the loss falls fast and the gradient norm rises as the model wakes up;
* ``cyclic_lr``: MLP, SGD with momentum, ``CyclicLR`` between 0.01 and 0.3 (the loss climbs at every
  peak);
* ``one_cycle``: the small CNN with BatchNorm, SGD, ``OneCycleLR`` up to 0.5.

Per scenario and seed, the runs are: (a) clean (no fault), (b) the faulty run unguarded, (c) guarded
with ``LossSpikeGuard(action="skip")``, (d) guarded with ``LossSpikeGuard(action="rollback")``, both
at their other defaults, and (e) Lightning's ``SpikeDetection()`` at its defaults, which raises
``TrainingSpikeException`` at the first spike it sees (where is reported). Lightning's detector is
also run passively on (a) and (b), counting where it would have raised, to give its false alarms over
a whole run. For healthy scenarios (a) and (b) are the same run.

An alert counts as a detection when it falls on an injected step or within the scenario's ``lag``
steps after it (an LR burst does its damage through the update; the loss shows it a step later); any
other alert is a false alarm. The final loss is the validation cross-entropy of the weights the run
ended with (at the raise, for a run that raised).

Run: ``python benchmarks/loss_spike.py`` (``make bench-spike``; about 3 min on one core) or ``--quick``
(one seed, about 1 min). Prints Markdown tables, writes every number to
``benchmarks/results/loss_spike-<time>.json``.
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
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.spike import SpikeDetection
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_gradguard import LossSpikeError, LossSpikeGuard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import adam, adamw, sgd
from common import digits_cnn as cnn
from common import digits_mlp as mlp
from common import environment as common_environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"
Data = tuple[Tensor, Tensor, Tensor, Tensor]


# ---------------------------------------------------------------------------------------------- data, models
def digits() -> Data:
    d = load_digits()
    x = d.data.astype(np.float32) / 16.0
    xtr, xva, ytr, yva = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    return torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xva), torch.tensor(yva)


class Rows(nn.Module):
    """A one-layer transformer encoder over the 8 rows of a digit image."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(8, 32))
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.encoder(h).mean(1))


Schedule = Callable[[torch.optim.Optimizer, int], Any]


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> Any:
    warm = 100

    def factor(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / max(1, steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def cyclic(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.3, step_size_up=100)


def one_cycle(opt: torch.optim.Optimizer, steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=steps + 1)


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """One training set-up and the fault injected into it (none for a healthy one).

    Steps are ``trainer.global_step`` of the optimizer step (0-based); runs are ``steps`` steps long.
    """

    name: str
    group: str  # "spiked", "divergence" or "healthy"
    what: str
    model: Callable[[], nn.Module]
    optimizer: Callable[[Any, float], torch.optim.Optimizer]
    lr: float
    batch: int
    steps: int
    schedule: Schedule | None = None
    corrupt: Mapping[int, str] = field(default_factory=dict)  # step -> "x<factor>" or "shuffle"
    burst: Mapping[int, float] = field(default_factory=dict)  # step -> LR factor
    diverge_from: int | None = None  # the scheduled LR grows by `growth` per step from here
    growth: float = 1.0
    lag: int = 0  # alerts this many steps after an injected step still count as its detection

    def events(self) -> list[tuple[int, int]]:
        """The injected faults as (first step, last step a detection may fall on)."""
        if self.diverge_from is not None:
            return [(self.diverge_from, self.steps)]
        steps = sorted({*self.corrupt, *self.burst})
        out: list[tuple[int, int]] = []
        for s in steps:  # consecutive injected steps are one event
            if out and s <= out[-1][1] - self.lag + 1:
                out[-1] = (out[-1][0], s + self.lag)
            else:
                out.append((s, s + self.lag))
        return out


#: the corrupted batches of the corrupt_* scenarios: optimizer step -> what is done to its batch
CORRUPTIONS = {250: "x100", 430: "shuffle", 610: "x20+shuffle", 870: "x50+shuffle"}


def scenarios() -> list[Scenario]:
    return [
        Scenario(
            "corrupt_adam",
            "spiked",
            "MLP, Adam 1e-3, batch 32; 4 corrupted batches: inputs x100; labels shuffled; inputs x20 and "
            "labels shuffled; inputs x50 and labels shuffled",
            mlp,
            adam,
            1e-3,
            32,
            1000,
            corrupt=CORRUPTIONS,
        ),
        Scenario(
            "corrupt_sgd",
            "spiked",
            "the same 4 corrupted batches; MLP, SGD 0.05 + momentum 0.9, batch 32",
            mlp,
            sgd,
            0.05,
            32,
            1000,
            corrupt=CORRUPTIONS,
        ),
        Scenario(
            "lr_burst",
            "spiked",
            "MLP, Adam 1e-3, batch 32; LR x100 for 3 steps (from 450), x50 for 2 steps (from 750)",
            mlp,
            adam,
            1e-3,
            32,
            1000,
            burst={450: 100.0, 451: 100.0, 452: 100.0, 750: 50.0, 751: 50.0},
            lag=10,
        ),
        Scenario(
            "divergence",
            "divergence",
            "MLP, SGD 0.05 + momentum 0.9, batch 32; the scheduled LR grows 2 % per step from step 300",
            mlp,
            sgd,
            0.05,
            32,
            1000,
            diverge_from=300,
            growth=1.02,
        ),
        Scenario(
            "small_batch_sgd",
            "healthy",
            "MLP, SGD 0.01 + momentum 0.9, batch 4 (noisy loss)",
            mlp,
            sgd,
            0.01,
            4,
            1000,
        ),
        Scenario(
            "warmup",
            "healthy",
            "row transformer, AdamW peak 3e-3, linear warm-up over 100 steps, cosine decay; batch 32",
            Rows,
            adamw,
            3e-3,
            32,
            1000,
            schedule=warmup_cosine,
        ),
        Scenario(
            "cyclic_lr",
            "healthy",
            "MLP, SGD + momentum, CyclicLR 0.01-0.3 (period 200 steps); batch 32",
            mlp,
            sgd,
            0.01,
            32,
            1000,
            schedule=cyclic,
        ),
        Scenario(
            "one_cycle",
            "healthy",
            "CNN with BatchNorm, SGD + momentum, OneCycleLR up to 0.5; batch 32",
            cnn,
            sgd,
            0.02,
            32,
            1000,
            schedule=one_cycle,
        ),
    ]


# ---------------------------------------------------------------------------------------------- one run
def corrupted(x: Tensor, y: Tensor, kind: str, seed: int) -> tuple[Tensor, Tensor]:
    """A corrupted copy of the batch: ``"x<k>"`` scales the inputs by k, ``"shuffle"`` shuffles the labels."""
    for part in kind.split("+"):
        if part == "shuffle":
            g = torch.Generator().manual_seed(seed)  # its own generator: the global RNG is left alone
            y = y[torch.randperm(y.numel(), generator=g)]
        else:
            x = x * float(part[1:])
    return x, y


class Net(pl.LightningModule):
    """The scenario's model and optimizer; with ``faulty`` its corrupted batches and LR growth."""

    def __init__(self, sc: Scenario, seed: int, faulty: bool) -> None:
        super().__init__()
        self.sc, self.seed, self.faulty = sc, seed, faulty
        self.net = sc.model()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        step = int(self.trainer.global_step)
        kind = self.sc.corrupt.get(step) if self.faulty else None
        if kind is not None:
            x, y = corrupted(x, y, kind, 1000 * self.seed + step)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = self.sc.optimizer(self.parameters(), self.sc.lr)
        scheduler = self.sc.schedule(opt, self.sc.steps) if self.sc.schedule is not None else None
        if self.faulty and self.sc.diverge_from is not None:
            start, growth = self.sc.diverge_from, self.sc.growth
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: growth ** max(0, t - start))
        if scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LRBurst(Callback):
    """Sets the LR at the start of every step: ``base * factor`` on the burst's steps, ``base`` otherwise."""

    def __init__(self, base: float, burst: Mapping[int, float]) -> None:
        self.base, self.burst = base, dict(burst)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        lr = self.base * self.burst.get(int(trainer.global_step), 1.0)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr


class SpikeCounter(SpikeDetection):
    """Lightning's ``SpikeDetection()`` at its defaults, noting the step instead of raising.

    Nothing it does before its first spike differs from the real callback, so its first note is where the
    real one raises; the later notes are where it would have raised again had the run gone on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def _handle_spike(self, fabric: Any, batch_idx: int) -> None:
        self.steps.append(int(fabric.global_step) - 1)  # after the optimizer step: one behind


@dataclass
class Run:
    scenario: str
    seed: int
    variant: str  # clean, unguarded, skip, rollback, lightning
    final_loss: float  # validation cross-entropy of the weights the run ended with (inf: not finite)
    steps: int  # optimizer steps done
    alerts: list[int] = field(default_factory=list)  # steps the detector flagged (this run's own)
    actions: list[str] = field(default_factory=list)
    raised_at: int | None = None  # the step whose exception ended the run
    skipped: int = 0
    rollbacks: int = 0
    passive_lightning: list[int] = field(default_factory=list)  # SpikeCounter's notes on this run
    seconds: float = 0.0


def loader(data: Data, batch: int, seed: int) -> torch.utils.data.DataLoader[Any]:
    xtr, ytr, _, _ = data
    g = torch.Generator().manual_seed(seed)
    dataset = torch.utils.data.TensorDataset(xtr, ytr)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, generator=g)


def val_loss(module: Net, data: Data) -> float:
    _, _, xva, yva = data
    module.net.eval()
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(module.net(xva), yva))
    return loss if math.isfinite(loss) else math.inf


def run(sc: Scenario, seed: int, variant: str, data: Data, guard_kwargs: Mapping[str, Any]) -> Run:
    faulty = variant != "clean"
    torch.manual_seed(seed)
    module = Net(sc, seed, faulty)
    callbacks: list[Callback] = []
    if faulty and sc.burst:
        callbacks.append(LRBurst(sc.lr, sc.burst))
    guard = LossSpikeGuard(action=variant, **guard_kwargs) if variant in ("skip", "rollback") else None
    counter = SpikeCounter() if variant in ("clean", "unguarded") else None
    callbacks += [cb for cb in (guard, counter) if cb is not None]
    if variant == "lightning":
        callbacks.append(SpikeDetection())
    out = Run(sc.name, seed, variant, math.inf, 0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-spike-") as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=sc.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=tmp,
            callbacks=callbacks,
        )
        try:
            trainer.fit(module, loader(data, sc.batch, seed))
        except LossSpikeError:
            out.raised_at = int(trainer.global_step)  # raised before the update: global_step not advanced
        except TrainingSpikeException:
            out.raised_at = int(trainer.global_step) - 1  # raised after the update of that step
            out.alerts = [out.raised_at]
    out.seconds = time.perf_counter() - started
    out.steps = int(trainer.global_step)
    out.final_loss = val_loss(module, data)
    if guard is not None:
        out.alerts = [r.step for r in guard.records]
        out.actions = [r.action for r in guard.records]
        out.skipped, out.rollbacks = guard.dropped_steps, guard.rollbacks
    if counter is not None:
        out.passive_lightning = list(counter.steps)
    return out


# ---------------------------------------------------------------------------------------------- scoring
def score(sc: Scenario, alerts: Sequence[int]) -> tuple[int, int, list[int]]:
    """(events detected, false alarms, the steps of the false alarms) for the alerts of one run."""
    events = sc.events()
    hit = [any(a <= s <= b for s in alerts) for a, b in events]
    false = [s for s in alerts if not any(a <= s <= b for a, b in events)]
    return sum(hit), len(false), false


VARIANTS = {
    "spiked": ("clean", "unguarded", "skip", "rollback", "lightning"),
    "divergence": ("clean", "unguarded", "skip", "rollback", "lightning"),
    "healthy": ("clean", "skip", "rollback", "lightning"),
}


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.inf


def _loss(v: float, ref: float | None = None) -> str:
    if not math.isfinite(v):
        return "diverged"
    return f"{v:.3f}" if ref is None else f"{v:.3f} ({100 * (v / ref - 1):+.0f} %)"


def summarize(sc: Scenario, runs: list[Run]) -> dict[str, Any]:
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.variant, []).append(r)
    seeds = len(by["clean"])
    row: dict[str, Any] = {"scenario": sc.name, "group": sc.group, "what": sc.what, "seeds": seeds}
    row["injected"] = len(sc.events()) if sc.group == "spiked" else 0
    row["loss"] = {v: mean([r.final_loss for r in rs]) for v, rs in by.items()}
    row["loss_per_seed"] = {v: [r.final_loss for r in rs] for v, rs in by.items()}
    for v in ("skip", "rollback", "lightning"):
        scored = [score(sc, r.alerts) for r in by[v]]
        row[v] = {
            "detected": sum(d for d, _, _ in scored),
            "false_alarms": sum(f for _, f, _ in scored),
            "false_alarm_steps": [s for _, _, s in scored],
            "alerts": [r.alerts for r in by[v]],
            "actions": [r.actions for r in by[v]],
            "raised_at": [r.raised_at for r in by[v]],
            "skipped": [r.skipped for r in by[v]],
            "rollbacks": [r.rollbacks for r in by[v]],
            "steps": [r.steps for r in by[v]],
        }
    for v in ("clean", "unguarded"):
        if v in by:
            scored = [score(sc, r.passive_lightning) if v != "clean" else score(sc, []) for r in by[v]]
            row[f"lightning_passive_{v}"] = {
                "alerts": [r.passive_lightning for r in by[v]],
                # on the clean run nothing is injected: every note is a false alarm
                "false_alarms": sum(len(r.passive_lightning) for r in by[v])
                if v == "clean"
                else sum(f for _, f, _ in scored),
            }
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    spiked = [r for r in rows if r["group"] != "healthy"]
    healthy = [r for r in rows if r["group"] == "healthy"]
    if spiked:
        out += [
            "| scenario | injected (x seeds) | detected: skip / rollback | false alarms: skip / rollback "
            "| (a) clean | (b) unguarded | (c) skip | (d) rollback | Lightning SpikeDetection raises at |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in spiked:
            clean = r["loss"]["clean"]
            injected = f"{r['injected']} x {r['seeds']}" if r["group"] == "spiked" else "divergence"
            cells = [
                r["scenario"],
                injected,
                f"{r['skip']['detected']} / {r['rollback']['detected']}",
                f"{r['skip']['false_alarms']} / {r['rollback']['false_alarms']}",
                _loss(clean),
                *(_loss(r["loss"][v], clean) for v in ("unguarded", "skip", "rollback")),
                lightning_cell(r),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if healthy:
        out += [
            "| scenario | false alarms: skip / rollback (all seeds) | final loss: clean | skip | rollback "
            "| Lightning SpikeDetection raises at | its alerts per run had it gone on |",
            "|---|---:|---:|---:|---:|---|---:|",
        ]
        for r in healthy:
            clean = r["loss"]["clean"]
            passive = r["lightning_passive_clean"]["false_alarms"] / r["seeds"]
            cells = [
                r["scenario"],
                f"{r['skip']['false_alarms']} / {r['rollback']['false_alarms']}",
                _loss(clean),
                _loss(r["loss"]["skip"], clean),
                _loss(r["loss"]["rollback"], clean),
                lightning_cell(r),
                f"{passive:.0f}",
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    divergence = [r for r in rows if r["group"] == "divergence"]
    for r in divergence:
        out += [
            f"Divergence (`{r['scenario']}`, LR growth from step "
            f"{scenario_by_name(r['scenario']).diverge_from}): what each guarded run did",
            "",
            "| run | seed | first alert | alerts | skipped | rollbacks | raised at | final loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for v in ("skip", "rollback"):
            d = r[v]
            for i, alerts in enumerate(d["alerts"]):
                raised = d["raised_at"][i]
                cells = [
                    v,
                    str(i),
                    str(alerts[0]) if alerts else "-",
                    str(len(alerts)),
                    str(d["skipped"][i]),
                    str(d["rollbacks"][i]),
                    "-" if raised is None else str(raised),
                    _loss(r["loss_per_seed"][v][i]),
                ]
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def lightning_cell(r: dict[str, Any]) -> str:
    sc = scenario_by_name(r["scenario"])
    parts = []
    for at in r["lightning"]["raised_at"]:
        if at is None:
            parts.append("never")
            continue
        hit = any(a <= at <= b for a, b in sc.events())
        parts.append(f"{at} ({'injected' if hit else 'false alarm'})")
    return ", ".join(parts)


def scenario_by_name(name: str) -> Scenario:
    return next(s for s in scenarios() if s.name == name)


# ---------------------------------------------------------------------------------------------- main
def environment() -> dict[str, Any]:
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"date": when, **common_environment()}


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="one seed (about 1 minute)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per scenario (default 3; --quick: 1)")
    p.add_argument("--scenarios", default="", help="comma-separated subset of scenario names")
    p.add_argument(
        "--guard", default="{}", help="JSON of extra LossSpikeGuard arguments (to try other thresholds)"
    )
    p.add_argument("--json", type=Path, default=None, help="output path (default: benchmarks/results/)")
    args = p.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    seeds = list(range(args.seeds if args.seeds is not None else (1 if args.quick else 3)))
    guard_kwargs = json.loads(args.guard)
    wanted = [s for s in args.scenarios.split(",") if s]
    chosen = [s for s in scenarios() if not wanted or s.name in wanted]
    data = digits()
    env = environment()
    print(f"{len(seeds)} seeds; LossSpikeGuard extra arguments {guard_kwargs or 'none'}; {env}", flush=True)
    rows, all_runs = [], []
    started = time.perf_counter()
    for sc in chosen:
        t0 = time.perf_counter()
        runs = [run(sc, s, v, data, guard_kwargs) for s in seeds for v in VARIANTS[sc.group]]
        all_runs += runs
        rows.append(summarize(sc, runs))
        print(f"# {sc.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    env["wall_s"] = round(time.perf_counter() - started, 1)
    print(markdown(rows))
    path = args.json or RESULTS_DIR / f"loss_spike-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {
        "environment": env,
        "seeds": seeds,
        "guard_kwargs": guard_kwargs,
        "scenarios": [{**asdict(s), "events": s.events()} for s in chosen],
        "summary": rows,
        "runs": [asdict(r) for r in all_runs],
    }
    path.write_text(json.dumps(content, indent=1, default=lambda o: getattr(o, "__name__", str(o))))
    print(f"wall {env['wall_s'] / 60:.1f} min; JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
