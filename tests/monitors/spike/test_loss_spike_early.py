"""LossSpikeGuard's early-divergence rule on real digits runs: a learning rate far too high is named within
a few steps of its onset, before the spike windows are warm; healthy starts a naive rule would flag stay
quiet.

The model records its own losses; where the rule must fire is computed here from them (the median of the
first 3 losses, then the first 5 in a row at 6 starts or more), independently of gradguard.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, make_trainer
from torch import nn

from lightning_gradguard import LossSpikeError, LossSpikeGuard
from lightning_gradguard.functional.spikes import start_level
from lightning_gradguard.monitors.spike.early import EarlyWatch
from lightning_gradguard.monitors.spike.rules import early_finding

sys.path.insert(0, str(ROOT / "examples"))

from zoo import digits


class DigitsMLP(pl.LightningModule):
    """A 64-64-10 ReLU MLP on the digits; ``offset`` is added to the loss (a loss below zero)."""

    def __init__(self, lr: float, momentum: float = 0.0, adam_warmup: int = 0, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr, self.momentum, self.adam_warmup, self.offset = lr, momentum, adam_warmup, offset
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1]) + self.offset
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if not self.adam_warmup:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        warm = self.adam_warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _run(model: DigitsMLP, guard: LossSpikeGuard, tmp_path: Path, steps: int, batch: int = 32) -> pl.Trainer:
    trainer = make_trainer([guard], max_steps=steps, max_epochs=-1, default_root_dir=str(tmp_path))
    trainer.fit(model, digits(batch_size=batch))
    return trainer


def _first_firing(losses: list[float], factor: float = 6.0) -> int | None:
    """The step the rule must fire at, by hand: 5 losses in a row at ``factor`` starts or more."""
    start = statistics.median(losses[:3])
    spread = statistics.median(abs(v - start) for v in losses[:3])
    threshold = start + (factor - 1.0) * max(abs(start), spread)
    for t in range(7, len(losses)):
        if all(v >= threshold for v in losses[t - 4 : t + 1]):
            return t
    return None


@pytest.mark.parametrize("offset", [0.0, -5.0], ids=["positive", "negative_loss"])
def test_a_far_too_high_lr_is_named_within_ten_steps(offset: float, tmp_path: Path) -> None:
    model, guard = DigitsMLP(lr=3.0, offset=offset), LossSpikeGuard()
    _run(model, guard, tmp_path, steps=12)
    losses = model.losses
    assert losses[1] > losses[0] and losses[6] > 10 * abs(losses[0] - offset)  # it climbs from step 1
    (alert,) = [a for a in guard.alerts if a.kind == "early_divergence"]
    fired = _first_firing(losses)
    assert alert.step == fired and fired is not None and fired <= 10
    assert alert.severity == "error" and alert.where is None
    start = statistics.median(losses[:3])
    assert alert.data["start"] == pytest.approx(start, rel=1e-6)
    assert alert.data["loss"] == pytest.approx(losses[fired], rel=1e-6)
    assert alert.data["lr"] == 3.0
    assert f"step {fired}" in alert.message and "learning rate (param group 0: 3)" in alert.message
    assert f"{start:.4g}" in alert.message and f"{losses[fired]:.4g}" in alert.message
    assert "Lower the learning rate" in alert.hint
    # an alert, nothing dropped: no good state exists yet; the spike windows are not warm
    assert guard.dropped_steps == 0 and guard.records == []


def test_action_raise_stops_the_run_at_the_early_divergence(tmp_path: Path) -> None:
    model, guard = DigitsMLP(lr=3.0), LossSpikeGuard(action="raise")
    with pytest.raises(LossSpikeError, match="Early divergence at step 9"):
        _run(model, guard, tmp_path, steps=30)
    assert [a.kind for a in guard.alerts] == ["early_divergence"] and len(model.losses) == 10


@pytest.mark.parametrize(
    ("kwargs", "batch"),
    [
        ({"lr": 0.1}, 32),  # the same model at a sane LR
        ({"lr": 3e-3, "adam_warmup": 20}, 32),  # Adam with a linear warm-up
        ({"lr": 0.03, "momentum": 0.9}, 4),  # batch 4: a noisy loss
        ({"lr": 0.1, "offset": -5.0}, 32),  # a loss below zero that falls
        ({"lr": 0.01, "momentum": 0.9, "offset": -2.3}, 4),  # a noisy loss crossing zero
    ],
    ids=["sane_sgd", "adam_warmup", "batch4", "negative", "crosses_zero"],
)
def test_healthy_starts_stay_quiet(kwargs: dict[str, Any], batch: int, tmp_path: Path) -> None:
    model, guard = DigitsMLP(**kwargs), LossSpikeGuard(action="raise")
    _run(model, guard, tmp_path, steps=50, batch=batch)
    assert guard.alerts == [] and guard._early.seen == 50 and not guard._early.active
    assert _first_firing(model.losses) is None  # the same verdict by hand
    assert statistics.fmean(model.losses[-10:]) < statistics.fmean(model.losses[:3])  # it learns


def test_the_rule_closes_when_the_windows_are_warm(tmp_path: Path) -> None:
    """A divergence that starts after the warm-up is the spike rule's: the early rule has stopped."""
    model, guard = DigitsMLP(lr=0.1), LossSpikeGuard(warmup_steps=8, window_steps=16)
    _run(model, guard, tmp_path, steps=12)
    assert guard._early.seen == 8 and not guard._early.active and guard._early.threshold > 0


