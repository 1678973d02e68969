"""Quickstart: train a small MLP on scikit-learn's digits with every gradguard callback attached.

Run it with ``make demo`` (or ``.venv/bin/python examples/quickstart.py`` from the repository root).
Before the first step the pre-flight checks prove the model can learn one batch and that its gradients
are right, and the LR range test picks the learning rate; then it trains for a few epochs on CPU (well
under a minute) with the monitors on, logs to TensorBoard under ``runs/quickstart`` and ends with a
short health report read back from the callbacks. Then::

    tensorboard --logdir runs

and open the "Custom Scalars" tab: the "GradGuard" section holds the gradient, weight, update-ratio,
clipping, gradient-flow, dead-ReLU, LR-finder and pre-flight charts (expand "Matches" under a chart, or
hover, to see which line is which layer). The "Histograms" tab holds ``grad/*``, ``grad_log10/*``,
``weight/*`` and ``activation_rate/*``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import (
    DeadReLUMonitor,
    GradGuardCallback,
    GradientCheck,
    GradientNormLogger,
    LRFinderPlus,
    NaNSentinel,
    OverfitBatchSanity,
    VanishingExplodingDetector,
)
from lightning_gradguard.report import build_report

SEED = 0
MAX_EPOCHS = 15
BATCH_SIZE = 32
LOG_EVERY_N_STEPS = 5  # 44 optimizer steps per epoch: about 9 points per epoch on every chart
GRADIENT_CLIP_VAL = 1.0
RUNS_DIR = "runs"
RUN_NAME = "quickstart"


def gradguard_callbacks() -> list[GradGuardCallback]:
    """Every gradguard callback this example runs with. A new callback is one more line here."""
    return [
        OverfitBatchSanity(),  # before step 0: can the model learn one batch? (raises if not)
        GradientCheck(),  # before step 0: autograd vs finite differences, float64
        LRFinderPlus(progress=False),  # LR range test at fit start; applies the suggestion
        GradientNormLogger(histogram_every_n_steps=50),  # scalars every 5 steps, histograms every 50
        VanishingExplodingDetector(),  # exploding / vanishing gradients, from the same statistics
        DeadReLUMonitor(),  # ReLU units that never fire, on sampled steps only
        NaNSentinel(),  # fails the run at the first NaN/inf loss or gradient, with a report
    ]


def quiet_lightning() -> None:
    """Keep the console readable: no device banners, tips or data-loader / deprecation warnings."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=pattern)
    # gradguard alerts go to the "lightning_gradguard" logger: print them, one line each
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("gradguard %(levelname)s: %(message)s"))
    gg = logging.getLogger("lightning_gradguard")
    gg.addHandler(handler)
    gg.setLevel(logging.INFO)
    gg.propagate = False


