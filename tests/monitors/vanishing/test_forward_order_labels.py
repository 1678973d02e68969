"""The depth rule reads the forward order by the labels the norms carry (issue 40).

A parameter registered directly on the LightningModule, or on a container module beside child modules with
parameters, is its own layer in the step's norms (``"in_scale"``, ``"encoder.pos"``). The forward order used
to be keyed by module name (``""``, ``"encoder"``), so those layers fell out of the depth rule without a
word: the first layer it compared was the first ``Linear``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from conftest import make_trainer, random_loader
from torch import nn

from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector
from lightning_gradguard.monitors.vanishing.order import ForwardOrder


class _Encoder(nn.Module):
    """A container: a parameter of its own (``pos``, added after ``fc``) beside a child with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.pos = nn.Parameter(torch.full((16,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.pos


class RootAndContainer(pl.LightningModule):
    """``in_scale`` on the root, used first; ``encoder.pos`` on a container; ``head`` last."""

    def __init__(self) -> None:
        super().__init__()
        self.in_scale = nn.Parameter(torch.ones(8))
        self.encoder = _Encoder()
        self.head = nn.Linear(16, 4)
        self.grad_norms: dict[int, float] = {}  # global step -> ||grad in_scale||, read by the test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x * self.in_scale)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        assert self.in_scale.grad is not None
        self.grad_norms[self.global_step] = float(self.in_scale.grad.norm())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


EXPECTED = {"in_scale": 0, "encoder.fc": 1, "encoder.pos": 2, "head": 3}


def test_root_and_container_parameters_have_their_depth_read_on_a_trainer() -> None:
    torch.manual_seed(0)
    model = RootAndContainer()
    det = VanishingExplodingDetector(check_every_n_steps=1, dense_steps=4)
    make_trainer([det], max_steps=4).fit(model, random_loader())
    assert det.forward_order == EXPECTED  # the labels of the norms, in the order the forward used them
    # the depth rule's first layer is the root parameter: its norm is the one the module saw
    step, data = det.last_check["step"], det.last_check["data"]
    assert torch.isclose(torch.tensor(data["first_layer_norm"]), torch.tensor(model.grad_norms[step]))


def test_forward_order_in_a_plain_loop_takes_parameters_at_their_first_use() -> None:
    model = RootAndContainer()
    with ForwardOrder(model) as watch:
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))  # a second pass moves nothing
    assert watch.order == EXPECTED and not watch.attached
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert torch.overrides._get_current_function_mode() is None  # the mode left with the hooks
