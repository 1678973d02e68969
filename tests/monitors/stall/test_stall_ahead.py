"""StallDetector reads the settings before they act (issue 38): the LR schedule read ahead on a copy of
the schedulers and confirmed by the first steps' actual LRs, a weight decay's rate at that schedule's
peak, the dropout rates; real Trainer runs of the digits classifier with the faults of the issue built in
(a per-epoch StepLR stepped per batch, weight_decay=50 under AdamW, dropout 0.9), their healthy twins,
and the copy's promise: the run with the detector is the run without it, bit for bit."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import make_trainer
from test_stall import Digits, kinds, loader
from torch import nn

from lightning_gradguard.monitors.stall.ahead import dropout_rates, lr_ahead
from lightning_gradguard.monitors.stall.callback import StallDetector

Schedule = Callable[[Any, torch.optim.Optimizer], Any]


class Set(Digits):
    """The digits classifier with its optimizer, schedule (``"interval"``) and dropout given."""

    def __init__(
        self,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        schedule: Schedule | None = None,
        interval: str = "step",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(dropout), nn.Linear(128, 10))
        self.make_optimizer, self.schedule, self.interval = optimizer, schedule, interval

    def configure_optimizers(self) -> Any:
        opt = self.make_optimizer(self.parameters())
        if self.schedule is None:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": self.schedule(self, opt), "interval": self.interval},
        }


def run(model: Set, steps: int, watch: bool = True) -> StallDetector:
    detector = StallDetector()
    make_trainer([detector] if watch else [], max_steps=steps, max_epochs=-1).fit(model, loader())
    return detector


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def halving(model: Any, opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_a_per_epoch_steplr_stepped_per_batch_is_named_once_the_first_steps_confirm_it() -> None:
    """StepLR(gamma=0.5) meant per epoch, stepped per batch: the LR halves every step. Named at step 2, the
    third check, once steps 0-2 used the LRs read ahead (at step 59-89 from the collapse before)."""
    model = Set(sgd, halving)
    detector = run(model, 60)
    assert kinds(detector) == [("lr_decayed", 2)]
    alert = detector.alerts[0]
    assert alert.data["lr_max"] == pytest.approx(0.1) and alert.data["fell_at"] == 7  # 0.1 * 2^-7 < 1e-3
    assert alert.data["useful_share"] == pytest.approx(7 / 60)
    history = re.findall(r"([0-9.e+-]+) at step (\d+)", alert.message.split("LR ahead:")[1])
    assert len(history) == 6  # the LRs it read ahead are the ones the run used
    assert all(float(lr) == pytest.approx(model.lrs[int(step)], rel=1e-2) for lr, step in history)
    assert '"interval": "step"' in alert.hint


def test_reading_ahead_changes_nothing_in_the_run() -> None:
    """The schedulers are stepped on copies whose optimizer is a stand-in: the watched run and the plain
    one use the same LRs and end with the same weights, bit for bit."""
    watched, plain = Set(sgd, halving), Set(sgd, halving)
    run(watched, 12)
    run(plain, 12, watch=False)
    assert watched.lrs == plain.lrs
    assert all(torch.equal(a, b) for a, b in zip(watched.parameters(), plain.parameters(), strict=True))


def _adamw(weight_decay: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=weight_decay)


def _warmup_cosine(model: Any, opt: torch.optim.Optimizer) -> Any:
    warm, total = 10, model.trainer.estimated_stepping_batches
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda k: (k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm))),
    )


def test_a_weight_decay_typo_is_named_at_the_start_and_its_twin_is_quiet() -> None:
    """AdamW weight_decay=50 (0.05 meant) at lr 2e-3 after a warm-up: the decay alone will remove 10 % of
    every weight a step at the schedule's peak, read at the start; at step 2, when the schedule is
    confirmed (at step 69 from the weight norms, and as a chance level at 59, before)."""
    typo = run(Set(_adamw(50.0), _warmup_cosine), 40)
    assert kinds(typo) == [("weight_decay_collapse", 2)]
    assert (
        typo.alerts[0].data["decay_rate"] == pytest.approx(2e-3 * 50) and typo.alerts[0].data["share"] == 1.0
    )
    twin = Set(_adamw(0.05), _warmup_cosine)
    assert run(twin, 120).alerts == []


def test_a_dropout_typo_is_named_at_step_0_and_its_twin_is_quiet() -> None:
    typo = run(Set(_adamw(0.01), dropout=0.9), 10)
    assert kinds(typo) == [("dropout_too_high", 0)]
    assert "net.2 0.9" in typo.alerts[0].message and "0.1" in typo.alerts[0].hint
    assert typo.alerts[0].severity == "warning"
    # 0.8 (a fifth kept: transformers' MobileNetV2 default, TF-slim's keep probability) is an INFO line
    note = run(Set(_adamw(0.01), dropout=0.8), 10)
    assert [(a.kind, a.severity, a.step) for a in note.alerts] == [("dropout_too_high", "info", 0)]
    assert run(Set(_adamw(0.01), dropout=0.1), 60).alerts == []


def test_dropout_rates_reads_modules_and_a_configs_rates() -> None:
    class Config:  # a Hugging Face config keeps its rates as attributes of the instance
        def __init__(self) -> None:
            self.attention_dropout, self.hidden_dropout_prob, self.layerdrop = 0.9, 0.1, 0.0
            self.dropout_keep_prob, self.use_dropout = 0.9, True  # a keep probability and a switch

    class DropPath(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop_prob = 0.2

    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout2d(0.0), DropPath())
    model.config = Config()  # type: ignore[assignment]
    assert dropout_rates(model) == [
        ("0", 0.5),
        ("2", 0.2),
        ("config.attention_dropout", 0.9),
        ("config.hidden_dropout_prob", 0.1),
    ]


def _from_global_step(model: Any, opt: torch.optim.Optimizer) -> Any:
    """A LambdaLR that reads the Trainer's step instead of its own count: a copy stepped ahead sees step 0
    for ever (0.5 ** k: a collapse), the run an LR of 1 after its first step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k if model.trainer.global_step == 0 else 1.0)


