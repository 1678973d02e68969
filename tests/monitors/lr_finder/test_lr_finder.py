"""LRFinderPlus: the suggestion math on curves with known answers, and the callback on real Lightning runs.

The callback tests compare against independent computations: a hand-written PyTorch sweep, a run
without the finder, and a run started at the suggested learning rate.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import logging
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import run_ddp_script
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from lightning.pytorch.core.saving import load_hparams_from_yaml
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_gradguard import LRFinderPlus, lr_find
from lightning_gradguard.functional.lr_suggest import (
    SUGGESTION_METHODS,
    centered_smooth,
    ema_smooth,
    suggest_all,
    suggest_minimum,
    suggest_slide,
    suggest_steep,
    suggest_valley,
    sweep_lrs,
)
from lightning_gradguard.monitors.lr_finder.divergence import DivergenceMonitor
from lightning_gradguard.monitors.lr_finder.search import SHORT_HORIZON
from tests.conftest import MemoryLogger, make_trainer


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers without a logger use the working directory: keep it out of the repository."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------------------- pure math
def test_sweep_lrs_exponential_and_linear() -> None:
    exp = sweep_lrs(1e-4, 1.0, 5, "exponential")
    assert exp == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1, 1.0])
    lin = sweep_lrs(0.1, 0.5, 5, "linear")
    assert lin == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    with pytest.raises(ValueError, match="mode"):
        sweep_lrs(0.1, 1.0, 5, "cosine")


def test_ema_smooth_is_bias_corrected() -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0]
    beta = 0.8
    expected, num, den = [], 0.0, 0.0  # weighted mean with weights beta**(t - i): an independent form
    for v in values:
        num = beta * num + v
        den = beta * den + 1.0
        expected.append(num / den)
    assert ema_smooth(values, beta) == pytest.approx(expected)
    assert ema_smooth([-7.0] * 4, 0.98) == pytest.approx([-7.0] * 4)  # no pull towards zero at the start


def test_centered_smooth_keeps_a_bump_where_it_is() -> None:
    x = np.arange(60)
    bump = list(np.exp(-0.5 * ((x - 30) / 4.0) ** 2))
    assert int(np.argmax(centered_smooth(bump, 3.0))) == 30
    assert int(np.argmax(ema_smooth(bump, 0.8))) > 31  # the causal EMA drags it to the right


def _curve(n: int = 100, x0: float = -3.0, x1: float = 0.0) -> tuple[list[float], list[float]]:
    """A loss that falls like -tanh around log10(lr) = x0 and blows up beyond x1."""
    lrs = sweep_lrs(1e-7, 10.0, n)
    xs = np.log10(lrs)
    y = 2.0 - np.tanh(xs - x0) + np.exp(3.0 * (xs - x1))
    return lrs, list(y)


def test_steep_finds_the_steepest_descent() -> None:
    lrs, losses = _curve(x0=-3.0)
    step = math.log10(lrs[1] / lrs[0])
    assert abs(math.log10(suggest_steep(lrs, losses)) + 3.0) <= step + 1e-9  # type: ignore[arg-type]


def test_minimum_is_argmin_over_ten() -> None:
    lrs, losses = _curve()
    i = int(np.argmin(losses))
    assert suggest_minimum(lrs, losses) == pytest.approx(lrs[i] / 10)


def _valley_curve(
    n: int = 121, sag: float = 0.0, noise: float = 0.0
) -> tuple[list[float], list[float], float]:
    """Flat (or gently sagging) start, a straight descent in log-LR from 1e-4 to 1e-2, flat to 1e-1, a rise.

    Returns the LRs, the losses and the width of one LR step in decades.
    """
    lrs = sweep_lrs(1e-7, 1.0, n)
    xs = np.log10(lrs)
    y = 2.0 - sag * (xs + 7.0)  # the plateau (sag = 0: flat), continuous at the descent's start
    top = 2.0 - sag * 3.0
    y = np.where(xs > -4.0, top - 0.75 * (xs + 4.0), y)  # the descent: 1.5 over two decades
    y = np.where(xs > -2.0, top - 1.5, y)  # the bottom: the smoothed descent stays symmetric
    y = np.where(xs > -1.0, top - 1.5 + 2.0 * (xs + 1.0), y)  # the rise
    y = y + noise * np.random.default_rng(0).standard_normal(n)
    return lrs, list(y), float(xs[1] - xs[0])


@pytest.mark.parametrize(("sag", "noise"), [(0.0, 0.0), (0.0, 0.01), (0.01, 0.0), (0.01, 0.003)])
def test_valley_is_the_middle_of_the_descent_not_of_a_sagging_or_noisy_plateau(
    sag: float, noise: float
) -> None:
    lrs, losses, step = _valley_curve(sag=sag, noise=noise)
    s = suggest_valley(lrs, centered_smooth(losses))  # smoothed first, as LRFinderPlus does
    assert s is not None
    assert abs(math.log10(s) + 3.0) <= step + 1e-9  # the middle of the descent, 1e-4..1e-2
    if noise == 0.0:  # the exact curve: exact to a step
        exact = suggest_valley(lrs, losses)
        assert exact is not None and abs(math.log10(exact) + 3.0) <= step + 1e-9


def test_valley_tolerance_sets_how_steep_counts_as_descent() -> None:
    # the descent falls steeply from 1e-4 to 1e-3 and half as fast on to 1e-2
    lrs = sweep_lrs(1e-6, 1.0, 121)
    xs = np.log10(lrs)
    y = np.where(xs < -4.0, 3.0, 3.0 - 1.0 * (xs + 4.0))
    y = np.where(xs > -3.0, 2.0 - 0.5 * (xs + 3.0), y)
    y = np.where(xs > -2.0, 1.5 + 2.0 * (xs + 2.0), y)
    step = float(xs[1] - xs[0])
    strict = suggest_valley(lrs, list(y), tolerance=0.9)  # only the steep decade counts
    loose = suggest_valley(lrs, list(y), tolerance=0.4)  # both decades count
    assert abs(math.log10(strict) + 3.5) <= step + 1e-9  # type: ignore[arg-type]
    assert abs(math.log10(loose) + 3.0) <= step + 1e-9  # type: ignore[arg-type]


def test_slide_lands_in_the_descent() -> None:
    lrs, losses = _curve(x0=-3.0, x1=0.0)
    s = suggest_slide(lrs, losses)
    assert s is not None
    assert -5.0 < math.log10(s) < math.log10(lrs[int(np.argmin(losses))])


def test_no_suggestion_when_the_loss_only_rises() -> None:
    lrs = sweep_lrs(1e-5, 1.0, 50)
    rising = [0.1 * i for i in range(50)]
    assert suggest_all(lrs, rising) == dict.fromkeys(SUGGESTION_METHODS)


def _monitor_stop(losses: list[float], **kw: Any) -> int:
    m = DivergenceMonitor(**kw)
    for i, v in enumerate(losses):
        if m.update(v):
            return i
    return -1


def test_divergence_rule_is_shift_and_scale_invariant_and_works_for_negative_losses() -> None:
    rng = np.random.default_rng(1)
    _, base = _curve(x0=-3.0, x1=-0.5)
    noisy = [v + 0.02 * rng.standard_normal() for v in base]
    stop = _monitor_stop(noisy, beta=0.9)
    assert 0 < stop < len(noisy) - 1  # it does stop, before the end
    assert _monitor_stop([v - 100.0 for v in noisy], beta=0.9) == stop  # all negative
    assert _monitor_stop([(v - 2.5) * 1e-4 for v in noisy], beta=0.9) == stop  # near zero, both signs
    # the stop comes after the minimum of the curve, on the rising side
    assert stop > int(np.argmin(base))


def test_divergence_rule_ignores_one_bad_batch_on_a_flat_start_and_stops_on_nan() -> None:
    rng = np.random.default_rng(2)
    flat = list(2.3 + 0.02 * rng.standard_normal(60))
    flat[25] = 2.6  # one unlucky batch (15 sigma)
    assert _monitor_stop(flat, beta=0.9) == -1
    m = DivergenceMonitor(beta=0.9)
    assert not m.update(1.0)
    assert m.update(float("nan")) and m.reason == "non-finite loss"


def test_divergence_rule_ignores_a_low_first_batch() -> None:
    # the very first smoothed value is the first raw loss: a low one must not become the best that the
    # flat start then seems to climb away from (seen on a real sweep: it stopped after 22 of 100 steps)
    rng = np.random.default_rng(3)
    flat = list(2.3 + 0.01 * rng.standard_normal(60))
    flat[0] = 2.27  # 3 sigma low
    for i in range(15, 30):
        flat[i] += (
            0.025  # a sustained wobble of the flat start (counting the first batch as best: stop at 26)
        )
    assert _monitor_stop(flat, beta=0.9) == -1
    rising = flat[:30] + [2.3 + 0.05 * i for i in range(1, 30)]  # a real rise still stops it
    assert 30 < _monitor_stop(rising, beta=0.9) < 40


class _ZeroHead(pl.LightningModule):
    """fastText's shape on digits: small input weights and a zero-initialised output layer, plain SGD. Every
    batch gives exactly ``ln(10)`` until the weights move, so the first losses show no noise at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.1
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Linear(32, CLASSES))
        nn.init.uniform_(self.net[0].weight, -1 / 256, 1 / 256)
        nn.init.zeros_(self.net[0].bias)
        nn.init.zeros_(self.net[1].weight)
        nn.init.zeros_(self.net[1].bias)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_a_flat_start_without_noise_does_not_stop_on_a_rise_that_does_not_matter() -> None:
    # the noise read from identical first losses is zero: the sweep used to stop as "diverged" near lr 2e-4
    # (every seed), on a loss that had moved by less than 1e-5 of its level, and suggested nothing
    torch.manual_seed(0)
    result = lr_find(
        _ZeroHead(),
        _loader(batch_size=4, shuffle=True),
        min_lr=1e-7,
        max_lr=10.0,
        num_training=100,
        search_steps=0,
        progress=False,
        trainer_kwargs=dict(logger=False, enable_checkpointing=False, enable_model_summary=False),
    )
    assert result is not None
    assert result.losses[:5] == [pytest.approx(math.log(CLASSES), abs=1e-6)] * 5
    assert result.lrs[-1] > 0.1  # on to where plain SGD moves these weights


