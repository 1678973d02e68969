"""Diagnosis at onset: how many steps after a fault starts do the training monitors say it, and do they
name its cause?

Every case is a real ``Trainer.fit`` on the CPU of a small model (a ReLU MLP on scikit-learn's digits, or
a 2-layer causal transformer language model on synthetic token sequences), a few hundred steps at most,
with all eight training monitors at their defaults (GradientNormLogger, VanishingExplodingDetector,
DeadReLUMonitor, ActivationRangeMonitor, OptimizerMonitor, StallDetector, NaNSentinel, LossSpikeGuard).
A fault (``kind="fault"``) has an ``onset`` (the optimizer step from which it acts), the words its
diagnosis should contain (``cause``: any of them, in an alert's message or hint, names it) and a fixed
twin (``kind="healthy"``: the same run without the fault, where any warning is a false alarm).

Usage::

    python benchmarks/onset_zoo.py            # every case; a markdown table (make bench-onset)
    python benchmarks/onset_zoo.py --case adam_beta2_small --verbose

For each fault: the first warning-or-worse alert, its step minus the onset (the delay), whether any alert
up to the end names the cause, and the first alert that does; for each healthy run: its warnings. The
harm of each fault is shown by its final loss against its twin's.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from zoo import digits, monitors, run_case  # the examples' zoo: its data, its monitors, its Trainer

VOCAB, LENGTH = 32, 16


# ---------------------------------------------------------------------------------------------- data
def tokens(n: int = 1024, batch_size: int = 32, seed: int = 0) -> DataLoader[Any]:
    """Sequences of a fixed random Markov chain over ``VOCAB`` tokens (each token has 2 likely successors):
    learnable well below chance (ln 32 = 3.47 nats) with a floor near ln 2 = 0.69."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=g)
    seq = torch.empty(n, LENGTH + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(LENGTH):
        pick = torch.randint(0, 2, (n,), generator=g)
        seq[:, t + 1] = successors[seq[:, t], pick]
    return DataLoader(
        TensorDataset(seq[:, :-1], seq[:, 1:]),
        batch_size=batch_size,
        shuffle=True,
        generator=g,
        drop_last=True,
    )


# ---------------------------------------------------------------------------------------------- models
class Classifier(pl.LightningModule):
    """Cross-entropy on ``net``'s output: (B, C) logits for labels, or (B, T, V) for next tokens."""

    def __init__(self, net: nn.Module, make_optimizer: Callable[[Any], Any], schedule: Any = None) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = make_optimizer
        self.schedule = schedule
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self.net(x).float()
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = self.make_optimizer(self.parameters())
        if self.schedule is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.schedule(opt), "interval": "step"}}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


class TokenLM(nn.Module):
    """Embedding, learned positions, 2 causal transformer layers (4 heads, d=64), a linear head.

    ``qk_scale`` multiplies the query and key projections at init (1: PyTorch's default init);
    ``ignore_input`` zeroes the token embeddings (a bug that leaves the output input-independent);
    ``norm_first``: pre-LN (``False``: post-LN).
    """

    def __init__(self, qk_scale: float = 1.0, ignore_input: bool = False, norm_first: bool = True) -> None:
        super().__init__()
        d = 64
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, LENGTH, d))
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True, norm_first=norm_first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.ignore_input = ignore_input
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)
        with torch.no_grad():
            for block in self.encoder.layers:
                block.self_attn.in_proj_weight[: 2 * d].mul_(qk_scale)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        if self.ignore_input:
            h = h * 0.0
        return self.head(self.encoder(h + self.pos, mask=self.mask, is_causal=True))


def warmup(steps: int) -> Callable[[Any], Any]:
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / steps))


# ---------------------------------------------------------------------------------------------- cases
Build = Callable[[], tuple[pl.LightningModule, DataLoader[Any]]]


@dataclass(frozen=True)
class Case:
    name: str
    kind: Literal["fault", "healthy"]
    build: Build
    steps: int
    onset: int = 0
    cause: tuple[str, ...] = ()
    twin: str = ""
    what: str = ""
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def _digits_mlp(make_optimizer: Callable[[Any], Any]) -> Build:
    return lambda: (Classifier(mlp(), make_optimizer), digits())


def _lm(make_optimizer: Callable[[Any], Any], schedule: Any = None, **net: Any) -> Any:
    return lambda: (Classifier(TokenLM(**net), make_optimizer, schedule), tokens())


