"""GradientCheck and the gradcheck math: deliberately wrong custom autograd Functions are found and named,
correct ones pass, and neither the model nor the RNG is disturbed."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gradguard import (
    GradientCheck,
    SanityCheckError,
    find_custom_functions,
    gradient_check,
)
from lightning_gradguard.functional import gradcheck
from lightning_gradguard.functional.gradcheck import (
    finite_difference_check,
    observed_order,
    relative_error,
    sample_coordinates,
    taylor_test,
)
from tests.conftest import make_trainer, random_loader


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers without a logger write their alert file to the working directory: keep it in tmp_path."""
    monkeypatch.chdir(tmp_path)


# ------------------------------------------------------------------------- custom Functions under test


class LinearFn(torch.autograd.Function):
    """y = x W^T + b with a hand-written backward; ``bug`` selects a deliberate mistake."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bug: str | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bug = bug
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        grad_x = grad_out @ w
        grad_w = grad_out.t() @ x
        if ctx.bug == "missing_factor":
            grad_w = 0.5 * grad_w
        if ctx.bug == "wrong_transpose":  # (x^T g) instead of (g^T x): same shape for a square W
            grad_w = x.t() @ grad_out
        if ctx.bug == "wrong_input_grad":
            grad_x = grad_out @ w.t()
        return grad_x, grad_w, grad_out.sum(0), None


class CustomLinear(nn.Module):
    def __init__(self, size: int, bug: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size) / size**0.5)
        self.bias = nn.Parameter(torch.randn(size) * 0.1)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearFn.apply(x, self.weight, self.bias, self.bug)


class SoftplusFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bug: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.bug = bug
        return nn.functional.softplus(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        slope = torch.sigmoid(x)
        return grad_out * (slope * 2 if ctx.bug else slope), None


class CustomSoftplus(nn.Module):
    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SoftplusFn.apply(x, self.bug)


def net(bug: str | None = None, act_bug: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), CustomSoftplus(act_bug), CustomLinear(8, bug), nn.Tanh(), nn.Linear(8, 3)
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def ce(model: nn.Module, b: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b[0]), b[1])


# ------------------------------------------------------------------------- pure math


def test_relative_error_formula() -> None:
    assert relative_error(1.0, 1.0) == 0.0
    assert relative_error(2.0, 1.0) == pytest.approx(0.5)
    assert relative_error(-1.0, 1.0) == pytest.approx(2.0)
    assert relative_error(1e-12, 0.0) == pytest.approx(1e-4)  # |a-n| / tiny
    assert relative_error(math.nan, 1.0) == math.inf
    with pytest.raises(ValueError, match="`tiny`"):
        relative_error(1.0, 1.0, tiny=0.0)


def test_taylor_order_is_two_for_the_true_gradient_and_one_for_a_wrong_one() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64, generator=g)
    x = torch.randn(7, 4, dtype=torch.float64, generator=g)

    def loss() -> torch.Tensor:
        return torch.tanh(x @ w.t()).pow(2).mean()

    true_grad = (2 * torch.tanh(x @ w.t()) * (1 - torch.tanh(x @ w.t()) ** 2)).t() @ x / x.shape[0] / 5
    w_before = w.clone()
    good = taylor_test(loss, [w], [true_grad], generator=torch.Generator().manual_seed(1))
    bad = taylor_test(loss, [w], [true_grad * 0.9], generator=torch.Generator().manual_seed(1))
    assert torch.equal(w, w_before)  # restored bit for bit
    assert good.passed and good.order == pytest.approx(2.0, abs=0.05)
    assert not bad.passed and bad.order == pytest.approx(1.0, abs=0.1)
    # 10 % missing: the linear part of the remainder is 0.1 <g, v> against a claimed 0.9 <g, v>
    assert bad.linear_error == pytest.approx(0.1 / 0.9, rel=0.05) and good.linear_error < 1e-3
    assert len(good.remainders) == len(good.hs) == 6 and good.evaluations == 7
    # the remainder of the true gradient is h^2 * v^T H v / 2: ratio 4 between successive halvings
    ratios = [a / b for a, b in zip(good.remainders, good.remainders[1:], strict=False)]
    assert ratios[-1] == pytest.approx(4.0, rel=0.05)


def test_taylor_remainder_at_rounding_level_passes_without_an_order() -> None:
    w = torch.randn(3, dtype=torch.float64)
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    result = taylor_test(lambda: (c * w).sum(), [w], [c])  # linear: the Taylor remainder is exactly 0
    assert result.passed and math.isnan(result.order)
    assert observed_order([1.0, 0.5], [1.0, 0.25]) == pytest.approx(2.0)
    assert math.isnan(observed_order([1.0, 0.5], [1e-20, 1e-20], floor=1e-15))


def test_finite_differences_match_a_closed_form_gradient() -> None:
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, -1.0, 2.0], [0.1, 0.0, -0.3]], dtype=torch.float64)

    def loss() -> torch.Tensor:
        return (a * w**3).sum()

    exact = 3 * a * w**2  # independent of autograd
    idx = list(range(6))
    ok = finite_difference_check(loss, w, exact, idx)
    assert ok.max_error < 1e-8 and ok.evaluations == 13
    assert ok.numeric == pytest.approx(exact.reshape(-1).tolist(), rel=1e-8, abs=1e-9)
    wrong = exact.clone()
    wrong[1, 2] *= 3
    bad = finite_difference_check(loss, w, wrong, idx)
    # 2/3 against the symmetric difference; the one-sided differences, O(eps) apart, lie a hair closer
    assert bad.indices[bad.worst] == 5 and bad.max_error == pytest.approx(2 / 3, rel=1e-5)


def test_sample_coordinates_takes_the_largest_then_random_distinct_ones() -> None:
    grad = torch.zeros(100)
    grad[[7, 42, 99]] = torch.tensor([5.0, -9.0, 1.0])
    idx = sample_coordinates(grad, 100, 6, torch.Generator().manual_seed(0))
    assert idx[:3] == [42, 7, 99] and len(set(idx)) == 6
    assert sorted(sample_coordinates(grad[:3], 3, 10)) == [0, 1, 2]
    assert sorted(sample_coordinates(None, 3, 10)) == [0, 1, 2]


def kinked_relu_units(n: int = 40) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
    """``L(θ) = |θ|²/2 + Σ_j c_j relu(u_j·θ + b_j)``, its exact gradient and a direction ``v`` along which two
    hidden units switch on or off at ``h = 2e-4`` and ``h = 3e-3``: inside the range of a Taylor test with
    ``h0 = 1e-2`` (down to 3.1e-4), outside that of one with ``h0 = 1e-4``."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(n, dtype=torch.float64, generator=g)
    u = torch.randn(24, n, dtype=torch.float64, generator=g) / n**0.5
    b = torch.randn(24, dtype=torch.float64, generator=g)
    c = torch.rand(24, dtype=torch.float64, generator=g) + 0.5

    def loss() -> torch.Tensor:
        return 0.5 * (theta**2).sum() + (c * torch.relu(u @ theta + b)).sum()

    def grad() -> torch.Tensor:  # by hand, not by autograd
        return theta + u.t() @ (c * (u @ theta + b > 0).double())

    g0, r = grad(), torch.randn(n, dtype=torch.float64, generator=g)
    v = g0 / g0.norm() + r / r.norm()
    v = v / v.norm()
    for j, h in ((0, 2e-4), (1, 3e-3)):
        u[j] = 2.0 * v + 0.1 * u[j]
        b[j] = -(u[j] @ (theta + h * v))  # unit j's kink at theta + h v
    return theta, loss, grad(), v