def test_the_watch_resumes_from_its_state_and_a_zero_start_never_fires() -> None:
    watch = EarlyWatch(6.0, horizon=50)
    for loss in [2.0, 2.2, 2.1, 13.0, 14.0]:
        assert not watch.observe(loss)
    resumed = EarlyWatch(6.0, horizon=50)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.above == 2 and resumed.threshold == pytest.approx(2.1 + 5 * 2.1)
    assert [resumed.observe(v) for v in (15.0, 16.0, 17.0)] == [False, False, True]
    assert not resumed.active  # once per run
    assert not any(resumed.observe(v) for v in (18.0, 19.0, 20.0))  # closed: never True again
    zero = EarlyWatch(6.0, horizon=50)
    assert not any(zero.observe(v) for v in [0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0])
    assert start_level([0.51, -0.086, 0.15]).scale == pytest.approx(0.236)  # the spread, not |0.15|
    # a checkpoint written before the rule existed: its run is past the warm-up, the watch stays closed
    guard = LossSpikeGuard()
    state = guard.state_dict()
    del state["early"]
    state["counters"]["judged"] = 60
    guard.load_state_dict(state)
    assert not guard._early.active and guard._early.seen == 60


@pytest.mark.parametrize(
    ("first", "loss", "said"),
    [
        ([2.3, 2.4, 2.2], 20.0, "(8.7x the start)"),
        ([-1.0, 0.1, 2.0], 6.7, "(up by 6.6: 7 starts, a start being 1.1, the first losses' spread)"),
        ([-2.0, -2.1, -1.9], 9.0, "(up by 11: 6.5 starts, a start being 2, the start's magnitude)"),
    ],
)
def test_the_alert_counts_the_rise_in_the_unit_of_its_factor(
    first: list[float], loss: float, said: str
) -> None:
    """Regression: a start near zero (scale: the first losses' spread) was called "7x the start" for a
    67x ratio, and a negative start gave "5.5 starts" beside "6 starts or more"."""
    alert = early_finding(step=9, first=first, loss=loss, factor=6.0, lr=0.1)
    assert said in alert.message, alert.message
    assert alert.data["factor"] == pytest.approx(start_level(first).factor(loss))


def test_early_divergence_factor_is_checked_and_none_turns_the_rule_off(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`early_divergence_factor`"):
        LossSpikeGuard(early_divergence_factor=1.0)
    with pytest.raises(TypeError, match="`early_divergence_factor`"):
        LossSpikeGuard(early_divergence_factor="6")  # type: ignore[arg-type]
    model, guard = DigitsMLP(lr=3.0), LossSpikeGuard(early_divergence_factor=None)
    _run(model, guard, tmp_path, steps=12)
    assert guard.alerts == [] and guard._early.seen == 0