class _AdafactorNet(pl.LightningModule):
    """A digits MLP under torch's Adafactor, recording the LR of every ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1e-3
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adafactor(self.parameters(), lr=self.lr)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor: torch 2.5 on")
def test_the_sweep_ends_where_adafactor_caps_its_step() -> None:
    # Adafactor's t-th step is min(lr, 1/sqrt(t)) of the parameters' RMS: past that every LR steps alike, and
    # a transformer's sweep went on falling to 112, far past its best LR (0.1), the steep point at 0.5
    torch.manual_seed(0)
    model = _AdafactorNet()
    kw: dict[str, Any] = dict(min_lr=1e-4, max_lr=10.0, num_training=60, search_steps=0, progress=False)
    result = lr_find(model, _loader(shuffle=True), trainer_kwargs={"logger": False}, **kw)
    assert result is not None and result.stop_reason == "capped"
    n = len(result.lrs)
    assert model.seen[:n] == pytest.approx(result.lrs)  # the LRs the steps ran at, from the model
    assert all(lr <= 1 / math.sqrt(t) for t, lr in enumerate(result.lrs, start=1))
    assert sweep_lrs(1e-4, 10.0, 60)[n] > 1 / math.sqrt(n + 1)  # the next one would have been capped
    assert result.suggestion is not None and result.suggestion <= result.lrs[-1]


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor: torch 2.5 on")
def test_a_capped_flat_sweep_does_not_advise_a_higher_max_lr() -> None:
    class FlatAdafactor(_AdafactorNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return 0.0 * self.net(batch[0]).sum() + 1.0  # does not depend on the learning rate

    model = FlatAdafactor()
    finder = _finder(min_lr=1e-4, max_lr=10.0, num_training=60)
    _fit(model, [finder], loader=_loader(), max_steps=1)
    assert finder.result is not None and finder.result.stop_reason == "capped"
    assert finder.result.suggestion is None
    assert [a.kind for a in finder.alerts] == ["lr_finder_failed"]
    hint = finder.alerts[0].hint
    assert "same capped step" in hint and "raise max_lr" not in hint


# ---------------------------------------------------------------------------------------------- modules
#: the sweeps' data: the first 384 scikit-learn digits (real data), 12 batches of 32 an epoch
SAMPLES, BATCH, FEATURES, CLASSES = 384, 32, 64, 10


@functools.lru_cache(maxsize=1)
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised pixels and labels of the first ``SAMPLES`` digits.

    Tiny random data (96 samples, batches of 8) gave sweeps whose fall was 2 to 6 times its own noise:
    indistinguishable from a loss that cannot fall. Here a 40-step sweep falls 20 to 45 times its noise.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:SAMPLES], dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    return x, torch.tensor(digits.target[:SAMPLES], dtype=torch.long)


def _loader(batch_size: int = BATCH, shuffle: bool = False) -> Any:
    x, y = _data()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle
    )


def _key(batch: Any) -> float:
    """A fingerprint of a batch: the sum of its first sample's features."""
    return float(batch[0][0].sum())


