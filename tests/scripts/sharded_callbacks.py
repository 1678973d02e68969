"""2-process CPU run (gloo) for tests/integration/test_sharded.py: ``python sharded_callbacks.py OUTDIR``.

The callbacks beside the norms, under the strategy named by OUTDIR (``ddp``, ``fsdp1`` or ``fsdp2``, set
up as in ``sharded_norms.py``). The same model (a ReLU MLP whose first layer has units that never fire),
data and seed under every strategy; fits in one process group, each writing OUTDIR/<fit><rank>.json:

1. ``guard``: DeadReLUMonitor (every step, window_samples 2) and LossSpikeGuard(action="skip",
   escalate_after=1) with
   a rollback point at the end of its warm-up; rank 1's loss is multiplied by 100 at steps ``SPIKES``:
   the first spike is skipped, the second (a streak of two) rolled back. Every rank records, at the end of
   every step, the whole weights (gathered: ``summon_full_params`` / ``DTensor.full_tensor``), the dead
   fractions, and when the guard took its rollback point;
2. ``lr``: LRFinderPlus (20 sweep steps, applied), then training;
3. ``preflight``: OverfitBatchSanity and GradientCheck (both ``action="warn"``), then training: the
   results, the GradGuard warnings and the whole weights after the fit.
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_gradguard import (
    DeadReLUMonitor,
    GradientCheck,
    LossSpikeGuard,
    LRFinderPlus,
    OverfitBatchSanity,
)
from lightning_gradguard.functional.stats import clean_name

STEPS = 14
SPIKES = (10, 11)  # skipped, then rolled back to the point taken after the warm-up (8 judged steps)
SIZES = (7, 13, 5, 3)
DEAD = 6  # units of the first layer that never fire (a bias far below zero)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU (see ``sharded_norms.py`` and docs/sharded.md)."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def strategy(kind: str) -> Any:
    if kind == "ddp":
        return "ddp"
    if kind == "fsdp1":
        return CPUFSDPStrategy(
            auto_wrap_policy={nn.Linear}, use_orig_params=True, process_group_backend="gloo"
        )
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")


def whole_weights(trainer: pl.Trainer, module: nn.Module) -> dict[str, list[float]]:
    """Every parameter as the whole tensor, flattened (a collective under sharding: call on every rank)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
            return {clean_name(n): p.detach().flatten().tolist() for n, p in module.named_parameters()}
    out = {}
    for n, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[clean_name(n)] = full.detach().flatten().tolist()
    return out


class Model(pl.LightningModule):
    def __init__(self, kind: str, spikes: tuple[int, ...] = (), dead: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(SIZES) - 2 else [])
        self.net = nn.Sequential(*layers)
        if dead:
            with torch.no_grad():
                self.net[0].bias[:DEAD] = -50.0
        self.kind, self.spikes = kind, spikes

    def configure_model(self) -> None:
        if self.kind != "fsdp2":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_rank == 1 and self.trainer.global_step in self.spikes:
            loss = loss * 100.0
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def loader(learnable: bool = False) -> Any:
    """Random inputs; random labels, or (``learnable``) labels a fixed linear map of the input decides,
    so that a range test's loss falls out of its noise and LRFinderPlus suggests a rate."""
    g = torch.Generator().manual_seed(0)
    n = 2 * 8 * STEPS
    x, y = torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)
    if learnable:
        y = (x @ torch.randn(SIZES[0], SIZES[-1], generator=g)).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(kind: str, out: Path, callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        strategy=strategy(kind),
        default_root_dir=str(out),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


class Recorder(pl.Callback):
    """At the end of every step (after the callbacks before it): whole weights, dead fractions, and
    whether the guard took a rollback point at this step."""

    def __init__(self, guard: LossSpikeGuard, relu: DeadReLUMonitor) -> None:
        self.guard, self.relu = guard, relu
        self.weights: dict[int, dict[str, list[float]]] = {}
        self.dead: dict[int, dict[str, float]] = {}
        self.snapshots: list[int] = []
        self._last: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = int(trainer.global_step) - 1
        self.weights[step] = whole_weights(trainer, pl_module)
        self.dead[step] = dict(self.relu.dead_fractions)
        point = self.guard._snapshot
        if point is not None and point is not self._last:
            self.snapshots.append(step)
        self._last = point


def guard_run(kind: str, out: Path) -> None:
    guard = LossSpikeGuard(
        action="skip", escalate_after=1, warmup_steps=8, window_steps=8, snapshot_every_n_steps=100
    )
    relu = DeadReLUMonitor(sample_every_n_steps=1, window_samples=2, patience=1, log_histograms=False)
    recorder = Recorder(guard, relu)
    t = trainer(kind, out / "guard", [guard, relu, recorder])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Model(kind, spikes=SPIKES), loader())
    seen = {
        "steps": int(t.global_step),
        "weights": recorder.weights,
        "dead": recorder.dead,
        "snapshots": recorder.snapshots,
        "records": [[r.step, r.action] for r in guard.records],
        "rollbacks": guard.rollbacks,
        "sampled": relu.sampled_batches,
        "warnings": [str(w.message) for w in caught if "GradGuard" in str(w.message)],
    }
    (out / f"guard{t.global_rank}.json").write_text(json.dumps(seen))


