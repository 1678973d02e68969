"""OverfitBatchSanity: healthy models pass, each broken pipeline fails with its own finding, and the real
run after the check is bit for bit the run without it."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import run_ddp_script, run_example
from torch import nn

from lightning_gradguard import OverfitBatchSanity, SanityCheckError
from lightning_gradguard.alerts import GradGuardError
from tests.conftest import MemoryLogger, make_trainer


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers without a logger write their alert file to the working directory: keep it in tmp_path."""
    monkeypatch.chdir(tmp_path)


def loader(
    n: int = 64, features: int = 8, classes: int = 4, batch_size: int = 16, shuffle: bool = False
) -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle
    )


class Classifier(pl.LightningModule):
    """A small MLP classifier with one switchable bug."""

    def __init__(self, bug: str | None = None, lr: float = 1e-2, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, classes))
        self.bug = bug
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        if self.bug == "detach":
            h = h.detach()
        if self.bug == "mix":  # a transpose before a reshape: samples leak into each other
            h = h.t().reshape(x.shape[0], -1)
        return self.net[2](h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.bug == "shuffled_labels":  # labels drawn out of step with their inputs on every pass
            y = y[torch.randperm(y.shape[0])]
        reduction = "sum" if self.bug == "sum_reduction" else "mean"
        loss = nn.functional.cross_entropy(self(x), y, reduction=reduction)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.bug == "optimizer_missing_layer":
            return torch.optim.Adam(self.net[2].parameters(), lr=self.lr)
        if self.bug == "lr_zero":
            return torch.optim.SGD(self.parameters(), lr=0.0)
        if self.bug == "no_optimizer":
            return None
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def fit(model: pl.LightningModule, check: OverfitBatchSanity, **kw: Any) -> pl.Trainer:
    trainer = make_trainer([check], **kw)
    trainer.fit(model, loader())
    return trainer


def kinds(check: OverfitBatchSanity) -> set[str]:
    assert check.result is not None
    return {f.kind for f in check.result.findings if f.severity == "error"}


def test_healthy_classifier_passes_and_stops_as_soon_as_it_reaches_the_target() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(max_steps=300)
    fit(Classifier(), check)
    r = check.result
    assert r is not None and r.passed and r.reached_target and not check.alerts
    assert r.num_samples == 16 and r.optimizer == "Adam"
    assert len(r.losses) == r.steps + 1 and len(r.grad_norms) == r.steps
    assert r.initial_loss == r.losses[0] and r.final_loss == r.losses[-1]
    assert r.target_loss == pytest.approx(0.1 * r.initial_loss)
    assert r.final_loss <= r.target_loss and all(v > r.target_loss for v in r.losses[1:-1])
    assert abs(r.initial_loss - math.log(4)) < 0.5 * math.log(4)
    assert r.grad_norms[-1] < r.grad_norms[0]
    assert 0 < r.seconds < 30


def test_curve_and_grad_norm_go_to_the_loggers(memory_logger: MemoryLogger) -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    fit(Classifier(), check, logger=memory_logger, max_steps=1)
    assert check.result is not None
    curve = memory_logger.series("preflight/overfit_loss")
    assert [curve[i] for i in range(len(check.result.losses))] == pytest.approx(check.result.losses)
    norms = memory_logger.series("preflight/overfit_grad_norm")
    assert norms[0] == pytest.approx(check.result.grad_norms[0])
    assert "train_loss" not in {k for _, m in memory_logger.calls[: len(curve)] for k in m}


def test_absolute_target() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(target=0.5, target_mode="absolute")
    fit(Classifier(), check, max_steps=1)
    r = check.result
    assert r is not None and r.passed and r.target_loss == 0.5
    assert r.final_loss <= 0.5 < r.losses[-2]


@pytest.mark.parametrize(
    ("bug", "kind", "names", "words"),
    [
        ("detach", "unused_parameter", ["net.0.weight", "net.0.bias"], ".detach()"),
        (
            "optimizer_missing_layer",
            "parameter_not_updated",
            ["net.0.weight", "net.0.bias"],
            "not in any param group",
        ),
        (
            "lr_zero",
            "parameter_not_updated",
            ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"],
            "lr=0",
        ),
        ("sum_reduction", "initial_loss_mismatch", [], "reduction='sum'"),
        ("shuffled_labels", "overfit_failed", [], "labels not matching their inputs"),
    ],
)
def test_broken_pipeline_fails_with_its_finding(bug: str, kind: str, names: list[str], words: str) -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(max_steps=150)
    with pytest.raises(SanityCheckError) as err:
        fit(Classifier(bug), check)
    assert isinstance(err.value, GradGuardError)
    assert check.result is not None and not check.result.passed
    assert kind in kinds(check)
    finding = next(f for f in check.result.findings if f.kind == kind)
    assert sorted(finding.names) == sorted(names)
    assert words in finding.message + finding.hint
    assert kind in str(err.value) and "overfit_failed" in {a.kind for a in err.value.alerts}
    for name in names:
        assert name in str(err.value)


def test_sum_reduction_ratio_is_the_batch_size_and_other_findings_are_silent() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(action="warn")
    fit(Classifier("sum_reduction"), check, max_steps=1)
    r = check.result
    assert r is not None
    (finding,) = [f for f in r.findings if f.kind == "initial_loss_mismatch"]
    assert finding.data["num_classes"] == 4 and finding.data["ratio"] == pytest.approx(16, rel=0.25)
    assert finding.data["initial_loss"] == pytest.approx(r.initial_loss)
    assert kinds(check) == {"initial_loss_mismatch"}  # it still memorises the batch


def test_shuffled_labels_stay_at_chance_level() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(max_steps=150, action="warn")
    fit(Classifier("shuffled_labels"), check, max_steps=1)
    r = check.result
    assert r is not None and not r.reached_target and r.steps == 150
    assert abs(r.final_loss - math.log(4)) < 0.35  # the best a model can do: predict the label frequencies
    assert r.chance_loss is not None and abs(r.final_loss - r.chance_loss) < 0.1
    assert "stuck at chance level" in next(f.message for f in r.findings if f.kind == "overfit_failed")


def test_batch_mixing_is_found_in_eval_mode_and_healthy_model_is_clean() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(check_batch_mixing=True, action="warn")
    fit(Classifier("mix"), check, max_steps=1)
    assert "batch_mixing" in kinds(check)
    finding = next(f for f in check.result.findings if f.kind == "batch_mixing")  # type: ignore[union-attr]
    assert finding.names == ["net.2"] and finding.data["samples_mixed"] > 0

    class WithBatchNorm(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))

    torch.manual_seed(0)
    clean = OverfitBatchSanity(check_batch_mixing=True)
    fit(WithBatchNorm(), clean, max_steps=1)  # BatchNorm mixes only through batch statistics (train mode)
    assert clean.result is not None and clean.result.passed


