"""2-process CPU DDP run (gloo) for tests/monitors/activation_range/test_activation_range.py.

``python ddp_activation_range.py OUTDIR``.

The ranks see different data on purpose (rank 1's inputs are 3x larger and shifted): the pooled max |x|,
RMS and kurtosis of a block differ from either rank's own. An ``nn.TransformerEncoderLayer`` gives an
attention logit per rank. Each rank writes what ActivationRangeMonitor reported at every sampled step to
OUTDIR/rank<r>.json, and its own block outputs and brute-force largest logits (``q @ k^T / sqrt(d)`` from
the layer's weights) to OUTDIR/truth<r>.pt.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gradguard import ActivationRangeMonitor

D, HEADS, L = 16, 2, 5


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.encoder = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, 3)
        self.outputs: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.logits: dict[int, list[float]] = {}
        for name in ("embed", "encoder", "head"):
            getattr(self, name).register_forward_hook(self._keep(name))
        self.encoder.self_attn.register_forward_pre_hook(self._truth)

    def _keep(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            step = int(self.trainer.global_step)
            self.outputs.setdefault(step, {}).setdefault(name, []).append(out.detach().double())

        return hook

    def _truth(self, mha: nn.MultiheadAttention, args: Any) -> None:
        x = args[0].detach().double()
        w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
        q, k = (F.linear(x, w[i * D : (i + 1) * D], b[i * D : (i + 1) * D]) for i in (0, 1))
        q, k = (t.reshape(x.shape[0], L, HEADS, D // HEADS).transpose(1, 2) for t in (q, k))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
        self.logits.setdefault(int(self.trainer.global_step), []).append(float(scores.max()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x * 3.0 + 1.0 if self.global_rank == 1 else x
        return F.cross_entropy(self.head(self.encoder(self.embed(x)).mean(1)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Recorder(pl.Callback):
    """After the monitor (callbacks run in list order): what it reported at each sampled step."""

    def __init__(self, monitor: ActivationRangeMonitor) -> None:
        self.monitor, self.seen, self.reported = monitor, 0, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.monitor.sampled_steps > self.seen:
            self.seen = self.monitor.sampled_steps
            self.reported[trainer.global_step - 1] = {
                "ranges": {k: r.scalars() for k, r in self.monitor.ranges.items()},
                "logits": dict(self.monitor.max_logits),
            }


def main(out: Path) -> None:
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, L, 4, generator=g), torch.randint(0, 3, (96,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    monitor = ActivationRangeMonitor()
    recorder = Recorder(monitor)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        log_every_n_steps=2,
        logger=False,
        default_root_dir=str(out),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor, recorder],
    )
    model = Model()
    trainer.fit(model, loader)
    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps({"reported": recorder.reported}))
    torch.save({"outputs": model.outputs, "logits": model.logits}, out / f"truth{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
