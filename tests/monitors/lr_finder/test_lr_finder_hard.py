"""LRFinderPlus on hard curves: a diverging tail, a faint descent in noisy batches, a warm-up schedule.

Each is a real Lightning run on real data (scikit-learn's digits and a generated linear regression),
checked against an independent reading of the same sweep: the curve smoothed by hand without its tail,
the LR the schedule's own lambda gives, the batches the model saw.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from lightning_gradguard import LRFinderPlus, lr_find
from lightning_gradguard.functional.lr_suggest import (
    centered_smooth,
    descent_check,
    divergence_start,
    loss_noise,
    read_curve,
    sweep_lrs,
    sweep_spread,
)
from tests.conftest import make_trainer


# ---------------------------------------------------------------------------------------------- data
def _regression(n: int = 512, features: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import make_regression

    x, y = make_regression(n_samples=n, n_features=features, noise=20.0, random_state=seed)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)


def _digits(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data[:n] / 16.0, dtype=torch.float32), torch.tensor(d.target[:n])


def _loader(data: tuple[torch.Tensor, torch.Tensor], batch_size: int, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*data), batch_size=batch_size, shuffle=True, generator=g
    )


class Model(pl.LightningModule):
    """A network, its loss and its optimizer; ``schedule`` builds an LR scheduler (stepped per step)."""

    def __init__(self, net: nn.Module, loss: Any, opt: Any, lr: float = 1e-3, schedule: Any = None) -> None:
        super().__init__()
        self.net, self.loss, self.opt, self.lr, self.schedule = net, loss, opt, lr, schedule
        self.seen: list[float] = []  # a fingerprint of every batch a training step ran on

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(float(x[0].sum()))
        return self.loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = self.opt(self.parameters(), lr=self.lr)
        if self.schedule is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.schedule(opt), "interval": "step"}}


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y)


def _fit(model: pl.LightningModule, finder: LRFinderPlus, loader: Any, **kw: Any) -> pl.Trainer:
    trainer = make_trainer([finder], **{"max_steps": 1, **kw})
    trainer.fit(model, loader)
    return trainer


# ---------------------------------------------------------------------------------------------- the tail
def test_a_blow_up_is_cut_off_before_the_curve_is_read() -> None:
    """Plain SGD on a linear regression: the loss falls, then blows up within a few steps. Smoothed together
    with the blow-up, the curve's low rises and moves left and the noise grows; cut off, the descent stands
    out and the suggestion sits on it."""
    torch.manual_seed(0)
    model = Model(nn.Linear(40, 1), _mse, torch.optim.SGD)
    finder = LRFinderPlus(min_lr=1e-4, max_lr=10.0, num_training=60, progress=False, plot=False)
    _fit(model, finder, _loader(_regression(), 32))
    result = finder.result
    assert result is not None and result.stop_reason == "diverged"
    cut = divergence_start(result.losses)
    assert result.divergence_at == cut < len(result.losses)
    low = float(np.median(result.losses[:6]))
    assert result.losses[cut] > 2 * low  # the tail: a blow-up, far above where the sweep started
    # judged without the tail: the descent stands out; the suggestions read the whole smoothed curve
    check = descent_check(result.losses[:cut], centered_smooth(result.losses[:cut]))
    assert result.curve == pytest.approx(centered_smooth(result.losses))
    assert check.stands_out and result.descent == check
    assert result.suggestion is not None and result.lrs[0] < result.suggestion < result.lrs[cut]


def test_a_short_descent_before_a_blow_up_stands_out_once_the_tail_is_cut() -> None:
    """The shape of a plain-SGD linear regression that learns just before it blows up: the loss falls from
    1.08 to 0.45 in the last half decade, then 4.1 and 31.9. Smoothed with the blow-up, the curve's low moves
    a dozen points left, onto the middle of the descent, and the fall it measures halves: most such curves
    were refused. Cut off, every one stands out, and the steepest point lies on the descent."""
    before, after = [], []
    for seed in range(8):
        noise = 0.15 * np.random.default_rng(seed).standard_normal(96)
        losses = [*(0.45 + 0.63 / (1 + math.exp((i - 84) / 3)) + noise[i] for i in range(96)), 4.1, 31.9]
        lrs = sweep_lrs(1e-7, 0.52, len(losses))
        before.append(descent_check(losses))
        reading = read_curve(lrs, losses)
        after.append(reading.descent)
        assert reading.cut == 96 and reading.suggestions["steep"] is not None
        assert lrs[75] < reading.suggestions["steep"] < lrs[90]  # on the descent (its middle: point 84)
    assert sum(not c.stands_out for c in before) >= 5  # measured: 6 of 8 refused, ratios 4.7 to 8.0
    assert all(c.lowest <= 84 for c in before)  # the low dragged onto the descent's middle
    assert all(c.stands_out and c.ratio > 9.0 for c in after)  # measured 9.4 to 12.7


def test_divergence_start_on_constructed_curves() -> None:
    lrs = sweep_lrs(1e-5, 1.0, 60)
    fall = [1.0 - 0.6 / (1 + math.exp(-(i - 30) / 4)) for i in range(55)]
    assert divergence_start(fall) == len(fall)  # a descent without a tail
    blown = [*fall, 4.1, 31.9]
    assert divergence_start(blown) == 55
    # a rise back to the start, no further, is the curve's own shape, not a blow-up
    assert divergence_start([*fall, 0.7, 0.9, 1.0]) == len(fall) + 3
    reading = read_curve(lrs[:57], blown)
    assert reading.cut == 55 and reading.descent.stands_out and reading.suggestions["steep"] is not None
    assert reading.curve == pytest.approx(centered_smooth(blown))
    assert divergence_start([1.0, 2.0]) == 2  # too short to read


# ---------------------------------------------------------------------------------------------- repeats
class Noisy(nn.Module):
    """Logistic regression on the digits whose loss carries extra noise from its own generator: the descent
    is real and smooth (convex, SGD, batches of 256), and one sweep's fall is lost in the noise. The noise
    depends on neither the weights nor the float rounding, so the curves are the same on every machine."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.scale = scale
        self.noise = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def jitter(self) -> torch.Tensor:
        return self.scale * torch.randn((), generator=self.noise)


