"""The search after the sweep: candidates inside the sweep's bracket, decided by short trainings.

Real Trainers on real data (digits, a linear regression); small models and budgets, so the file runs in
seconds. What the search chose is checked by what training at it does, never by an exact LR.
"""

from __future__ import annotations

import csv
import functools
import itertools
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_gradguard import LRFinderPlus, lr_find
from lightning_gradguard.monitors.lr_finder import rules
from lightning_gradguard.monitors.lr_finder.callback import DEFAULT_SEARCH_STEPS
from lightning_gradguard.monitors.lr_finder.holdout import IndexSampler, split
from lightning_gradguard.monitors.lr_finder.result import Trial
from lightning_gradguard.monitors.lr_finder.schedule import compressed, schedule_factors
from lightning_gradguard.monitors.lr_finder.search import (
    BLIND_DECADES,
    CONSTANT_MARGIN,
    INPUT_SHARE,
    SHORT_HORIZON,
    choose,
    log_spaced,
    refinement,
)
from lightning_gradguard.report.read import read_run
from tests.monitors.lr_finder.test_lr_finder import Net, Probe, _equal_nested, _loader, _same_state
from tests.testkit import LateLabels, make_trainer


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the alerts' JSONL of a trainer without a logger lands here


# ---------------------------------------------------------------------------------------------- a regression
@functools.lru_cache(maxsize=1)
def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    """1024 samples, 16 standard-normal features, a linear target with a little noise (seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    w = torch.randn(16, generator=g)
    return x, x @ w + 0.1 * torch.randn(1024, generator=g)


def _regression_loader(seed: int = 0) -> Any:
    x, y = _regression()
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True, generator=g
    )


class LinReg(pl.LightningModule):
    """``nn.Linear`` under plain SGD: its range test's steep point sits far below the LRs that train best."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.lin = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trained_loss(lr: float, steps: int = 15) -> float:
    """Mean squared error on the whole data after ``steps`` SGD steps at ``lr`` from the same start."""
    torch.manual_seed(0)
    model = LinReg(lr)
    opt = model.configure_optimizers()
    loader = _regression_loader(1)
    batches = (batch for _ in range(steps) for batch in loader)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        model.training_step((x, y), 0).backward()
        opt.step()
    x, y = _regression()
    with torch.no_grad():
        loss = float(nn.functional.mse_loss(model.lin(x).squeeze(-1), y))
    return loss if math.isfinite(loss) else math.inf


def _lr_find(**kw: Any) -> Any:
    torch.manual_seed(0)
    kw.setdefault("progress", False)
    return lr_find(LinReg(), _regression_loader(), trainer_kwargs={"accelerator": "cpu"}, **kw)


# ---------------------------------------------------------------------------------------------- the search
def test_the_search_trains_better_than_the_curves_steep_point() -> None:
    """The feature: without the search the suggestion is the curve's steep point, which trains this
    regression far more slowly than the LRs just below divergence; the search finds one of those."""
    result = _lr_find(search_steps=90, max_lr=10.0)
    assert result is not None and result.search is not None and result.search.chosen is not None
    assert result.suggestion == result.search.chosen
    # the suggestion sits below the last round's winner: short trials favour large LRs
    last_round = [t.lr for t in result.search.trials if t.round == 1]
    assert result.search.winner in last_round
    # and it learned the task: pairing each sample's inputs with another's targets undoes most of it
    won = next(t for t in result.search.trials if t.round == 1 and t.lr == result.search.winner)
    assert won.input_dependence > 0.5
    assert result.search.chosen == pytest.approx(result.search.winner / SHORT_HORIZON)
    sweep_only = _lr_find(search_steps=0, max_lr=10.0)
    assert sweep_only.search is None and sweep_only.suggestion == result.sweep_suggestion
    assert result.suggestion > 3 * sweep_only.suggestion
    # 15 steps at the search's LR end much lower than at the steep point's
    assert _trained_loss(result.suggestion) < 0.3 * _trained_loss(sweep_only.suggestion)
    # the search's steps: five candidates of r steps, then up to three of 2r (r = 90 // 11 = 8)
    trials = result.search.trials
    assert [t.steps for t in trials if t.round == 0] == [8] * 5
    assert all(t.steps == 16 for t in trials if t.round == 1) and 2 <= sum(t.round for t in trials) <= 3
    assert result.search.steps == sum(t.steps for t in trials) <= 90
    assert result.search.evaluated_on == "held-out training batches"  # 8 + 16 batches: within one pass


def test_a_sweep_still_falling_at_max_lr_is_extended_or_said(caplog: pytest.LogCaptureFixture) -> None:
    """max_lr far below where this regression diverges: the loss still falls at the sweep's end."""
    extended = _lr_find(search_steps=45, max_lr=1e-2, search_candidates=3)
    assert extended.extended_to is not None and extended.extended_to > 1e-2
    assert extended.lrs[-1] > 1e-2 and extended.suggestion is not None
    assert extended.search is not None and extended.search.bracket[1] > 1e-2
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    plain = _lr_find(search_steps=0, max_lr=1e-2)
    assert plain.extended_to is None and plain.still_falling and max(plain.lrs) <= 1e-2 * (1 + 1e-9)
    said = [r.getMessage() for r in caplog.records if "LRFinderPlus [epoch 0]" in r.getMessage()]
    assert said and "still falling" in said[-1] and "raise max_lr" in said[-1]


