"""StallDetector on real Trainer runs of a digits classifier with the failures of issue 16 built in (each
checked against what the run really did: weights that never moved, the LR the optimizer held, the clip
ratio recomputed by hand, the labels of the checked batches), and its rules on synthetic checks."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, reference_total_norm
from torch import nn

from lightning_gradguard.monitors.stall.callback import StallDetector
from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds, label_entropy
from lightning_gradguard.monitors.stall.rules import observe
from lightning_gradguard.monitors.stall.state import StallState

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def loader(sort: bool = False, batch_size: int = 32) -> Any:
    x, y = digits()
    if sort:
        order = torch.argsort(y, stable=True)
        x, y = x[order], y[order]
    data = torch.utils.data.TensorDataset(x, y)
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        data, batch_size=batch_size, shuffle=not sort, drop_last=True, generator=g
    )


class Digits(pl.LightningModule):
    """A 64-128-10 ReLU classifier; ``fault`` builds one failure in (``None``: a healthy run)."""

    def __init__(self, fault: str | None = None, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.fault, self.lr = fault, lr
        self.automatic_optimization = fault != "zero_grad_between"
        self.previous: torch.Tensor | None = None
        self.lrs: list[float] = []
        self.clip_ratios: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.fault == "shifted_targets":  # the previous batch's targets: an off-by-one in the pipeline
            y, self.previous = (self.previous if self.previous is not None else y), y
        loss = nn.functional.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            self.manual_backward(loss)
            opt.zero_grad()  # the bug: between backward and step
            opt.step()
        return loss

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.fault == "clip_1e-3":
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            raw = float(reference_total_norm(grads))
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1e-3)
            self.clip_ratios[self.trainer.global_step] = float(reference_total_norm(grads)) / raw

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=0.0 if self.fault == "clip_1e-3" else 0.9
        )
        schedules = {
            "steplr_per_step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.1),
            "lr_jump": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 100.0 if k >= 60 else 1.0),
            "warmup_in_samples": lambda o: torch.optim.lr_scheduler.LambdaLR(
                o, lambda k: min(1.0, k / 17970)
            ),
            None: lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=120),  # healthy: decays to 0
        }
        make = schedules.get(self.fault)
        if make is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make(opt), "interval": "step"}}


def fit(model: Digits, steps: int = 200, **kwargs: Any) -> StallDetector:
    detector = StallDetector()
    make_trainer([detector], max_steps=steps, max_epochs=-1, **kwargs).fit(
        model, loader(sort=model.fault == "sorted")
    )
    return detector


def kinds(detector: StallDetector) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in detector.alerts]


# ---------------------------------------------------------------------------------------------- real runs
def test_a_healthy_cosine_run_to_zero_lr_is_quiet() -> None:
    model = Digits()
    detector = fit(model, steps=120)
    assert model.lrs[-1] < 1e-3 * model.lrs[0]  # the LR really went to ~0 at the end
    assert detector.alerts == [] and detector.state.smoothed is not None and detector.state.smoothed < 0.3


def test_a_scheduler_stepping_per_batch_is_lr_decayed_early() -> None:
    """Named from the schedule read ahead, once steps 0-2 confirmed it (issue 38; by step 79 or 89 before,
    from the updates' collapse and a loss that stopped improving)."""
    model = Digits("steplr_per_step")
    detector = fit(model, steps=100)
    assert model.lrs[20] < 1e-3 * model.lrs[0]  # the premise: the LR is ~0 after 20 steps
    (alert,) = detector.alerts
    assert alert.kind == "lr_decayed" and alert.step == 2 and '"interval": "step"' in alert.hint
    assert alert.data["lr_max"] == pytest.approx(0.1)


def test_zero_grad_between_backward_and_step_is_no_update() -> None:
    model = Digits("zero_grad_between")
    before = [p.detach().clone() for p in model.parameters()]
    detector = fit(model, steps=60)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing moved
    # visible from step 0: named at the third check of the dense start (steps 0, 1, 2), not at step 19
    assert kinds(detector) == [("no_update", 2)] and "zero_grad" in detector.alerts[0].hint


def test_clipping_to_1e_3_in_a_hook_is_clipped_updates() -> None:
    model = Digits("clip_1e-3")
    detector = fit(model, steps=60)
    (alert,) = detector.alerts
    assert alert.kind == "clipped_updates" and alert.step == 2  # the dense start's third check
    # the ratio it read is the one the hook applied, measured by hand at the same step
    assert alert.data["clip_ratio"] == pytest.approx(model.clip_ratios[2], rel=1e-4)


def test_a_loader_sorted_by_class_is_sorted_labels() -> None:
    detector = fit(Digits("sorted"), steps=80)
    assert kinds(detector)[0][0] == "sorted_labels" and kinds(detector)[0][1] <= 40
    # the labels it counted are those of the checked batches (steps 0-4, 9, 19, ...): one class each
    _x, y = digits()
    ordered = torch.sort(y, stable=True).values
    expected = torch.zeros(10)
    for step in [*range(5), *range(9, 80, 10)]:
        at = step % (len(y) // 32)  # the epoch wraps around (drop_last)
        expected += torch.bincount(ordered[32 * at : 32 * (at + 1)], minlength=10).float()
    got = torch.tensor(detector.state.label_counts + [0.0] * (10 - len(detector.state.label_counts)))
    assert torch.equal(got, expected)


def test_shifted_targets_stay_at_chance_and_an_lr_jump_is_named() -> None:
    chance = fit(Digits("shifted_targets"), steps=90)
    # the second check from warmup_steps (40) on whose window (the three check intervals before) is flat
    assert kinds(chance)[0] == ("chance_level", 59)
    # the entropy of the labels seen: near log(10), digits being nearly balanced
    assert abs(chance.alerts[0].data["chance"] - math.log(10)) < 0.05

    jump = fit(Digits("lr_jump", lr=0.001), steps=80)
    assert kinds(jump)[0][0] == "lr_jump" and 50 <= kinds(jump)[0][1] <= 70
    assert jump.alerts[0].data["factor"] == pytest.approx(100.0)


def test_a_warmup_counted_in_samples_never_ends() -> None:
    model = Digits("warmup_in_samples")
    detector = fit(model, steps=130)
    assert max(model.lrs) < 0.01 * 0.1
    # read ahead over the 130 planned steps, judged once steps 0-2 used the LRs read ahead (step 19
    # before issue 38, when the pace of three checks had to show it)
    assert kinds(detector) == [("warmup_never_ends", 2)]
    alert = detector.alerts[0]
    assert alert.data["lr_max"] == pytest.approx(max(model.lrs), rel=1e-6)  # the schedule's own highest
    assert alert.data["share"] < 0.05 and "130 planned steps" in alert.message


# ---------------------------------------------------------------------------------------------- the rules
def check(step: int, **kw: Any) -> StallCheck:
    base: dict[str, Any] = {"lr": 0.1, "lr_max": 0.1, "lr_configured": 0.1, "loss": 1.0}
    return StallCheck(step=step, **{**base, **kw})


def test_label_entropy_is_the_loss_of_predicting_the_class_frequencies() -> None:
    counts = [30.0, 10.0, 0.0, 60.0]
    p = torch.tensor(counts) / sum(counts)
    brute = float(-(p[p > 0] * p[p > 0].log()).sum())
    assert label_entropy(counts) == pytest.approx(brute) and label_entropy([5.0] * 10) == pytest.approx(
        math.log(10)
    )


def test_each_kind_is_reported_once_and_a_symptom_after_a_cause_is_not() -> None:
    state = StallState(StallThresholds(patience=1, warmup_steps=0), num_classes=10)
    found = observe(state, check(0, update_total=0.0, update_ratios={"a": 0.0}, loss=math.log(10)))
    assert [f.kind for f in found] == ["no_update"]  # the loss is at chance too: a symptom
    assert observe(state, check(10, update_total=0.0, update_ratios={"a": 0.0}, loss=math.log(10))) == []


def test_a_converged_run_with_collapsed_updates_is_not_stalled() -> None:
    state = StallState(StallThresholds())
    found = []
    for i in range(60):  # the loss fell 100x, then the updates shrank 1000x at a steady LR
        ratio = 1e-3 if i < 20 else 1e-6
        loss = 2.0 * 0.8**i if i < 20 else 0.02
        found += observe(
            state, check(10 * i, loss=loss, update_ratios={"a": ratio, "b": ratio}, update_total=1.0)
        )
    assert found == []


def test_a_long_warmup_is_judged_against_the_planned_run() -> None:
    """A linear warm-up over 1000 steps: flagged in a 500-step run (it never ends there), quiet in a
    10 000-step run, where it ends at 10 % of the run."""
    found: dict[int, list[str]] = {}
    for planned in (500, 10_000):
        state = StallState(StallThresholds())
        found[planned] = []
        for step in range(0, 200, 10):
            lr = 0.1 * (step + 1) / 1000
            kinds = observe(state, check(step, lr=lr, lr_max=lr, lr_configured=0.1, planned_steps=planned))
            found[planned] += [f.kind for f in kinds]
    assert found == {500: ["warmup_never_ends"], 10_000: []}


def test_a_resumed_run_keeps_what_the_rules_remember(tmp_path: Any) -> None:
    """A sorted loader stopped at step 20 (pure checks counted, no alert yet) and resumed from its
    checkpoint: the streak, the label counts and the LR bookkeeping carry over, so the alert comes at the
    same step as in one uninterrupted run; the resumed run does not report it again afterwards."""
    whole = fit(Digits("sorted"), steps=60)
    first = StallDetector()
    trainer = make_trainer([first], max_steps=20, max_epochs=-1, default_root_dir=str(tmp_path))
    trainer.fit(Digits("sorted"), loader(sort=True))
    assert first.alerts == [] and first.state.streaks["sorted_labels"] >= 1
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = StallDetector()
    make_trainer([resumed], max_steps=60, max_epochs=-1, default_root_dir=str(tmp_path)).fit(
        Digits("sorted"), loader(sort=True), ckpt_path=str(ckpt)
    )
    assert kinds(resumed) == kinds(whole) == [("sorted_labels", 29)]
    # every checked batch counted, those before the checkpoint included (Lightning restarts a resumed
    # epoch's unshuffled loader at its beginning, so which classes they are differs)
    assert sum(resumed.state.label_counts) == sum(whole.state.label_counts) == 32 * (5 + 6)  # 0-4, 9-59


def test_ddp_ranks_pool_losses_and_labels_and_agree(tmp_path: Any) -> None:
    """2 processes (gloo), each rank its own shuffled batches of a shifted-target pipeline: every check's
    logged loss is the mean of both ranks' losses, the label counts are both ranks' checked batches, and
    both ranks raise chance_level at the same step."""
    import json

    from conftest import run_ddp_script

    proc = run_ddp_script("ddp_stall.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["alerts"] == ranks[1]["alerts"] and ranks[0]["alerts"][0][0] == "chance_level"
    assert ranks[0]["label_counts"] == ranks[1]["label_counts"]
    checks = sorted(int(s) for s in ranks[0]["logged"])
    assert checks == [*range(5), *range(9, 100, 10)]  # the dense start, then every 10
    counts = torch.zeros(10)
    for rank in ranks:
        for step, targets, _ in rank["seen"]:
            if step in checks:
                counts += torch.bincount(torch.tensor(targets), minlength=10).float()
    assert counts.tolist() == ranks[0]["label_counts"] + [0.0] * (10 - len(ranks[0]["label_counts"]))
    previous = -1
    for check in checks:  # the losses since the previous check, over both ranks
        losses = [loss for rank in ranks for step, _, loss in rank["seen"] if previous < step <= check]
        logged = ranks[0]["logged"][str(check)]["stall/loss"]
        assert logged == pytest.approx(sum(losses) / len(losses), rel=1e-5), check
        previous = check


class WeightsAround(pl.Callback):
    """Each layer's weights before and after every optimizer step, and the gradient before clipping."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.ratios: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        layers: dict[str, list[float]] = {}
        for n, p in pl_module.named_parameters():
            acc = layers.setdefault(n.rsplit(".", 1)[0], [0.0, 0.0])
            acc[0] += float((p.detach() - self.before[n]).double().square().sum())
            acc[1] += float(self.before[n].double().square().sum())
        self.ratios[trainer.global_step - 1] = {k: math.sqrt(u / w) for k, (u, w) in layers.items()}


def test_the_update_ratios_it_judges_are_the_layers_own() -> None:
    """A 64-2048-10 MLP: the 2048x64 layer (131 072 entries) is measured on a strided sample, within 3 %
    of its exact ratio; the bias vectors and the head exactly; and the median it logs is theirs."""
    model = Digits()
    model.net = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 10))
    brute, detector = WeightsAround(), StallDetector(check_every_n_steps=5)
    make_trainer([brute, detector], max_steps=10, max_epochs=-1).fit(model, loader())
    check = detector.last_check
    assert check is not None and check.step == 9 and set(check.update_ratios) == {"net.0", "net.2"}
    exact = brute.ratios[9]
    assert check.update_ratios["net.0"] == pytest.approx(exact["net.0"], rel=0.03)  # measured: 1.3 %
    assert check.update_ratios["net.2"] == pytest.approx(exact["net.2"], rel=1e-4)
    median = sorted(check.update_ratios.values())
    assert detector.last_logged["stall/update_ratio_median"] == pytest.approx((median[0] + median[1]) / 2)
    assert detector.last_logged["stall/clip_ratio"] == pytest.approx(1.0)  # no clipping here


class RawLosses(Digits):
    """Records each micro-batch's loss as training_step returns it, by optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.raw.append((self.trainer.global_step, float(loss)))
        return loss


def test_under_accumulation_the_check_loss_is_the_mean_of_the_micro_batch_losses() -> None:
    """Lightning hands on_train_batch_end the loss divided by accumulate_grad_batches: the check's loss
    is the mean of the losses training_step returned since the previous check, not a third of it."""
    model, detector = RawLosses(), StallDetector(check_every_n_steps=5)
    make_trainer([detector], max_steps=10, max_epochs=-1, accumulate_grad_batches=3).fit(model, loader())
    since = [loss for step, loss in model.raw if 4 < step <= 9]
    assert len(since) == 15
    assert detector.last_logged["stall/loss"] == pytest.approx(sum(since) / len(since), rel=1e-5)


def test_weight_decay_collapse_is_still_named_from_the_weight_norms_without_a_reading_ahead() -> None:
    """The rule's second way in (a decay set after the start, a schedule that cannot be read ahead): the
    decayed layers' norms falling 10x below their highest, lower at every check, the decay's part of the
    update larger than the rest, on 3 checks in a row, the loss stuck far from done."""
    state = StallState(StallThresholds(), num_classes=10)
    fired = {}
    for i in range(12):
        w = 0.5**i
        c = check(
            10 * i,
            lr=1e-3,
            lr_max=1e-3,
            lr_configured=1e-3,
            loss=2.0,
            weight_norms={"a": w, "b": 2 * w},
            decay={"a": (0.1 * w, 0.01 * w), "b": (0.2 * w, 0.02 * w)},
            decay_groups=[(1e-3, 100.0)],
        )
        fired.update({f.kind: c.step for f in observe(state, c)})
    # the norms are 10x below their highest from the fifth check (step 40) on, 3 checks in a row at 60
    assert fired == {"weight_decay_collapse": 60}