def test_a_taylor_miss_on_kinks_is_settled_by_smaller_steps_or_inconclusive_never_a_failure() -> None:
    theta, loss, g, v = kinked_relu_units()
    before = theta.clone()
    plain = taylor_test(loss, [theta], [g], direction=[v])
    assert not plain.passed and plain.order < 1.5 and plain.linear_error > 1e-2  # the kink at 2e-4
    check = gradcheck.taylor_check(loss, [theta], [g], direction=[v])
    assert check.passed and not check.inconclusive and check.h0s == [1e-2, 1e-4]
    # the directional finite difference agrees; the retry, clear of both kinks, sees the curvature |v|² = 1
    assert check.directional is not None and check.directional.error < 1e-8
    assert check.taylor.order == pytest.approx(2.0, abs=0.01)
    assert check.taylor.remainders[0] == pytest.approx(0.5 * 1e-4**2, rel=1e-4)
    assert check.evaluations == 7 + 2 + 6  # L(θ) is not evaluated again for the retry
    assert torch.equal(theta, before)
    # without retries (no budget left) the miss stays unexplained: inconclusive, passed, never failed
    alone = gradcheck.taylor_check(loss, [theta], [g], direction=[v], retries=0)
    assert alone.passed and alone.inconclusive and alone.h0s == [1e-2] and alone.evaluations == 9