class WithValidation(Net):
    """Net with a validation loader's loss: the search scores its candidates on the validation batches."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))


def test_the_search_restores_everything_bit_for_bit() -> None:
    """With the search (and a validation loader to score on), everything comes back exactly: the run
    after it is the run without the finder, step for step."""
    pl.seed_everything(3)
    before, after = Probe(), Probe()
    finder = LRFinderPlus(
        min_lr=1e-4,
        max_lr=10.0,
        num_training=30,
        apply=False,
        progress=False,
        plot=False,
        search_steps=45,
        search_candidates=3,
    )
    model_a = WithValidation()
    trainer_a = make_trainer([before, finder, after], max_epochs=2, limit_val_batches=3)
    trainer_a.fit(model_a, _loader(shuffle=True), _loader())
    result = finder.result
    assert result is not None and result.search is not None and len(result.search.trials) >= 4
    assert result.search.evaluated_on == "validation batches"
    for key in ("model", "grads", "optimizer", "scheduler", "rng", "global_step", "loop", "training"):
        _equal_nested(before.seen[0][key], after.seen[0][key])
    pl.seed_everything(3)
    model_b = WithValidation()
    make_trainer([], max_epochs=2, limit_val_batches=3).fit(model_b, _loader(shuffle=True), _loader())
    assert model_a.step_losses == model_b.step_losses
    _same_state(model_a, model_b)


def test_the_search_runs_with_the_runs_setup_and_leaves_the_run_as_it_was() -> None:
    """bf16-mixed precision, two micro-batches a step, gradient clipping, a per-epoch StepLR and a second
    test at epoch 1: the trials run with all of them, and the run is still the run without the finder."""
    kw: dict[str, Any] = dict(
        max_epochs=2, precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5
    )
    pl.seed_everything(5)
    finder = LRFinderPlus(
        min_lr=1e-4,
        max_lr=10.0,
        num_training=40,
        apply=False,
        progress=False,
        plot=False,
        search_steps=45,
        search_candidates=3,
        milestones=[0, 1],
    )
    model_a = Net()
    make_trainer([finder], **kw).fit(model_a, _loader(shuffle=True))
    first = finder.results[0].search
    assert len(finder.results) == 2 and first is not None and len(first.trials) >= 4
    pl.seed_everything(5)
    model_b = Net()
    make_trainer([], **kw).fit(model_b, _loader(shuffle=True))
    assert model_a.step_losses == model_b.step_losses and len(model_a.step_losses) == 24
    _same_state(model_a, model_b)


class CannotFall(pl.LightningModule):
    """A loss that does not depend on the weights: no descent, no suggestion, nothing to search."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(torch.zeros(len(y), 10) + x[:, :10], y) + 0 * self.lin(x).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_loss_that_cannot_fall_stays_refused_after_one_blind_search() -> None:
    """The sweep's descent does not stand out of its noise, so the search trains candidates blind; none
    moves the held-out loss at all, so it runs once (longer trials cannot move it either) and the refusal
    stands, its reason and hint saying what the trials saw."""
    result = lr_find(CannotFall(), _loader(shuffle=True), progress=False, search_steps=60, max_sweeps=1)
    assert result is not None and result.suggestion is None and result.sweep_suggestion is None
    search = result.search
    assert search is not None and search.blind and search.trials and search.chosen is None
    assert search.retries == 0 and search.steps == sum(t.steps for t in search.trials)
    assert result.reason.startswith(result.sweep_reason) and "does not stand out" in result.sweep_reason
    assert "nor did training" in result.reason
    finding = rules.range_test_failed(rules.Tested(result=result, epoch=0, min_points=10))
    assert finding is not None and "search_steps" in finding.hint


def test_a_budget_too_small_for_the_trials_is_said_and_the_sweep_decides() -> None:
    # 0.5 of a 32-batch epoch: 16 steps, below 5 steps for each of 5 + 6 trial lengths
    result = _lr_find(search_steps=0.5, max_lr=10.0)
    assert result.search is not None and not result.search.trials and "too small" in result.search.reason
    assert result.suggestion == result.sweep_suggestion is not None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"search_steps": -1}, ValueError),
        ({"search_steps": 1.5}, ValueError),
        ({"search_steps": 0.0}, ValueError),
        ({"search_steps": "300"}, TypeError),
        ({"search_steps": True}, TypeError),
        ({"search_candidates": 2}, ValueError),
        ({"search_candidates": 4.0}, TypeError),
    ],
)
def test_search_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        LRFinderPlus(**kwargs)


