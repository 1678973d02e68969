"""What the tests share that needs torch and Lightning: a real in-memory Logger, a small classifier that
records the true norms, the random loader, labels met late, the Trainer the tests use, the list of public
callbacks and the search budget of a fit's test.

Imported on first use through ``conftest`` (``from conftest import make_trainer`` still works): the
pytest-xdist controller, which runs no test, never imports torch or Lightning.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from torch import nn

#: the LR search's budget in tests that run it only as part of a fit (not to judge what it chooses): every
#: round runs (5 trials of 10 steps, up to 3 of 20) in a fifth of the default's 600 steps
SEARCH_STEPS = 110


def reference_total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all ``grads`` together, computed apart from the library: torch's
    ``get_total_norm`` where it exists (torch 2.6 and later), else each tensor's ``vector_norm`` and
    the norm of those (what ``get_total_norm`` does), so the tests run on the torch floor too."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type=norm_type)
    if not grads:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)


class MemoryLogger(Logger):
    """A real ``Logger``: every ``log_metrics`` call is kept as ``(step, metrics)``."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []
        self._save_dir = save_dir

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    def log_dir(self) -> str | None:
        return self._save_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def series(self, tag: str) -> dict[int, float]:
        """``{step: value}`` of one tag (the last value wins if a step repeats)."""
        return {int(s): m[tag] for s, m in self.calls if tag in m and s is not None}


def random_loader(
    n: int = 64, features: int = 8, classes: int = 4, batch_size: int = 8, seed: int = 0
) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class RecordingMLP(pl.LightningModule):
    """A small classifier that records, independently of gradguard, the true norms at every step."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        self.lr = lr
        self.true_total: dict[int, float] = {}
        self.true_layers: dict[int, dict[str, float]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.true_total[self.trainer.global_step] = float(reference_total_norm(grads))
        layers: dict[str, list[torch.Tensor]] = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                layers.setdefault(name.rsplit(".", 1)[0], []).append(p.grad.reshape(-1))
        self.true_layers[self.trainer.global_step] = {
            k: float(torch.linalg.vector_norm(torch.cat(v))) for k, v in layers.items()
        }

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LateLabels(nn.Module):
    """What a model that needs long to use its inputs shows short trainings: for its first ``after`` training
    steps every sample meets the next sample's label (rolled by one), so nothing it learns there depends on
    its inputs; then its own. The count is a buffer, so a restored snapshot starts it again (the LR
    search's trials each begin at the same count). Call it on a training step's labels."""

    seen: torch.Tensor

    def __init__(self, after: int = 30) -> None:
        super().__init__()
        self.after = after
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, y: torch.Tensor, training: bool) -> torch.Tensor:
        if not training:
            return y
        self.seen += 1
        return y.roll(1) if int(self.seen) <= self.after else y


def public_callbacks() -> list[type]:
    """Every callback class the package exports (a new one is checked by the convention tests at once)."""
    import lightning_gradguard
    from lightning_gradguard import GradGuardCallback

    exported = [getattr(lightning_gradguard, name) for name in lightning_gradguard.__all__]
    return [
        c
        for c in exported
        if isinstance(c, type) and issubclass(c, GradGuardCallback) and c is not GradGuardCallback
    ]


def make_trainer(callbacks: list[Any], logger: Any = None, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger if logger is not None else False,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)