def test_warn_action_reports_and_trains_on() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(action="warn", max_steps=20)
    trainer = fit(Classifier("detach"), check, max_steps=3)
    assert trainer.global_step == 3
    assert {"unused_parameter", "overfit_failed"} <= {a.kind for a in check.alerts}
    assert all(a.severity == "error" for a in check.alerts if a.kind == "overfit_failed")


def test_fallback_optimizer_when_configure_optimizers_returns_none() -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(max_steps=300, fallback_lr=1e-2)
    with pytest.warns(UserWarning, match="optimizer"):
        fit(Classifier("no_optimizer"), check, max_steps=1)
    assert check.result is not None and check.result.optimizer == "Adam" and check.result.passed


def test_ignore_parameters_silences_a_deliberately_unused_head() -> None:
    class Unused(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.aux = nn.Linear(8, 2)

    torch.manual_seed(0)
    check = OverfitBatchSanity(ignore_parameters=["aux.*"])
    fit(Unused(), check, max_steps=1)
    assert check.result is not None and check.result.passed
    torch.manual_seed(0)
    strict = OverfitBatchSanity(action="warn")
    fit(Unused(), strict, max_steps=1)
    assert next(f.names for f in strict.result.findings if f.kind == "unused_parameter") == [  # type: ignore[union-attr]
        "aux.weight",
        "aux.bias",
    ]


class Stochastic(pl.LightningModule):
    """Everything a few trial steps could disturb: dropout (RNG), BatchNorm (buffers), Adam moments, a
    scheduler, a shuffling loader (RNG at every epoch), NumPy and Python randomness in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + float(np.random.rand()) * 1e-3 + random.random() * 1e-3
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def _final_state(callbacks: list[Any]) -> tuple[dict[str, torch.Tensor], int, float]:
    pl.seed_everything(123, verbose=False)
    model = Stochastic()
    trainer = make_trainer(callbacks, max_epochs=2)
    trainer.fit(model, loader(shuffle=True))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]


def test_exact_restore_the_real_run_is_bit_identical_to_one_without_the_check() -> None:
    base, base_steps, base_lr = _final_state([])
    check = OverfitBatchSanity(max_steps=50, action="warn")
    after, steps, lr = _final_state([check])
    assert check.result is not None and check.result.steps > 0  # the check really trained
    assert steps == base_steps == 8 and lr == base_lr
    assert base.keys() == after.keys()
    for k in base:  # atol=0: bit for bit
        assert torch.equal(base[k], after[k]), k


def test_manual_optimization_is_skipped_with_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(nn.functional.cross_entropy(self(batch[0]), batch[1]))
            opt.step()  # type: ignore[union-attr]

    check = OverfitBatchSanity()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        fit(Manual(), check, max_steps=1)
    assert check.result is None and not check.alerts
    said = [r for r in caplog.records if "automatic optimization" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]


def test_ddp_two_processes_reach_the_same_verdict_without_hanging(tmp_path: Path) -> None:
    proc = run_ddp_script("ddp_preflight.py", tmp_path, timeout=120)  # a hang would time out here
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["error"] for r in results] == ["SanityCheckError", "SanityCheckError"], proc.stderr[-4000:]
    assert [r["gradient_check_passed"] for r in results] == [True, False]  # rank 1's backward is wrong
    (on_rank0,), (on_rank1,) = (r["gradient_alerts"] for r in results)  # action="warn": both went on
    assert on_rank0[0] == on_rank1[0] == "gradient_mismatch"
    assert on_rank1[1] == "net.2.s" and "another rank" in on_rank0[2]
    assert [r["overfit_passed"] for r in results] == [True, False]  # only rank 1's labels are broken
    assert [r["global_step"] for r in results] == [0, 0]
    assert "another rank" in results[0]["message"] and "overfit_failed" in results[0]["kinds"]
    assert "stuck at chance level" in results[1]["message"]
    assert abs(results[0]["time"] - results[1]["time"]) < 10


def test_preflight_example_runs_and_keeps_its_promises(tmp_path: Path) -> None:
    out = run_example("preflight.py", tmp_path).stdout
    healthy = out.split("=== 2.")[0]
    assert healthy.count("-> passed=True") == 2
    errors = [
        float(line.split("max relative error")[1].split()[0])
        for line in healthy.splitlines()
        if "error" in line
    ]
    assert len(errors) == 4 and max(errors) < 1e-5
    assert float(healthy.split("val accuracy")[1].split()[0]) > 0.9
    assert "SanityCheckError: gradient_mismatch at hand.weight" in out
    table = out.split("=== 3.")[1]
    for bug, kind in [
        ("detach", "unused_parameter"),
        ("optimizer_missing_layer", "parameter_not_updated"),
        ("lr_zero", "parameter_not_updated"),
        ("sum_loss", "initial_loss_mismatch"),
        ("shuffled_labels", "overfit_failed"),
        ("dataset_random_labels", "labels_unstable"),
    ]:
        row = next(line for line in table.splitlines() if line.startswith(bug))
        assert kind in row, row
    assert "stuck at chance level" in table


def test_a_batch_the_model_cannot_train_on_gives_a_warning_not_a_crash() -> None:
    class WithBatchNorm(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))

    check = OverfitBatchSanity(max_samples=1)  # BatchNorm cannot train on a single sample
    trainer = make_trainer([check], max_steps=2)
    model = WithBatchNorm()
    with pytest.warns(UserWarning, match="OverfitBatchSanity could not run the check"):
        trainer.fit(model, loader())
    assert trainer.global_step == 2 and check.result is None and not check.alerts
    assert all(not m._forward_hooks for m in model.modules())  # no hook left behind


@pytest.mark.parametrize("precision", ["bf16-mixed", "64-true"])
def test_both_checks_run_under_other_precisions(precision: str) -> None:
    from lightning_gradguard import GradientCheck

    torch.manual_seed(0)
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    trainer = make_trainer([grads, overfit], precision=precision, max_steps=1)
    trainer.fit(Classifier(), loader())  # 64-true: the batch is converted to float64 as in training
    assert overfit.result is not None and overfit.result.passed
    assert grads.result is not None and grads.result.passed


def test_an_identically_zero_gradient_of_a_minority_is_an_info_line_with_its_share() -> None:
    """A token the batch never selects (a gradient of exact zeros) is no fault of the run: one INFO line
    with its share of the model, and the check passes."""

    class Gated(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 0 * self.gate  # in the graph, but its gradient is exactly 0

    torch.manual_seed(0)
    check = OverfitBatchSanity()
    fit(Gated(), check, max_steps=1)
    assert check.result is not None and check.result.passed
    (finding,) = check.result.findings
    assert (finding.kind, finding.severity, finding.names) == ("unused_parameter", "info", ["gate"])
    total = sum(p.numel() for p in Gated().parameters())
    assert finding.data["entries"] == 1 and finding.data["share"] == pytest.approx(1 / total)
    assert f"{1 / total:.1%} of the trainable model" in finding.message
    assert [(a.kind, a.severity, a.where) for a in check.alerts] == [("unused_parameter", "info", "gate")]


def test_parameters_unused_by_design_are_info_and_most_of_the_model_is_an_error() -> None:
    """A mask token and a relative-position table the forward never reads (as Hugging Face classifiers
    hold them) are an INFO line with their share and a DDP note, and the check passes; a backbone whose
    output is detached (most of the trainable entries without a gradient) fails it."""

    class WithUnread(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.mask_token = nn.Parameter(torch.zeros(8))
            self.net[0].rel_table = nn.Parameter(torch.zeros(4, 4))  # in a module that runs, never read

    torch.manual_seed(0)
    check = OverfitBatchSanity()
    fit(WithUnread(), check, max_steps=1)
    assert check.result is not None and check.result.passed
    (finding,) = check.result.findings
    assert finding.severity == "info" and sorted(finding.names) == ["mask_token", "net.0.rel_table"]
    assert finding.data["entries"] == 24 and "find_unused_parameters=True" in finding.message
    torch.manual_seed(0)
    broken = OverfitBatchSanity(action="warn")
    fit(Classifier("detach"), broken, max_steps=1)
    (error,) = [f for f in broken.result.findings if f.kind == "unused_parameter"]  # type: ignore[union-attr]
    assert error.severity == "error" and error.data["share"] >= 0.5 and "never learns" in error.message


class BatchNormClassifier(Classifier):
    """A BatchNorm MLP whose BatchNorm parameters the optimizer really leaves alone (no rounding involved):
    ``not_in_optimizer``, or ``step_hook``: a step pre-hook zeroes the BatchNorm weight's gradient."""

    def __init__(self, how: str) -> None:
        super().__init__(lr=1e-3)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
        self.how = how

    def configure_optimizers(self) -> Any:
        bn = self.net[1]
        if self.how == "not_in_optimizer":
            return torch.optim.Adam([*self.net[0].parameters(), *self.net[3].parameters()], lr=self.lr)
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)

        def drop_gradient(*_: Any) -> None:
            if bn.weight.grad is not None:
                bn.weight.grad.zero_()

        opt.register_step_pre_hook(drop_gradient)
        return opt