def test_candidates_and_their_losses_go_to_tensorboard_the_csv_and_the_report(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    finder = LRFinderPlus(
        min_lr=1e-4, max_lr=10.0, num_training=30, progress=False, search_steps=45, search_candidates=3
    )
    torch.manual_seed(0)
    make_trainer([finder], logger=logger, max_steps=2).fit(LinReg(), _regression_loader())
    search = finder.result.search if finder.result is not None else None
    assert search is not None and search.trials
    with open(Path(logger.log_dir) / "lr_search.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["lr"]) for r in rows] == [t.lr for t in search.trials]
    won = [float(r["lr"]) for r in rows if int(r["won"])]
    assert won == [search.winner] and search.chosen == pytest.approx(won[0] / SHORT_HORIZON)
    depends = [float(r["input_dependence"]) for r in rows]
    assert depends == pytest.approx([t.input_dependence for t in search.trials], nan_ok=True)
    run = read_run(logger.log_dir)
    assert run.lr_searches["lr_finder"]["lr"] == [t.lr for t in search.trials]
    assert len(run.scalars["lr_finder/search_lr"].values) == len(search.trials)
    assert "lr_finder/search_loss" in run.scalars


# ---------------------------------------------------------------------------------------------- the pieces
def test_log_spaced_candidates_and_the_refinement() -> None:
    grid = log_spaced(1e-3, 1e-1, 5)
    assert grid[0] == pytest.approx(1e-3) and grid[-1] == pytest.approx(1e-1)
    assert all(b / a == pytest.approx(10**0.5) for a, b in itertools.pairwise(grid))
    assert log_spaced(1e-2, 1.05e-2, 5) == [pytest.approx(math.sqrt(1e-2 * 1.05e-2))]
    # a symmetric valley around the middle point: the refinement is that point
    assert refinement(grid, [3.0, 2.0, 1.0, 2.0, 3.0]) == pytest.approx(grid[2])
    # lower on the right: the refinement moves right, at most half a step
    right = refinement(grid, [3.0, 2.0, 1.0, 1.5, 3.0])
    assert right is not None and grid[2] < right <= grid[2] * 10**0.25 * (1 + 1e-9)
    # the best at an end: half a step past it; a diverged candidate is no minimum
    assert refinement(grid, [1.0, 2.0, 3.0, 4.0, math.inf]) == pytest.approx(grid[0] / 10**0.25)
    assert refinement(grid, [5.0, 4.0, 3.0, 2.0, 1.0]) == pytest.approx(grid[-1] * 10**0.25)
    assert refinement(grid, [math.inf] * 5) is None


def _trial(lr: float, losses: list[float]) -> Trial:
    return Trial(
        lr=lr, round=1, steps=10, loss=sum(losses) / len(losses), train_loss=0.0, batch_losses=tuple(losses)
    )


def test_the_last_round_prefers_the_smaller_lr_the_batches_cannot_tell_apart() -> None:
    best = _trial(1e-2, [1.0, 1.2, 0.8, 1.0])
    tied = _trial(1e-3, [1.01, 1.19, 0.82, 1.0])  # 0.005 higher on average, the differences scatter 0.01
    worse = _trial(1e-3, [1.1, 1.3, 0.9, 1.1])  # 0.1 higher on every batch
    assert choose([best, tied]) is tied
    assert choose([best, worse]) is best
    high = _trial(1e-1, [1.01, 1.19, 0.82, 1.0])
    assert choose([high, best]) is best  # without a prior, a larger LR never takes a tie
    # the sweep's own suggestion decides among candidates the batches cannot tell apart
    assert choose([best, tied, high], prior=0.05) is high and choose([best, tied], prior=0.02) is best
    assert choose([best, worse], prior=1e-3) is best  # and nowhere else
    assert choose([best, Trial(lr=1e-4, round=1, steps=3, loss=math.inf, train_loss=math.inf)]) is best


def _configs(scheduler: Any) -> SimpleNamespace:
    config = SimpleNamespace(scheduler=scheduler, interval="step", reduce_on_plateau=False)
    return SimpleNamespace(lr_scheduler_configs=[config])


def test_the_schedule_is_read_to_its_end_and_compressed_to_a_trial() -> None:
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-3)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=200)
    factors = schedule_factors(_configs(one_cycle), opt, 1e-3, None)  # type: ignore[arg-type]
    assert len(factors) in (200, 201) and max(factors) == pytest.approx(1.0)  # to the step it refuses
    assert factors.index(max(factors)) == pytest.approx(0.3 * 200, abs=2)  # OneCycleLR's pct_start
    trial = compressed(factors, 20)
    assert len(trial) == 20 and trial.index(max(trial)) in (5, 6) and trial[-1] < 1e-3
    # a warm-up to a constant LR: the constant part is kept nine times the warm-up's length
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    warm = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 50))
    factors2 = schedule_factors(_configs(warm), opt2, 0.1, None)  # type: ignore[arg-type]
    assert len(factors2) == 500 and factors2[-1] == 1.0
    # a known run length is read that far; no scheduler: a constant factor
    opt3 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    warm3 = torch.optim.lr_scheduler.LambdaLR(opt3, lambda s: min(1.0, (s + 1) / 50))
    assert len(schedule_factors(_configs(warm3), opt3, 0.1, 120)) == 120  # type: ignore[arg-type]
    assert schedule_factors(SimpleNamespace(lr_scheduler_configs=[]), opt3, 0.1, None) == [1.0]  # type: ignore[arg-type]
    assert compressed([1.0], 4) == [1.0] * 4 and compressed([0.5, 1.0], 4) == [0.5, 0.5, 1.0, 1.0]
    # a schedule that never settles, of unknown length: ten times its warm-up, or to a tenth of its peak
    opt4 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    inverse_sqrt = torch.optim.lr_scheduler.LambdaLR(opt4, lambda s: min((s + 1) / 30, (30 / (s + 1)) ** 0.5))
    factors4 = schedule_factors(_configs(inverse_sqrt), opt4, 0.1, None)  # type: ignore[arg-type]
    assert len(factors4) == 300 and factors4[29] == pytest.approx(1.0)
    assert factors4[-1] == pytest.approx((30 / 300) ** 0.5, rel=0.01)
    opt5 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    exponential = torch.optim.lr_scheduler.ExponentialLR(opt5, gamma=0.1 ** (1 / 200))
    factors5 = schedule_factors(_configs(exponential), opt5, 0.1, None)  # type: ignore[arg-type]
    assert len(factors5) in (200, 201, 202) and factors5[-1] == pytest.approx(0.1, rel=0.02)