def test_a_wrong_gradient_on_a_kinked_function_still_fails_on_the_directional_difference() -> None:
    theta, loss, g, v = kinked_relu_units()
    wrong = g.clone()
    wrong[20:] *= 0.5  # wrong only where the coordinate check below does not look
    coords = finite_difference_check(loss, theta, wrong, list(range(6)))
    assert coords.max_error < 1e-6  # blind to it
    check = gradcheck.taylor_check(loss, [theta], [wrong], direction=[v])
    assert not check.passed and not check.inconclusive and check.directional is not None
    expected = abs(float((wrong - g) @ v)) / max(abs(float(wrong @ v)), abs(float(g @ v)))
    assert expected > 0.05 and check.directional.error == pytest.approx(expected, rel=1e-4)
    # the directional difference is taken again at 1/100 and 1/10000 of its step (a kink within ε could
    # explain a miss) and stays wrong at each; no Taylor retry for a gradient proven wrong
    assert check.h0s == [1e-2] and check.evaluations == 7 + 3 * 2
    # the directional difference alone, on a smooth function: exact up to O(ε²)
    x = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    d = [torch.tensor([0.6, 0.0, 0.8], dtype=torch.float64)]
    smooth = gradcheck.directional_difference(lambda: torch.exp(x).sum(), [x], [torch.exp(x)], d)
    assert smooth.error < 1e-8 and smooth.numeric == pytest.approx(float(torch.exp(x) @ d[0]), rel=1e-9)
    with pytest.raises(ValueError, match="`retries`"):
        gradcheck.taylor_check(loss, [theta], [g], retries=-1)


# ------------------------------------------------------------------------- detection


def test_custom_functions_are_attributed_to_the_module_that_applies_them() -> None:
    model = net()
    x, _ = batch()
    found = find_custom_functions(model, lambda: model(x))
    assert found == {"1": ["SoftplusFn"], "2": ["LinearFn"]}

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return SoftplusFn.apply(self.inner(x), False)  # applied by Outer itself

    outer = Outer()
    assert find_custom_functions(outer, lambda: outer(x)) == {
        "": ["SoftplusFn"],
        "inner.1": ["SoftplusFn"],
        "inner.2": ["LinearFn"],
    }
    plain = nn.Sequential(nn.Linear(6, 3), nn.ReLU())
    assert find_custom_functions(plain, lambda: plain(x)) == {}


# ------------------------------------------------------------------------- gradient_check


def test_correct_custom_functions_pass() -> None:
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    result = gradient_check(model, batch(), ce)
    assert result.passed and not result.failures
    assert result.targets == ["1", "2"]
    # the custom layer's own parameters and everything upstream of the custom Functions
    assert [p.name for p in result.parameters] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(p.max_rel_error < 1e-5 for p in result.parameters)
    assert all(p.taylor_order == pytest.approx(2.0, abs=0.2) for p in result.parameters)
    assert all(p.checked for p in result.parameters)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():  # the model itself is untouched (float32, same values)
        assert v.dtype == before[k].dtype and torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bug", ["missing_factor", "wrong_transpose"])
def test_wrong_weight_gradient_is_found_and_named(bug: str) -> None:
    result = gradient_check(net(bug), batch(), ce)
    assert not result.passed
    assert [p.name for p in result.failures] == ["2.weight"]
    (bad,) = result.failures
    assert bad.max_rel_error > 1e-2 and bad.taylor_order < 1.5
    if bug == "missing_factor":
        assert bad.max_rel_error == pytest.approx(0.5, rel=1e-4)
        assert bad.analytic == pytest.approx(0.5 * bad.numeric, rel=1e-4)
    assert bad.worst_index is not None and len(bad.worst_index) == 2