@pytest.mark.parametrize(
    ("how", "stuck", "why"),
    [
        ("not_in_optimizer", ["net.1.weight", "net.1.bias"], "not in any param group of Adam"),
        ("step_hook", ["net.1.weight"], "optimizer.step() computes no update for them"),
    ],
)
def test_a_parameter_the_optimizer_does_not_update_is_an_error_under_bf16_true(
    how: str, stuck: list[str], why: str
) -> None:
    """bf16 weights near 1.0 that are updated by less than bfloat16 resolves are a warning; one that
    gets no update at all is still an error, with bf16 weights as with float32 ones."""
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    trainer = make_trainer([check], precision="bf16-true", max_steps=1)
    with pytest.raises(SanityCheckError, match="parameter_not_updated"):
        trainer.fit(BatchNormClassifier(how), loader())
    assert check.result is not None and not check.result.passed
    (finding,) = [f for f in check.result.findings if f.kind == "parameter_not_updated"]
    assert finding.severity == "error" and finding.names == stuck and why in finding.message
    assert not [f for f in check.result.findings if f.kind == "update_below_precision"]


def _preflight_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(("OverfitBatchSanity:", "GradientCheck:"))
    ]


def test_a_fit_that_resumes_from_a_checkpoint_skips_both_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checks judge a run as it starts (a trained model's loss is not a fresh classifier's): a fit
    resumed from a checkpoint of a run saved without them skips them too, with one INFO line each."""
    from lightning_gradguard import GradientCheck

    torch.manual_seed(0)
    trainer = make_trainer([], max_epochs=3, default_root_dir=str(tmp_path))
    trainer.fit(Classifier(lr=0.05), loader())
    ckpt = str(tmp_path / "trained.ckpt")
    trainer.save_checkpoint(ckpt)
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    trainer = make_trainer([overfit, grads], max_epochs=4)
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        trainer.fit(Classifier(), loader(), ckpt_path=ckpt)
    assert overfit.result is None and grads.result is None and not overfit.alerts + grads.alerts
    assert trainer.global_step == 16  # the run went on
    assert _preflight_lines(caplog) == [
        f"{name}: this fit resumes from a checkpoint at step 12; the check runs only when a run starts "
        "(step 0): skipped."
        for name in ("OverfitBatchSanity", "GradientCheck")
    ]


def test_a_second_fit_on_the_same_trainer_does_not_run_the_checks_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Raising max_epochs and calling fit() again continues the run at step 4: the checks ran when it
    started (step 0), and a second pass would train the half-trained model on its first batch again."""
    from lightning_gradguard import GradientCheck

    torch.manual_seed(0)
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    trainer = make_trainer([overfit, grads], max_epochs=1)
    model = Classifier()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        trainer.fit(model, loader())
        first = (overfit.result, grads.result)
        assert first[0] is not None and first[0].passed and first[1] is not None and first[1].passed
        assert [line.split(" - ")[0] for line in _preflight_lines(caplog)] == [
            "OverfitBatchSanity: passed",
            "GradientCheck: passed",
        ]
        caplog.clear()
        trainer.fit_loop.max_epochs = 2
        trainer.fit(model, loader())
    assert trainer.global_step == 8  # the second fit trained on
    assert overfit.result is first[0] and grads.result is first[1]  # neither ran again
    assert _preflight_lines(caplog) == [
        f"{name}: this fit continues the Trainer's run at step 4; the check runs only when a run starts "
        "(step 0): skipped."
        for name in ("OverfitBatchSanity", "GradientCheck")
    ]