def test_a_winner_that_only_learned_the_class_frequencies_learned_nothing() -> None:
    """Regression (examples/lr_find.py under another machine's rounding: the trials of a digits MLP sat at
    chance, 2.302 -> 2.293 on every held-out batch, and the search applied 0.67, past its bracket; the run
    then stayed at chance): a fall that is sure (every batch) but under 2 % of the level is no learning,
    and the sweep's suggestion stands."""
    from lightning_gradguard.monitors.lr_finder.search import _learned

    start = [2.302 + 0.001 * (i % 3) for i in range(8)]

    def trial(fall: float) -> Trial:
        return Trial(
            lr=0.5, round=1, steps=54, loss=2.3 - fall, train_loss=2.3, batch_losses=[x - fall for x in start]
        )

    assert not _learned(trial(0.009), start)  # sure: the same 0.009 on every batch, but 0.4 %
    assert _learned(trial(0.2), start)  # 9 %: the trials learned


# ---------------------------------------------------------------------------------------------- issue 39
class Offset(pl.LightningModule):
    """One bias fitted to targets ``5 + N(0, 1)`` under plain SGD: its loss reaches the noise floor (1.0)
    within a few dozen steps at any LR of the bracket, so twice the steps teach nothing more."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.b = nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (y,) = batch
        return ((self.b - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_trials_that_learn_nothing_more_are_said_to(caplog: pytest.LogCaptureFixture) -> None:
    """Every candidate sits at the noise floor after 30 steps (1.05 against 26 before training): the
    trials say how fast an LR gets there, not how it trains over a run. Twice the steps do not lower the
    best loss (a hundredth of the 2 % it takes): the search chooses, and says so."""
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    y = 5.0 + torch.randn(2048, generator=torch.Generator().manual_seed(0))
    shuffle = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(y)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=shuffle)
    torch.manual_seed(0)
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False}
    result = lr_find(Offset(), loader, search_steps=330, **kw)
    assert result is not None and result.search is not None and result.sweep_suggestion is not None
    assert result.search.start_loss > 10 and any(t.round == 1 for t in result.search.trials)
    assert result.search.chosen is not None and result.search.reason == ""
    assert "learned nothing more" in result.search.note and result.suggestion == result.search.chosen
    said = [r.getMessage() for r in caplog.records if "LRFinderPlus [epoch 0]" in r.getMessage()]
    assert said and "learned nothing more" in said[-1]
    # a search whose second round learned more says nothing of the kind
    learning = _lr_find(search_steps=90, max_lr=10.0)
    assert learning.search is not None and learning.search.note == ""


class Classifier(pl.LightningModule):
    """A small MLP classifier of 16 features into 3 classes under Adam."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _classes(informative: bool) -> Any:
    """1,024 samples of 16 features; the labels follow the features (``informative``) or are drawn
    with frequencies 0.7, 0.2, 0.1 whatever the features are."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    if informative:
        y = (x[:, :3] + 0.3 * torch.randn(1024, 3, generator=g)).argmax(1)
    else:
        y = torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), 1024, replacement=True, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=g)


def test_trials_that_learn_only_the_label_frequencies_do_not_choose() -> None:
    """Regression: labels that do not depend on the inputs: all a model can learn is how often each label
    occurs, from ln 3 = 1.10 down to their entropy, 0.80, at any LR that is not too small. The trials did
    learn that (30 % below the loss before training), so the search ranked the LRs by noise among them
    and applied its pick. Their losses barely rise when each sample's inputs meet another sample's
    targets: the search now says so (after running again with longer trials, which learn no more) and the
    sweep's suggestion stands. Where the labels follow the inputs, the same search chooses."""
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False, "search_steps": 110}
    torch.manual_seed(0)
    frequencies = lr_find(Classifier(), _classes(informative=False), **kw)
    assert frequencies is not None and frequencies.search is not None and frequencies.search.trials
    last = [t for t in frequencies.search.trials if t.round == 1]
    assert last and all(t.input_dependence < INPUT_SHARE for t in last if math.isfinite(t.input_dependence))
    assert frequencies.search.chosen is None and "does not depend on the inputs" in frequencies.search.reason
    assert frequencies.search.retries == 2  # trials 4 times as long learn no more: nothing to learn
    assert frequencies.suggestion == frequencies.sweep_suggestion is not None
    torch.manual_seed(0)
    task = lr_find(Classifier(), _classes(informative=True), **kw)
    assert task is not None and task.search is not None and task.search.chosen is not None
    won = next(t for t in task.search.trials if t.round == 1 and t.lr == task.search.winner)
    assert won.input_dependence > 0.5 and task.suggestion == task.search.chosen