@pytest.mark.parametrize(
    ("schedule", "interval"),
    [
        (_from_global_step, "step"),  # read ahead wrongly: the first steps do not confirm it, no verdict
        (lambda m, o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5), "epoch"),  # per epoch, as meant
        (lambda m, o: torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=120), "step"),
        (lambda m, o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=120), "step"),
        # an exponential warm-up over the whole run: low for most of it, but only before its peak
        (lambda m, o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1e-4 ** (1 - k / 119)), "step"),
    ],
    ids=["global_step", "exponential_per_epoch", "one_cycle", "cosine", "exponential_warmup"],
)
def test_healthy_schedules_are_not_judged_ahead(schedule: Schedule, interval: str) -> None:
    model = Set(sgd, schedule, interval)
    assert run(model, 120).alerts == []
    assert len(set(model.lrs)) > 1 or schedule is _from_global_step  # each schedule did move the LR


def test_a_schedule_read_past_its_end_gives_what_it_read_and_the_run_is_untouched() -> None:
    """A OneCycleLR shorter than the steps asked for raises when stepped past its end: the reading stops
    there. The real optimizer and scheduler are as they were (the copy's optimizer is a stand-in)."""
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=30)
    config = SimpleNamespace(scheduler=sched, interval="step", frequency=1, reduce_on_plateau=False)
    trainer = SimpleNamespace(
        lr_scheduler_configs=[config], num_training_batches=10, accumulate_grad_batches=1
    )
    before = (sched.state_dict(), [dict(g, params=None) for g in opt.param_groups])
    lrs = lr_ahead(trainer, net, opt, 100)  # type: ignore[arg-type]
    assert (
        len(lrs) == 31
        and max(lrs) == pytest.approx(0.1)
        and lrs[0] == pytest.approx(opt.param_groups[0]["lr"])
    )
    assert sched.state_dict() == before[0] and [dict(g, params=None) for g in opt.param_groups] == before[1]


def test_a_scheduler_that_cannot_be_copied_is_not_read_ahead_and_the_rest_is() -> None:
    """A scheduler holding a lock cannot be deep-copied: the schedule is not read ahead (no verdict on
    it, no failure of the check), and the dropout rates are still read."""

    def locked(model: Any, opt: torch.optim.Optimizer) -> Any:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scheduler.lock = threading.Lock()  # type: ignore[attr-defined]
        return scheduler

    detector = run(Set(sgd, locked, dropout=0.9), 10)
    assert [a.kind for a in detector.alerts if a.step <= 2] == ["dropout_too_high"]
    assert detector.last_check is not None and detector.last_check.ahead is not None
    assert list(detector.last_check.ahead.lrs) == []