def test_training_snapshot_restores_model_optimizer_scheduler_rng_and_progress() -> None:
    from lightning_gradguard.core.snapshot import TrainingSnapshot

    torch.manual_seed(0)
    model = Stochastic()
    trainer = make_trainer([], max_steps=3)
    trainer.fit(model, loader(shuffle=True))  # Adam and StepLR have state, progress counters moved
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    before = (trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped, sched.last_epoch)
    before_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.eval()
    snap = TrainingSnapshot(model, trainer=trainer)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    _ = (torch.rand(5), np.random.rand(5), random.random())  # move every RNG
    model.train()
    x, y = next(iter(loader()))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model.net(x), y).backward()
        opt.step()
        sched.step()
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.increment_completed()
    trainer.fit_loop.epoch_loop._batches_that_stepped += 5
    assert trainer.global_step != before[0]
    snap.restore()
    assert [m.training for m in model.modules()] == [False] * len(list(model.modules()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k]), k
    for k, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, before_opt[k][n]), (k, n)
    assert (
        trainer.global_step,
        trainer.fit_loop.epoch_loop._batches_that_stepped,
        sched.last_epoch,
    ) == before
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert (
        torch.equal(again[0], expected[0])
        and np.array_equal(again[1], expected[1])
        and again[2] == expected[2]
    )
    for p, g in zip(model.parameters(), before_grads, strict=True):  # the last real step's gradients
        assert g is not None and p.grad is not None and torch.equal(p.grad, g)