class NoisyTraining(Classifier):
    """A classifier whose training loss carries a large noise that does not depend on the weights (as heavy
    augmentation or a tiny batch does): its range test's descent is lost in that noise; trained models,
    scored in eval mode on held-out samples, show what they learned."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        return loss + 3.0 * torch.randn(()) if self.training else loss


def test_a_sweep_lost_in_its_noise_gets_its_lr_from_trials_below_its_top() -> None:
    """Regression: a sweep whose descent does not stand out of its noise suggested nothing, and no search ran:
    the run kept its LR. The search now trains candidates over the two decades below the sweep's top (its last
    LR before the diverging tail, a third of it for a constant LR), and the trials, scored without that noise,
    choose; ``search_steps=0`` keeps the refusal."""
    kw: dict[str, Any] = {
        "trainer_kwargs": {"accelerator": "cpu"},
        "progress": False,
        "max_sweeps": 1,
        "num_training": 50,
    }
    torch.manual_seed(0)
    result = lr_find(NoisyTraining(), _classes(informative=True), search_steps=110, **kw)
    assert result is not None and result.sweep_suggestion is None
    assert "does not stand out of its noise" in result.sweep_reason
    search = result.search
    assert search is not None and search.blind and search.chosen is not None
    assert result.suggestion == search.chosen and result.reason == ""
    top = result.lrs[result.divergence_at - 1] if result.divergence_at else result.lrs[-1]
    assert search.bracket == pytest.approx((top / CONSTANT_MARGIN / 10**BLIND_DECADES, top / CONSTANT_MARGIN))
    won = next(
        t for t in search.trials if t.lr == search.winner and t.round == max(x.round for x in search.trials)
    )
    assert won.input_dependence > 0.5  # it learned the task
    torch.manual_seed(0)
    sweep_only = lr_find(NoisyTraining(), _classes(informative=True), search_steps=0, **kw)
    assert sweep_only is not None and sweep_only.suggestion is None and sweep_only.search is None


class LateStarter(Classifier):
    """Meets its own labels only after its first 30 training steps (:class:`~tests.testkit.LateLabels`): a
    model that needs longer than short trials to use its inputs, as a ViT or a transformer tagger does."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        self.late = LateLabels(after=30)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), self.late(y, self.training))


def test_trials_too_short_to_learn_the_task_run_again_twice_as_long() -> None:
    """Regression: trials of 10 and 20 steps end before this model meets a label of its own inputs, so none
    learned the task and the search chose nothing, keeping the sweep's suggestion. It now runs again from
    the start with trials twice as long, up to ``search_retries`` times, and chooses once they learned; the
    note says why, every run's trials are kept, and ``search_retries=0`` keeps the old answer."""
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False, "search_steps": 110}
    torch.manual_seed(0)
    result = lr_find(LateStarter(), _classes(informative=True), **kw)
    assert result is not None and result.search is not None
    search = result.search
    assert search.retries >= 1 and search.chosen is not None and result.suggestion == search.chosen
    first = [t for t in search.trials if t.round == 1]
    assert first and max(t.steps for t in first) == 20
    assert all(not t.input_dependence >= INPUT_SHARE for t in first)  # nan or below: nothing learned
    last_round = 2 * search.retries + 1
    won = next(t for t in search.trials if t.round == last_round and t.lr == search.winner)
    assert won.steps == 20 << search.retries and won.input_dependence > INPUT_SHARE
    assert search.steps == sum(t.steps for t in search.trials)
    assert "the trials are too short" in search.note and "more time" in search.note
    torch.manual_seed(0)
    once = lr_find(LateStarter(), _classes(informative=True), search_retries=0, **kw)
    assert once is not None and once.search is not None and once.search.chosen is None
    assert once.search.retries == 0 and "raise search_steps" in once.search.reason
    assert once.suggestion == once.sweep_suggestion


class AutoEncoder(Classifier):
    """Reconstructs its 16 features through 4 (the labels in the batch go unused)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return nn.functional.mse_loss(self.net(x), x)


class NoisyInputs(Classifier):
    """The classifier with noise added to its inputs inside ``training_step``: a loss that differs from one
    evaluation of the same batch to the next."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x + 0.3 * torch.randn_like(x)), y)


class Contrastive(Classifier):
    """A SimCLR-style encoder of the 16 features: two noisy views of each sample (in evaluation the same
    ones every time, drawn in order from a seeded generator), each of the 2n views to pick its partner by
    cosine similarity (NT-Xent). The labels in the batch go unused, as a self-supervised run's dataset
    labels do."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        g = None if self.training else torch.Generator().manual_seed(0)
        views = torch.cat([x + torch.randn(x.shape, generator=g), x + torch.randn(x.shape, generator=g)])
        z = nn.functional.normalize(self.net(views), dim=-1)
        n = len(x)
        sim = (z @ z.T / 0.2).masked_fill(torch.eye(2 * n, dtype=torch.bool), -math.inf)
        return nn.functional.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


@pytest.mark.parametrize("module", [AutoEncoder, NoisyInputs, Contrastive])
def test_the_inputs_check_stays_silent_where_it_cannot_tell(module: type[pl.LightningModule]) -> None:
    """An autoencoder's loss does not depend on how inputs and labels are paired; a loss with noise in it
    differs between two evaluations of the same batches, and on labels that do not follow the inputs its
    noise could pass for either answer. Neither gives evidence, and the search chooses as it would
    without the check. Regression (the contrastive encoder): the check moved the inputs, whose views are
    drawn by their place in the batch, so a loss that never reads the labels changed by a percent or two
    either way and the check fired (held-out SimCLR of ``make bench-lr-hard``: the search chose nothing,
    three times). The targets move now, and that loss stays the same."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False, "search_steps": 110}
    result = lr_find(module(), _classes(informative=False), **kw)
    assert result is not None and result.search is not None
    last = [t for t in result.search.trials if t.round == 1]
    assert last and all(math.isnan(t.input_dependence) for t in last)
    assert "inputs" not in result.search.reason


