"""``adam_step_bound`` against torch's own optimizers: the worst gradient sequence reaches it, none passes it.

By Cauchy-Schwarz the largest per-entry step (in units of lr) is reached when the gradient ``k`` steps back
is proportional to ``c_k / w_k`` (its weight in ``m_hat`` over its weight in ``v_hat``). The tests feed that
sequence, and random ones, to ``torch.optim.Adam`` / ``NAdam`` / ``RAdam`` on one float64 entry with
``eps=0`` and compare the last step taken with the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradguard.functional.optimizer_state import adam_step_bound, adam_step_threshold


def _last_step(make: type, grads: list[float], **kwargs: float | tuple[float, float]) -> float:
    """``|delta w| / lr`` of the last of ``len(grads)`` steps of ``make`` on one float64 entry."""
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = make([w], lr=1.0, eps=0.0, **kwargs)
    before = 0.0
    for g in grads:
        before = float(w.detach())
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    return abs(float(w.detach()) - before)


def _nadam_weights(b1: float, t: int, decay: float = 0.004) -> list[float]:
    """NAdam's weight of the gradient ``k`` steps back in its numerator, from torch's update formula."""
    mu = [b1 * (1 - 0.5 * 0.96 ** (i * decay)) for i in range(1, t + 2)]
    product = math.prod(mu[:t])
    a, b = (1 - mu[t - 1]) / (1 - product), mu[t] / (1 - product * mu[t])
    return [b * (1 - b1) * b1**k + (a if k == 0 else 0.0) for k in range(t)]


@pytest.mark.parametrize(("betas", "t"), [((0.9, 0.999), 60), ((0.9, 0.95), 40), ((0.0, 0.99), 30)])
def test_adam_reaches_its_bound_on_the_worst_sequence(betas: tuple[float, float], t: int) -> None:
    b1, b2 = betas
    # c_k / w_k for the gradient k = t - j steps back; with beta1 = 0 only the last gradient is in m, and
    # the largest step is a gradient after (nearly) zero ones, as in RMSprop
    worst = [(b1 / b2) ** (t - j) for j in range(1, t + 1)] if b1 else [1e-100] * (t - 1) + [1.0]
    bound = adam_step_bound(b1, b2, t)
    assert bound is not None
    assert _last_step(torch.optim.Adam, worst, betas=betas) == pytest.approx(bound, rel=1e-9)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # no sequence goes past it
        grads = (torch.randn(t, generator=g, dtype=torch.float64) * torch.rand(t, generator=g) ** 8).tolist()
        assert _last_step(torch.optim.Adam, grads, betas=betas) <= bound * (1 + 1e-12)


def test_nadam_reaches_its_bound_and_it_exceeds_adams() -> None:
    t, b1, b2 = 50, 0.9, 0.999
    c = _nadam_weights(b1, t)
    worst = [c[t - j] / b2 ** (t - j) for j in range(1, t + 1)]
    bound = adam_step_bound(b1, b2, t, "nadam")
    assert bound is not None and bound > adam_step_bound(b1, b2, t)  # NAdam's extra gradient term
    assert _last_step(torch.optim.NAdam, worst, betas=(b1, b2)) == pytest.approx(bound, rel=1e-9)


def test_radam_has_no_bound_until_rectified_then_stays_within_adams() -> None:
    assert adam_step_bound(0.9, 0.999, 4, "radam") is None  # rho_t <= 5: an SGD step, in gradient units
    bound = adam_step_bound(0.9, 0.999, 30, "radam")
    assert bound == adam_step_bound(0.9, 0.999, 30)
    worst = [(0.9 / 0.999) ** (30 - j) for j in range(1, 31)]
    assert bound is not None and _last_step(torch.optim.RAdam, worst, betas=(0.9, 0.999)) <= bound


def test_a_beta2_at_or_below_beta1_squared_has_no_bound() -> None:
    assert adam_step_bound(0.9, 0.81, 100) == math.inf
    assert adam_step_bound(0.9, 0.1, 2) == math.inf
    assert adam_step_bound(0.9, 0.9, 10_000) == pytest.approx(1.0)  # beta1 = beta2: at most lr
    # the growth it stands for: after one large gradient, each zero gradient multiplies the step by
    # beta1 / sqrt(beta2) (once the bias corrections have settled)
    steps = [_last_step(torch.optim.Adam, [1.0] + [1e-100] * n, betas=(0.9, 0.1)) for n in (60, 61)]
    assert steps[1] / steps[0] == pytest.approx(0.9 / math.sqrt(0.1), rel=1e-3)


def test_the_threshold_is_the_factor_or_adams_own_bound() -> None:
    assert adam_step_threshold(math.inf, 10.0) == 10.0
    assert adam_step_threshold(7.27, 10.0) == 10.0
    assert adam_step_threshold(13.7, 10.0) == 13.7  # NAdam after 1000 steps can legitimately go that far
