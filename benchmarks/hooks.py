"""What our hooks cost per training step: Python calls and aten ops counted, hook time against the floor.

On a GPU the device work of an every-step check is microseconds; what a user pays per step is the CPU
time our hooks spend in Python before the next kernels launch. This benchmark measures that directly, on
one model (a 4-layer ``nn.TransformerEncoder`` language model, d=256, vocabulary 1000, batch 16 x 64
tokens, AdamW), at the callbacks' defaults, in the steady state (after step 25):

* **counts** (independent of the machine's load): the Python function calls (``sys.setprofile``
  ``call`` events) and the aten ops (a ``TorchDispatchMode``) made inside every hook method of the
  watched callbacks, per optimizer step, beside those of Lightning's whole training step and of the
  *floor* (the least an every-step check can do: one fused norm of all gradients and one host read);
* **time** (wall clock, same process, interleaved rounds): the time spent inside the hooks per step,
  against the floor's.

Groups: NaNSentinel alone; the four monitors (GradientNormLogger, VanishingExplodingDetector,
DeadReLUMonitor, NaNSentinel); all eight training monitors (those four and LossSpikeGuard,
OptimizerMonitor, ActivationRangeMonitor, StallDetector). ``make bench-hooks``; ``--quick`` for a smoke
run; ``--profile GROUP`` lists where a group's calls go.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import environment
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import (
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradientNormLogger,
    LossSpikeGuard,
    NaNSentinel,
    OptimizerMonitor,
    StallDetector,
    VanishingExplodingDetector,
)

SEED = 0
STEADY_FROM = 25
RESULTS = Path(__file__).resolve().parent / "results" / "hooks.json"
#: the issue's targets, per steady-state step (calls, aten ops) and the time ratio to the floor: on the median
#: step, and for the groups of ``ON_THE_MEAN`` on the mean over the steady state (steps 25-74: a whole cycle
#: of the defaults' cadences, with the detector's checks and a logging step)
TARGETS = {
    "nan_sentinel": (60, 6, 1.2),
    "four_monitors": (100, 12, None),
    "eight_monitors": (200, None, None),
}


# ---------------------------------------------------------------------------------------------- the model
class TinyLM(pl.LightningModule):
    """A 4-layer pre-LN transformer language model: next-token cross-entropy over 1000 tokens."""

    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch  # 65 tokens: 64 in, the next 64 out
        h = self.encoder(self.embed(tokens[:, :-1]) + self.pos, mask=self.mask)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def loader(steps: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(SEED)
    return DataLoader(TensorDataset(torch.randint(0, 1000, (16 * steps, 65), generator=g)), batch_size=16)


class Floor(Callback):
    """The least an every-step check can do: one fused norm of all gradients and one host read (the
    parameter list taken once, so a step makes no Python call beyond the hook and one comprehension)."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if not self.params:
            self.params = list(pl_module.parameters())
        grads = [p.grad for p in self.params if p.grad is not None]
        bool(torch.stack(torch._foreach_norm(grads)).norm().isfinite())


GROUPS: dict[str, Callable[[], list[Callback]]] = {
    "floor": lambda: [Floor()],
    "nan_sentinel": lambda: [NaNSentinel()],
    "four_monitors": lambda: [
        GradientNormLogger(),
        VanishingExplodingDetector(),
        DeadReLUMonitor(),
        NaNSentinel(),
    ],
    "eight_monitors": lambda: [
        GradientNormLogger(),
        VanishingExplodingDetector(),
        DeadReLUMonitor(),
        NaNSentinel(),
        LossSpikeGuard(),
        OptimizerMonitor(),
        ActivationRangeMonitor(),
        StallDetector(),
    ],
}


# ---------------------------------------------------------------------------------------------- counting
#: the dispatcher's own Python (it looks up rules for the counting mode): part of the meter, not counted
_MACHINERY = str(Path(torch.__file__).parent / "_library")


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepCount:
    calls: int = 0
    ops: int = 0
    where: collections.Counter[str] = field(default_factory=collections.Counter)