def test_wrong_input_gradients_show_upstream() -> None:
    result = gradient_check(net("wrong_input_grad"), batch(), ce)
    assert {p.name for p in result.failures} == {"0.weight", "0.bias"}
    result = gradient_check(net(act_bug=True), batch(), ce)  # a parameter-free custom activation
    assert {p.name for p in result.failures} == {"0.weight", "0.bias"}


def test_without_custom_functions_everything_is_checked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    result = gradient_check(model, batch(), ce, max_samples=8)
    assert result.passed and result.targets == [""]
    assert [p.name for p in result.parameters] == [n for n, _ in model.named_parameters()]


def test_backward_hook_that_rescales_is_a_target_and_is_caught() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model[2].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 3,))
    result = gradient_check(model, batch(), ce)
    assert result.hooked_modules == ["2"] and result.targets == ["2"]
    assert {p.name for p in result.failures} == {"0.weight", "0.bias"}


def test_user_chosen_modules_and_the_evaluation_budget() -> None:
    result = gradient_check(net(), batch(), ce, modules=["4"])
    assert [p.name for p in result.parameters] == ["4.weight", "4.bias"]  # a standard layer: its own
    tanh = gradient_check(net(), batch(), ce, modules=["3"])  # parameter-free: everything upstream of it
    assert [p.name for p in tanh.parameters] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # max_evaluations alone (max_seconds=None): the evaluations the time budget is sized on are not spent
    small = gradient_check(
        net(), batch(), ce, modules=[""], max_evaluations=50, samples_per_tensor=6, max_seconds=None
    )
    assert small.evaluations <= 50 and small.skipped
    assert all(len(p.checked) == 1 for p in small.parameters)
    assert len(small.parameters) + len(small.skipped) == 6
    with pytest.raises(ValueError, match="`modules`"):
        gradient_check(net(), batch(), ce, modules=["nope"])


def test_plain_module_needs_a_loss_fn() -> None:
    with pytest.raises(ValueError, match="`loss_fn`"):
        gradient_check(net(), batch())


# ------------------------------------------------------------------------- callback


class Lit(pl.LightningModule):
    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.net = net(bug)

    def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
        loss = ce(self.net, b)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> Any:
    x, y = batch()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)


def test_callback_raises_naming_the_parameter() -> None:
    check = GradientCheck()
    with pytest.raises(SanityCheckError) as err:
        make_trainer([check]).fit(Lit("missing_factor"), loader())
    assert [a.kind for a in err.value.alerts] == ["gradient_mismatch"]
    alert = err.value.alerts[0]
    assert alert.where == "net.2.weight" and alert.data["relative_error"] == pytest.approx(0.5, rel=1e-3)
    assert "net.2.weight" in str(err.value) and "Taylor order" in str(err.value)
    assert check.result is not None and check.result.targets == ["net.1", "net.2"]


def test_callback_passes_and_leaves_the_run_bit_identical() -> None:
    def run(callbacks: list[Any]) -> dict[str, torch.Tensor]:
        pl.seed_everything(7, verbose=False)
        model = Lit()
        make_trainer(callbacks, max_epochs=2).fit(model, loader())
        return {k: v.clone() for k, v in model.state_dict().items()}

    check = GradientCheck()
    with_check, without = run([check]), run([])
    assert check.result is not None and check.result.passed and not check.alerts
    assert check.result.evaluations > 20
    for k in without:
        assert torch.equal(with_check[k], without[k]), k


def test_callback_says_in_one_info_line_that_it_passed(caplog: pytest.LogCaptureFixture) -> None:
    check = GradientCheck()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([check], max_steps=1).fit(Lit(), loader())
    result = check.result
    assert result is not None and result.passed
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GradientCheck")]
    worst = max(p.max_rel_error for p in result.parameters)
    assert line.startswith("GradientCheck: passed - 4 parameter tensors (targets 'net.1', 'net.2') checked")
    assert f"largest relative error {worst:.1e}" in line and "float64" in line and "inconclusive" not in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):  # a failure says no such thing
        make_trainer([GradientCheck(action="warn")], max_steps=1).fit(Lit("missing_factor"), loader())
    assert not [r for r in caplog.records if "GradientCheck: passed" in r.getMessage()]


