"""What each callback costs on a GPT-2-small-sized model (124 M parameters) on the CPU.

The model is a 12-layer pre-norm transformer decoder stack. It has GPT-2 small's sizes: 768 wide,
12 heads, a 3072-wide GELU MLP, a 50257-token vocabulary and an LM head tied to the embedding, so
124.4 M parameters. It trains with AdamW on random tokens, 2 sequences of 128 tokens per batch.

Each variant runs in a fresh subprocess, so its peak resident memory (``ru_maxrss``) is its own. It
runs ``--steps`` optimizer steps with ``Trainer(log_every_n_steps=--log-every)``, so logging steps
happen in a short run. Per variant it reports:

* the median step time of the steps after the first two (the faster of ``--rounds`` runs, in rotated
  order), and its ratio to the bare run;
* the peak extra memory over the bare run;
* how many scalar tags and histograms one logging step writes;
* the event file's growth per 1000 steps at the callbacks' default cadence: every 50th step a logging
  step, every 500th a histogram step. This is measured from the bytes of this run's logging steps.

Run: ``python benchmarks/big_model.py`` (``make bench-big``; about 7 minutes on 2 cores). Writes
``benchmarks/results/big_model-<time>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "bare": "no callback",
    "gnl": "GradientNormLogger()",
    "nan_sentinel": "NaNSentinel()",
    "vanishing_exploding": "VanishingExplodingDetector()",
    "dead_relu": "DeadReLUMonitor()",
    "loss_spike": "LossSpikeGuard()",
    "suite": "the five monitors above together, at their defaults",
    "suite_capped": "the five together, with max_layers=16 on the three with per-layer output",
}


def _callbacks(variant: str) -> list[Any]:
    from lightning_gradguard import (
        DeadReLUMonitor,
        GradientNormLogger,
        LossSpikeGuard,
        NaNSentinel,
        VanishingExplodingDetector,
    )

    make = {
        "gnl": GradientNormLogger,
        "nan_sentinel": NaNSentinel,
        "vanishing_exploding": VanishingExplodingDetector,
        "dead_relu": DeadReLUMonitor,
        "loss_spike": LossSpikeGuard,
    }
    if variant == "suite":
        return [f() for f in make.values()]
    if variant == "suite_capped":
        capped = (GradientNormLogger, VanishingExplodingDetector, DeadReLUMonitor)
        return [f(max_layers=16) if f in capped else f() for f in make.values()]  # type: ignore[operator]
    return [make[variant]()] if variant in make else []


def run_variant(variant: str, steps: int, log_every: int, seq: int, batch: int) -> dict[str, Any]:
    """One variant in this process: its step times, its tags and its event-file bytes."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch import nn

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    torch.manual_seed(0)

    class GPT2Small(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(50257, 768)
            self.wpe = nn.Embedding(1024, 768)
            layer = nn.TransformerEncoderLayer(
                768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.ln_f = nn.LayerNorm(768)
            self.register_buffer(
                "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            h = self.wte(tokens[:, :-1]) + self.wpe.weight[: tokens.shape[1] - 1]
            h = self.ln_f(self.blocks(h, mask=self.mask[: h.shape[1], : h.shape[1]], is_causal=True))
            logits = h @ self.wte.weight.T  # tied LM head
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50257, (batch * steps, seq + 1), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=batch)
    model = GPT2Small()
    n_params = sum(p.numel() for p in model.parameters())
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="gradguard-big-") as tmp:
        logger = TensorBoardLogger(tmp, name="big", default_hp_metric=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            logger=logger,
            log_every_n_steps=log_every,
            callbacks=[*_callbacks(variant), clock],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, loader)
        logger.finalize("success")
        events = glob.glob(os.path.join(str(logger.log_dir), "events.out.tfevents.*"))
        sizes = _event_bytes(events)
    times = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    return {
        "variant": variant,
        "parameters": n_params,
        "step_s": statistics.median(times[2:]),
        "step_times_s": times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **sizes,
    }


def _event_bytes(files: list[str]) -> dict[str, Any]:
    """Bytes and points of the event files, split into scalar and histogram records, per step logged."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    scalar: dict[int, list[int]] = {}  # step -> [bytes, points]
    histo: dict[int, list[int]] = {}
    for f in files:
        for raw in RawEventFileLoader(f).Load():
            event = event_pb2.Event.FromString(raw)
            values = list(event.summary.value)
            if not values:
                continue
            is_histo = any(v.HasField("histo") for v in values)
            slot = (histo if is_histo else scalar).setdefault(int(event.step), [0, 0])
            slot[0] += len(raw) + 16  # the record's framing: length, two checksums
            slot[1] += len(values)

    def per_step(d: dict[int, list[int]], i: int) -> float:
        return statistics.median(v[i] for v in d.values()) if d else 0.0

    return {
        "scalar_steps": len(scalar),
        "scalar_points_per_step": per_step(scalar, 1),
        "scalar_bytes_per_step": per_step(scalar, 0),
        "histogram_steps": len(histo),
        "histograms_per_step": per_step(histo, 1),
        "histogram_bytes_per_step": per_step(histo, 0),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--log-every", type=int, default=2, help="Trainer(log_every_n_steps) for this short run")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant, in rotated order")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_variant(args.one, args.steps, args.log_every, args.seq, args.batch)))
        return 0
    names = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for round_idx in range(args.rounds):  # rotated order: a slow spell of the machine hits every variant
        for variant in names[round_idx % len(names) :] + names[: round_idx % len(names)]:
            cmd = [sys.executable, __file__, "--one", variant, "--steps", str(args.steps)]
            cmd += ["--log-every", str(args.log_every), "--seq", str(args.seq), "--batch", str(args.batch)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
            r = json.loads(out[-1])
            runs[variant].append(r)
            print(
                f"# round {round_idx}: {variant}: {r['step_s']:.2f} s/step, {r['peak_rss_mb']:.0f} MB",
                file=sys.stderr,
            )
    # per variant: the fastest round's step time and the lowest peak (both least disturbed by the machine)
    results = []
    for rs in runs.values():
        best = min(rs, key=lambda r: r["step_s"])
        results.append(best | {"peak_rss_mb": min(r["peak_rss_mb"] for r in rs), "rounds": rs})
    bare = next(r for r in results if r["variant"] == "bare")
    print(
        "| variant | step time | ratio vs bare | peak extra memory | scalars per logging step | histograms "
        "per histogram step | event file per 1000 steps at defaults |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        extra_scalar = r["scalar_bytes_per_step"] - bare["scalar_bytes_per_step"]
        # at the defaults a logging step every 50 steps, a histogram step every 500
        growth = 20 * max(0.0, extra_scalar) + 2 * r["histogram_bytes_per_step"]
        print(
            f"| `{r['variant']}` | {r['step_s']:.2f} s | {r['step_s'] / bare['step_s']:.3f}x "
            f"| {r['peak_rss_mb'] - bare['peak_rss_mb']:+.0f} MB "
            f"| {r['scalar_points_per_step'] - bare['scalar_points_per_step']:.0f} "
            f"| {r['histograms_per_step']:.0f} | {growth / 1e6:.2f} MB |"
        )
    path = RESULTS_DIR / f"big_model-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