@pytest.fixture(scope="module")
def noisy_runs() -> dict[int, tuple[Any, Model]]:
    runs = {}
    for max_sweeps in (1, 4):
        torch.manual_seed(0)
        net = Noisy(scale=0.55)
        model = Model(
            net, lambda out, y, n=net: nn.functional.cross_entropy(out, y) + n.jitter(), torch.optim.SGD
        )
        finder = LRFinderPlus(
            min_lr=1e-3,
            max_lr=10.0,
            num_training=60,
            progress=False,
            plot=False,
            max_sweeps=max_sweeps,
            search_steps=0,
        )
        _fit(model, finder, _loader(_digits(), 256))
        runs[max_sweeps] = (finder.result, model)
    return runs


def test_one_noisy_sweep_cannot_tell_its_descent_from_noise(noisy_runs: dict[int, Any]) -> None:
    result, _ = noisy_runs[1]
    assert result.sweeps == 1 and result.suggestion is None  # max_sweeps=1: no repeat
    # measured 5.5 (the noise is the generator's, the descent convex: the same on any machine)
    assert result.descent is not None and 4.0 < result.descent.ratio < 0.95 * result.descent.required


def test_averaged_repeats_lift_a_real_descent_out_of_the_noise(noisy_runs: dict[int, Any]) -> None:
    single, _ = noisy_runs[1]
    result, model = noisy_runs[4]
    assert 1 < result.sweeps <= 4 and result.suggestion is not None
    assert result.descent is not None and result.descent.stands_out  # measured 7.4 after 3 sweeps
    assert result.descent.noise < 0.75 * single.descent.noise  # about 1 / sqrt(sweeps)
    # each repeat runs at the first sweep's LRs on the next batches: the curve is the mean of the sweeps
    assert result.lrs == single.lrs == sweep_lrs(1e-3, 10.0, 60)
    steps = len(result.lrs)
    assert len(model.seen) == steps * result.sweeps + 1  # every sweep's steps, and the run's one step
    first, second = model.seen[:steps], model.seen[steps : 2 * steps]
    assert first != second  # the repeat drew the next batches, not the first sweep's again
    assert result.losses[0] != pytest.approx(single.losses[0])  # averaged with another sweep's loss