def test_training_snapshot_restores_torchmetrics_states() -> None:
    import torchmetrics

    from lightning_gradguard.core.snapshot import TrainingSnapshot

    holder = nn.Module()
    holder.metric = torchmetrics.MeanMetric()
    holder.metric.update(torch.tensor([1.0, 2.0]))
    snap = TrainingSnapshot(holder)
    holder.metric.update(torch.tensor([100.0]))
    assert float(holder.metric.compute()) == pytest.approx(103 / 3)
    snap.restore()
    assert float(holder.metric.compute()) == pytest.approx(1.5) and holder.metric._update_count == 1


class RandomLabelDataset(torch.utils.data.Dataset):
    """A pipeline bug: the label of sample i is looked up with a fresh random index on every access."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = torch.randint(0, 4, (64,), generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[int(torch.randint(0, 64, ()))]


@pytest.mark.parametrize("shuffle", [False, True])
def test_labels_drawn_independently_of_inputs_are_caught_by_a_second_draw(shuffle: bool) -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    trainer = make_trainer([check], max_steps=1)
    data = torch.utils.data.DataLoader(RandomLabelDataset(), batch_size=16, shuffle=shuffle)
    with pytest.raises(SanityCheckError, match="labels_unstable"):  # shuffle: the same indices are redrawn
        trainer.fit(Classifier(), data)
    assert check.result is not None and check.result.reached_target  # one fixed draw is memorisable
    (finding,) = [f for f in check.result.findings if f.kind == "labels_unstable"]
    assert finding.data["samples"] == 16 and finding.data["samples_changed"] >= 8
    # shuffling loader, same labels for the same inputs: no finding; augmented inputs: not judged
    torch.manual_seed(0)
    fine = OverfitBatchSanity()
    make_trainer([fine], max_steps=1).fit(Classifier(), loader(shuffle=True))
    assert fine.result is not None and fine.result.passed and not fine.result.findings
