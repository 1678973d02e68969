"""LRFinderPlus suggests a learning rate only from a descent that stands out of the curve's own noise.

Issue 25, item 1: on a model whose loss cannot fall (a detached output) the sweep's curve varied by a
tenth of a percent and the finder still applied a learning rate read from that noise, with no
``lr_finder_failed`` alert. The math is checked against independent computations (a known noise level,
a Monte Carlo estimate of the smoother's noise), the callback on real Trainers on scikit-learn's digits.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from lightning_gradguard import LRFinderPlus, lr_find
from lightning_gradguard.functional.lr_suggest import (
    DESCENT_NOISE_MULTIPLE,
    SUGGESTION_METHODS,
    centered_smooth,
    descent_check,
    loss_noise,
    smoothing_gain,
    suggest_all,
    sweep_lrs,
)
from tests.conftest import make_trainer


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers without a logger use the working directory: keep it out of the repository."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------------------- the math
def _sweep_curve(n: int = 100, noise: float = 0.05, seed: int = 0) -> tuple[list[float], list[float]]:
    """A range test's shape (flat, a fall of 1.0 around 1e-3, a blow-up past 1e-1) plus Gaussian noise."""
    lrs = sweep_lrs(1e-6, 1.0, n)
    x = np.log10(lrs)
    y = 2.0 - 0.5 * (1 + np.tanh(2.0 * (x + 3.0))) + np.exp(3.0 * (x + 1.0)) - np.exp(-6.0)
    return lrs, list(y + noise * np.random.default_rng(seed).standard_normal(n))


def test_loss_noise_reads_the_scatter_and_not_the_trend() -> None:
    rng = np.random.default_rng(0)
    steps = np.arange(100)
    for sd in (0.01, 0.05, 0.2):
        estimates = []
        for _ in range(20):
            y = 3.0 - 0.02 * steps + sd * rng.standard_normal(100)  # a steady fall, steeper than the noise
            y[-8:] += np.linspace(1.0, 50.0, 8)  # and a diverging tail
            estimates.append(loss_noise(list(y)))
        assert float(np.mean(estimates)) == pytest.approx(sd, rel=0.15)
    # a range test's shape without noise (a fall of 1.0 within a decade, a blow-up): a little, not the fall
    assert loss_noise(_sweep_curve(100, 0.0)[1]) < 0.02
    # never below 5e-4 of the loss's size (float rounding, or a loss that barely moves)
    assert loss_noise([2.302585] * 50) == pytest.approx(5e-4 * 2.302585)


def test_smoothing_gain_is_the_noise_the_smoother_keeps() -> None:
    rng = np.random.default_rng(1)
    for n in (12, 40, 100):
        smoothed = np.array([centered_smooth(list(rng.standard_normal(n))) for _ in range(3000)])
        measured = smoothed.std(axis=0)  # Monte Carlo, independent of the weights' formula
        assert smoothing_gain(n) == pytest.approx(measured, rel=0.08)
        assert smoothing_gain(n)[0] > 1.2 * smoothing_gain(n)[n // 2]  # a cut kernel at the ends


def test_pure_noise_does_not_stand_out_and_a_real_descent_does() -> None:
    rng = np.random.default_rng(2)
    lrs = sweep_lrs(1e-6, 1.0, 100)
    ratios = [descent_check(list(2.3 + 0.05 * rng.standard_normal(100))).ratio for _ in range(300)]
    assert max(ratios) < DESCENT_NOISE_MULTIPLE and float(np.quantile(ratios, 0.99)) < 5.0
    for seed in range(5):
        lrs, losses = _sweep_curve(noise=0.1, seed=seed)
        check = descent_check(losses)
        assert check.stands_out and check.ratio > 2 * DESCENT_NOISE_MULTIPLE
        assert 0.7 < check.fall < 1.3  # the fall of 1.0, smoothed
        assert lrs[check.start] < 1e-4 and 1e-3 < lrs[check.lowest] < 1e-1
        assert check.fall / check.fall_noise == pytest.approx(check.ratio)


def test_suggest_all_with_the_raw_losses_suggests_nothing_from_noise() -> None:
    rng = np.random.default_rng(3)
    lrs = sweep_lrs(1e-6, 1.0, 100)
    flat = list(2.3 + 0.01 * rng.standard_normal(100))
    curve = centered_smooth(flat)
    assert any(v is not None for v in suggest_all(lrs, curve).values())  # each method reads a wiggle
    assert suggest_all(lrs, curve, raw=flat) == dict.fromkeys(SUGGESTION_METHODS)
    lrs, losses = _sweep_curve(noise=0.05)
    curve = centered_smooth(losses)
    assert suggest_all(lrs, curve, raw=losses) == suggest_all(lrs, curve)  # a real descent: unchanged
    # a fall below float resolution, however smooth, is no descent
    tiny = [2.302585 - 1e-7 * i for i in range(100)]
    assert not descent_check(tiny).stands_out


def test_descent_check_validates_and_handles_short_curves() -> None:
    with pytest.raises(ValueError, match="same length"):
        descent_check([1.0, 2.0, 3.0], [1.0, 2.0])
    assert descent_check([]).ratio == 0.0 and not descent_check([1.0]).stands_out
    assert descent_check([0.0] * 10).ratio == 0.0  # no fall, no noise


# ---------------------------------------------------------------------------------------------- on a Trainer
@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(data.target, dtype=torch.long)


def _loader(batch_size: int = 32) -> Any:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(*_digits())
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, generator=g, drop_last=True)