class PairChecked(Classifier):
    """Checks that every sample's label is the one it was drawn with (the last feature carries it): a
    ``training_step`` that raises on any batch the data loader would never make."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if not torch.equal(x[:, -1].long(), y):
            raise ValueError("a sample's features and label do not belong together")
        return super().training_step((x[:, :-1], y), batch_idx)


def test_a_step_that_fails_on_mismatched_inputs_costs_the_check_not_the_search() -> None:
    torch.manual_seed(0)
    x, y = next(iter(torch.utils.data.DataLoader(_classes(True).dataset, batch_size=1024)))
    data = torch.utils.data.TensorDataset(torch.cat([x[:, :15], y[:, None].float()], 1), y)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model = PairChecked()
    model.net[0] = nn.Linear(15, 32)
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False, "search_steps": 110}
    result = lr_find(model, loader, **kw)
    assert result is not None and result.search is not None and result.search.chosen is not None
    assert all(math.isnan(t.input_dependence) for t in result.search.trials)


class InverseSqrt(Classifier):
    """The classifier under an inverse-square-root decay after a 30-step warm-up (the fairseq schedule),
    which never stops changing; it records the LR of every training step it takes with gradients."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.seen.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 30, (30 / (s + 1)) ** 0.5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def _first_trial_factors(model: InverseSqrt) -> list[float]:
    """``lr_find`` on ``model`` with a 110-step search: the LR of each step of its first trial (recorded by
    the model), over the trial's candidate LR."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False, "search_steps": 110}
    result = lr_find(model, _classes(informative=True), max_lr=1.0, **kw)
    assert result is not None and result.search is not None and result.search.trials
    first = result.search.trials[0]
    done = len(model.seen) - sum(t.steps for t in result.search.trials)
    return [lr / first.lr for lr in model.seen[done : done + first.steps]]


def test_a_schedule_that_never_settles_is_squeezed_from_a_guessed_run_not_100000_steps() -> None:
    """Regression: ``lr_find`` does not know the run's length, and an inverse-square-root schedule never
    stops changing, so it was read to its 100,000-step limit and squeezed into each trial: after its first
    step a trial ran at 2-9 % of the LR it stood for (a held-out transformer tagger's search then picked
    LRs whose runs end at chance). The run is now taken to be ten times the warm-up: a trial warms up to
    its candidate's LR and ends at sqrt(30 / 300) of it."""
    trial = _first_trial_factors(InverseSqrt())
    assert len(trial) == 10
    assert max(trial) > 0.9  # near the warm-up's end (the squeeze samples step 33 of 300): the candidate's LR
    assert trial[-1] == pytest.approx((30 / 300) ** 0.5, rel=0.05)  # not 30 / 100,000 ** 0.5 = 0.017


class DecayPerEpoch(InverseSqrt):
    """The recording classifier under the PyTorch MNIST example's schedule: the LR times 0.7 every epoch of
    22 batches, with no end of its own (its factor underflows to zero after about 45,000 steps)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7 ** (s // 22))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def test_a_decay_that_reaches_zero_only_by_underflow_is_squeezed_from_a_guessed_run() -> None:
    """Regression: a geometric decay reaches zero where its factor underflows, and that was read as the run's
    end, about 45,000 steps away: squeezed into a trial, every step after the first ran below 1e-30 of the
    candidate's LR (the MNIST example under Adadelta learned nothing in trials of up to 432 steps). The run
    is now taken to end where the LR has fallen to a tenth (after 7 epochs, 155 steps): a trial starts at
    its candidate's LR and ends at 0.7 ** 7 of it."""
    trial = _first_trial_factors(DecayPerEpoch())
    assert len(trial) == 10
    assert trial[0] == pytest.approx(1.0) and trial[1] == pytest.approx(1.0)  # was 0.7 ** 229 after step 1
    assert trial[-1] == pytest.approx(0.7**7, rel=1e-6)