def test_the_passed_line_names_inconclusive_taylor_tests() -> None:
    from lightning_gradguard import GradientCheckResult, ParameterCheck
    from lightning_gradguard.monitors.gradcheck.findings import passed_line

    def param(name: str, error: float, inconclusive: bool) -> ParameterCheck:
        return ParameterCheck(
            name, 10, [0], error, (0,), 1.0, 1.0, 1.1, [], 0.03, True, [1e-2, 1e-4, 1e-6], 1e-9, inconclusive
        )

    result = GradientCheckResult(True, [param("a.weight", 2e-7, True), param("b.bias", 3e-6, False)], [""])
    result.seconds = 1.25
    line = passed_line(result)
    assert line.startswith("GradientCheck: passed - 2 parameter tensors of the whole model checked")
    assert "largest relative error 3.0e-06 (1.2 s)" in line
    assert "Taylor test inconclusive for 1 (`a.weight`)" in line and "b.bias" not in line
    assert [p.name for p in result.inconclusive] == ["a.weight"]


def digits_loader() -> Any:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    data = torch.utils.data.TensorDataset(x, torch.tensor(digits.target))
    return torch.utils.data.DataLoader(data, batch_size=32)


class DigitsCNN(pl.LightningModule):
    """Six Conv2d + BatchNorm2d + ReLU blocks on 8x8 digits, average pooling, a linear head: stock layers."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for c in [1] + [width] * 5:
            blocks += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))

    def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(b[0]), b[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_healthy_conv_batchnorm_relu_cnn_passes_although_kinks_lower_the_taylor_order() -> None:
    # Every gradient here is autograd's own and right, but the Taylor steps cross ReLU kinks (BatchNorm
    # centres the pre-activations on 0 and couples the 4 samples): with this seed 4 tensors get orders of
    # 0.4-1.2 at h = 1e-2..3e-4. That used to be a gradient_mismatch error and the run never started.
    torch.manual_seed(4)
    model = DigitsCNN(width=6)
    check = GradientCheck(
        max_seconds=None
    )  # every tensor, however loaded the machine (not the budget's test)
    trainer = make_trainer([check], max_steps=2)
    trainer.fit(model, digits_loader())
    assert trainer.global_step == 2 and not check.alerts
    result = check.result
    assert result is not None and result.passed and result.targets == [""]
    assert [p.name for p in result.parameters] == [n for n, _ in model.named_parameters()]
    assert all(p.max_rel_error < 1e-3 for p in result.parameters)
    missed = [p for p in result.parameters if len(p.taylor_h0) > 1]
    assert missed, "the seed no longer makes the Taylor steps cross a kink: pick another"
    for p in missed:  # settled: finite differences along the Taylor direction agree, smaller steps behave
        assert p.directional_error < 1e-6 and p.taylor_h0 == [1e-2, 1e-4]
        assert p.taylor_inconclusive or p.taylor_order >= 1.5 or p.taylor_linear_error <= 1e-2
    settled = [p for p in result.parameters if len(p.taylor_h0) == 1]
    assert all(math.isnan(p.directional_error) for p in settled)
    # cost: 7 (Taylor) + 13 (6 coordinates) per tensor, 2 + 6 more per missed one, 1 for the gradient
    assert result.evaluations == 1 + 20 * len(result.parameters) + 8 * len(missed)


def test_callback_warn_action_trains_on() -> None:
    check = GradientCheck(action="warn")
    trainer = make_trainer([check], max_steps=2)
    trainer.fit(Lit("wrong_transpose"), loader())
    assert trainer.global_step == 2
    assert [a.where for a in check.alerts] == ["net.2.weight"]


def test_a_model_the_check_cannot_copy_gives_a_warning_not_a_crash() -> None:
    class Uncopyable(Lit):
        def __init__(self) -> None:
            super().__init__()
            self.stream = (i for i in range(3))  # generators cannot be deep-copied

    check = GradientCheck()
    trainer = make_trainer([check], max_steps=2)
    with pytest.warns(UserWarning, match="GradientCheck could not run the check"):
        trainer.fit(Uncopyable(), loader())
    assert trainer.global_step == 2 and check.result is None and not check.alerts
    with pytest.raises(ValueError, match="`modules`"):
        make_trainer([GradientCheck(modules=["nope"])], max_steps=1).fit(Lit(), loader())


def test_relu_kinks_lower_the_taylor_order_without_a_false_alarm() -> None:
    # A wide ReLU MLP: with 8k pre-activations some sit within a Taylor step of zero, so the remainder
    # picks up a term linear in h although every gradient is right (found with this seed).
    torch.manual_seed(3)
    mlp = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    result = gradient_check(mlp, (x, y), ce)
    assert result.passed and not result.failures
    kinked = [p for p in result.parameters if p.taylor_order < 1.5]
    assert kinked, "the seed no longer produces a kink: pick another"
    assert all(p.taylor_linear_error < 1e-2 and p.max_rel_error < 1e-5 for p in kinked)


def test_lightning_cli_builds_both_preflight_callbacks_from_yaml(tmp_path: Any) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_gradguard import OverfitBatchSanity
    from tests.conftest import RecordingMLP

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_gradguard.monitors.gradcheck.callback.GradientCheck
      init_args:
        modules: [net.0, net.2]
        max_samples: 2
        tolerance: 1.0e-4
        action: warn
    - class_path: lightning_gradguard.monitors.overfit.callback.OverfitBatchSanity
      init_args:
        max_steps: 50
        target: 0.3
        target_mode: absolute
        max_samples: null
        ignore_parameters: ["aux.*"]
        check_batch_mixing: true
"""
    )
    cli = LightningCLI(RecordingMLP, run=False, args=["--config", str(config)], save_config_callback=None)
    (grads,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, GradientCheck)]
    (overfit,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, OverfitBatchSanity)]
    assert (grads.modules, grads.max_samples, grads.tolerance, grads.action) == (
        ["net.0", "net.2"],
        2,
        1e-4,
        "warn",
    )
    assert (overfit.max_steps, overfit.target, overfit.target_mode, overfit.max_samples) == (
        50,
        0.3,
        "absolute",
        None,
    )
    assert overfit.ignore_parameters == ["aux.*"] and overfit.check_batch_mixing is True