class Net(pl.LightningModule):
    """Dropout (RNG), BatchNorm (buffers), SGD with momentum (optimizer state), a StepLR schedule."""

    def __init__(self, lr: float = 0.05, shift: float = 0.0, nan_above: float | None = None) -> None:
        super().__init__()
        self.lr = lr
        self.shift = shift
        self.nan_above = nan_above
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, CLASSES)
        )
        self.calls = 0
        self.step_losses: list[float] = []
        self.step_lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y) + self.shift
        self.log("train_loss", loss)
        if self.nan_above is not None and self.trainer.optimizers[0].param_groups[0]["lr"] > self.nan_above:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_losses.append(float(outputs["loss"]))
        self.step_lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
        }


def _finder(**kw: Any) -> LRFinderPlus:
    kw.setdefault("min_lr", 1e-4)
    kw.setdefault("max_lr", 10.0)
    kw.setdefault("num_training", 40)
    kw.setdefault("progress", False)
    kw.setdefault("search_steps", 0)  # the range test alone (the search: test_lr_search.py)
    kw.setdefault("plot", False)
    return LRFinderPlus(**kw)


def _fit(model: pl.LightningModule, callbacks: list[Any], loader: Any = None, **kw: Any) -> pl.Trainer:
    trainer = make_trainer(callbacks, **kw)
    trainer.fit(model, loader if loader is not None else _loader(shuffle=True))
    return trainer


