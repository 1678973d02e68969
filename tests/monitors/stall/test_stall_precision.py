"""StallDetector on 16-bit weights (issue 24, "diagnosis at onset": the mixed-precision fault).

Under ``Trainer(precision="bf16-true")`` the weights themselves are bfloat16 (8 significant bits): a step
under half the gap between two neighbouring values (under 0.2-0.39 % of ``|w|``) rounds back to the old
value. Adam's per-entry step is about its LR, so at ``lr=1e-4`` every weight with ``|w|`` above ~0.026 never
moves: on the digits MLP below (64-128-64-10, ReLU) 69-70 % of the entries with a gradient keep their value
on the very first step, 82-86 % from step 9 on, on 3 seeds. The run is harmed: after 200 steps its mean
loss over the last 10 steps is 2.21-2.23 against 1.84-1.88 for the same run under ``"bf16-mixed"`` (float32
weights), on seeds 0-2.

Each run is checked against an independent count (:class:`Rounded`: every weight and gradient copied before
the step, compared after it, whole tensors) and stands next to its healthy twins, which stay quiet: the same
run under ``"bf16-mixed"``, bf16-true at LRs that train (Adam 1e-2, SGD 0.1 with momentum), float32, and
bf16-true models whose unchanged entries have no gradient (dead ReLU units; a layer in a param group with
LR 0): a rule that counted every unchanged entry would flag those.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, make_trainer
from torch import nn

from lightning_gradguard.core.stats import UpdateSample
from lightning_gradguard.functional.updates import dtype_spacing
from lightning_gradguard.monitors.stall.callback import StallDetector
from lightning_gradguard.monitors.stall.check import Rounding, StallCheck, StallThresholds
from lightning_gradguard.monitors.stall.rules import observe
from lightning_gradguard.monitors.stall.state import StallState

sys.path.insert(0, str(ROOT / "examples"))

from zoo import ZooModule, digits

pytestmark = pytest.mark.filterwarnings("ignore:.*(does not have many workers|precision).*")


class Rounded(pl.Callback):
    """On every check step of StallDetector's default cadence, the share of the 16-bit weight entries with
    a non-zero gradient that did not change, and the share of all their entries that did not change (what
    a rule blind to the gradient would count), from whole copies taken before the step."""

    def __init__(self) -> None:
        self.lost: dict[int, float] = {}
        self.unchanged: dict[int, float] = {}
        self._before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        step = trainer.global_step
        if step < 5 or (step + 1) % 10 == 0:  # the dense start, then every 10
            self._before = [
                (p, p.detach().clone(), p.grad.detach().clone())
                for p in pl_module.parameters()
                if p.grad is not None and p.dtype in (torch.bfloat16, torch.float16)
            ]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._before:
            return
        graded = lost = unchanged = total = 0
        for p, w, g in self._before:
            same = p.detach() == w
            graded += int((g != 0).sum())
            lost += int(((g != 0) & same).sum())
            unchanged += int(same.sum())
            total += p.numel()
        step = trainer.global_step - 1
        self.lost[step] = lost / graded if graded else 0.0
        self.unchanged[step] = unchanged / total
        self._before = []


def mlp(seed: int = 0, dead: bool = False, frozen: bool = False) -> nn.Sequential:
    """The digits MLP (64-128-64-10, ReLU); ``dead``: 96 of the 128 first-layer units never fire (bias
    -20); ``frozen``: the first layer does not train (``requires_grad=False``)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        if dead:
            net[0].bias[:96] = -20.0
    if frozen:
        net[0].requires_grad_(False)
    return net


def adam(lr: float) -> Any:
    return lambda params: torch.optim.Adam(params, lr=lr)


def sgd(lr: float, momentum: float = 0.0) -> Any:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def fit(
    net: nn.Module, make_optimizer: Any, precision: str, steps: int
) -> tuple[ZooModule, StallDetector, Rounded]:
    model, stall, rounded = ZooModule(net, make_optimizer), StallDetector(), Rounded()
    trainer = make_trainer([stall, rounded], precision=precision, max_steps=steps, max_epochs=-1)
    trainer.fit(model, digits())
    return model, stall, rounded