class HookMeter:
    """Counts, per training step, the Python calls and aten ops made inside the watched callbacks' hooks.

    Each overridden ``on_*`` hook of each callback is wrapped at the instance (Lightning calls the
    instance attribute); inside a hook a profile function counts ``call`` events (the counting mode's own
    ``__torch_dispatch__`` and what it calls are not counted) and the mode counts aten ops. A step is
    opened by ``on_train_batch_start`` (see :class:`StepMarks`).
    """

    def __init__(self, callbacks: Sequence[Callback], where: bool = False) -> None:
        self.steps: list[StepCount] = []
        self.where = where
        self._skip_depth = 0
        self._mode = _Ops()
        self._ignored = {_Ops.__torch_dispatch__.__code__}
        for cb in callbacks:
            for name in dir(Callback):
                if name.startswith("on_") and getattr(type(cb), name) is not getattr(Callback, name):
                    setattr(cb, name, self._wrap(getattr(cb, name)))

    def new_step(self) -> None:
        self.steps.append(StepCount())

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if self._skip_depth or frame.f_code in self._ignored or _MACHINERY in frame.f_code.co_filename:
                self._skip_depth += 1
                return
            step = self.steps[-1]
            step.calls += 1
            if self.where:
                code, path = frame.f_code, Path(frame.f_code.co_filename)
                step.where[f"{path.parent.name}/{path.name}:{code.co_firstlineno}:{code.co_name}"] += 1
        elif event == "return" and self._skip_depth:
            self._skip_depth -= 1

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.steps:
                return fn(*args, **kwargs)
            before = self._mode.count
            with self._mode:
                sys.setprofile(self._profile)
                try:
                    return fn(*args, **kwargs)
                finally:
                    sys.setprofile(None)
                    self.steps[-1].ops += self._mode.count - before

        return counted


class StepMarks(Callback):
    """Opens a new step on every ``on_train_batch_start`` (first among the callbacks); optionally counts
    every Python call of the whole step (Lightning's own work: the step with no callback of ours)."""

    def __init__(self, meter: HookMeter, whole_step: bool = False) -> None:
        self.meter, self.whole_step = meter, whole_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.whole_step:
            sys.setprofile(None)
        self.meter.new_step()
        if self.whole_step:
            sys.setprofile(self.meter._profile)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        sys.setprofile(None)


