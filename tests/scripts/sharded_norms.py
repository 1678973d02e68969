"""2-process CPU run (gloo) for tests/integration/test_sharded.py: ``python sharded_norms.py OUTDIR``.

The strategy is OUTDIR's name: ``ddp``, ``fsdp1`` (Lightning's ``FSDPStrategy``, FULL_SHARD, every Linear
wrapped, ``use_orig_params=True``, through the CPU subclass below) or ``fsdp2`` (``ModelParallelStrategy``
with ``fully_shard`` on every Linear and the root in ``configure_model``: DTensor parameters). Two fits in
one process group, the same model, data and seed under every strategy:

1. healthy: GradientNormLogger (every step, norm 2, histograms every 3 steps) and a second one (the
   infinity norm) with the Trainer clipping by value, LossSpikeGuard and VanishingExplodingDetector,
   CSV and TensorBoard loggers under OUTDIR: every rank writes what the callbacks saw (what each
   GradientNormLogger logged, per step) to OUTDIR/rank<r>.json;
2. NaN: rank 1's batch holds a NaN at optimizer step ``NAN_AT``; NaNSentinel(action="stop") must stop
   every rank at that step with the update dropped: every rank writes OUTDIR/nan<r>.json;
3. (``fsdp1`` only) FSDP1 with ``use_orig_params=False``: OUTDIR/flat<r>.json.
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
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_gradguard import (
    GradientNormLogger,
    LossSpikeGuard,
    NaNSentinel,
    VanishingExplodingDetector,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: testkit's reference norm
from testkit import reference_total_norm

NAN_AT = 3
STEPS = 6
SIZES = (7, 13, 5, 3)  # odd sizes: the shards of a parameter are uneven, some ranks hold none of one


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU (gloo): Lightning passes ``device_id=None`` to FSDP, which then
    wants a GPU; on CPU the device must be given. For tests and CPU users (see docs/sharded.md)."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class Recorder(pl.Callback):
    """What each GradientNormLogger logged at each step (they run before it: Lightning's callback order)."""

    def __init__(self, loggers: dict[str, GradientNormLogger]) -> None:
        self.loggers, self.seen = loggers, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = int(trainer.global_step) - 1
        self.seen[step] = {name: dict(lg.last_logged) for name, lg in self.loggers.items()}


class Model(pl.LightningModule):
    def __init__(self, kind: str, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
            layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(SIZES) - 2 else [])
        self.net = nn.Sequential(*layers)
        self.kind, self.nan_at = kind, nan_at
        self.reference: dict[int, float] = {}

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
        if self.nan_at is not None and self.global_rank == 1 and self.trainer.global_step == self.nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.kind == "ddp":  # the true total norm, from the full (all-reduced) gradients
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.reference[int(self.trainer.global_step)] = float(reference_total_norm(grads))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def strategy(kind: str) -> Any:
    if kind == "ddp":
        return "ddp"
    if kind == "fsdp1":
        return CPUFSDPStrategy(
            auto_wrap_policy={nn.Linear}, use_orig_params=True, process_group_backend="gloo"
        )
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")


def loader() -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(2 * 8 * STEPS, SIZES[0], generator=g),
        torch.randint(0, SIZES[-1], (2 * 8 * STEPS,), generator=g),
    )
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(kind: str, out: Path, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("strategy", strategy(kind))
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        default_root_dir=str(out),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def healthy(kind: str, out: Path) -> None:
    norm2 = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=3)  # of rank 0's pieces
    norm_inf = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0, norm_type="inf")
    recorder = Recorder({"2": norm2, "inf": norm_inf})
    spike = LossSpikeGuard(grad_norm_threshold=6.0, warmup_steps=8, action="warn")
    detector = VanishingExplodingDetector(action="warn")
    t = trainer(
        kind,
        out,
        [norm2, norm_inf, recorder, spike, detector],
        logger=[CSVLogger(out, name="csv", version=0), TensorBoardLogger(out, name="tb", version=0)],
        log_every_n_steps=1,
        gradient_clip_val=10.0,
        gradient_clip_algorithm="value",
    )
    model = Model(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader())
    seen = {
        "steps": int(t.global_step),
        "reference": model.reference,
        "logged": recorder.seen,
        "spike_windows": {k: list(v) for k, v in spike.windows.items()},
        "detector": detector.last_check,
        "warnings": [str(w.message) for w in caught if "GradGuard" in str(w.message)],
    }
    (out / f"rank{t.global_rank}.json").write_text(json.dumps(seen, default=str))


def nan_run(kind: str, out: Path) -> None:
    sentinel = NaNSentinel(action="stop")
    t = trainer(kind, out / "nan", [sentinel], logger=False)
    model = Model(kind, nan_at=NAN_AT)
    t.fit(model, loader())
    params = [p.detach() for p in model.parameters()]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    result = {
        "alerts": [(a.kind, a.step) for a in sentinel.alerts],
        "global_step": int(t.global_step),
        "finite": all(bool(torch.isfinite(p).all()) for p in local),
        "report_dir": sentinel.last_report_dir,
        "history": [[r.step, r.total_grad_norm] for r in sentinel.norm_history.records()],
    }
    (out / f"nan{t.global_rank}.json").write_text(json.dumps(result, default=str))


def flat_params(out: Path) -> None:
    """FSDP1 with ``use_orig_params=False``: the optimizer holds one ``_flat_param`` per Linear."""
    norm2 = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    recorder = Recorder({"2": norm2})
    flat = CPUFSDPStrategy(auto_wrap_policy={nn.Linear}, use_orig_params=False, process_group_backend="gloo")
    t = trainer("fsdp1", out / "flat", [norm2, recorder], logger=False, strategy=flat)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Model("fsdp1"), loader())
    seen = {
        "logged": recorder.seen,
        "warnings": [str(w.message) for w in caught if "GradGuard" in str(w.message)],
    }
    (out / f"flat{t.global_rank}.json").write_text(json.dumps(seen, default=str))


def main(out: Path) -> None:
    kind = out.name
    assert kind in ("ddp", "fsdp1", "fsdp2"), kind
    pl.seed_everything(0)
    healthy(kind, out)
    nan_run(kind, out)
    if kind == "fsdp1":
        flat_params(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