def kinds(stall: StallDetector) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in stall.alerts]


def final(model: ZooModule) -> float:
    return sum(model.losses[-10:]) / 10


def test_bf16_true_weights_with_adam_at_1e_4_are_named_at_the_third_check() -> None:
    model, stall, rounded = fit(mlp(), adam(1e-4), "bf16-true", 200)
    assert kinds(stall) == [("update_below_precision", 2)]  # checks 0, 1, 2: patience 3; nothing else
    alert = stall.alerts[0]
    assert (alert.severity, alert.where) == ("warning", "precision")
    # the rule's share is the share of the (whole, unsampled) entries counted independently
    assert [rounded.lost[s] for s in (0, 9, 19)] == pytest.approx([0.69, 0.82, 0.83], abs=0.02)
    assert min(rounded.lost[s] for s in (0, 1, 2)) > 0.6  # over rounding_share (0.5) from the first check
    assert alert.data["share"] == pytest.approx(rounded.lost[2], abs=1e-6)
    assert alert.data["lr"] == pytest.approx(1e-4)
    assert alert.data["relative_spacing"] == 2.0**-7
    # the typical |w| (~0.05: nn.Linear's init) sits where bfloat16 values are 2**-12 apart; a step there
    # must exceed 2**-13 = 1.2e-4, more than Adam's ~1e-4
    assert alert.data["spacing"] == spacing(alert.data["weight"], torch.bfloat16) == 2.0**-12
    assert 0.04 < alert.data["weight"] < 0.07 and alert.data["update"] < alert.data["spacing"] / 2
    share = f"{rounded.lost[2]:.0%} of the bfloat16 weight entries"  # the share Rounded counted
    for words in (share, "8 significant bits", "0.39%", "LR 0.0001"):
        assert words in alert.message
    assert 'precision="bf16-mixed"' in alert.hint and "stochastic" in alert.hint
    # harmful: the same run with float32 weights learns far more in the same steps
    twin, quiet, _ = fit(mlp(), adam(1e-4), "bf16-mixed", 200)
    assert quiet.alerts == [] and quiet.last_check is not None and quiet.last_check.rounding is None
    assert final(model) > 2.15 and final(twin) < 1.95  # measured: 2.23 vs 1.88


@pytest.mark.parametrize(
    ("name", "build", "steps", "trained"),
    [
        ("adam_1e-2", lambda: (mlp(), adam(1e-2)), 100, 0.3),  # loss 0.10-0.13 at step 100
        ("sgd_0.1_momentum", lambda: (mlp(), sgd(0.1, 0.9)), 100, 0.45),  # 0.2-0.3
        ("dead_units_adam_1e-2", lambda: (mlp(dead=True), adam(1e-2)), 100, 0.3),
        ("frozen_first_layer", lambda: (mlp(frozen=True), adam(1e-2)), 100, 0.5),
    ],
)
def test_bf16_true_runs_that_train_are_quiet(name: str, build: Any, steps: int, trained: float) -> None:
    net, make_optimizer = build()
    model, stall, rounded = fit(net, make_optimizer, "bf16-true", steps)
    assert kinds(stall) == [] and final(model) < trained
    c = stall.last_check
    assert c is not None and c.rounding is not None and c.rounding.dtype == torch.bfloat16
    assert c.rounding.share == pytest.approx(rounded.lost[c.step], abs=1e-6)
    assert max(rounded.lost.values()) < 0.45  # measured 0.20-0.40 at step 0 under SGD, < 0.35 after
    if name == "dead_units_adam_1e-2":  # the dead units' entries have no gradient and never change:
        assert min(rounded.unchanged.values()) > 0.5  # a rule blind to the gradient would count them