class StepDecay(InverseSqrt):
    """The recording classifier under a step decay: LR / 10 at 90, 180 and 270 steps (30, 60 and 90 % of a
    300-step run), then a thousandth of it for good."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[90, 180, 270], gamma=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def _warm_then_hold(step: int) -> float:
    return min(1.0, (step + 1) / 30)


def _warm_then_decay(step: int) -> float:
    return min((step + 1) / 30, max(0.0, (300 - step) / 270))


class WarmUp(Classifier):
    """The classifier under Adam with a 30-step linear warm-up, then the LR it reached for good (``hold``),
    or a linear decay to zero at step 300."""

    def __init__(self, hold: bool) -> None:
        super().__init__()
        self.hold = hold

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, _warm_then_hold if self.hold else _warm_then_decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}


def test_a_warm_up_to_a_held_lr_is_searched_below_its_edge_as_a_constant_lr_is() -> None:
    """Regression: any warm-up counted as making the sweep's edge safe, so a run that warms up to an LR and
    then holds it was searched up to that edge; it spends its run at that LR, as a constant-LR run does,
    and short trials near the edge chose LRs that its full run could not hold (a CTC recogniser: 6.83
    times the best loss). Its search now stops :data:`CONSTANT_MARGIN` below the edge; one that decays
    from its peak still goes up to it."""
    tops = {}
    for hold in (True, False):
        torch.manual_seed(0)
        kw: dict[str, Any] = {"trainer_kwargs": {"accelerator": "cpu"}, "progress": False}
        result = lr_find(WarmUp(hold), _classes(informative=True), max_lr=10.0, search_steps=110, **kw)
        assert result is not None and result.search is not None and result.divergence_at is not None
        assert result.schedule is not None and result.schedule.warms_up
        edge = result.lrs[result.divergence_at - 1] / result.schedule.peak
        tops[hold] = result.search.bracket[1] / edge
    assert tops[True] == pytest.approx(1 / CONSTANT_MARGIN) and tops[False] == pytest.approx(1.0)


def test_a_step_decay_holds_its_last_level_as_long_as_the_one_before_not_nine_times_the_decay() -> None:
    """Regression: a schedule that stopped changing at a level below its peak was read as a warm-up to a
    constant LR, held for nine times its changing part (2,710 steps here): squeezed into a trial, it spent
    one step at the candidate's LR and the rest at a hundredth to a thousandth of it (a digits MLP under
    this schedule learned nearly nothing in its trials, and the search chose three times the best LR). The
    last level now lasts as long as the one before (90 steps, a 360-step run): a trial holds each level for
    its share of the run, the candidate's LR for 3 of its 10 steps."""
    trial = _first_trial_factors(StepDecay())
    assert trial == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 0.001], rel=1e-6)