def digits_loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    """8x8 digit images as 64 standardised features; 80/20 stratified split, scaler fit on train only."""
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    scaler = StandardScaler().fit(x_train)  # constant (always-zero) border pixels keep scale 1

    def dataset(features: Any, labels: Any) -> TensorDataset:
        return TensorDataset(
            torch.tensor(scaler.transform(features), dtype=torch.float32), torch.tensor(labels)
        )

    train = DataLoader(dataset(x_train, y_train), batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    val = DataLoader(dataset(x_val, y_val), batch_size=256)
    return train, val


class DigitsMLP(pl.LightningModule):
    """64 -> 128 -> 64 -> 10 with ReLU. gradguard names the layers ``hidden1``, ``hidden2`` and ``head``."""

    def __init__(self, lr: float = 2e-3, weight_decay: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.hidden1 = nn.Linear(64, 128)
        self.hidden2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.hidden1(x))
        x = torch.relu(self.hidden2(x))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


class EpochLine(pl.Callback):
    """One line per epoch instead of a progress bar."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        print(
            f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}  step {trainer.global_step:4d}  "
            f"val/loss {float(m['val/loss']):.3f}  val/acc {float(m['val/acc']):.3f}"
        )


def _check_line(cb: GradGuardCallback) -> str | None:
    """One line for a pre-flight check, the LR range test or the dead-ReLU monitor (None for the others)."""
    if isinstance(cb, OverfitBatchSanity) and cb.result is not None:
        r = cb.result
        return (
            f"overfit one batch       {'passed' if r.passed else 'FAILED'}: loss {r.initial_loss:.3f} -> "
            f"{r.final_loss:.4f} in {r.steps} steps on {r.num_samples} samples ({r.seconds:.2f} s)"
        )
    if isinstance(cb, GradientCheck) and cb.result is not None:
        g = cb.result
        worst = max((p.max_rel_error for p in g.parameters), default=float("nan"))
        return (
            f"gradient check          {'passed' if g.passed else 'FAILED'}: {len(g.parameters)} tensors, "
            f"worst relative error {worst:.1e} ({g.evaluations} float64 evaluations, {g.seconds:.2f} s)"
        )
    if isinstance(cb, LRFinderPlus) and cb.result is not None:
        f = cb.result
        picked = f"{f.suggestion:.3g}" if f.suggestion is not None else "none"
        applied = "applied" if f.applied else "not applied (the configured LR was kept)"
        return f"LR range test           suggested lr {picked} ({f.method}), {len(f.lrs)} points; {applied}"
    if isinstance(cb, DeadReLUMonitor):
        dead = ", ".join(f"{k} {v:.0%}" for k, v in cb.dead_fractions.items()) or "no ReLU seen"
        return f"dead ReLU units         {dead}"
    return None


def _norm_table(trainer: pl.Trainer, cb: GradGuardCallback, last: dict[str, float]) -> None:
    """The last logged norms of a GradientNormLogger, per layer, and its clipping statistics."""
    print(f"last total grad norm    {last['grad_norm/total']:.4g}   (pre-clip, as the optimizer saw it)")
    print(f"last total update ratio {last.get('update_ratio/total', float('nan')):.3g}   (healthy ~1e-3)")
    layers = [k.split("/", 1)[1] for k in last if k.startswith("grad_norm/") and k != "grad_norm/total"]
    w = max(len(name) for name in [*layers, "layer"])
    print(f"\n{'layer':<{w}} {'grad norm':>10} {'weight norm':>12} {'update/weight':>14}")
    for layer in layers:
        print(
            f"{layer:<{w}} {last[f'grad_norm/{layer}']:>10.4g} "
            f"{last.get(f'weight_norm/{layer}', float('nan')):>12.4g} "
            f"{last.get(f'update_ratio/{layer}', float('nan')):>14.3g}"
        )
    clip = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("grad_clip/")}
    if clip:
        window = min(trainer.global_step, getattr(cb, "clip_window", trainer.global_step))
        print(
            f"\nclipping at {trainer.gradient_clip_val:g}: {clip['fraction_clipped']:.0%} of the last "
            f"{window} steps clipped; pre-clip norm p50/p90/p99 = {clip['pre_clip_norm_p50']:.3g} / "
            f"{clip['pre_clip_norm_p90']:.3g} / {clip['pre_clip_norm_p99']:.3g}; "
            f"suggested gradient_clip_val = {clip.get('suggested_clip_val', float('nan')):g}"
        )


def _where_it_went(trainer: pl.Trainer, callbacks: list[GradGuardCallback]) -> None:
    """The alerts by kind, and where the alert file and the TensorBoard run are."""
    kinds = Counter(alert.kind for cb in callbacks for alert in cb.alerts)
    listed = ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items())) or "none"
    print(f"\nalerts by kind          {listed}")
    log_dir = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
    jsonl = os.path.join(log_dir, "gradguard_alerts.jsonl")
    exists = "" if os.path.exists(jsonl) else "  (not written: no alerts)"
    print(f"alerts JSONL            {jsonl}{exists}")
    print(f"TensorBoard run         {log_dir}")
    print(f"\ntensorboard --logdir {RUNS_DIR}")


def health_summary(trainer: pl.Trainer, callbacks: list[GradGuardCallback], seconds: float) -> None:
    """Print what the callbacks saw, read from their public state (``last_logged`` and ``alerts``)."""
    print(f"\n=== gradguard health summary ({seconds:.1f} s, {trainer.global_step} optimizer steps) ===")
    print(f"final val accuracy      {float(trainer.callback_metrics['val/acc']):.3f}")
    for line in filter(None, map(_check_line, callbacks)):
        print(line)
    for cb in callbacks:
        last: dict[str, float] = getattr(cb, "last_logged", {})
        if last and "grad_norm/total" in last:
            _norm_table(trainer, cb, last)
    for cb in callbacks:
        if isinstance(cb, NaNSentinel):
            print(
                f"\nNaN/inf checks          loss and gradients of all {trainer.global_step} steps finite "
                f"(GradScaler skips: {cb.skipped_steps})"
            )
    _where_it_went(trainer, callbacks)


def main() -> None:
    quiet_lightning()
    pl.seed_everything(SEED, verbose=False)
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    train, val = digits_loaders()
    callbacks = gradguard_callbacks()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=MAX_EPOCHS,
        gradient_clip_val=GRADIENT_CLIP_VAL,
        log_every_n_steps=LOG_EVERY_N_STEPS,
        logger=TensorBoardLogger(RUNS_DIR, name=RUN_NAME, default_hp_metric=False),
        callbacks=[*callbacks, EpochLine()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(DigitsMLP(), train, val)
    health_summary(trainer, callbacks, time.perf_counter() - start)
    report = build_report(trainer.log_dir or RUNS_DIR)
    print(f"health report (HTML)    {report}   (gradguard report {trainer.log_dir})")


if __name__ == "__main__":
    main()