def test_a_loss_that_cannot_fall_is_still_refused_after_repeats() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model = Model(
        net, lambda out, y: nn.functional.cross_entropy(out.detach(), y) + 0 * out.sum(), torch.optim.Adam
    )
    finder = LRFinderPlus(min_lr=1e-5, max_lr=1.0, num_training=60, progress=False, plot=False)
    _fit(model, finder, _loader(_digits(), 4))
    assert finder.result is not None and finder.result.suggestion is None
    assert finder.alerts and "depends on the trained weights" in finder.alerts[0].hint


def test_a_flat_sweep_says_what_to_do_about_a_plateau() -> None:
    """A 10-layer tanh MLP at PyTorch's init: its loss stays at chance for the whole sweep (it breaks away
    only after hundreds of steps at 0.03 to 0.3, benchmarks/lr_hard.py's deep_tanh). No suggestion, and the
    hint says both things it can be and what to do about each. (With the search, the default, trials of a
    few hundred steps below the sweep's top then learn: test_lr_search.py tests that blind search.)"""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 64), nn.Tanh()]
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    model = Model(nn.Sequential(*layers, nn.Linear(64, 10)), nn.functional.cross_entropy, torch.optim.SGD)
    finder = LRFinderPlus(progress=False, plot=False, max_sweeps=1, search_steps=0)
    _fit(model, finder, _loader(_digits(), 32))
    result = finder.result
    assert result is not None and result.suggestion is None and result.descent is not None
    assert result.descent.fall < 0.02 * 2.3  # flat: the premise (measured under 0.5 %)
    hint = finder.alerts[0].hint
    assert hint.startswith("The loss stayed flat") and "plateau" in hint
    assert "num_training of 500 to 1000" in hint and "depends on the trained weights" in hint


def test_sweep_spread_is_the_noise_of_the_mean_of_the_sweeps() -> None:
    rng = np.random.default_rng(0)
    trend = np.linspace(2.0, 1.0, 50)
    drift = np.linspace(0.0, 0.5, 50)  # one sweep's trajectory drifting away from the others: not noise
    sweeps = rng.standard_normal((4, 50)) * 0.3 + trend
    sweeps[1] += drift
    d = np.diff(sweeps, axis=1)
    expected = math.sqrt(np.mean([np.var(d[:, i], ddof=1) for i in range(49)]) / 2 / 4)
    assert sweep_spread(sweeps.tolist()) == pytest.approx(expected)
    assert sweep_spread(sweeps.tolist()) == pytest.approx(0.3 / 2, rel=0.15)
    # a skewed loss (a single sample's cross-entropy is one): its tail counts in full, where the MAD of the
    # differences does not see it (measured 1.46 to 1.90 times the MAD noise with this generator)
    tails = rng.lognormal(0.0, 1.2, (4, 200)) * 0.1
    assert sweep_spread(tails.tolist()) > 1.3 * loss_noise(list(tails.mean(0)))
    assert sweep_spread([[1.0, 2.0]]) == 0.0


def test_a_heavy_tailed_loss_that_cannot_fall_is_refused_after_repeats() -> None:
    """Batches of one sample on a model that cannot learn (its logits detached): each loss is one sample's
    cross-entropy, skewed by rare confident mistakes. The step-to-step MAD ignores those tails, and the
    mean of four 40-point sweeps once passed for a descent at 7.4 times that noise (seed 0 of five);
    with the noise at least the spread between the sweeps, every seed is refused."""
    x, y = _digits(2000)  # all 1797
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    for seed in range(5):
        loader = _loader((x, y), 1, seed)
        pl.seed_everything(seed, verbose=False)
        net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        model = Model(
            net,
            lambda out, t: nn.functional.cross_entropy(out.detach(), t) + 0.0 * out.sum(),
            torch.optim.SGD,
        )
        result = lr_find(model, loader, num_training=40, progress=False)
        assert result is not None and result.suggestion is None, (seed, result.descent)
        assert result.descent is not None and result.descent.ratio < 4.0