def test_a_kink_at_the_point_checked_is_told_from_a_wrong_gradient() -> None:
    """Regression (issue 29): ReLU6 and BatchNorm put units exactly on a kink (an all-zero channel
    normalised to 0, a clip at 6): the symmetric difference there is the mean of two slopes autograd never
    gives, and a healthy MobileNetV2 failed the check. The one-sided differences disagree with each other
    there, and autograd's slope is one of them (or between): no error. A slope outside them still is."""
    x = torch.tensor([0.0, 1.5, -2.0, 6.0], dtype=torch.float64)
    loss = lambda: torch.nn.functional.relu6(x).sum()  # noqa: E731  kinks at 0 and 6, on entries 0 and 3
    autograd = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # what torch's relu6 backward gives
    ok = finite_difference_check(loss, x, autograd, [0, 1, 2, 3])
    assert ok.numeric[0] == pytest.approx(0.5) and ok.numeric[3] == pytest.approx(0.5)  # symmetric: 1/2
    assert ok.max_error < 1e-8
    wrong = autograd.clone()
    wrong[0] = -1.0  # not a slope of relu6 at 0 from either side
    bad = finite_difference_check(loss, x, wrong, [0, 1, 2, 3])
    assert bad.indices[bad.worst] == 0 and bad.max_error == pytest.approx(1.0)
    v = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64) / 3**0.5  # one kink on its way
    along = gradcheck.directional_difference(loss, [x], [autograd], [v], base=float(loss()))
    assert along.numeric == pytest.approx(1.5 / 3**0.5) and along.error < 1e-8
    smooth_wrong = gradcheck.directional_difference(
        loss, [x], [torch.tensor([0.0, 5.0, 0.0, 0.0], dtype=torch.float64)], [v], base=float(loss())
    )
    assert smooth_wrong.error > 0.3  # the entry off every kink is wrong: outside both one-sided slopes