class _DropsCheckSteps(pl.Callback):
    """Drops the update of every StallDetector check step, as LossSpikeGuard's skip does (after the
    detector sampled the gradients)."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        from lightning_gradguard.core.skips import skip_update

        step = trainer.global_step
        if step < 5 or (step + 1) % 10 == 0:  # the dense start, then every 10
            skip_update(trainer, optimizer, "loss_spike")


def test_an_update_another_callback_dropped_is_not_rounded_away() -> None:
    """Regression: a dropped update leaves every weight unchanged although its gradient was sampled; on
    three check steps in a row that read as 100 % rounded away on a healthy bf16-true run (and, once that
    was fixed, as no_update: the same blind spot, for any dtype). A check whose update another callback
    dropped judges its loss, not its update."""
    model, stall = ZooModule(mlp(), adam(1e-2)), StallDetector()
    trainer = make_trainer([stall, _DropsCheckSteps()], precision="bf16-true", max_steps=40, max_epochs=-1)
    trainer.fit(model, digits())
    assert kinds(stall) == []
    c = stall.last_check
    assert c is not None and c.rounding is None and c.update_total is None  # not judged
    assert c.loss is not None  # the loss still is


def test_a_param_group_with_lr_0_is_not_counted() -> None:
    """The first two layers in a group with LR 0: their entries have gradients and never change (99 % of
    the entries), yet nothing rounds them away; the head trains at Adam 1e-2."""
    net = mlp()

    def groups(params: Any) -> torch.optim.Optimizer:
        head = list(net[4].parameters())
        body = [p for p in net.parameters() if all(p is not h for h in head)]
        return torch.optim.Adam([{"params": body, "lr": 0.0}, {"params": head, "lr": 1e-2}])

    _, stall, rounded = fit(net, groups, "bf16-true", 40)
    assert kinds(stall) == [] and min(rounded.lost.values()) > 0.9  # counted blind to the LR: all lost
    c = stall.last_check
    assert c is not None and c.rounding is not None and c.rounding.parameters == 2  # the head only


def test_a_converged_bf16_true_run_whose_late_steps_round_away_is_quiet() -> None:
    """Adam 1e-3 trains (loss ~0.1 by step 150) and then its steps shrink below bfloat16's resolution: from
    step ~120 over half the entries keep their value. The run learned: the rule judges only while the loss
    is above half its first value."""
    model, stall, rounded = fit(mlp(), adam(1e-3), "bf16-true", 200)
    late = [s for s, share in rounded.lost.items() if share > 0.5]
    assert len(late) >= 3 and final(model) < 0.3
    assert kinds(stall) == []


def test_float32_models_cost_nothing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = UpdateSample.sample_grads
    monkeypatch.setattr(UpdateSample, "sample_grads", lambda self, g: calls.append(1) or original(self, g))
    _, stall, rounded = fit(mlp(), adam(1e-4), "32-true", 30)
    assert kinds(stall) == [] and not stall._low_precision and rounded.lost == {}
    assert stall.last_check is not None and stall.last_check.rounding is None and calls == []
    _, stall, _ = fit(mlp(), adam(1e-4), "bf16-true", 10)
    assert stall._low_precision and len(calls) == 6  # the gradients sampled on the checks only: 0-4, 9


def test_float16_weights_are_named_with_their_own_resolution() -> None:
    """``"16-true"``, plain SGD at 1e-3: steps of ~1e-6 against float16's gap of 2**-15 at |w| ~0.05."""
    _, stall, rounded = fit(mlp(), sgd(1e-3), "16-true", 20)
    assert kinds(stall) == [("update_below_precision", 2)]
    alert = stall.alerts[0]
    assert alert.data["share"] == pytest.approx(rounded.lost[2], abs=1e-6) and alert.data["share"] > 0.85
    assert alert.data["relative_spacing"] == 2.0**-10
    assert "float16" in alert.message and "11 significant bits" in alert.message


def rounding(share: float, graded: float = 1000.0) -> Rounding:
    return Rounding(
        dtype=torch.bfloat16,
        parameters=3,
        graded=graded,
        lost=share * graded,
        update=1e-4,
        weight=0.05,
        lost_weight=0.06,
    )


