"""Every callback across the Trainer configurations users run: does the run go through, and unchanged?

One row per Trainer configuration (precision, accumulation, clipping, manual optimization, several
optimizers, LBFGS, validation, limits, fast_dev_run, no logger; the slow ones: 2-process DDP, persistent
DataLoader workers, ``torch.compile``, 16-mixed with a GradScaler), one column per callback alone, all of
them together, and none. A cell trains a small model with a fixed seed and compares its final weights
with the column "none" of its row:

* ``same``: bit for bit the unwatched run (what every monitor that only watches must give);
* ``differs``: trained, weights not identical (expected only where a callback changes the run on purpose:
  LRFinderPlus applies its learning rate; the sampling monitors under ``torch.compile`` run their sampled
  steps eagerly, docs/detectors.md);
* ``failed``: an exception (the error's type and first line).

``python benchmarks/matrix.py`` runs the whole matrix (``--quick``: the rows the test suite runs);
tests/integration/test_matrix.py runs the fast rows inside ``make test`` and asserts the expectations.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradguard import (
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradientCheck,
    GradientNormLogger,
    LossSpikeGuard,
    LRFinderPlus,
    NaNSentinel,
    OptimizerMonitor,
    OverfitBatchSanity,
    StallDetector,
    VanishingExplodingDetector,
)

SEED = 0


# ---------------------------------------------------------------------------------------------- models
class Net(pl.LightningModule):
    """A small classifier on 8x8 inputs: a conv with BatchNorm (``cnn=True``) or an MLP, then a head.

    ``optimizer``: ``"adam"``, ``"sgd"`` or ``"lbfgs"``; ``manual``: manual optimization (one optimizer,
    or two with ``two_optimizers``: the body and the head, as a GAN steps two).
    """

    def __init__(
        self, cnn: bool = False, optimizer: str = "adam", manual: bool = False, two_optimizers: bool = False
    ) -> None:
        super().__init__()
        if cnn:
            self.body: nn.Module = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Flatten(),
            )
            width = 8 * 64
        else:
            self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
            width = 32
        self.head = nn.Linear(width, 4)
        self.optimizer_name, self.two_optimizers = optimizer, two_optimizers
        self.automatic_optimization = not manual

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
            opt.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self(x).float(), y))
            opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self) -> Any:
        if self.two_optimizers:
            return [
                torch.optim.Adam(self.body.parameters(), 1e-3),
                torch.optim.Adam(self.head.parameters(), 1e-3),
            ]
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader(batches: int = 8, batch_size: int = 16, **kwargs: Any) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(SEED)
    n = batches * batch_size
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, **kwargs)


# ---------------------------------------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Config:
    """One Trainer configuration: its Trainer arguments, its model, its data; ``slow``: not in make test."""

    trainer: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    validate: bool = False
    slow: bool = False


def _scaler_plugin() -> dict[str, Any]:
    return {"plugins": [MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))]}


CONFIGS: dict[str, Config] = {
    "default": Config(),
    "accumulate_2": Config(trainer={"accumulate_grad_batches": 2}),
    "clip_norm": Config(trainer={"gradient_clip_val": 0.5}),
    "clip_value": Config(trainer={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}),
    "bf16_mixed_cnn": Config(trainer={"precision": "bf16-mixed"}, model={"cnn": True}),
    "bf16_true_cnn": Config(trainer={"precision": "bf16-true"}, model={"cnn": True}),
    "manual": Config(model={"manual": True}),
    "two_optimizers": Config(model={"manual": True, "two_optimizers": True}),
    "lbfgs": Config(model={"optimizer": "lbfgs"}),
    "sgd_validation": Config(model={"optimizer": "sgd"}, validate=True, trainer={"val_check_interval": 4}),
    "limits": Config(trainer={"limit_train_batches": 3, "max_epochs": 2}),
    "overfit_batches": Config(trainer={"overfit_batches": 2, "max_epochs": 3}),
    "max_steps": Config(trainer={"max_steps": 5, "max_epochs": -1}),
    "bf16_accumulate_clip": Config(
        trainer={"precision": "bf16-mixed", "accumulate_grad_batches": 3, "gradient_clip_val": 0.5}
    ),
    "fast_dev_run": Config(trainer={"fast_dev_run": True}),
    "no_logger": Config(trainer={"logger": False, "log_every_n_steps": 0}),
    "16_mixed_scaler": Config(trainer=_scaler_plugin(), slow=True),
    "persistent_workers": Config(data={"num_workers": 1, "persistent_workers": True}, slow=True),
    "compile_cnn": Config(model={"cnn": True}, slow=True),
    "ddp_2": Config(trainer={"devices": 2, "strategy": "ddp"}, slow=True),
}

#: the columns: each callback alone (with settings that keep a tiny run quick), all of them, none
COLUMNS: dict[str, Callable[[], list[pl.Callback]]] = {
    "none": lambda: [],
    "GradientNormLogger": lambda: [GradientNormLogger(log_every_n_steps=2)],
    "VanishingExplodingDetector": lambda: [VanishingExplodingDetector()],
    "DeadReLUMonitor": lambda: [DeadReLUMonitor(sample_every_n_steps=2)],
    "ActivationRangeMonitor": lambda: [ActivationRangeMonitor(sample_every_n_steps=2)],
    "OptimizerMonitor": lambda: [OptimizerMonitor(log_every_n_steps=2)],
    "StallDetector": lambda: [StallDetector(check_every_n_steps=2)],
    "NaNSentinel": lambda: [NaNSentinel()],
    "LossSpikeGuard": lambda: [LossSpikeGuard()],
    "OverfitBatchSanity": lambda: [OverfitBatchSanity()],
    "GradientCheck": lambda: [GradientCheck()],
    "LRFinderPlus": lambda: [LRFinderPlus(num_training=12, progress=False, plot=False)],
    "all": lambda: [c()[0] for name, c in COLUMNS.items() if name not in ("none", "all", "LRFinderPlus")],
}
#: the columns that change the run on purpose (the rest must leave it bit for bit as it was)
CHANGES_THE_RUN = {"LRFinderPlus"}
#: under torch.compile the sampling monitors' sampled steps run eagerly (docs/detectors.md)
EAGER_UNDER_COMPILE = {"VanishingExplodingDetector", "DeadReLUMonitor", "ActivationRangeMonitor", "all"}


def expected(config: str, column: str) -> str:
    """What a cell must give: ``same``, or ``trained`` (``same`` or ``differs``)."""
    if column in CHANGES_THE_RUN or (config == "compile_cnn" and column in EAGER_UNDER_COMPILE):
        return "trained"
    return "same"


def _trainer(config: Config, callbacks: list[pl.Callback], root: str) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": CSVLogger(root),
        "log_every_n_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": root,
        "callbacks": callbacks,
    }
    kwargs.update(config.trainer)
    return pl.Trainer(**kwargs)


def run_cell(config_name: str, column: str) -> dict[str, Tensor] | str:
    """The final weights of one cell, or ``"failed: <error>"``."""
    config = CONFIGS[config_name]
    pl.seed_everything(SEED, verbose=False)
    model = Net(**config.model)
    if config_name == "compile_cnn":
        model.body = torch.compile(model.body)  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as root:
        try:
            trainer = _trainer(config, COLUMNS[column](), root)
            val = loader(2, **config.data) if config.validate else None
            trainer.fit(model, loader(**config.data), val)
        except Exception as err:  # a cell's verdict, not the matrix's end
            first = str(err).splitlines()[0] if str(err) else ""
            return f"failed: {type(err).__name__}: {first[:120]}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_ddp_cell(config_name: str, column: str) -> dict[str, Tensor] | str:
    """A DDP cell in a process of its own (Lightning relaunches the script for rank 1, so the whole
    matrix cannot run in the launching process): ``--cell`` runs it and saves rank 0's weights."""
    import subprocess

    with tempfile.TemporaryDirectory() as out:
        target = Path(out) / "weights.pt"
        proc = subprocess.run(
            [sys.executable, __file__, "--cell", config_name, column, str(target)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if not target.exists():
            out_lines = (proc.stderr + proc.stdout).splitlines()
            lines = [line for line in out_lines if "Error" in line or "[error]" in line]
            lines = lines or ["no weights written"]
            return f"failed: {lines[-1].strip()[:120]}"
        loaded: dict[str, Tensor] = torch.load(target)
        return loaded


def compare(weights: dict[str, Tensor] | str, reference: dict[str, Tensor] | str) -> str:
    if isinstance(weights, str):
        return weights
    if isinstance(reference, str):
        return "trained (no reference)"
    same = weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    return "same" if same else "differs"


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="only the rows make test runs")
    parser.add_argument(
        "--cell", nargs=3, metavar=("CONFIG", "COLUMN", "OUT"), help="one cell, weights to OUT"
    )
    args = parser.parse_args(argv)
    quiet()
    if args.cell:
        config, column, out = args.cell
        weights = run_cell(config, column)
        if pl.utilities.rank_zero_only.rank == 0 and not isinstance(weights, str):
            torch.save(weights, out)
        return 0
    torch.set_num_threads(1)
    rows = [name for name, c in CONFIGS.items() if not (args.quick and c.slow)]
    columns = list(COLUMNS)
    print("| config | " + " | ".join(columns[1:]) + " |")
    print("|---|" + "---|" * (len(columns) - 1))
    wrong = 0
    for name in rows:
        run = run_ddp_cell if "strategy" in CONFIGS[name].trainer else run_cell
        reference = run(name, "none")
        cells = []
        for column in columns[1:]:
            got = compare(run(name, column), reference)
            ok = got == "same" or (
                expected(name, column) == "trained" and got in ("differs", "trained (no reference)")
            )
            wrong += not ok
            cells.append(got if ok else f"**{got}**")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{len(rows) * (len(columns) - 1)} cells, {wrong} not as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
