"""Per-step overhead of gradguard callbacks against bare Lightning, measured on CPU.

One process, interleaved A/B rounds: every round runs one short ``Trainer.fit`` per variant (the order
rotates from round to round), each fit on an identical freshly seeded ~5.3 M-parameter transformer
encoder and identical random data. A tiny timing callback records the wall time between consecutive
``on_train_batch_start`` calls (one full optimizer step: data, forward, backward, clipping hooks,
optimizer, logging) and drops the warm-up steps. Each variant's step time is divided by the bare
run's step time *of the same round*; the table reports the median of those ratios over the rounds and
their min-max spread.

Run it with ``make bench`` (or ``.venv/bin/python benchmarks/overhead.py`` from the repository root);
``--quick`` is a ~1 minute smoke run, ``--list`` shows the variants. Adding a row is one entry in
:data:`VARIANTS`: a factory returning the callbacks, Trainer kwargs and module kwargs of one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import lightning
import lightning.pytorch as pl
import torch
from common import environment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
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
TRAINER_LOG_EVERY_N_STEPS = 50  # Lightning's default; GradientNormLogger() follows it
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelConfig:
    """A small transformer-encoder classifier: 5.27 M parameters in 75 tensors at these defaults."""

    vocab: int = 2048
    seq_len: int = 32
    d_model: int = 256
    nhead: int = 4
    layers: int = 6
    ff: int = 1024
    classes: int = 10
    batch_size: int = 8
    lr: float = 1e-4


class TinyEncoder(pl.LightningModule):
    """Embedding + learned positions + ``nn.TransformerEncoder`` + mean pool + linear head.

    Args:
        cfg: sizes.
        grad_norm_every_step: run Lightning's documented recipe
            ``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``.
    """

    def __init__(self, cfg: ModelConfig, grad_norm_every_step: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.grad_norm_every_step = grad_norm_every_step
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, cfg.seq_len, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.nhead, cfg.ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.d_model, cfg.classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.head(h.mean(dim=1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.grad_norm_every_step:
            self.log_dict(grad_norm(self, norm_type=2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr)


def make_loader(cfg: ModelConfig, batches: int) -> DataLoader[Any]:
    """Random tokens and labels from a fixed seed: one epoch of ``batches`` batches, no shuffling."""
    g = torch.Generator().manual_seed(SEED)
    n = cfg.batch_size * batches
    tokens = torch.randint(0, cfg.vocab, (n, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.classes, (n,), generator=g)
    return DataLoader(TensorDataset(tokens, labels), batch_size=cfg.batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------- callbacks
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class StepTimer(Callback):
    """Timestamps of every ``on_train_batch_start``; step ``i`` lasts ``t[i + 1] - t[i]``.

    ``clock="wall"`` (default) is elapsed time. ``clock="cpu"`` is the CPU time of this process (all its
    threads): the work a step costs, nearly unaffected by other processes competing for the cores, for
    measuring on a busy machine.
    """

    def __init__(self, clock: str = "wall") -> None:
        self.starts: list[float] = []
        self.clock = CLOCKS[clock]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.starts.append(self.clock())

    def step_times(self, skip: int) -> list[float]:
        """Durations in seconds of the steps after the first ``skip`` (the last step has no end mark)."""
        return [b - a for a, b in zip(self.starts[skip:], self.starts[skip + 1 :], strict=False)]


class HookClock:
    """Time spent inside the ``on_*`` hooks a callback overrides: the direct cost of our code.

    Each overridden hook of each watched callback is wrapped (an instance attribute, which Lightning
    calls instead of the class method). The step-time ratio includes everything (memory traffic, extra
    syncs, logger I/O); this number isolates the callbacks' own work and is nearly free of run-to-run
    noise, which matters when the overhead is far below the noise of a whole step. The tensor hooks
    that GradientNormLogger(log_noise_scale=True) puts on the parameters (they run inside the backward
    pass, once per parameter and micro-batch) are timed too.
    """

    def __init__(self, callbacks: Sequence[Callback], clock: Callable[[], float]) -> None:
        self.events: list[tuple[float, float]] = []  # (start, duration)
        self.clock = clock
        for cb in callbacks:
            for name in dir(Callback):
                if name.startswith("on_") and getattr(type(cb), name) is not getattr(Callback, name):
                    setattr(cb, name, self._wrap(getattr(cb, name)))
            noise = getattr(cb, "_noise", None)
            if noise is not None and getattr(noise, "on", False):  # attached at the first batch: wrap now
                noise._hook = self._wrap(noise._hook)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((t, self.clock() - t))

        return timed

    def total_between(self, start: float, end: float) -> float:
        return sum(d for t, d in self.events if start <= t < end)


class Floor(Callback):
    """The least an every-step check can do: one fused norm read of all gradients and one host read."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()


