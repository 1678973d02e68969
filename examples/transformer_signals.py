"""The deeper signals on a small transformer: the gradient noise scale, the optimizer's state, activation
ranges and attention logits, each shown on a real run and read in words.

A 2-layer pre-LN transformer encoder (``nn.TransformerEncoderLayer``: its attention is
``nn.MultiheadAttention``) classifies scikit-learn's digits, each 8x8 image read as a sequence of 8
tokens (its rows). AdamW, micro-batches of 16 accumulated 4 at a time (64 samples per optimizer step),
on the CPU, well under a minute. Three callbacks watch it:

* ``GradientNormLogger(log_noise_scale=True)``: the gradient noise scale B_simple (McCandlish et al.
  2018) from the two batch sizes the run already has: one micro-batch (16) and the optimizer step (64);
* ``OptimizerMonitor()``: AdamW's step size in units of the LR, cos(update, -gradient), its moments
  against ``eps``, and the updates skipped by cause;
* ``ActivationRangeMonitor()``: per block the largest |x|, RMS, kurtosis and float16 headroom of its
  output, and the largest attention logit q.k/sqrt(d) of each attention module.

Run it with ``.venv/bin/python examples/transformer_signals.py`` from the repository root
(``--epochs N`` for a shorter or longer run). It logs to TensorBoard under
``runs/transformer_signals`` (Custom Scalars, "GradGuard" section) and ends by printing every signal's
latest value with what it says about this run.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import ActivationRangeMonitor, GradientNormLogger, OptimizerMonitor

SEED = 0
MICRO_BATCH = 16
ACCUMULATE = 4  # 4 micro-batches of 16: the noise scale's two batch sizes are 16 and 64
LOG_EVERY_N_STEPS = 10
RUNS_DIR = "runs"
RUN_NAME = "transformer_signals"


def digits_sequences() -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Each digit as 8 tokens of 8 standardised pixels (its rows); 80/20 stratified split."""
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    scaler = StandardScaler().fit(x_train)

    def dataset(features: Any, labels: Any) -> TensorDataset:
        tokens = torch.tensor(scaler.transform(features), dtype=torch.float32).reshape(-1, 8, 8)
        return TensorDataset(tokens, torch.tensor(labels))

    train = DataLoader(dataset(x_train, y_train), batch_size=MICRO_BATCH, shuffle=True, drop_last=True)
    return train, DataLoader(dataset(x_val, y_val), batch_size=256)