# ---------------------------------------------------------------------------------------------- schedules
def _warmup_cosine(warmup: int, total: int, peak: float = 1.0) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def _scheduled(schedule: Any, lr: float = 1e-3) -> Model:
    """A digits MLP trained with AdamW under the given schedule (what is read is the schedule, not the
    model: any curve with a clear descent serves; benchmarks/lr_hard.py scores the rule on a transformer)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Model(net, nn.functional.cross_entropy, torch.optim.AdamW, lr=lr, schedule=schedule)


@pytest.mark.parametrize(
    ("name", "schedule", "warmup", "peak"),
    [
        ("lambda", lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(30, 300)), 29, 1.0),
        (
            "lambda_peak_2",
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(30, 300, 2.0)),
            29,
            2.0,
        ),
        (
            "onecycle",
            lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=300),
            None,
            1.0,
        ),
        (
            "sequential",
            lambda opt: torch.optim.lr_scheduler.SequentialLR(
                opt,
                [
                    torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=20),
                    torch.optim.lr_scheduler.CosineAnnealingLR(opt, 280),
                ],
                milestones=[20],
            ),
            20,
            1.0,
        ),
    ],
)
def test_a_warm_up_schedule_gets_its_peak_at_the_curves_low(
    name: str, schedule: Any, warmup: int | None, peak: float
) -> None:
    model = _scheduled(schedule)
    finder = LRFinderPlus(progress=False, plot=False, search_steps=0)  # the sweep's rule alone
    trainer = _fit(model, finder, _loader(_digits(), 32), max_steps=3)
    result = finder.result
    assert result is not None and result.suggestion is not None and result.applied
    assert result.rule == "peak" and result.schedule is not None and result.schedule.warms_up
    assert result.schedule.peak == pytest.approx(peak)
    if warmup is not None:
        assert result.schedule.warmup_steps == warmup
    # the peak is the smoothed curve's low, read independently
    low = result.lrs[int(np.argmin(centered_smooth(result.losses)))]
    assert result.suggestions["peak"] == pytest.approx(low)
    assert result.suggestion == pytest.approx(low / peak)
    assert result.suggestions["steep"] is not None and result.suggestions["steep"] < low
    # applied: the schedule now peaks at the curve's low, and it was not moved by reading it
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 3  # the run's own three steps, not the read-ahead
    group = trainer.optimizers[0].param_groups[0]
    if name == "onecycle":
        assert group["max_lr"] == pytest.approx(low)
    else:
        assert group["initial_lr"] == pytest.approx(low / peak)


def test_without_a_warm_up_the_constant_rule_decides() -> None:
    cosine = _scheduled(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 300))
    finder = LRFinderPlus(progress=False, plot=False, search_steps=0)  # the sweep's rule alone
    _fit(cosine, finder, _loader(_digits(), 32))
    result = finder.result
    assert result is not None and result.rule == "steep" and result.schedule is not None
    assert not result.schedule.warms_up and result.suggestion == result.suggestions["steep"]
    forced = LRFinderPlus(progress=False, plot=False, method="steep", search_steps=0)
    _fit(
        _scheduled(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(30, 300))),
        forced,
        _loader(_digits(), 32),
    )
    assert forced.result is not None and forced.result.rule == "steep"


def test_lr_find_reads_the_modules_schedule_beyond_its_one_epoch() -> None:
    """lr_find's throwaway Trainer runs one epoch of 16 batches; the warm-up is 150 steps of the real run."""
    model = _scheduled(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(150, 1500)))
    result = lr_find(model, _loader(_digits(), 32), progress=False, search_steps=0)
    assert result is not None and result.rule == "peak" and result.schedule is not None
    assert result.schedule.warmup_steps == 149 and result.suggestion is not None
    assert model.lr == result.suggestion == pytest.approx(result.suggestions["peak"])