def check(step: int, loss: float, share: float, update_total: float = 1.0) -> StallCheck:
    return StallCheck(
        step=step,
        lr=1e-4,
        lr_max=1e-4,
        lr_configured=1e-4,
        loss=loss,
        update_total=update_total,
        rounding=rounding(share),
    )


def test_the_rule_wants_patience_a_majority_and_a_loss_still_high() -> None:
    state = StallState(StallThresholds())
    found = [observe(state, check(s, 2.3, share)) for s, share in ((0, 0.9), (9, 0.9), (19, 0.5), (29, 0.6))]
    assert found == [[], [], [], []]  # 0.5 is not more than half: the streak starts again
    found = [observe(state, check(s, 2.3, 0.6)) for s in (39, 49)]
    assert [f.kind for f in found[-1]] == ["update_below_precision"]
    learned = StallState(StallThresholds())
    for s, loss in ((0, 2.3), (9, 0.5), (19, 0.3), (29, 0.2), (39, 0.2), (49, 0.2)):
        assert observe(learned, check(s, loss, 0.9 if s > 0 else 0.0)) == []


def test_updates_all_rounded_away_are_not_missing_gradients() -> None:
    """An LR so small that no entry moves: every update is exactly 0, and the gradients were there."""
    state = StallState(StallThresholds())
    found = [observe(state, check(s, 2.3, 1.0, update_total=0.0)) for s in (0, 9, 19, 29)]
    assert [f.kind for fs in found for f in fs] == ["update_below_precision"]


def test_updates_that_stop_later_for_another_reason_are_still_no_update() -> None:
    """Regression: once update_below_precision had fired, no_update stayed silent for the rest of the run,
    even after the rounding streak ended and every update became exactly 0 (the gradients gone)."""
    shares = [0.9, 0.9, 0.9, 0.9, *[None] * 4]
    state = StallState(StallThresholds())
    found = []
    for i, share in enumerate(shares):
        step = 10 * i + 9 if i else 0
        if share is None:  # nothing moves any more, and no 16-bit entry had a gradient
            c = replace(check(step, 2.3, 0.0, update_total=0.0), rounding=rounding(0.0, graded=0.0))
        else:
            c = check(step, 2.3, share)
        found += [(step, f.kind) for f in observe(state, c)]
    assert [kind for _, kind in found][:2] == ["update_below_precision", "no_update"], found


def spacing(value: float, dtype: torch.dtype) -> float:
    return float(dtype_spacing(torch.tensor(value), dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [1.0, 0.0517578125, 0.75, 3e-3, 300.0])
def test_spacing_is_the_gap_to_the_next_representable_value(dtype: torch.dtype, value: float) -> None:
    x = torch.tensor(value, dtype=dtype)
    bits = torch.int16
    up = (x.view(bits) + 1).view(dtype)  # the next value away from zero (positive x)
    assert spacing(float(x), dtype) == float(up.double() - x.double())
    assert math.isclose(spacing(-float(x), dtype), spacing(float(x), dtype))


def test_a_grad_scaler_backing_off_is_not_a_run_without_updates() -> None:
    """16-mixed with a real GradScaler (on the CPU, as on a GPU): the scaler skips its first steps while its
    scale backs off (here from 1e8: nine skips), as it always does from its start; the dense start used to
    read those steps as no_update at step 2. Issue 38: the early rules read the step's facts."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e8)
    stall = StallDetector()
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model = ZooModule(net, lambda params: torch.optim.AdamW(params, lr=1e-3))
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    make_trainer([stall], max_steps=20, plugins=[plugin]).fit(model, digits())
    skipped = round(math.log2(1e8 / scaler.get_scale()))
    assert 5 <= skipped < 20  # the premise: the dense start (steps 0-4) was skipped, then the run updated
    assert model.losses[-1] < model.losses[skipped]  # and learned once the scaler let it
    assert not [a.format() for a in stall.alerts], "a scaler's back-off is no stall"