def _unchanged(model: pl.LightningModule, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _same_state(a: pl.LightningModule, b: pl.LightningModule) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _equal_nested(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal_nested(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal_nested(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


class Probe(Callback):
    """Copies every piece of state at on_train_epoch_start (placed before and after the finder)."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, Any]] = {}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.fabric.utilities.seed import _collect_rng_states

        self.seen[trainer.current_epoch] = copy.deepcopy(
            {
                "model": pl_module.state_dict(),
                "grads": [p.grad for p in pl_module.parameters()],
                "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "rng": _collect_rng_states(include_cuda=False),
                "global_step": trainer.global_step,
                "loop": trainer.fit_loop.state_dict(),
                "training": [m.training for m in pl_module.modules()],
            }
        )


# ---------------------------------------------------------------------------------------------- restore
def test_exact_restore_and_the_run_after_equals_a_run_started_at_the_suggestion() -> None:
    pl.seed_everything(0)
    before, after = Probe(), Probe()
    # 60 steps: at epoch 1 the model is half trained, and a 40-step sweep's fall there is lost in its noise
    finder = _finder(milestones=[0, 1], num_training=60)
    model_a = Net(lr=0.05)
    trainer_a = _fit(model_a, [before, finder, after], max_epochs=2)
    # the sweep really moved things, and everything came back bit for bit
    assert len(finder.results) == 2 and all(len(r.lrs) >= 10 for r in finder.results)
    for epoch in (0, 1):
        _equal_nested(before.seen[epoch]["rng"], after.seen[epoch]["rng"])
        for key in ("model", "grads", "global_step", "loop", "training"):
            _equal_nested(before.seen[epoch][key], after.seen[epoch][key])
    suggestion0 = finder.results[0].suggestion
    assert suggestion0 is not None and finder.results[0].applied
    # the optimizer and scheduler differ only by the applied learning rate
    opt_b, opt_a = before.seen[1]["optimizer"], after.seen[1]["optimizer"]
    _equal_nested(opt_b["state"], opt_a["state"])
    assert opt_a["param_groups"][0]["lr"] == finder.results[1].suggestion
    assert after.seen[0]["scheduler"]["base_lrs"] == [suggestion0]

    # a run started with the first suggestion (and the second one applied at epoch 1 by hand)
    class SetLR(Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 1:
                s = finder.results[1].suggestion
                sched = trainer.lr_scheduler_configs[0].scheduler
                assert sched.base_lrs == [
                    trainer.optimizers[0].param_groups[0]["lr"]
                ]  # StepLR not decayed yet
                trainer.optimizers[0].param_groups[0]["lr"] = s
                trainer.optimizers[0].param_groups[0]["initial_lr"] = s
                sched.base_lrs = [s]
                sched._last_lr = [s]

    pl.seed_everything(0)
    model_b = Net(lr=suggestion0)
    trainer_b = _fit(model_b, [SetLR()], max_epochs=2)
    assert model_a.step_losses == model_b.step_losses  # bit-identical, both epochs
    assert model_a.step_lrs == model_b.step_lrs
    assert trainer_a.global_step == trainer_b.global_step == 24
    _same_state(model_a, model_b)
    _equal_nested(trainer_a.optimizers[0].state_dict(), trainer_b.optimizers[0].state_dict())


def test_apply_false_leaves_the_run_identical_to_one_without_the_finder() -> None:
    pl.seed_everything(1)
    model_a = Net()
    finder = _finder(apply=False, milestones=[0, 1], max_lr=1.0, divergence_threshold=None)
    _fit(model_a, [finder], max_epochs=2)
    assert finder.results[0].suggestion is not None and not finder.results[0].applied
    rng_a = torch.get_rng_state()
    pl.seed_everything(1)
    model_b = Net()
    _fit(model_b, [], max_epochs=2)
    _same_state(model_a, model_b)
    assert model_a.step_losses == model_b.step_losses
    assert torch.equal(rng_a, torch.get_rng_state())
    assert model_a.calls == model_b.calls + 2 * 40  # the sweep ran 40 training steps per milestone


# ---------------------------------------------------------------------------------------------- sweep
class Plain(pl.LightningModule):
    """No dropout, no BatchNorm: a sweep that a hand-written loop can reproduce exactly."""

    def __init__(self, groups: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(FEATURES, 16)
        self.b = nn.Linear(16, CLASSES)
        self.groups = groups
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.groups:
            return torch.optim.SGD(
                [{"params": self.a.parameters(), "lr": 0.1}, {"params": self.b.parameters(), "lr": 0.01}]
            )
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _reference_sweep(lrs: list[float], ratios: list[float], accumulate: int) -> list[float]:
    """The same sweep in plain PyTorch: one point per optimizer step, the mean micro-batch loss."""
    model = Plain()
    opt = torch.optim.SGD(
        [{"params": model.a.parameters(), "lr": 1.0}, {"params": model.b.parameters(), "lr": 1.0}]
    )
    batches = [b for _ in range(10) for b in _loader()]
    it = iter(batches)
    out = []
    for lr in lrs:
        for g, r in zip(opt.param_groups, ratios, strict=True):
            g["lr"] = lr * r
        opt.zero_grad()
        total = 0.0
        for _ in range(accumulate):
            x, y = next(it)
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / accumulate).backward()
            total += float(loss.detach())
        opt.step()
        out.append(total / accumulate)
    return out


@pytest.mark.parametrize("accumulate,groups,mode", [(1, False, "exponential"), (3, True, "linear")])
def test_sweep_matches_a_hand_written_loop(accumulate: int, groups: bool, mode: str) -> None:
    model = Plain(groups=groups)
    finder = _finder(min_lr=1e-3, max_lr=1.0, num_training=20, divergence_threshold=None, mode=mode)
    _fit(model, [finder], loader=_loader(), accumulate_grad_batches=accumulate, max_steps=1)
    result = finder.result
    assert result is not None and len(result.lrs) == 20
    assert result.lrs == pytest.approx(sweep_lrs(1e-3, 1.0, 20, mode))
    ratios = [1.0, 0.1] if groups else [1.0, 1.0]
    assert result.losses == pytest.approx(_reference_sweep(result.lrs, ratios, accumulate), rel=1e-5)
    assert model.calls == 20 * accumulate + accumulate  # the sweep, then one real optimizer step
    lrs = [g["lr"] for g in model.trainer.optimizers[0].param_groups]
    assert lrs[0] == result.suggestion
    if groups:
        assert lrs[1] == pytest.approx(0.1 * result.suggestion)  # ratio kept


def test_gradscaler_skipped_steps_are_dropped() -> None:
    model = Plain()
    finder = _finder(min_lr=1e-3, max_lr=1.0, num_training=20, divergence_threshold=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    _fit(model, [finder], loader=_loader(), plugins=[plugin], max_steps=1)
    result = finder.result
    assert result is not None and result.skipped_steps >= 1
    assert len(result.lrs) + result.skipped_steps == 20
    assert result.lrs == pytest.approx(sweep_lrs(1e-3, 1.0, 20)[result.skipped_steps :])
    assert scaler.get_scale() < 2.0**127  # the real step after the sweep starts from the restored scale


def test_bf16_mixed_sweep_suggests_and_restores() -> None:
    pl.seed_everything(0)
    probe_before, probe_after = Probe(), Probe()
    finder = _finder()
    _fit(Net(), [probe_before, finder, probe_after], precision="bf16-mixed", max_steps=2)
    assert finder.result is not None and finder.result.suggestion is not None
    _equal_nested(probe_before.seen[0]["model"], probe_after.seen[0]["model"])


def test_negative_loss_gives_the_same_sweep_as_the_shifted_positive_one() -> None:
    results = []
    for shift in (0.0, -50.0):
        pl.seed_everything(0)
        finder = _finder()
        _fit(Net(shift=shift), [finder], max_steps=1)
        results.append(finder.result)
    pos, neg = results
    assert pos is not None and neg is not None and max(neg.losses) < 0
    assert neg.stop_reason == pos.stop_reason == "diverged"
    assert neg.lrs == pos.lrs
    for k, v in pos.suggestions.items():
        assert neg.suggestions[k] == pytest.approx(v, rel=1e-6)


def test_nan_mid_sweep_is_trimmed_and_still_suggests() -> None:
    pl.seed_everything(0)
    finder = _finder(divergence_threshold=None)
    model = Net(nan_above=0.5)
    _fit(model, [finder], max_steps=1)
    result = finder.result
    assert result is not None and result.stop_reason == "non-finite loss"
    below = [lr for lr in sweep_lrs(1e-4, 10.0, 40) if lr <= 0.5]
    assert result.lrs == below and all(math.isfinite(v) for v in result.losses)
    assert result.suggestion is not None and result.suggestion <= 0.5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_no_suggestion_gives_none_and_an_alert() -> None:
    class Flat(Plain):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return 0.0 * self(batch[0]).sum() + 1.0  # does not depend on the learning rate

    model = Flat()
    finder = _finder(num_training=20)
    _fit(model, [finder], loader=_loader(), max_steps=1)
    assert finder.result is not None and finder.result.suggestion is None
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == 0.1  # unchanged
    kinds = [a.kind for a in finder.alerts]
    assert kinds == ["lr_finder_failed"]
    assert "does not stand out of its noise: the smoothed loss never fell" in finder.alerts[0].message
    assert "depends on the trained weights" in finder.alerts[0].hint


def test_too_few_points_gives_none_and_an_alert_with_the_reason() -> None:
    pl.seed_everything(0)
    finder = _finder()
    model = Net(nan_above=2e-4)  # NaN from the fourth sweep step on
    _fit(model, [finder], max_steps=1)
    result = finder.result
    assert result is not None and result.suggestion is None and len(result.lrs) == 3
    assert result.stop_reason == "non-finite loss"
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == 0.05
    assert [a.kind for a in finder.alerts] == ["lr_finder_failed"]
    assert "only 3 of 40 sweep steps" in finder.alerts[0].message


def test_manual_optimization_is_one_info_line_and_no_alert(caplog: pytest.LogCaptureFixture) -> None:
    """Manual optimization is a design, not a failure: no sweep, no lr_finder_failed, no warning; one INFO
    line (shared with the pre-flight checks) says what to run instead."""

    class Manual(Plain):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    finder = _finder()
    model = Manual()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        warnings.simplefilter("error", UserWarning)  # none of ours: a warning here fails the test
        warnings.filterwarnings("ignore", message=".*(num_workers|logging interval|LeafSpec).*")
        trainer = _fit(model, [finder], loader=_loader(), max_steps=2)
    assert trainer.global_step == 2 and model.calls == 0  # Plain.training_step was replaced; no sweep ran
    result = finder.result
    assert result is not None and result.suggestion is None and result.stop_reason == "not run"
    assert not finder.alerts
    said = [r for r in caplog.records if "need automatic optimization" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "LRFinderPlus" in said[0].getMessage() and "lr_find()" in said[0].getMessage()


# ---------------------------------------------------------------------------------------------- closures
class _LBFGS(Plain):
    """An optimizer whose ``step`` needs a closure (it evaluates the loss several times per step)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def _reference_lbfgs_sweep(lrs: list[float]) -> tuple[list[float], int]:
    """The LBFGS sweep in plain PyTorch: one closure per step on that step's batch, its first loss recorded.
    Also returns how many times the closures ran."""
    model = Plain()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=3)
    it = iter([b for _ in range(10) for b in _loader()])
    out, calls = [], 0
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        x, y = next(it)
        losses: list[float] = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)  # noqa: B023 (called within this iteration)
            loss.backward()
            losses.append(float(loss.detach()))  # noqa: B023
            return loss

        opt.step(closure)
        out.append(losses[0])
        calls += len(losses)
    return out, calls


class _CallsAtEpochStart(Callback):
    """``pl_module.calls`` at each epoch start: after the sweep when placed after the finder."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.calls.append(pl_module.calls)


def test_lbfgs_sweeps_through_a_closure_and_the_run_trains() -> None:
    """Regression: the sweep called ``optimizer.step()`` without a closure (``LBFGS.step() missing 1
    required positional argument: 'closure'``), crashing a run that Lightning trains fine."""
    model = _LBFGS()
    initial = copy.deepcopy(model.state_dict())
    finder = _finder(min_lr=1e-3, max_lr=1.0, num_training=15, divergence_threshold=None)
    after = _CallsAtEpochStart()
    trainer = _fit(model, [finder, after], loader=_loader(), max_steps=2)
    result = finder.result
    assert result is not None and result.stop_reason == "completed" and len(result.lrs) == 15
    expected, evaluations = _reference_lbfgs_sweep(result.lrs)
    assert result.losses == pytest.approx(expected, rel=1e-5)
    assert after.calls == [evaluations] and evaluations > 15  # LBFGS re-evaluated through the closure
    assert trainer.global_step == 2  # the run then trained, from the restored weights
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in initial.items())
    if result.suggestion is not None:
        assert trainer.optimizers[0].param_groups[0]["lr"] == result.suggestion


def test_lr_find_sweeps_an_lbfgs_model_and_leaves_it_unchanged() -> None:
    model = _LBFGS()
    before = copy.deepcopy(model.state_dict())
    result = lr_find(
        model,
        _loader(),
        min_lr=1e-3,
        max_lr=1.0,
        num_training=15,
        divergence_threshold=None,
        search_steps=110,  # the search runs, at a small budget: an LBFGS step is up to 20 evaluations
        progress=False,
        trainer_kwargs={"accelerator": "cpu"},
    )
    assert result is not None and result.stop_reason == "completed"
    assert result.losses == pytest.approx(_reference_lbfgs_sweep(result.lrs)[0], rel=1e-5)
    _unchanged(model, before)


def test_lbfgs_under_a_gradscaler_is_an_unsupported_setup_not_a_crash() -> None:
    """Lightning refuses LBFGS under 16-mixed at its first step; the sweep says so before it would step."""
    scaler = torch.amp.GradScaler("cpu")
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    model = _LBFGS()
    with pytest.warns(UserWarning, match="needs a closure"):
        result = lr_find(
            model, _loader(), progress=False, trainer_kwargs={"accelerator": "cpu", "plugins": [plugin]}
        )
    assert result is not None and result.stop_reason == "not run" and model.calls == 0
    assert "LBFGS needs a closure" in result.reason and "GradScaler" in result.reason


# ---------------------------------------------------------------------------------------------- batch limits
class _SeesEveryBatch(Plain):
    """Records the fingerprint of every batch ``training_step`` gets (sweep and run alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(_key(batch))
        return super().training_step(batch, batch_idx)


def _first_features(n: int) -> list[float]:
    return [_key(batch) for batch in list(_loader())[:n]]


@pytest.mark.parametrize(
    ("trainer_kwargs", "num_training", "per_epoch", "steps"),
    [
        ({"limit_train_batches": 1, "max_epochs": 3}, 40, 1, 3),  # the report: a run of 3 steps
        ({"limit_train_batches": 3, "max_epochs": 2}, 40, 3, 6),
        ({"limit_train_batches": 0.5}, 40, 6, 6),
        ({"limit_train_batches": 7, "accumulate_grad_batches": 2}, 40, 7, 4),
        ({"overfit_batches": 2}, 40, 2, 2),
        ({"limit_train_batches": 3, "max_epochs": 20}, 40, 3, 40),  # the run is long enough: 40 steps
        ({"limit_train_batches": 6}, 5, 6, 5),
    ],
)
def test_under_a_batch_limit_the_sweep_does_what_lightnings_lr_find_does(
    trainer_kwargs: dict[str, Any],
    num_training: int,
    per_epoch: int,
    steps: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: with limit_train_batches=1 the sweep still drew ~100 batches of the full loader.

    Now it draws the limited batches only, pass after pass as the run's epochs do, and takes at most the
    run's own optimizer steps (Lightning's Tuner.lr_find on the same Trainer: measured 3 steps for
    limit_train_batches=1, max_epochs=3; 40 steps over 3 batches with limit 3, max_epochs=50).
    """
    model = _SeesEveryBatch()
    finder = _finder(num_training=num_training, divergence_threshold=None)
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        trainer = _fit(model, [finder], loader=_loader(), **trainer_kwargs)
    result = finder.result
    assert result is not None
    micro = steps * trainer_kwargs.get("accumulate_grad_batches", 1)
    run_batches = per_epoch * trainer_kwargs.get("max_epochs", 1)
    # the sweep's training_step calls come first, each pass on the limited batches; then the run
    assert len(model.seen) == micro + run_batches
    limited = _first_features(per_epoch)
    assert model.seen[:micro] == [limited[i % per_epoch] for i in range(micro)]
    assert model.seen[micro:] == limited * trainer_kwargs.get("max_epochs", 1)
    assert len(result.lrs) == steps and result.lrs == pytest.approx(sweep_lrs(1e-4, 10.0, steps))
    capped = [r.message for r in caplog.records if "caps the sweep" in r.message]
    if steps == num_training:
        assert result.limited_to is None and not capped
        return
    assert steps == trainer.estimated_stepping_batches
    assert result.limited_to == steps and len(capped) == 1
    assert f"({per_epoch} training batch" in capped[0] and f"at {steps} of its num_training=40" in capped[0]
    if steps < finder.min_points:
        alert = finder.alerts[-1]
        assert result.suggestion is None and f"capped at {steps}" in alert.message
        assert "limit_train_batches" in alert.hint and "Widen" not in alert.hint


def test_lr_find_respects_limit_train_batches_in_its_trainer_kwargs() -> None:
    """lr_find's throwaway Trainer has max_epochs=1: one limited epoch, as Lightning's tuner on it."""
    model = _SeesEveryBatch()
    kwargs = {"accelerator": "cpu", "limit_train_batches": 4}
    result = lr_find(model, _loader(), num_training=40, progress=False, trainer_kwargs=kwargs)
    assert model.seen == _first_features(4)  # the sweep only: lr_find trains nothing
    assert result is not None and len(result.lrs) == 4 and result.limited_to == 4
    model = _SeesEveryBatch()  # no end to the run: num_training steps, cycling the 4 batches
    kwargs = {**kwargs, "max_epochs": -1}  # (the sweep alone: a search would train its trials on them too)
    result = lr_find(model, _loader(), num_training=12, progress=False, trainer_kwargs=kwargs, search_steps=0)
    assert model.seen == _first_features(4) * 3
    assert result is not None and len(result.lrs) == 12 and result.limited_to is None


def test_state_dict_remembers_which_milestones_ran(tmp_path: Path) -> None:
    pl.seed_everything(0)
    finder = _finder(milestones=[0, 5])
    trainer = _fit(Net(), [finder], max_steps=1)
    state = finder.state_dict()
    assert state["done_epochs"] == [0]
    trainer.save_checkpoint(tmp_path / "step1.ckpt")
    resumed = _finder(milestones=[0, 5])
    trainer = make_trainer([resumed], max_steps=2)
    trainer.fit(Net(), _loader(shuffle=True), ckpt_path=str(tmp_path / "step1.ckpt"))
    assert resumed.results == []  # epoch 0 already had its test: not run again after a resume
    again = _finder(milestones=[0, 5])
    again.load_state_dict(state)
    _fit(Net(), [again], max_steps=1)  # a fresh fit (no ckpt_path) is a new run: it tests again
    assert len(again.results) == 1


# ---------------------------------------------------------------------------------------------- outputs
def test_curve_goes_to_the_loggers_csv_and_figure(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0)
    logger = MemoryLogger(str(tmp_path))
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    finder = _finder(plot=True, progress=True)
    _fit(Net(), [finder], logger=[logger, tb], max_steps=1)
    result = finder.result
    assert result is not None
    n = len(result.lrs)
    assert logger.series("lr_finder/loss") == {i: pytest.approx(v) for i, v in enumerate(result.losses)}
    assert logger.series("lr_finder/lr") == {i: pytest.approx(v) for i, v in enumerate(result.lrs)}
    assert len(logger.series("lr_finder/smoothed_loss")) == n
    assert logger.series("lr_finder/suggested_lr") == {0: pytest.approx(result.suggestion)}
    with open(tmp_path / "lr_finder.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == n and float(rows[3]["loss"]) == pytest.approx(result.losses[3])
    assert (tmp_path / "lr_finder.png").stat().st_size > 1000
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("lr_finder/loss")]
    assert tb_loss == pytest.approx(result.losses, rel=1e-6)
    assert "lr_finder/curve" in events.Tags()["images"]


class _WithHparams(Net):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_applied_lr_goes_to_the_result_and_the_loggers_hyperparameters(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0)
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    csv_logger = CSVLogger(str(tmp_path), name="csv", version=0)
    finder = _finder(milestones=[0, 1], num_training=60)
    model = _WithHparams(lr=0.05)
    _fit(model, [finder], logger=[tb, csv_logger], max_epochs=2)
    first, second = finder.results
    assert first.applied and second.applied
    assert first.applied_lr == first.suggestion and second.applied_lr == second.suggestion
    # what the run trained with: the first real batch of each epoch (12 batches) ran at the applied LR
    assert model.step_lrs[0] == first.applied_lr and model.step_lrs[12] == second.applied_lr
    expected = {
        "lr_finder/applied_lr": first.suggestion,
        "lr_finder/method": "steep",
        "lr_finder/applied_lr_epoch1": second.suggestion,
        "lr_finder/method_epoch1": "steep",
    }
    for hparams in (
        dict(tb.hparams),
        load_hparams_from_yaml(str(tmp_path / "tb" / "version_0" / "hparams.yaml")),
        dict(csv_logger.experiment.hparams),
        load_hparams_from_yaml(str(tmp_path / "csv" / "version_0" / "hparams.yaml")),
    ):
        assert {k: hparams.get(k) for k in expected} == expected
        assert hparams["lr"] == 0.05  # the module's own hyperparameters are kept beside them
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    assert len(events.Scalars("hp_metric")) == 1  # Lightning's own at fit start; none added by the finder


def test_apply_false_records_no_applied_lr(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0)
    csv_logger = CSVLogger(str(tmp_path), name="csv", version=0)
    finder = _finder(apply=False)
    _fit(Net(), [finder], logger=csv_logger, max_steps=1)
    assert finder.result is not None and finder.result.suggestion is not None
    assert not finder.result.applied and finder.result.applied_lr is None
    assert not any(k.startswith("lr_finder/") for k in csv_logger.experiment.hparams)


class _Slow(Net):
    """Slow enough (10 ms a step) that tqdm redraws its bar during the sweep."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


class _Spy:
    """Replaces the sweep's ``Tqdm``: records the keyword arguments of every bar it creates."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        import lightning_gradguard.monitors.lr_finder.engine as module

        self.bars: list[dict[str, Any]] = []
        bars = self.bars

        class Spy(Tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                bars.append(kwargs)
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(module, "Tqdm", Spy, raising=False)


def test_progress_is_a_tqdm_bar_of_its_own_and_the_summary_one_log_line(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    errs = []
    for progress in (True, False):  # the Trainer shows its own bar in both
        pl.seed_everything(0)
        finder = _finder(progress=progress, max_lr=1.0, num_training=30, divergence_threshold=None)
        # tqdm's bar named: Lightning's default is RichProgressBar wherever `rich` is installed (transformers
        # brings it), and the sweep draws no bar beside one that is not tqdm's (see below)
        with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
            _fit(_Slow(), [finder, TQDMProgressBar()], max_steps=1, enable_progress_bar=True)
        errs.append(capsys.readouterr().err)
        assert finder.result is not None and finder.result.applied
    # the bar: tqdm's own format on stderr, with the LR and the loss, and no bare progress lines
    err = errs[0]
    assert "LRFinderPlus [epoch 0]" in err and "/30 [" in err
    assert re.search(r"lr=\d\.\d\de-\d\d", err) and "loss=" in err
    assert not re.search(r"step \d+/\d+", err) and "points, stopped" not in err
    # placed like Lightning's validation bar: under the training bar; gone at the end
    assert [(b["position"], b["leave"]) for b in spy.bars] == [(1, False)]
    assert "LRFinderPlus" not in errs[1]  # progress=False: no bar
    # the result: one INFO line per sweep on the "lightning_gradguard" logger, saying it was applied
    said = "suggestion (steep: the run does not warm up)"  # its StepLR
    summaries = [r for r in caplog.records if r.name == "lightning_gradguard" and said in r.message]
    assert len(summaries) == 2 and all(r.levelno == logging.INFO for r in summaries)
    assert all(" applied; " in r.message and "30 points, stopped: completed" in r.message for r in summaries)


class _NotTqdm(ProgressBar):
    """A progress bar that is not tqdm's (as ``RichProgressBar``, which needs the ``rich`` package)."""


@pytest.mark.parametrize("trainer_bar", ["enable_progress_bar=False", "refresh_rate=0", "not tqdm"])
def test_no_sweep_bar_when_the_trainer_draws_no_tqdm_bar(
    trainer_bar: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 25, item 8): the sweep drew its tqdm bar under ``enable_progress_bar=False``
    (a 7 KB single line in a log). The Trainer decides: no tqdm bar of its own, none from the sweep, even
    with ``progress=True`` passed explicitly; a ``RichProgressBar`` would have a tqdm bar written across
    its live display."""
    spy = _Spy(monkeypatch)
    bar: dict[str, Any] = {
        "enable_progress_bar=False": {"enable_progress_bar": False},
        "refresh_rate=0": {"enable_progress_bar": True, "callbacks": [TQDMProgressBar(refresh_rate=0)]},
        "not tqdm": {"enable_progress_bar": True, "callbacks": [_NotTqdm()]},
    }[trainer_bar]
    pl.seed_everything(0)
    finder = _finder(progress=True, max_lr=1.0, num_training=30, divergence_threshold=None)
    trainer = make_trainer([finder, *bar.pop("callbacks", [])], max_steps=1, **bar)
    trainer.fit(_Slow(), _loader(shuffle=True))
    err = capfd.readouterr().err
    assert finder.result is not None and finder.result.applied  # the sweep ran
    assert spy.bars == []
    assert "LRFinderPlus [epoch" not in err and "it/s]" not in err and "\r" not in err


def test_the_sweep_bar_follows_a_tqdm_bar_subclass_and_lr_finds_own_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Shifted(TQDMProgressBar):  # a user's subclass, drawn two lines lower
        pass

    spy = _Spy(monkeypatch)
    pl.seed_everything(0)
    finder = _finder(progress=True, num_training=10, divergence_threshold=None)
    make_trainer([finder, Shifted(process_position=1)], max_steps=1, enable_progress_bar=True).fit(
        Plain(), _loader()
    )
    assert [b["position"] for b in spy.bars] == [3]  # under the subclass's training bar
    # lr_find turns its throwaway Trainer's bars off itself: the sweep's bar stays, unless the user says
    for trainer_kwargs, drawn in (({}, [0]), ({"enable_progress_bar": False}, [])):
        spy.bars.clear()
        lr_find(
            Plain(),
            _loader(),
            num_training=10,
            search_steps=0,  # the search's own bar: the same place, after the sweep's
            trainer_kwargs={"accelerator": "cpu", **trainer_kwargs},
        )
        assert [b["position"] for b in spy.bars] == drawn


def test_without_a_logger_no_files_are_written(tmp_path: Path) -> None:
    pl.seed_everything(0)
    finder = _finder(plot=True)
    _fit(Net(), [finder], max_steps=1, default_root_dir=str(tmp_path))
    assert finder.result is not None and finder.result.suggestion is not None
    assert not list(tmp_path.rglob("lr_finder*"))


class _Recorder(Callback):
    """A user's callback passed in ``trainer_kwargs``: records how the throwaway fit ended."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.events.append("train_batch")

    def on_train_epoch_start(self, *args: Any) -> None:
        self.events.append("epoch_start")

    def on_train_epoch_end(self, *args: Any) -> None:
        self.events.append("epoch_end")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.events.append(f"exception {type(exception).__name__}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.events.append("train_end")


def test_lr_find_ends_its_fit_cleanly_before_any_training_batch() -> None:
    pl.seed_everything(0)
    model = Net(lr=0.05)
    before = copy.deepcopy(model.state_dict())
    recorder = _Recorder()
    kwargs = {"accelerator": "cpu", "callbacks": [recorder], "min_epochs": 3, "min_steps": 10}
    result = lr_find(
        model,
        _loader(),
        min_lr=1e-4,
        max_lr=10.0,
        num_training=40,
        progress=False,
        search_steps=0,
        trainer_kwargs=kwargs,
    )
    assert result is not None and result.suggestion is not None
    # a finished fit: no exception, no epoch and no training batch (min_epochs/min_steps notwithstanding)
    assert recorder.events == ["train_end"]
    assert model.calls == len(result.lrs) + (result.stop_reason == "non-finite loss")  # the sweep only
    _unchanged(model, before)


def test_lr_find_runs_no_empty_epoch_that_a_users_early_stopping_would_fail_on() -> None:
    """An EarlyStopping on a validation metric, passed to the throwaway fit: an epoch end without
    validation (lr_find runs none) raises "Early stopping conditioned on metric ... not available"."""
    from lightning.pytorch.callbacks import EarlyStopping

    pl.seed_everything(0)
    stopper = EarlyStopping(monitor="val_loss", check_on_train_epoch_end=True)
    kwargs = {"accelerator": "cpu", "callbacks": [stopper]}
    result = lr_find(Net(lr=0.05), _loader(), num_training=20, progress=False, trainer_kwargs=kwargs)
    assert result is not None and len(result.lrs) > 0


def test_lr_find_skips_under_fast_dev_run_like_lightnings_tuner(caplog: pytest.LogCaptureFixture) -> None:
    pl.seed_everything(0)
    model = Net(lr=0.05)
    before = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        result = lr_find(
            model, _loader(), progress=False, trainer_kwargs={"accelerator": "cpu", "fast_dev_run": True}
        )
    assert result is None and model.lr == 0.05 and model.calls == 0  # nothing ran, nothing trained
    _unchanged(model, before)
    lines = [r for r in caplog.records if r.name == "lightning_gradguard"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "fast_dev_run" in lines[0].message


def test_lr_find_function_writes_the_attribute_and_leaves_the_model_unchanged() -> None:
    pl.seed_everything(0)
    model = Net(lr=0.05)
    before = copy.deepcopy(model.state_dict())
    result = lr_find(model, _loader(shuffle=True), min_lr=1e-4, max_lr=10.0, num_training=40, progress=False)
    assert result is not None and result.suggestion is not None
    assert model.lr == result.suggestion
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


# ---------------------------------------------------------------------------------------------- arguments
# ---------------------------------------------------------------------------------------------- DDP
def test_ddp_two_processes_same_sweep_same_suggestion(tmp_path: Path) -> None:
    proc = run_ddp_script("ddp_lr_finder.py", tmp_path, timeout=180)  # a hang would time out here
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    keys = ["lrs", "losses", "suggestions", "stop_reason", "applied_lr", "applied_lrs", "global_step"]
    keys += ["epochs", "later", "search", "evaluated_on", "winner"]
    for key in keys:
        assert ranks[0][key] == ranks[1][key], key
    # 10-step trials over 8 batches a rank: held out by sample, a quarter of the 512 (64 on each rank)
    assert ranks[0]["evaluated_on"] == "128 held-out training samples"
    assert ranks[0]["epochs"] == [0, 1] and ranks[0]["global_step"] == 16  # the sweeps did not count
    # the sweep's steep point bracketed the search (same on both ranks: every loss is the ranks' mean)
    assert ranks[0]["suggestions"]["steep"] == ranks[0]["sweep_suggestion"] and len(ranks[0]["search"]) >= 4
    assert ranks[0]["winner"] in [lr for lr, _, _ in ranks[0]["search"]]
    assert ranks[0]["first_applied"] == pytest.approx(ranks[0]["winner"] / SHORT_HORIZON)
    assert ranks[0]["later"][0][2] == ranks[0]["applied_lr"]  # the mid-training test's LR is in use
    assert len(ranks[0]["lrs"]) >= 10 and len(ranks[0]["later"][0][0]) >= 10
    # the curve is the mean over the ranks of their own shard's loss
    assert ranks[0]["losses"][0] == pytest.approx(
        0.5 * (ranks[0]["first_loss"] + ranks[1]["first_loss"]), rel=1e-6
    )
    assert ranks[0]["first_loss"] != ranks[1]["first_loss"]
    assert (tmp_path / "csv" / "version_0" / "lr_finder.csv").exists()
    # the applied LRs are the run's hyperparameters (written once, by rank 0)
    hparams = load_hparams_from_yaml(str(tmp_path / "csv" / "version_0" / "hparams.yaml"))
    assert ranks[0]["applied_lrs"] == [ranks[0]["first_applied"], ranks[0]["applied_lr"]]
    assert hparams["lr_finder/applied_lr"] == ranks[0]["first_applied"]
    assert hparams["lr_finder/applied_lr_epoch1"] == ranks[0]["applied_lr"]


def test_ddp_ranks_run_the_search_again_together(tmp_path: Path) -> None:
    """The search's first trials learn nothing (the model meets its own labels after 30 steps): both ranks
    decide on the ranks' mean losses to run it again, train the same longer trials and choose the same LR;
    neither waits for the other forever."""
    proc = run_ddp_script("ddp_lr_finder.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"retry_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["retries"] >= 1 and ranks[0]["winner"] is not None and not ranks[0]["reason"]
    assert max(round_ for round_, _, _, _ in ranks[0]["trials"]) == 2 * ranks[0]["retries"] + 1


class _SeesBatches(Net):
    """Records the fingerprint of every batch the real run trains on (its batch order)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:  # the real loop only
        self.seen.append(_key(batch))


def test_a_seeded_shuffling_loader_keeps_its_batch_order_after_the_sweep() -> None:
    """The sweep draws batches through the sampler's own generator; the snapshot puts it back."""

    def seeded_loader() -> Any:
        x, y = _data()
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(
            data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
        )

    runs = []
    for callbacks in ([_finder(apply=False)], []):
        pl.seed_everything(0)
        model = _SeesBatches()
        make_trainer(callbacks, max_epochs=1).fit(model, seeded_loader())
        runs.append(model.seen)
    assert len(runs[0]) > 2 and runs[0] == runs[1]
