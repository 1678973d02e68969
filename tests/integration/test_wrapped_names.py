"""Layer names are the user's: wrappers (torch.compile, activation checkpointing) add nothing to a tag.

The same network, plain and wrapped, trained the same way: the tags and values the monitors log must be
the same, with no ``_orig_mod`` or ``_checkpoint_wrapped_module`` in any tag, alert or layer name.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, make_trainer, random_loader
from torch import nn

from lightning_gradguard import DeadReLUMonitor, GradientNormLogger, VanishingExplodingDetector
from lightning_gradguard.functional.stats import clean_name


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


class Model(pl.LightningModule):
    def __init__(self, wrap: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = _net()
        if wrap == "compile":
            net = torch.compile(net, backend="eager")  # an OptimizedModule: parameters under _orig_mod
        elif wrap == "checkpoint":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            net = checkpoint_wrapper(net)
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run(wrap: str, tmp_path: Any) -> tuple[dict[str, dict[int, float]], list[str]]:
    logger = MemoryLogger(str(tmp_path / wrap))
    callbacks = [
        GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0),
        VanishingExplodingDetector(check_every_n_steps=1),
        DeadReLUMonitor(),
    ]
    make_trainer(callbacks, logger, default_root_dir=str(tmp_path / wrap), max_steps=6).fit(
        Model(wrap), random_loader()
    )
    tags = {tag for _, metrics in logger.calls for tag in metrics}
    return {tag: logger.series(tag) for tag in tags}, [a.where or "" for cb in callbacks for a in cb.alerts]


def test_clean_name_drops_only_wrapper_parts() -> None:
    assert clean_name("net._orig_mod.0.weight") == "net.0.weight"
    assert (
        clean_name("_fsdp_wrapped_module.layers.1._checkpoint_wrapped_module.fc.bias") == "layers.1.fc.bias"
    )
    assert clean_name("orig_mod.my_module_.weight") == "orig_mod.my_module_.weight"


@pytest.mark.parametrize("wrap", ["compile", "checkpoint"])
def test_a_wrapped_network_logs_the_plain_networks_tags_and_values(wrap: str, tmp_path: Any) -> None:
    plain, _ = _run("plain", tmp_path)
    wrapped, wheres = _run(wrap, tmp_path)
    assert "grad_norm/net.0" in plain and "dead_relu/net.1" in plain  # the families under test are there
    assert sorted(wrapped) == sorted(plain)
    for tag, series in plain.items():
        assert wrapped[tag] == pytest.approx(series, rel=1e-6, abs=1e-12), tag
    assert not [w for w in wheres if "_orig_mod" in w or "_wrapped_module" in w]