class DigitsTransformer(pl.LightningModule):
    """Embedding, 2 pre-LN encoder layers (4 heads, d=64), final LayerNorm, mean pooling, linear head."""

    def __init__(self, d: int = 64, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(8, d)
        self.position = nn.Parameter(torch.randn(8, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d,
            nhead=4,
            dim_feedforward=2 * d,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but norm_first is True"
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.position)
        return self.head(self.norm(h).mean(dim=1))

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
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*LeafSpec.*", ".*enable_nested_tensor.*"):
        warnings.filterwarnings("ignore", message=pattern)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("gradguard %(levelname)s: %(message)s"))
    gg = logging.getLogger("lightning_gradguard")
    gg.addHandler(handler)
    gg.setLevel(logging.WARNING)
    gg.propagate = False


# ---------------------------------------------------------------------------------------------- reading
def read_noise_scale(last: dict[str, float]) -> list[str]:
    batch = last.get("noise_scale/batch_size", float("nan"))
    b_simple = last.get("noise_scale/b_simple")
    terms = (
        f"smoothed |G|^2 = {last.get('noise_scale/grad_sq', math.nan):.4g}, "
        f"tr(Sigma) = {last.get('noise_scale/trace_sigma', math.nan):.4g}"
    )
    if b_simple is None:
        return [f"noise scale   not defined yet ({terms}): the smoothed |G|^2 is not positive"]
    if b_simple > 2 * batch:
        verdict = (
            f"the batch in use ({batch:.0f}) is {b_simple / batch:.1f}x below it: the gradient is noise-"
            "dominated, and a larger batch (up to ~B_simple) would need nearly proportionally fewer steps"
        )
    elif b_simple < batch / 2:
        verdict = (
            f"the batch in use ({batch:.0f}) is {batch / b_simple:.1f}x above it: past the critical batch, "
            "extra samples per step buy little; a smaller batch would train as fast per sample"
        )
    else:
        verdict = f"the batch in use ({batch:.0f}) is near it: about the most efficient batch for this phase"
    return [f"noise scale   B_simple = {b_simple:.4g} samples ({terms})", f"              {verdict}"]


def read_optimizer(last: dict[str, float], model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    eps = float(optimizer.param_groups[0]["eps"])
    layers = sorted({k.split("/", 2)[2] for k in last if k.startswith("optimizer/step_size/")} - {"total"})
    numel: dict[str, int] = {}
    for name, p in model.named_parameters():  # a parameter belongs to the longest layer name it starts with
        owners = [layer for layer in layers if name == layer or name.startswith(layer + ".")]
        owner = max(owners, key=len, default=None)
        if owner is not None:
            numel[owner] = numel.get(owner, 0) + p.numel()
    w = max(len(n) for n in [*layers, "layer"])
    lines = [
        f"optimizer     {type(optimizer).__name__}, eps {eps:g}: per-entry step in units of the LR "
        "(step size / sqrt(numel)), cos(update, -gradient), RMS of sqrt(v_hat) / eps",
        f"              {'layer':<{w}} {'step/lr/entry':>13} {'cosine':>7} {'sqrt(v)/eps':>12}",
    ]
    for layer in layers:
        step = last[f"optimizer/step_size/{layer}"] / math.sqrt(max(numel.get(layer, 1), 1))
        cos = last.get(f"optimizer/update_cosine/{layer}", math.nan)
        rms = last.get(f"optimizer/exp_avg_sq_rms/{layer}", math.nan) / eps
        lines.append(f"              {layer:<{w}} {step:>13.3f} {cos:>7.3f} {rms:>12.3g}")
    cos_total = last.get("optimizer/update_cosine/total", math.nan)
    lowest = min(
        (
            v / eps
            for k, v in last.items()
            if k.startswith("optimizer/exp_avg_sq_rms/") and k[-6:] != "/total"
        ),
        default=math.nan,
    )
    lines.append(
        f"              total cos(update, -gradient) {cos_total:.3f}: "
        + ("positive, the updates go downhill" if cos_total > 0 else "NOT positive: updates go uphill")
        + f"; the smallest sqrt(v_hat) is {lowest:.3g}x eps: "
        + ("eps is negligible in every layer" if lowest > 10 else "eps matters in some layer")
    )
    skipped = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("optimizer/skipped_updates/")}
    lines.append(
        "              skipped updates: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(skipped.items()))
    )
    return lines


def read_activations(monitor: ActivationRangeMonitor) -> list[str]:
    w = max(len(n) for n in [*monitor.ranges, "block"])
    lines = [
        "activations   per block output: largest |x|, RMS, kurtosis (Gaussian 3), float16 headroom",
        f"              {'block':<{w}} {'max|x|':>8} {'RMS':>7} {'kurtosis':>9} {'headroom':>9}",
    ]
    for name, r in monitor.ranges.items():
        lines.append(
            f"              {name:<{w}} {r.max_abs:>8.3g} {r.rms:>7.3g} {r.kurtosis:>9.3g} "
            f"{r.headroom_bits:>6.1f} bits"
        )
    least = min(monitor.ranges.values(), key=lambda r: r.headroom_bits)
    worst = max(monitor.ranges.items(), key=lambda kv: kv[1].kurtosis)
    lines.append(
        f"              the least headroom is {least.headroom_bits:.1f} bits (2^{least.headroom_bits:.1f} "
        f"x below 65504): {'a 16-mixed run is far from overflow' if least.headroom_bits > 6 else 'tight'}; "
        f"the largest kurtosis, {worst[1].kurtosis:.3g} ({worst[0]}), "
        + ("shows no outlier features" if worst[1].kurtosis < 30 else "shows outlier features")
    )
    for name, logit in monitor.max_logits.items():
        state = "healthy (the tens or below)" if logit < 25 else "growing: watch it"
        lines.append(f"attention     {name}: largest logit q.k/sqrt(d) = {logit:.3g}, {state}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--epochs", type=int, default=12, help="epochs (22 optimizer steps each)")
    args = parser.parse_args(argv)
    quiet_lightning()
    pl.seed_everything(SEED, verbose=False)
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    train, val = digits_sequences()
    grads = GradientNormLogger(log_noise_scale=True, histogram_every_n_steps=0)
    optim, ranges = OptimizerMonitor(), ActivationRangeMonitor()
    model = DigitsTransformer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        accumulate_grad_batches=ACCUMULATE,
        log_every_n_steps=LOG_EVERY_N_STEPS,
        logger=TensorBoardLogger(RUNS_DIR, name=RUN_NAME, default_hp_metric=False),
        callbacks=[grads, optim, ranges],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, train, val)
    seconds = time.perf_counter() - start
    print(
        f"\n=== the deeper signals ({seconds:.1f} s, {trainer.global_step} optimizer steps of "
        f"{MICRO_BATCH} x {ACCUMULATE} samples) ==="
    )
    print(f"final val accuracy {float(trainer.callback_metrics['val/acc']):.3f}")
    for line in [
        *read_noise_scale(grads.last_logged),
        *read_optimizer(optim.last_logged, model, trainer.optimizers[0]),
        *read_activations(ranges),
    ]:
        print(line)
    alerts = [a.kind for cb in (grads, optim, ranges) for a in cb.alerts]
    print(f"alerts        {', '.join(alerts) or 'none'}")
    print(f"TensorBoard run {trainer.log_dir}\n\ntensorboard --logdir {RUNS_DIR}")


if __name__ == "__main__":
    main()