class Digits(pl.LightningModule):
    """A digits MLP trained with Adam at the user's ``lr=3e-3``.

    ``fault``: ``"detached"``, the logits are detached, so the loss cannot fall (the weights get zero
    gradients; the curve is batch-to-batch noise only); ``"bias_only"``, the logits are a trainable bias
    alone, so the loss can fall only by the gap between ln 10 and the labels' entropy (about 2e-4 of its
    level), whatever the learning rate; ``None``: the healthy twin.
    """

    def __init__(self, fault: str | None = None, lr: float = 3e-3) -> None:
        super().__init__()
        self.fault, self.lr = fault, lr
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.bias = nn.Parameter(torch.zeros(10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        if self.fault == "detached":
            logits = logits.detach()
        elif self.fault == "bias_only":
            logits = self.bias.expand(len(y), -1)
        keep = 0.0 * sum(p.sum() for p in self.parameters())  # every parameter in the graph
        return nn.functional.cross_entropy(logits, y) + keep

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@pytest.mark.parametrize(
    ("fault", "method"),
    [*(("detached", method) for method in SUGGESTION_METHODS), ("bias_only", "steep")],
)
def test_a_loss_that_cannot_fall_gets_no_suggestion_keeps_its_lr_and_an_alert(
    fault: str, method: str
) -> None:
    """Regression (issue 25, item 1): the detached model's curve moved by 0.16 % and the finder applied
    1.79e-4 over the user's 3e-3 without an alert; every method read a descent from the noise."""
    pl.seed_everything(0)
    model = Digits(fault)
    # the defaults (1e-7 to 1, 100 steps), but one blind search, not its retries (the bias alone learns the
    # label frequencies, a move too small to choose by, and trials up to 4x as long learn no more), and only
    # for the default method: what the search does after a refusal does not depend on the method
    search = {"search_retries": 0} if method == "steep" else {"search_steps": 0}
    finder = LRFinderPlus(method=method, progress=False, plot=False, **search)
    make_trainer([finder], max_steps=1).fit(model, _loader())
    result = finder.result
    assert result is not None and len(result.lrs) >= 20
    assert result.descent is not None and result.descent.ratio < DESCENT_NOISE_MULTIPLE
    assert result.suggestion is None and result.suggestions == dict.fromkeys(SUGGESTION_METHODS)
    assert not result.applied and model.trainer.optimizers[0].param_groups[0]["lr"] == 3e-3  # kept
    assert [a.kind for a in finder.alerts] == ["lr_finder_failed"]
    message = finder.alerts[0].message
    assert (
        "does not stand out of its noise" in message and f"needs {DESCENT_NOISE_MULTIPLE:g} times" in message
    )
    assert f"{result.descent.ratio:.2g} times the noise" in message or "never fell" in message
    assert "left unchanged" in message and "depends on the trained weights" in finder.alerts[0].hint
    if method == "steep":
        assert result.search is not None and result.search.blind and "nor did training" in message


@pytest.mark.parametrize(("batch_size", "accumulate"), [(32, 1), (4, 1), (4, 4)])
def test_the_healthy_twin_still_gets_its_suggestion(batch_size: int, accumulate: int) -> None:
    pl.seed_everything(0)
    model = Digits()
    finder = LRFinderPlus(progress=False, plot=False)
    make_trainer([finder], max_steps=1, accumulate_grad_batches=accumulate).fit(model, _loader(batch_size))
    result = finder.result
    assert result is not None and result.descent is not None
    assert result.descent.ratio > 2 * DESCENT_NOISE_MULTIPLE  # a margin, not a coin flip
    assert all(v is not None for v in result.suggestions.values())
    assert result.applied and model.trainer.optimizers[0].param_groups[0]["lr"] == result.suggestion
    assert finder.alerts == []
    # the suggestion is what the unchanged rules read off the same curve
    assert result.suggestions == suggest_all(result.lrs, result.curve)


def test_lr_find_on_a_detached_model_writes_no_learning_rate() -> None:
    pl.seed_everything(0)
    model = Digits("detached")
    result = lr_find(model, _loader(), progress=False, trainer_kwargs={"accelerator": "cpu"})
    assert result is not None and result.suggestion is None and math.isclose(model.lr, 3e-3)
    assert "does not stand out of its noise" in result.reason