class Recording(InverseSqrt):
    """The recording classifier under a constant LR."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def test_the_default_budget_trains_trials_long_enough_to_see_a_late_blow_up() -> None:
    """At the default budget the second round's trials are 108 steps (5 of 54, then 3 of 108, counted
    apart from the library, one ``training_step`` with gradients each): a 54-step trial, the longest of a
    300-step budget, cannot see a run that blows up after a hundred steps at a large LR (SGD momentum on
    ``make bench-lr-hard``: a distilled student 29 times the best loss, a triplet network 3.9; 1.25 and
    1.40 at this budget)."""
    torch.manual_seed(0)
    model = Recording()
    result = lr_find(model, _classes(informative=True), max_lr=1.0, trainer_kwargs={"accelerator": "cpu"})
    assert result is not None and result.search is not None and result.search.retries == 0
    trials = result.search.trials
    assert [t.round for t in trials] == [0] * 5 + [1] * (len(trials) - 5)
    finite = [t for t in trials if math.isfinite(t.loss)]
    assert [t.steps for t in finite] == [54 if t.round == 0 else 108 for t in finite]
    seen = model.seen[len(model.seen) - sum(t.steps for t in trials) :]  # the search's steps, last
    for t in trials:
        assert seen[: t.steps] == pytest.approx([t.lr] * t.steps)
        seen = seen[t.steps :]
    assert result.search.steps == sum(t.steps for t in trials) <= DEFAULT_SEARCH_STEPS == 600


def test_the_refinement_is_a_trained_candidate_never_trusted_untrained() -> None:
    """The parabola's low point between the first round's best and its neighbours is trained in the second
    round beside the best two; the choice is one of the LRs trained there."""
    result = _lr_find(search_steps=90, max_lr=10.0)
    search = result.search
    first = [t for t in search.trials if t.round == 0]
    second = [t.lr for t in search.trials if t.round == 1]
    extra = refinement([t.lr for t in first], [t.loss for t in first])
    best_two = [t.lr for t in sorted(first, key=lambda t: t.loss)[:2]]
    assert extra is not None and second[:2] == best_two
    if all(max(extra / lr, lr / extra) > 1.1 for lr in best_two):
        assert second[2] == extra
    assert search.winner in second


def test_the_refinement_finds_a_parabolas_low_and_only_within_half_a_step() -> None:
    """A loss that is a parabola in log-LR with its low at ``best`` (known in closed form): the lowest grid
    point and its neighbours give ``best`` exactly, wherever it lies between grid points; three points that
    are no parabola (a flat bottom) move the lowest point half a grid step at most."""
    grid = log_spaced(1e-3, 1e-1, 5)
    half = 10**0.25
    for offset in (-0.45, -0.2, 0.0, 0.3, 0.49):  # in grid steps from the middle point
        best = grid[2] * 10 ** (0.5 * offset)
        losses = [0.7 + (math.log(lr / best)) ** 2 for lr in grid]
        assert refinement(grid, losses) == pytest.approx(best, rel=1e-9)
    far = grid[2] * 10 ** (0.5 * 0.8)  # 0.8 steps right of grid[2]: grid[3] is the lowest point
    losses = [0.7 + (math.log(lr / far)) ** 2 for lr in grid]
    assert refinement(grid, losses) == pytest.approx(far, rel=1e-9)
    flat_top = [3.0, 1.0, 1.0, 1.0, 3.0]  # no single lowest middle: the first lowest point's parabola
    got = refinement(grid, flat_top)
    assert got is not None and grid[1] <= got <= grid[1] * half * (1 + 1e-9)


def _round(lr: float, round_: int, losses: list[float]) -> Trial:
    return Trial(
        lr=lr,
        round=round_,
        steps=10 * (round_ + 1),
        loss=sum(losses) / len(losses),
        train_loss=0.0,
        batch_losses=tuple(losses),
    )


def test_the_second_round_must_learn_more_than_the_first() -> None:
    from lightning_gradguard.monitors.lr_finder.search import _nothing_learned, plateau_note

    start = [2.0, 2.2, 1.8, 2.0]
    first = [_round(0.1, 0, [1.0, 1.2, 0.8, 1.0]), _round(1.0, 0, [1.5, 1.7, 1.3, 1.5])]
    same = [_round(0.1, 1, [1.001, 1.199, 0.802, 1.0])]  # no lower: the trials plateaued
    sure_but_small = [_round(0.1, 1, [0.99, 1.19, 0.79, 0.99])]  # 0.01 lower on every batch: 1 %
    lower = [_round(0.1, 1, [0.8, 1.0, 0.6, 0.8])]  # 0.2 lower on every batch: 20 %
    assert "learned nothing more" in plateau_note(first, same)
    assert "learned nothing more" in plateau_note(first, sure_but_small)
    assert plateau_note(first, lower) == ""
    assert _nothing_learned(lower[0], start) == ""
    assert "fell clearly below" in _nothing_learned(first[0], [1.0, 1.2, 0.8, 1.0])


# ----------------------------------------------------------------------------------------- held out by sample
class Recorder(LinReg):
    """LinReg whose batches carry their samples' indices: it records, in order, which samples each call
    of ``training_step`` saw and whether it trained (train mode, gradients on) or scored (eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.calls.append((self.training and torch.is_grad_enabled(), ids.tolist()))
        return super().training_step((x, y), batch_idx)


def _indexed_loader(dataset: Any = None) -> Any:
    x, y = _regression()
    data = dataset or torch.utils.data.TensorDataset(x, y, torch.arange(len(x)))
    return torch.utils.data.DataLoader(
        data, batch_size=32, shuffle=dataset is None, generator=torch.Generator()
    )


def test_trials_longer_than_a_pass_never_train_on_the_samples_that_score_them() -> None:
    """Without a validation loader the candidates are scored on training data. Trials of 36 and 72 steps
    over a 32-batch pass start new, reshuffled passes: held out by batch, the scoring samples came back in
    those passes and the trials trained on them (all 512, on main 0c8d888). Held out by
    sample, no trial ever sees one."""
    torch.manual_seed(0)
    model = Recorder()
    result = lr_find(
        model,
        _indexed_loader(),
        trainer_kwargs={"accelerator": "cpu"},
        progress=False,
        search_steps=400,
        max_lr=10.0,
    )
    assert result is not None and result.search is not None and result.search.trials
    assert max(t.steps for t in result.search.trials) > 32  # longer than a pass
    first_score = next(i for i, (trained, _) in enumerate(model.calls) if not trained)
    scored = {i for trained, ids in model.calls if not trained for i in ids}
    trained_in_trials = {i for trained, ids in model.calls[first_score:] if trained for i in ids}
    assert trained_in_trials and not scored & trained_in_trials
    assert len(scored) == 256  # eight batches' worth, a quarter of the data at most
    assert len(trained_in_trials) == 1024 - 256  # the trials still train on all the rest
    assert result.search.evaluated_on == "256 held-out training samples"


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        x, y = _regression()
        return iter(zip(x, y, torch.arange(len(x)), strict=True))


def test_a_loader_that_cannot_be_split_by_sample_keeps_the_hold_out_by_batch() -> None:
    torch.manual_seed(0)
    result = lr_find(
        Recorder(),
        _indexed_loader(_Stream()),
        trainer_kwargs={"accelerator": "cpu"},
        progress=False,
        search_steps=90,
        max_lr=10.0,
    )
    assert result is not None and result.search is not None and result.search.trials
    assert result.search.evaluated_on == "held-out training batches"


def test_the_split_holds_out_at_most_a_quarter_and_gives_every_trial_the_same_passes() -> None:
    x, y = _regression()
    small = torch.utils.data.TensorDataset(x[:200], y[:200])
    loader = torch.utils.data.DataLoader(small, batch_size=16, shuffle=True)
    cut = split(loader, 32, 100)
    assert cut is not None and cut.samples == 50 and len(cut.rest) == 150
    held = torch.cat([b[0] for b in cut.held_out])
    assert len(held) == 50
    a, b = ([batch[0] for loader in [cut.training()] for _ in range(2) for batch in loader] for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)) and not torch.equal(a[0], a[10])
    trained = torch.cat(a)
    assert len(trained) == 300 and not (trained[:, None, :] == held[None, :, :]).all(-1).any()
    assert split(loader, 2, 13) is None  # trials that stay within the pass of 13 batches need no split
    assert split(torch.utils.data.DataLoader(small, batch_size=64), 32, 100) is None  # 2 batches > 1/4
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 200, 200)
    assert split(torch.utils.data.DataLoader(small, batch_size=16, sampler=weighted), 4, 100) is None


def test_under_ddp_every_rank_takes_its_share_of_the_same_order() -> None:
    shares = [list(IndexSampler(range(10), shuffle=True, replicas=3, rank=r)) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]  # padded, as DistributedSampler pads: equal batches
    assert sorted(set().union(*shares)) == list(range(10))
    order = [i for row in zip(*shares, strict=True) for i in row]  # the one order all ranks drew
    assert sorted(order[:10]) == list(range(10)) and order[10:] == order[:2]
    assert order != list(range(10))  # shuffled
