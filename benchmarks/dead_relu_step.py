"""Cost of a DeadReLUMonitor sampled step against a plain step, interleaved in one process.

One ``Trainer.fit`` of the overhead benchmark's transformer encoder (``benchmarks/overhead.py``: 5.3 M
parameters, ReLU feed-forward blocks called as ``F.relu`` inside ``nn.TransformerEncoderLayer``) with
``DeadReLUMonitor(sample_every_n_steps=2, window_samples=1, patience=1)``: every other step is sampled
(capture mode,
module hooks, on-device reductions, the one host transfer and the window bookkeeping; which ones is
asked of the monitor, ``monitor.due(step)``), the others are plain, so the two kinds alternate under
identical conditions. Each round also runs the same fit without any
callback, to show that the unsampled steps cost what bare steps cost. A step is the wall time between
consecutive ``on_train_batch_start`` calls (it includes the monitor's work at the end of the batch).

Run: ``.venv/bin/python benchmarks/dead_relu_step.py [--rounds 3] [--steps 60] [--threads 1] [--clock cpu]``.
The issue's target is a sampled step <= 1.3x a plain step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import ModelConfig, StepTimer, TinyEncoder, make_loader, quiet

from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor


def fit(cfg: ModelConfig, steps: int, monitor: DeadReLUMonitor | None, clock: str = "cpu") -> list[float]:
    timer = StepTimer(clock)
    torch.manual_seed(0)
    model = TinyEncoder(cfg)
    callbacks: list[Any] = [timer] if monitor is None else [timer, monitor]
    with tempfile.TemporaryDirectory(prefix="gradguard-deadrelu-") as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + 1,
            max_epochs=1,
            logger=False,
            default_root_dir=tmp,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model, train_dataloaders=make_loader(cfg, steps + 1))
    return timer.step_times(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per fit (the first 10 are dropped)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): this process's CPU time, robust on a busy machine; wall: elapsed time",
    )
    args = p.parse_args()
    quiet()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig()
    skip = 10
    fit(cfg, 12, DeadReLUMonitor(sample_every_n_steps=2, window_samples=1, patience=1))  # untimed warm-up
    rows = []
    start = time.perf_counter()
    for r in range(args.rounds):
        monitor = DeadReLUMonitor(sample_every_n_steps=2, window_samples=1, patience=1)
        times = fit(cfg, args.steps, monitor, args.clock)[skip:]
        bare = statistics.median(fit(cfg, args.steps, None, args.clock)[skip:])
        # which steps were sampled is the monitor's own rule (Lightning's logging rule: odd steps here)
        sampled = statistics.median(t for i, t in enumerate(times, start=skip) if monitor.due(i))
        plain = statistics.median(t for i, t in enumerate(times, start=skip) if not monitor.due(i))
        layers = len(monitor.dead_fractions)
        rows.append((sampled, plain, bare))
        print(
            f"round {r + 1}: sampled {1000 * sampled:.1f} ms, plain {1000 * plain:.1f} ms, bare "
            f"{1000 * bare:.1f} ms -> sampled/plain {sampled / plain:.3f}x, plain/bare {plain / bare:.3f}x "
            f"({layers} ReLU layers watched)",
            flush=True,
        )
    ratio = statistics.median(s / p for s, p, _ in rows)
    idle = statistics.median(p / b for _, p, b in rows)
    print(
        f"\nmedian over {args.rounds} rounds: sampled step = {ratio:.3f}x a plain step "
        f"(target <= 1.3x: {'MET' if ratio <= 1.3 else 'NOT MET'}); unsampled step = {idle:.3f}x a bare "
        f"step; torch {torch.__version__}, {args.threads} threads, {args.clock} clock, "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