class SeedStyleMonitor(Callback):
    """The naive monitor: one ``p.grad.norm().item()`` per parameter every step, logged through Lightning."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        norms = {
            f"seed_grad_norm/{name}": p.grad.norm().item()
            for name, p in pl_module.named_parameters()
            if p.grad is not None
        }
        pl_module.log_dict(norms)


# ---------------------------------------------------------------------------------------------- variants
class Setup(NamedTuple):
    """What one run adds to the bare configuration."""

    callbacks: list[Callback]
    trainer_kwargs: dict[str, Any]
    module_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Variant:
    description: str
    factory: Callable[[], Setup]
    default: bool = True  # part of a plain run (otherwise only with --variants)


def _callbacks(*cbs: Callback) -> Callable[[], Setup]:
    """A factory for a run that only adds callbacks (built fresh for every run)."""
    return lambda: Setup(list(cbs), {}, {})


def _gnl(**kwargs: Any) -> Callable[[], Setup]:
    return lambda: Setup([GradientNormLogger(**kwargs)], {}, {})


BASELINE = "bare"

# name -> how to build it; rows print in this order. A new row is one more entry.
VARIANTS: dict[str, Variant] = {
    BASELINE: Variant("bare Lightning, no callback", _callbacks()),
    "gnl_defaults": Variant(
        "GradientNormLogger() (every 50 steps, histograms every 500)",
        _gnl(),
    ),
    "gnl_every_step": Variant(
        "GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)",
        _gnl(log_every_n_steps=1, histogram_every_n_steps=0),
    ),
    "gnl_every_step_hist": Variant(
        "GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=1)",
        _gnl(log_every_n_steps=1, histogram_every_n_steps=1),
    ),
    "lightning_grad_norm": Variant(
        "self.log_dict(grad_norm(self, norm_type=2)) every step in on_before_optimizer_step",
        lambda: Setup([], {}, {"grad_norm_every_step": True}),
    ),
    "floor": Variant(
        "the floor of an every-step check: one fused norm over all gradients and one host read",
        lambda: Setup([Floor()], {}, {}),
    ),
    "seed_style": Variant(
        "per-parameter p.grad.norm().item() every step, self.log_dict",
        lambda: Setup([SeedStyleMonitor()], {}, {}),
    ),
    "nan_sentinel": Variant(
        "NaNSentinel() (loss and gradients checked every step)",
        lambda: Setup([NaNSentinel()], {}, {}),
    ),
    "nan_sentinel_with_gnl": Variant(
        "NaNSentinel() + GradientNormLogger(): the gradient statistics are computed once for both",
        lambda: Setup([NaNSentinel(), GradientNormLogger()], {}, {}),
    ),
    "bare_accumulate4": Variant(
        "bare Lightning, accumulate_grad_batches=4 (times are per micro-batch)",
        lambda: Setup([], {"accumulate_grad_batches": 4}, {}),
        default=False,
    ),
    "nan_sentinel_accumulate4": Variant(
        "NaNSentinel() with accumulate_grad_batches=4: each micro-batch's loss, the gradients at the step",
        lambda: Setup([NaNSentinel()], {"accumulate_grad_batches": 4}, {}),
        default=False,
    ),
    "nan_sentinel_accumulate4_micro": Variant(
        "NaNSentinel(check_micro_batches=True), accumulate_grad_batches=4: gradients after every micro-batch",
        lambda: Setup([NaNSentinel(check_micro_batches=True)], {"accumulate_grad_batches": 4}, {}),
        default=False,
    ),
    "gnl_noise_scale": Variant(
        "GradientNormLogger(log_noise_scale=True), accumulate_grad_batches=4 (compare with bare_accumulate4)",
        lambda: Setup([GradientNormLogger(log_noise_scale=True)], {"accumulate_grad_batches": 4}, {}),
        default=False,
    ),
    "vanishing_exploding": Variant(
        "VanishingExplodingDetector() (every step for 20 steps, then every 5th)",
        lambda: Setup([VanishingExplodingDetector()], {}, {}),
    ),
    "vanishing_exploding_every_step": Variant(
        "VanishingExplodingDetector(check_every_n_steps=1)",
        lambda: Setup([VanishingExplodingDetector(check_every_n_steps=1)], {}, {}),
        default=False,
    ),
    "dead_relu": Variant(
        "DeadReLUMonitor() (steps 0-4, then every 50th; hooks only on those steps)",
        lambda: Setup([DeadReLUMonitor()], {}, {}),
    ),
    "activation_range": Variant(
        "ActivationRangeMonitor() (step 0, then every 50th: block ranges and attention logits)",
        lambda: Setup([ActivationRangeMonitor()], {}, {}),
    ),
    "activation_range_every_step": Variant(
        "ActivationRangeMonitor(sample_every_n_steps=1): the cost of one sampled step",
        lambda: Setup([ActivationRangeMonitor(sample_every_n_steps=1)], {}, {}),
        default=False,
    ),
    "loss_spike": Variant(
        "LossSpikeGuard() (judged every step; a CPU snapshot every 100 healthy steps)",
        lambda: Setup([LossSpikeGuard()], {}, {}),
    ),
    "loss_spike_no_snapshot": Variant(
        "LossSpikeGuard(snapshot_every_n_steps=0): the judgement alone",
        lambda: Setup([LossSpikeGuard(snapshot_every_n_steps=0)], {}, {}),
    ),
    "loss_spike_with_nan_sentinel": Variant(
        "LossSpikeGuard() + NaNSentinel(): the per-parameter gradient norms are computed once for both",
        lambda: Setup([LossSpikeGuard(), NaNSentinel()], {}, {}),
        default=False,
    ),
    "loss_spike_loss_only": Variant(
        "LossSpikeGuard(grad_norm_threshold=None): the loss alone, the gradients are not read",
        lambda: Setup([LossSpikeGuard(grad_norm_threshold=None)], {}, {}),
        default=False,
    ),
    "optimizer_monitor": Variant(
        "OptimizerMonitor() (every 50 steps: step size, cosine, AdamW moments, skip counters)",
        lambda: Setup([OptimizerMonitor()], {}, {}),
    ),
    "optimizer_monitor_every_step": Variant(
        "OptimizerMonitor(log_every_n_steps=1): the cost of one measured step",
        lambda: Setup([OptimizerMonitor(log_every_n_steps=1)], {}, {}),
        default=False,
    ),
    "stall_detector": Variant(
        "StallDetector() (a check every 10 steps: update ratios, clip ratio, loss, labels)",
        lambda: Setup([StallDetector()], {}, {}),
    ),
    "all_monitors": Variant(
        "GradientNormLogger() + NaNSentinel() + VanishingExplodingDetector() + DeadReLUMonitor()",
        lambda: Setup(
            [GradientNormLogger(), NaNSentinel(), VanishingExplodingDetector(), DeadReLUMonitor()], {}, {}
        ),
    ),
    "detect_anomaly": Variant(
        "Trainer(detect_anomaly=True): torch.autograd anomaly mode on every step",
        lambda: Setup([], {"detect_anomaly": True}, {}),
    ),
    "lightning_grad_norm_log1": Variant(
        "grad_norm recipe with Trainer(log_every_n_steps=1): written to the logger every step",
        lambda: Setup([], {"log_every_n_steps": 1}, {"grad_norm_every_step": True}),
        default=False,
    ),
}


# ---------------------------------------------------------------------------------------------- running
@dataclass
class RunResult:
    variant: str
    round: int
    position: int
    mean_ms: float  # amortised: includes the periodic logging steps at their real frequency
    median_ms: float  # the typical step
    steps: int
    wall_s: float
    hook_ms: float = 0.0  # per step, inside the hooks of the variant's callbacks (see HookClock)


def run_once(
    name: str,
    cfg: ModelConfig,
    warmup: int,
    steps: int,
    round_idx: int,
    position: int,
    clock: str = "wall",
) -> RunResult:
    """One ``Trainer.fit`` of ``warmup + steps + 1`` optimizer steps; times the ``steps`` after warm-up."""
    setup = VARIANTS[name].factory()
    timer = StepTimer(clock)
    hooks = HookClock(setup.callbacks, CLOCKS[clock])
    total = warmup + steps + 1  # +1: the last measured step ends where the next one starts
    torch.manual_seed(SEED)
    model = TinyEncoder(cfg, **setup.module_kwargs)
    loader = make_loader(cfg, total)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-bench-") as tmp:
        trainer_kwargs: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": total,
            "max_epochs": 1,
            "logger": TensorBoardLogger(tmp, name="bench"),
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "log_every_n_steps": TRAINER_LOG_EVERY_N_STEPS,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
        }
        trainer_kwargs.update(setup.trainer_kwargs)
        trainer = pl.Trainer(callbacks=[timer, *setup.callbacks], **trainer_kwargs)
        trainer.fit(model, train_dataloaders=loader)
    wall = time.perf_counter() - t0
    times = timer.step_times(warmup)
    if len(times) != steps:
        raise RuntimeError(f"{name}: expected {steps} timed steps, got {len(times)}")
    hook_s = hooks.total_between(timer.starts[warmup], timer.starts[-1])
    del trainer, model, loader
    gc.collect()
    return RunResult(
        variant=name,
        round=round_idx,
        position=position,
        mean_ms=1000 * statistics.fmean(times),
        median_ms=1000 * statistics.median(times),
        steps=len(times),
        wall_s=wall,
        hook_ms=1000 * hook_s / len(times),
    )


def rotated(names: Sequence[str], round_idx: int) -> list[str]:
    """Round ``r`` starts at variant ``r mod n``: over ``n`` rounds every variant runs in every slot."""
    k = round_idx % len(names)
    return [*names[k:], *names[:k]]


@dataclass
class Summary:
    variant: str
    description: str
    mean_ms: float
    ratio: float
    ratio_min: float
    ratio_max: float
    median_ratio: float  # the same, from per-run median step times (typical step, no logging spikes)
    hook_ms: float  # median over rounds of the time per step spent in the variant's callback hooks
    hook_share: float  # hook_ms / the bare step time of the same round (median)
    rounds: int
    ratios: list[float] = field(default_factory=list)


def summarize(results: list[RunResult], names: Sequence[str]) -> list[Summary]:
    bare = {r.round: r for r in results if r.variant == BASELINE}
    out = []
    for name in names:
        runs = [r for r in results if r.variant == name]
        ratios = [r.mean_ms / bare[r.round].mean_ms for r in runs]
        typical = [r.median_ms / bare[r.round].median_ms for r in runs]
        out.append(
            Summary(
                variant=name,
                description=VARIANTS[name].description,
                mean_ms=statistics.median(r.mean_ms for r in runs),
                ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                median_ratio=statistics.median(typical),
                hook_ms=statistics.median(r.hook_ms for r in runs),
                hook_share=statistics.median(r.hook_ms / bare[r.round].mean_ms for r in runs),
                rounds=len(runs),
                ratios=ratios,
            )
        )
    return out


def markdown_table(summaries: list[Summary]) -> str:
    lines = [
        "| variant | what | ms / step | ratio vs bare | spread (min-max) | typical-step ratio "
        "| in callback hooks, ms / step (share of bare) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        hooks = f"{s.hook_ms:.2f} ({s.hook_share:.2%})" if s.hook_ms > 0 else "-"
        lines.append(
            f"| `{s.variant}` | {s.description} | {s.mean_ms:.1f} | {s.ratio:.3f}x "
            f"| {s.ratio_min:.3f}-{s.ratio_max:.3f} | {s.median_ratio:.3f}x | {hooks} |"
        )
    return "\n".join(lines)


def target_lines(summaries: list[Summary]) -> list[str]:
    """The spec's targets, checked against this run's numbers."""
    by = {s.variant: s for s in summaries}
    lines = []
    if "gnl_defaults" in by:
        r = by["gnl_defaults"].ratio
        verdict = "MET" if r <= 1.02 else "NOT MET"
        lines.append(f"GradientNormLogger() at defaults <= 1.02x bare: {r:.3f}x -> {verdict}")
    if "gnl_every_step" in by and "lightning_grad_norm" in by:
        a, b = by["gnl_every_step"].mean_ms, by["lightning_grad_norm"].mean_ms
        verdict = "MET" if a < b else "NOT MET"
        lines.append(
            f"GradientNormLogger every step cheaper than grad_norm every step: {a:.1f} ms vs {b:.1f} ms "
            f"-> {verdict}"
        )
    if "gnl_every_step" in by and "gnl_every_step_hist" in by:
        bare_ms = by[BASELINE].mean_ms
        extra_ms = by["gnl_every_step_hist"].mean_ms - by["gnl_every_step"].mean_ms
        every = 10 * TRAINER_LOG_EVERY_N_STEPS
        lines.append(
            f"Histograms cost {extra_ms:.1f} ms per histogram step; at the default cadence (every {every} "
            f"steps) that amortises to {extra_ms / every:.3f} ms/step = {extra_ms / every / bare_ms:.2%} "
            "of a bare step (not inside the timed window of gnl_defaults)"
        )
    for name, label in (
        ("vanishing_exploding", "VanishingExplodingDetector()"),
        ("dead_relu", "DeadReLUMonitor()"),
    ):
        if name in by:
            r = by[name].ratio
            lines.append(f"{label} <= 1.02x bare: {r:.3f}x -> {'MET' if r <= 1.02 else 'NOT MET'}")
    if "nan_sentinel" in by:
        r = by["nan_sentinel"].ratio
        verdict = "MET" if r <= 1.01 else "NOT MET"
        lines.append(f"NaNSentinel() <= 1.01x bare: {r:.3f}x -> {verdict}")
        lines.append(
            f"NaNSentinel's own hooks: {by['nan_sentinel'].hook_ms:.2f} ms/step "
            f"= {by['nan_sentinel'].hook_share:.2%} of a bare step"
        )
        if "detect_anomaly" in by:
            ours = by["nan_sentinel"].mean_ms - by[BASELINE].mean_ms
            theirs = by["detect_anomaly"].mean_ms - by[BASELINE].mean_ms
            # the step-time difference is noise-bound; never count less than the time in our hooks
            factor = theirs / max(ours, by["nan_sentinel"].hook_ms)
            verdict = "MET" if factor >= 50 else "NOT MET"
            lines.append(
                f"NaNSentinel overhead {max(ours, by['nan_sentinel'].hook_ms):.2f} ms/step vs detect_anomaly "
                f"{theirs:+.2f} ms/step: {factor:.0f}x smaller (target >= 50x) -> {verdict}"
            )
    for name, label in (
        ("loss_spike", "LossSpikeGuard()"),
        ("loss_spike_no_snapshot", "LossSpikeGuard(snapshot_every_n_steps=0)"),
        ("loss_spike_loss_only", "LossSpikeGuard(grad_norm_threshold=None)"),
    ):
        if name in by:
            s = by[name]
            lines.append(
                f"{label}: {s.ratio:.3f}x bare; its own hooks {s.hook_ms:.3f} ms/step = {s.hook_share:.2%} "
                "of a bare step"
            )
    if "floor" in by and by["floor"].hook_ms > 0:
        floor = by["floor"].hook_ms
        for name, label, target in (
            ("nan_sentinel", "NaNSentinel()", 1.2),
            ("all_monitors", "the four monitors", 1.5),
        ):
            if name in by:
                x = by[name].hook_ms / floor
                verdict = "MET" if x <= target else "NOT MET"
                lines.append(
                    f"{label}: {by[name].hook_ms:.2f} ms/step in hooks = {x:.2f}x the floor "
                    f"({floor:.2f} ms; target <= {target}x) -> {verdict}"
                )
    if "loss_spike_with_nan_sentinel" in by and "nan_sentinel" in by:
        # the gradient pass is the sentinel's anyway: what the guard adds on top of it
        extra = by["loss_spike_with_nan_sentinel"].hook_share - by["nan_sentinel"].hook_share
        verdict = "MET" if extra <= 0.005 else "NOT MET"
        lines.append(
            f"LossSpikeGuard() beside NaNSentinel() adds {extra:.2%} of a bare step in hooks "
            f"(target <= 0.5 %) -> {verdict}"
        )
    return lines


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("lightning_gradguard").setLevel(logging.WARNING)
    for pattern in (
        ".*does not have many workers.*",
        ".*LeafSpec.*",
        ".*Tip:.*",
        ".*litlogger.*",
        ".*is smaller than the logging interval.*",
        ".*enable_nested_tensor.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick: 2)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed optimizer steps per run, after warm-up (default 100, i.e. two logging intervals "
        "of 50; --quick: 50)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of every run")
    p.add_argument(
        "--batch-size", type=int, default=ModelConfig.batch_size, help="sequences per batch (default 8)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2 = cores)")
    p.add_argument("--quick", action="store_true", help="smoke mode, about a minute")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time (default; needs an otherwise idle machine); cpu: this process's CPU "
        "time, robust when other processes share the cores",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset (the '{BASELINE}' reference is always run); see --list",
    )
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument("--json", type=Path, default=None, help="JSON output path (default: benchmarks/results/)")
    p.add_argument("--no-json", action="store_true", help="do not write JSON")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.steps is None:
        args.steps = 50 if args.quick else 100
    if min(args.rounds, args.steps, args.warmup, args.threads, args.batch_size) < 1:
        p.error("--rounds, --steps, --warmup, --threads and --batch-size must be >= 1")
    return args


def selected_variants(spec: str | None) -> list[str]:
    if spec is None:
        return [n for n, v in VARIANTS.items() if v.default]
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in wanted if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    return [n for n in VARIANTS if n == BASELINE or n in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, v in VARIANTS.items():
            print(f"{name:28s} {'' if v.default else '(opt-in) '}{v.description}")
        return 0
    quiet()
    torch.set_num_threads(args.threads)
    names = selected_variants(args.variants)
    cfg = ModelConfig(batch_size=args.batch_size)
    n_params = sum(p.numel() for p in TinyEncoder(cfg).parameters())
    print(
        f"model: transformer encoder, {n_params / 1e6:.2f} M parameters, "
        f"batch {cfg.batch_size}x{cfg.seq_len} tokens; torch {torch.__version__}, "
        f"lightning {lightning.__version__}, {args.threads} threads, {args.clock} clock"
    )
    print(
        f"{args.rounds} rounds x {len(names)} variants, "
        f"{args.warmup} warm-up + {args.steps} timed steps per run",
        flush=True,
    )
    start = time.perf_counter()
    for i, name in enumerate(names):  # untimed: first-use costs (imports, allocator, thread pools)
        run_once(name, cfg, warmup=args.warmup, steps=1, round_idx=-1, position=i, clock=args.clock)
    results: list[RunResult] = []
    for r in range(args.rounds):
        for pos, name in enumerate(rotated(names, r)):
            res = run_once(name, cfg, args.warmup, args.steps, r, pos, clock=args.clock)
            results.append(res)
        bare_ms = next(x.mean_ms for x in results if x.round == r and x.variant == BASELINE)
        row = ", ".join(f"{x.variant} {x.mean_ms / bare_ms:.3f}" for x in results if x.round == r)
        print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - start:.0f} s): {row}", flush=True)
    elapsed = time.perf_counter() - start
    summaries = summarize(results, names)
    print()
    print(markdown_table(summaries))
    print()
    for line in target_lines(summaries):
        print(line)
    print(f"\nbenchmark wall time: {elapsed:.0f} s")
    if not args.no_json:
        path = args.json or RESULTS_DIR / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": {
                "rounds": args.rounds,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
                "clock": args.clock,
                "trainer_log_every_n_steps": TRAINER_LOG_EVERY_N_STEPS,
                "model": asdict(cfg),
                "parameters": n_params,
            },
            "environment": environment(args.threads),
            "wall_s": elapsed,
            "summary": [asdict(s) for s in summaries],
            "runs": [asdict(r) for r in results],
        }
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