CASES: list[Case] = [
    Case(
        "sgd_lr_too_high",
        "fault",
        _digits_mlp(lambda p: torch.optim.SGD(p, lr=2.0)),
        120,
        cause=("learning rate", "lr"),
        twin="sgd_sane",
        what="SGD at lr 2 on a digits MLP: the loss climbs to many times its start within 20 steps",
    ),
    Case("sgd_sane", "healthy", _digits_mlp(lambda p: torch.optim.SGD(p, lr=0.05)), 120),
    Case(
        "adam_beta2_small",
        "fault",
        _digits_mlp(lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.9, 0.3))),
        120,
        cause=("beta2", "betas"),
        twin="adam_default",
        what="Adam with beta2=0.3 (below beta1^2=0.81): per-entry steps far above lr",
    ),
    Case("adam_default", "healthy", _digits_mlp(lambda p: torch.optim.Adam(p, lr=1e-3)), 120),
    Case(
        "adam_lr_100x",
        "fault",
        _digits_mlp(lambda p: torch.optim.Adam(p, lr=1e-1)),
        120,
        cause=("learning rate", "lr"),
        twin="adam_default",
        what="Adam at lr 0.1, 100x the usual 1e-3: update/weight ratios far above 1e-3",
    ),
    Case(
        "attention_one_hot_init",
        "fault",
        _lm(lambda p: torch.optim.AdamW(p, lr=1e-3), qk_scale=30.0),
        150,
        cause=("init", "QK", "query", "entropy"),
        twin="lm_default",
        what="queries and keys initialised 30x too large: attention near one-hot at step 0",
    ),
    Case("lm_default", "healthy", _lm(lambda p: torch.optim.AdamW(p, lr=1e-3)), 150),
    Case(
        "weight_decay_collapse",
        "fault",
        _lm(lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=50.0)),
        250,
        cause=("weight decay", "weight_decay"),
        twin="lm_default",
        what="AdamW with weight_decay=50: every weight shrinks 5 % a step, the loss sits at chance",
    ),
    Case(
        "input_ignored",
        "fault",
        _lm(lambda p: torch.optim.AdamW(p, lr=1e-3), ignore_input=True),
        250,
        cause=("chance", "input"),
        twin="lm_default",
        what="a bug zeroes the token embeddings: the output cannot depend on the input",
    ),
    Case(
        "lm_warmup_cosine",
        "healthy",
        _lm(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1), schedule=warmup(30)),
        250,
    ),
    Case(
        "bf16_true_small_lr",
        "fault",
        _digits_mlp(lambda p: torch.optim.Adam(p, lr=1e-4)),
        150,
        cause=("bf16", "bfloat16", "precision", "resolution"),
        twin="bf16_mixed_small_lr",
        what="bf16-true weights with Adam at lr 1e-4: most updates are below bfloat16's resolution",
        trainer_kwargs={"precision": "bf16-true"},
    ),
    Case(
        "bf16_mixed_small_lr",
        "healthy",
        _digits_mlp(lambda p: torch.optim.Adam(p, lr=1e-4)),
        150,
        trainer_kwargs={"precision": "bf16-mixed"},
    ),
]


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Outcome:
    case: Case
    alerts: list[Any]
    final_loss: float
    ended: str
    seconds: float

    @property
    def warnings(self) -> list[Any]:
        return [a for a in self.alerts if a.severity != "info"]

    def names_cause(self, alert: Any) -> bool:
        text = f"{alert.message} {alert.hint}".lower()
        return any(word.lower() in text for word in self.case.cause)


def run(case: Case) -> Outcome:
    """Train ``case`` as the examples' zoo trains its cases (seed 0, every training monitor at its
    defaults, no logger, ``log_every_n_steps=10``); a monitor that stops the run is a verdict."""
    callbacks, built = monitors(), []

    def build() -> tuple[pl.LightningModule, DataLoader[Any]]:
        built.append(case.build())  # the module's losses are read even when a monitor stops the run
        return built[-1]

    ended = "completed"
    start = time.perf_counter()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="gradguard-onset-") as tmp:
        warnings.simplefilter("ignore")
        try:
            run_case(replace(case, build=build), callbacks, root_dir=tmp)
        except Exception as err:  # LossSpikeError, NonFiniteError
            ended = f"stopped: {type(err).__name__}"
    seconds = time.perf_counter() - start
    alerts = sorted((a for c in callbacks for a in getattr(c, "alerts", [])), key=lambda a: a.step)
    losses = getattr(built[0][0], "losses", []) if built else []
    tail = [x for x in losses[-10:] if math.isfinite(x)]
    final = sum(tail) / len(tail) if tail else math.nan
    return Outcome(case, alerts, final, ended, seconds)


def _short(alert: Any) -> str:
    return f"{alert.kind} @{alert.step} ({alert.source})"


def row(out: Outcome, twin: Outcome | None) -> str:
    c = out.case
    first = out.warnings[0] if out.warnings else None
    if c.kind == "healthy":
        said = ", ".join(_short(a) for a in out.warnings[:3]) or "quiet"
        return f"| {c.name} | healthy | - | - | {said} | - | {out.final_loss:.3f} | {out.ended} |"
    named = next((a for a in out.warnings if out.names_cause(a)), None)
    delay = "-" if first is None else str(first.step - c.onset)
    named_at = "no" if named is None else f"{_short(named)}, +{named.step - c.onset}"
    harm = f"{out.final_loss:.3f} vs {twin.final_loss:.3f}" if twin is not None else f"{out.final_loss:.3f}"
    first_s = "-" if first is None else _short(first)
    cells = [c.name, str(c.onset), delay, first_s, named_at, ", ".join(c.cause), harm, out.ended]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--case", action="append", help="only these cases (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="print every alert")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        __import__("logging").getLogger(name).setLevel("ERROR")
    chosen = [c for c in CASES if not args.case or c.name in args.case]
    outcomes = {c.name: run(c) for c in chosen}
    head = [
        "case",
        "onset",
        "delay",
        "first alert",
        "cause named (delay)",
        "cause words",
        "final loss vs twin",
    ]
    print("| " + " | ".join([*head, "end"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for c in chosen:
        print(row(outcomes[c.name], outcomes.get(c.twin)), flush=True)
        if args.verbose:
            for a in outcomes[c.name].alerts:
                print(f"    {a.step:4d} {a.severity:8s} {a.kind}: {a.message[:160]}")
    faults = [o for o in outcomes.values() if o.case.kind == "fault"]
    delays = sorted(o.warnings[0].step - o.case.onset for o in faults if o.warnings)
    healthy_alarms = sum(len(o.warnings) for o in outcomes.values() if o.case.kind == "healthy")
    named = sum(any(o.names_cause(a) for a in o.warnings) for o in faults)
    median = delays[len(delays) // 2] if delays else math.nan
    print(
        f"\n{len(faults)} faults: {len(delays)} detected, median delay {median} steps, "
        f"cause named in {named}; "
        f"healthy runs: {healthy_alarms} warnings"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
