"""Pre-flight checks on scikit-learn's digits: prove in seconds that a model can learn and that its
gradients are right, before the real run.

Run it with ``.venv/bin/python examples/preflight.py`` from the repository root (a few seconds on CPU).
What it does:

1. a healthy MLP with a hand-written layer (a custom ``torch.autograd.Function``) passes both checks:
   ``GradientCheck`` compares its backward with finite differences in float64, ``OverfitBatchSanity``
   memorises the first batch; then the real training runs, unaffected, to a good validation accuracy;
2. the same layer with a wrong transpose in its backward: ``GradientCheck`` stops the run and names the
   parameter;
3. six broken pipelines (a ``.detach()`` in forward, an optimizer missing a layer, ``lr=0``, a loss
   summed instead of averaged, labels reshuffled against their inputs in ``training_step``, a dataset
   that looks labels up with a random index): ``OverfitBatchSanity`` stops each one with its own
   finding, in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import GradientCheck, OverfitBatchSanity, SanityCheckError

SEED = 0
BATCH_SIZE = 32
RUNS_DIR = "runs/preflight"
HIDDEN = 64  # square hidden layer: a transposed weight gradient has the right shape and goes unnoticed


class HandLinearFn(torch.autograd.Function):
    """``x @ W.T + b`` with a hand-written backward (``bug="transpose"`` plants a classic mistake)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bug: str | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bug = bug
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        grad_w = x.t() @ grad_out if ctx.bug == "transpose" else grad_out.t() @ x
        return grad_out @ w, grad_w, grad_out.sum(0), None


class HandLinear(nn.Module):
    def __init__(self, size: int, bug: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size) / size**0.5)
        self.bias = nn.Parameter(torch.zeros(size))
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HandLinearFn.apply(x, self.weight, self.bias, self.bug)


class DigitsMLP(pl.LightningModule):
    """64 pixels -> 64 -> hand-written 64x64 -> 10 classes, with one switchable bug."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.bug = bug
        self.inp = nn.Linear(64, HIDDEN)
        self.hand = HandLinear(HIDDEN, bug="transpose" if bug == "custom_backward" else None)
        self.out = nn.Linear(HIDDEN, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.bug == "detach":
            h = h.detach()
        return self.out(torch.relu(self.hand(h)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.bug == "shuffled_labels":
            y = y[torch.randperm(len(y))]
        loss = nn.functional.cross_entropy(self(x), y, reduction="sum" if self.bug == "sum_loss" else "mean")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        if self.bug == "optimizer_missing_layer":
            return torch.optim.Adam(list(self.hand.parameters()) + list(self.out.parameters()), lr=1e-3)
        return torch.optim.Adam(self.parameters(), lr=0.0 if self.bug == "lr_zero" else 1e-3)


class RandomLabelLookup(torch.utils.data.Dataset):
    """A data bug: each item's label is looked up with a fresh random index instead of the item's own."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i][0], self.data[int(torch.randint(len(self.data), ()))][1]


def digits_loaders() -> tuple[DataLoader, DataLoader]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    scaler = StandardScaler().fit(x_tr)

    def ds(a: Any, b: Any) -> TensorDataset:
        return TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.long))

    train = DataLoader(ds(scaler.transform(x_tr), y_tr), batch_size=BATCH_SIZE, shuffle=True)
    val = DataLoader(ds(scaler.transform(x_va), y_va), batch_size=256)
    return train, val


def trainer(callbacks: list[Any], max_epochs: int = 1, max_steps: int = -1) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=RUNS_DIR,  # the alerts' JSON-lines file goes there
    )


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_gradguard").setLevel(logging.CRITICAL)  # we print the errors ourselves
    warnings.filterwarnings("ignore")
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    train, val = digits_loaders()

    print("=== 1. healthy model: both checks pass, then the real run ===")
    pl.seed_everything(SEED, verbose=False)
    grad_check, overfit = GradientCheck(), OverfitBatchSanity(max_steps=300)
    model = DigitsMLP()
    started = time.perf_counter()
    run = trainer([grad_check, overfit], max_epochs=5)
    run.fit(model, train, val)
    g, o = grad_check.result, overfit.result
    assert g is not None and o is not None
    print(f"gradient check: targets {g.targets} (custom Functions {g.custom_functions})")
    for p in g.parameters:
        print(
            f"  {p.name:<12} max relative error {p.max_rel_error:.1e}  Taylor order {p.taylor_order:.2f}  "
            f"linear Taylor remainder {p.taylor_linear_error:.1e}"
        )
    print(f"  {g.evaluations} loss evaluations in {g.seconds:.2f} s -> passed={g.passed}")
    print(
        f"overfit one batch ({o.num_samples} samples, {o.optimizer}): loss {o.initial_loss:.3f} -> "
        f"{o.final_loss:.4f} in {o.steps} steps, {o.seconds:.2f} s -> passed={o.passed}"
    )
    print(
        f"real run: val accuracy {float(run.callback_metrics['val_acc']):.3f} after 5 epochs "
        f"({time.perf_counter() - started:.1f} s in all)"
    )

    print("\n=== 2. a wrong transpose in the hand-written backward ===")
    pl.seed_everything(SEED, verbose=False)
    try:
        trainer([GradientCheck()]).fit(DigitsMLP("custom_backward"), train)
    except SanityCheckError as err:
        alert = err.alerts[0]
        print(
            f"SanityCheckError: {alert.kind} at {alert.where}: relative error "
            f"{alert.data['relative_error']:.2f}, Taylor order {alert.data['taylor_order']:.2f}"
        )

    print("\n=== 3. broken pipelines, caught before the first real step ===")
    print(f"{'bug':<26}{'findings':<50}{'seconds':>8}")
    bugs = (
        "detach",
        "optimizer_missing_layer",
        "lr_zero",
        "sum_loss",
        "shuffled_labels",
        "dataset_random_labels",
    )
    for bug in bugs:
        pl.seed_everything(SEED, verbose=False)
        check = OverfitBatchSanity(max_steps=300)
        started = time.perf_counter()
        try:
            if bug == "dataset_random_labels":  # the bug is in the data, not in the model
                data = DataLoader(RandomLabelLookup(train.dataset), batch_size=BATCH_SIZE, shuffle=True)
                trainer([check]).fit(DigitsMLP(), data)
            else:
                trainer([check]).fit(DigitsMLP(bug), train)
            found = "none (passed)"
        except SanityCheckError as err:
            found = ", ".join(sorted({a.kind for a in err.alerts}))
        print(f"{bug:<26}{found:<50}{time.perf_counter() - started:>8.2f}")
        errors = [f for f in (check.result.findings if check.result else []) if f.severity == "error"]
        specific = [f for f in errors if f.kind != "overfit_failed"]
        for f in specific or errors:  # the specific findings; else the curve and its likely causes
            print(f"    {f.message}")
            if not specific:
                print(f"    {f.hint}")


if __name__ == "__main__":
    main()