class _StallsOnce(pl.LightningModule):
    """A healthy MLP whose first loss evaluation stalls, as a loaded machine or a process's one-time costs
    stall it (the check runs on a copy: the copy's first evaluation stalls, then the run's first step)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.stall = seconds

    def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
        if self.stall:
            time.sleep(self.stall)
            self.stall = 0.0
        return nn.functional.cross_entropy(self.net(b[0]), b[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_first_evaluation_that_stalls_does_not_shrink_the_check() -> None:
    # The budget was max_seconds over the first evaluation's time: a first evaluation that took 1 s left 20
    # evaluations of max_seconds=20, too few for 4 tensors (a tensor is planned at 16 or more), though
    # each later evaluation takes milliseconds (the whole check needs about 100: 0.3 s here; it still
    # fits with evaluations of 190 ms, six times what a loaded machine measured).
    torch.manual_seed(0)
    check = GradientCheck(max_seconds=20.0)
    trainer = make_trainer([check], max_steps=1)
    trainer.fit(_StallsOnce(1.0), random_loader(n=16))
    result = check.result
    assert result is not None and result.passed and not result.skipped
    assert [p.name for p in result.parameters] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert all(len(p.checked) == min(6, p.numel) for p in result.parameters)


def test_a_check_the_budget_left_empty_does_not_say_it_passed(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    check = GradientCheck(max_seconds=1e-9)  # no evaluation fits: every tensor is left out
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([check], max_steps=1).fit(_StallsOnce(0.0), random_loader(n=16))
    assert check.result is not None and not check.result.parameters and len(check.result.skipped) == 4
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GradientCheck: ")]
    assert said and all("passed" not in m for m in said), said
    assert any("nothing checked" in m and "all 4 parameter tensors" in m for m in said), said


class ClassToken(pl.LightningModule):
    """A ViT's opening (BEiT, Data2Vec-vision, DeiT): a zero-initialized class token beside the patch
    embeddings (weights at Hugging Face's std 0.02), then a LayerNorm with ``eps=1e-12``. Over the
    token's row (all 0) the LayerNorm scales by
    ``1/sqrt(1e-12)``: a gradient of about 1e2 whose curvature a finite-difference step of 1e-6 does not
    resolve (the row's variance it adds is that eps's size). ``scale``: a backward hook multiplies the
    LayerNorm's input gradient by it (1.02: a wrong backward, 2 % off)."""

    def __init__(self, scale: float | None = None, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Linear(8, width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.norm = nn.LayerNorm(width, eps=1e-12)
        self.head = nn.Linear(width, 4)
        for layer in (self.patch, self.head):  # Hugging Face's initializer_range
            nn.init.normal_(layer.weight, std=0.02)
        if scale is not None:
            self.norm.register_full_backward_hook(lambda m, gin, gout: (gin[0] * scale,))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        tokens = self.patch(x.view(len(x), 4, 8))
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1)
        return nn.functional.cross_entropy(self.head(self.norm(tokens).mean(1)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_class_token_under_a_layernorm_is_no_mismatch_and_a_wrong_backward_there_still_is() -> None:
    """Found by the sweep of every transformers architecture (BEiT, Data2Vec-vision, DeiT: relative errors
    of 5e-3 to 9e-3 on their class tokens at 1e-6). A coordinate that disagrees is measured again with a
    10x smaller step; a wrong backward disagrees at both steps."""
    model = ClassToken()
    x, y = next(iter(random_loader(n=16, features=32, batch_size=16)))
    loss = lambda: model.training_step((x.double(), y), 0)  # noqa: E731
    model.double()
    grad = torch.autograd.grad(loss(), model.cls_token)[0]
    indices = sample_coordinates(grad, grad.numel(), 6)
    # the premise, by the finite differences alone: off at the first step, on at the smaller one
    first = finite_difference_check(loss, model.cls_token, grad, indices, eps=1e-6)
    smaller = finite_difference_check(loss, model.cls_token, grad, indices, eps=1e-7)
    assert grad.abs().max() > 100 and first.max_error > 1e-3 > 10 * smaller.max_error, (first, smaller)

    check = GradientCheck()
    make_trainer([check], max_steps=1).fit(ClassToken(), random_loader(features=32))
    assert check.result is not None and check.result.passed and not check.alerts
    assert "cls_token" in [p.name for p in check.result.parameters]

    wrong = GradientCheck(action="warn")
    make_trainer([wrong], max_steps=1).fit(ClassToken(scale=1.02), random_loader(features=32))
    assert wrong.result is not None and "cls_token" in {p.name for p in wrong.result.failures}
    assert all(p.max_rel_error > 1e-2 for p in wrong.result.failures)
