"""GradientCheck on a healthy model whose loss code casts to float32: no false mismatch.

A ``training_step`` that computes its loss on ``logits.float()`` (the usual way to keep a loss in
float32 under mixed precision) used to round the float64 check's logits to float32: finite differences at
``eps = 1e-6`` then measured rounding noise, and a healthy MLP failed with relative errors of 1-88 %.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, random_loader
from torch import nn

from lightning_gradguard import GradientCheck, gradient_check


class CastingMLP(pl.LightningModule):
    def __init__(self, cast: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.cast = cast

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        if self.cast == "float":
            logits = logits.float()
        elif self.cast == "to":
            logits = logits.to(torch.float32)
        elif self.cast == "half_round_trip":
            logits = logits.half().float()
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("cast", ["float", "to", "half_round_trip"])
def test_a_float32_cast_in_the_loss_is_no_mismatch(cast: str) -> None:
    torch.manual_seed(0)
    check = GradientCheck()
    make_trainer([check], max_steps=1).fit(CastingMLP(cast), random_loader(n=32))
    assert check.result is not None and check.result.passed, [p for p in check.result.parameters]
    assert check.result.promoted  # the check says the loss code asked for less than float64


def test_the_function_keeps_the_loss_in_float64_too() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    batch = (torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2]))
    result = gradient_check(net, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]))
    assert result.passed and max(p.max_rel_error for p in result.parameters) < 1e-6


class _Gelu(torch.autograd.Function):
    """A correct tanh-GELU with its own backward: a custom Function makes GradientCheck check every
    parameter upstream of it, so the whole attention block below is checked."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.7978845608 * (x + 0.044715 * x**3))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608 * (1 + 3 * 0.044715 * x * x))


class Float32Parts(pl.LightningModule):
    """Self-attention over 6 tokens that computes parts in float32 on purpose, as Bloom, Gemma and most LMs
    do: ``softmax(..., dtype=torch.float32)``, or an RMSNorm's variance ``mean(..., dtype=torch.float32)``
    (beside a mask made with ``torch.zeros(..., dtype=torch.float32)``), then a custom-Function MLP."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        if self.how == "softmax_dtype":
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        else:
            mask = torch.zeros(scores.shape[-2:], dtype=torch.float32).triu(1) * -1e4
            probs = torch.softmax(scores + mask, dim=-1)
        h = x + probs @ v
        if self.how == "norm_dtype":  # an RMSNorm whose variance is computed in float32
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + 1e-6).to(h.dtype)
        else:
            h = self.norm(h)
        return self.head(h + self.down(_Gelu.apply(self.up(h)))).mean(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x.view(-1, 6, 8)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("how", ["softmax_dtype", "norm_dtype"])
def test_parts_computed_in_float32_on_purpose_are_no_mismatch(how: str) -> None:
    """An op asked for float32 (``dtype=`` of a softmax or a mean) used to compute in float32 inside
    the float64 check: the loss then carried float32 rounding, and a healthy model with a custom Function
    failed on a dozen upstream tensors (relative errors 1e-3 to 9e-2 on a small Bloom)."""
    torch.manual_seed(0)
    check = GradientCheck(max_seconds=None)
    x = torch.randn(32, 48)
    y = torch.randint(0, 4, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    make_trainer([check], max_steps=1).fit(Float32Parts(how), loader)
    result = check.result
    assert result is not None and result.custom_functions == {"": ["_Gelu"]}
    assert len(result.parameters) >= 8  # every parameter upstream of the Function was checked
    assert result.passed, [(p.name, p.max_rel_error) for p in result.failures]
    assert max(p.max_rel_error for p in result.parameters) < 1e-5
    assert result.promoted