def _trainer(callbacks: list[Callback], steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def count(group: str, steps: int, where: bool = False, **model: int) -> list[StepCount]:
    """Per-step counts of ``group`` (``"lightning"``: the whole step of a run without our callbacks) on
    ``TinyLM(**model)``."""
    torch.manual_seed(SEED)
    callbacks = [] if group == "lightning" else GROUPS[group]()
    meter = HookMeter(callbacks, where=where)
    marks = StepMarks(meter, whole_step=group == "lightning")
    _trainer([marks, *callbacks], steps).fit(TinyLM(**model), loader(steps))
    sys.setprofile(None)
    return meter.steps[STEADY_FROM:]


# ---------------------------------------------------------------------------------------------- timing
class HookClock:
    """Wall time spent inside the watched callbacks' hooks, per step."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.per_step: list[float] = []
        for cb in callbacks:
            for name in dir(Callback):
                if name.startswith("on_") and getattr(type(cb), name) is not getattr(Callback, name):
                    setattr(cb, name, self._wrap(getattr(cb, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.per_step:
                    self.per_step[-1] += time.perf_counter() - t

        return timed


class _Opener(Callback):
    """Opens a step's time slot (first among the callbacks)."""

    def __init__(self, clock: HookClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.per_step.append(0.0)


def hook_times(group: str, steps: int) -> list[float]:
    torch.manual_seed(SEED)
    callbacks = GROUPS[group]()
    clock = HookClock(callbacks)
    _trainer([_Opener(clock), *callbacks], steps).fit(TinyLM(), loader(steps))
    return clock.per_step[STEADY_FROM:]


# ---------------------------------------------------------------------------------------------- report
@dataclass
class Row:
    group: str
    calls_median: float
    calls_mean: float
    ops_median: float
    ops_mean: float
    hook_ms_median: float | None = None
    floor_ratio: float | None = None
    floor_ratio_spread: tuple[float, float] | None = None


def measure(steps: int, rounds: int) -> list[Row]:
    """Counts of every group (and of Lightning's whole step), then ``rounds`` interleaved timing rounds."""
    rows = []
    for group in ("lightning", *GROUPS):
        counted = count(group, steps)
        calls, ops = [s.calls for s in counted], [s.ops for s in counted]
        rows.append(
            Row(
                group,
                statistics.median(calls),
                statistics.fmean(calls),
                statistics.median(ops),
                statistics.fmean(ops),
            )
        )
    times: dict[str, list[list[float]]] = {g: [] for g in GROUPS}
    for r in range(rounds):  # interleaved: every group once per round, the order rotating
        order = list(GROUPS)[r % len(GROUPS) :] + list(GROUPS)[: r % len(GROUPS)]
        for group in order:
            times[group].append(hook_times(group, steps))
    floor = [statistics.median(t) for t in times["floor"]]
    for row in rows:
        if row.group not in times:
            continue
        per_round = [statistics.median(t) for t in times[row.group]]
        ratios = [a / b for a, b in zip(per_round, floor, strict=True)]
        row.hook_ms_median = 1e3 * statistics.median(per_round)
        row.floor_ratio = statistics.median(ratios)
        row.floor_ratio_spread = (min(ratios), max(ratios))
    return rows


def table(rows: list[Row]) -> str:
    out = [
        "| group | Python calls / step (median, mean) | aten ops / step (median, mean) | hook time / step "
        "| x floor (median, min-max) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        timed = "" if r.hook_ms_median is None else f"{r.hook_ms_median:.3f} ms"
        ratio = ""
        if r.floor_ratio is not None and r.floor_ratio_spread is not None:
            low, high = r.floor_ratio_spread
            ratio = f"{r.floor_ratio:.2f} ({low:.2f}-{high:.2f})"
        calls, ops = f"{r.calls_median:.0f}, {r.calls_mean:.1f}", f"{r.ops_median:.0f}, {r.ops_mean:.1f}"
        out.append(f"| {r.group} | {calls} | {ops} | {timed} | {ratio} |")
    return "\n".join(out)


#: the groups whose budget holds for the mean over a whole cadence cycle (check and logging steps), not
#: only for the median (a quiet step)
ON_THE_MEAN = {"four_monitors"}


def verdicts(rows: list[Row]) -> list[str]:
    by = {r.group: r for r in rows}
    lines = []
    for group, (calls, ops, ratio) in TARGETS.items():
        r = by[group]
        mean = group in ON_THE_MEAN
        got_calls, got_ops = (r.calls_mean, r.ops_mean) if mean else (r.calls_median, r.ops_median)
        what = "mean" if mean else "median"
        checks = [f"calls ({what}) {got_calls:.0f} <= {calls}: {'met' if got_calls <= calls else 'MISSED'}"]
        if ops is not None:
            checks.append(f"ops ({what}) {got_ops:.0f} <= {ops}: {'met' if got_ops <= ops else 'MISSED'}")
        if ratio is not None and r.floor_ratio is not None:
            checks.append(
                f"time {r.floor_ratio:.2f}x <= {ratio}x: {'met' if r.floor_ratio <= ratio else 'MISSED'}"
            )
        lines.append(f"{group}: " + "; ".join(checks))
    return lines


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--profile", choices=["lightning", *GROUPS], help="where a group's calls go")
    parser.add_argument("--steps", action="store_true", help="the counts of every step of every group")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    steps, rounds = (40, 2) if args.quick else (75, 5)
    if args.steps:
        for group in ("lightning", *GROUPS):
            print(group, [(s.calls, s.ops) for s in count(group, steps)])
        return 0
    if args.profile:
        counted = count(args.profile, steps, where=True)
        total: collections.Counter[str] = collections.Counter()
        for s in counted:
            total.update(s.where)
        print(f"{sum(total.values()) / len(counted):8.1f}  calls per step in all")
        for name, n in total.most_common():
            print(f"{n / len(counted):8.1f}  {name}")
        return 0
    rows = measure(steps, rounds)
    print(f"steady state: steps {STEADY_FROM}-{steps - 1} of {steps}; time: {rounds} interleaved rounds")
    print(table(rows))
    print("\n".join(verdicts(rows)))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"environment": environment(), "rows": [asdict(r) for r in rows]}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