def _gradguard_warnings(caught: list[Any]) -> list[str]:
    names = ("GradGuard", "LRFinderPlus", "OverfitBatchSanity", "GradientCheck")
    return [str(w.message) for w in caught if any(n in str(w.message) for n in names)]


def lr_run(kind: str, out: Path) -> None:
    # a model without dead units on learnable labels: its sweep's descent stands out of the noise, so a
    # suggestion is made and applied (random labels give a curve LRFinderPlus rightly suggests nothing on)
    # the sweep alone (search_steps=0): its curve and suggestion are compared with DDP's to 1e-5; the
    # search's winner between candidates whose losses tie to float rounding could differ
    finder = LRFinderPlus(
        num_training=30, min_lr=1e-3, max_lr=3.0, plot=False, progress=False, search_steps=0
    )
    t = trainer(kind, out / "lr", [finder])
    model = Model(kind, dead=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(learnable=True))
    r = finder.results[0]
    seen = {
        "stop_reason": r.stop_reason,
        "reason": r.reason,
        "lrs": r.lrs,
        "losses": r.losses,
        "suggestion": r.suggestion,
        "applied_lr": r.applied_lr,
        "lr_now": float(t.optimizers[0].param_groups[0]["lr"]),
        "alerts": [a.kind for a in finder.alerts],
        "warnings": _gradguard_warnings(caught),
        "steps": int(t.global_step),
        "weights": whole_weights(t, model),
    }
    (out / f"lr{t.global_rank}.json").write_text(json.dumps(seen))


def preflight_run(kind: str, out: Path) -> None:
    overfit = OverfitBatchSanity(max_steps=30, action="warn")
    check = GradientCheck(action="warn")
    t = trainer(kind, out / "preflight", [overfit, check])
    model = Model(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader())
    seen = {
        "overfit": None if overfit.result is None else overfit.result.passed,
        "gradcheck": None if check.result is None else check.result.passed,
        "alerts": [a.kind for a in overfit.alerts + check.alerts],
        "warnings": _gradguard_warnings(caught),
        "steps": int(t.global_step),
        "weights": whole_weights(t, model),
    }
    (out / f"preflight{t.global_rank}.json").write_text(json.dumps(seen))


FITS = {"guard": guard_run, "lr": lr_run, "preflight": preflight_run}


def main(out: Path, fits: list[str]) -> None:
    kind = out.name
    assert kind in ("ddp", "fsdp1", "fsdp2"), kind
    pl.seed_everything(0)
    for name in fits:
        FITS[name](kind, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(FITS))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
