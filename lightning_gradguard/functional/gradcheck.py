"""Gradient checking math: a Taylor test and symmetric finite differences with a relative error.

Both tests take a closure ``loss_fn()`` that recomputes a scalar loss from the *current* values of some
tensors (usually parameters) and perturb those tensors in place, restoring them bit for bit afterwards.
Run them in float64: in float32 the finite-difference estimate drowns in rounding error before it gets
accurate enough to be compared with autograd. No Trainer, no Lightning: usable on any closure.

* :func:`taylor_test` follows the loss along one random direction ``v``. With a correct gradient ``g``
  the remainder ``|L(θ + h v) - L(θ) - h <g, v>|`` shrinks like ``h**2``; with a wrong one it shrinks
  only like ``h`` once ``h`` is small. The observed order is the slope of ``log(remainder)`` against
  ``log(h)``.
* :func:`finite_difference_check` compares ``g`` with ``(L(θ + ε e_i) - L(θ - ε e_i)) / (2 ε)`` on a
  bounded sample of coordinates ``i`` per tensor, with the relative error
  ``|a - n| / max(|a|, |n|, tiny)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "FiniteDifferenceResult",
    "TaylorResult",
    "finite_difference_check",
    "observed_order",
    "relative_error",
    "sample_coordinates",
    "taylor_test",
]

LossFn = Callable[[], Tensor]

#: float64 machine epsilon: the rounding level the noise floors below are built on.
_EPS64 = float(torch.finfo(torch.float64).eps)


def relative_error(analytic: float, numeric: float, tiny: float = 1e-8) -> float:
    """``|analytic - numeric| / max(|analytic|, |numeric|, tiny)``: 0 when equal, about 1 when unrelated.

    ``tiny`` keeps two gradients that are both (nearly) zero from dividing rounding noise by zero.
    """
    if tiny <= 0:
        raise ValueError(f"`tiny` must be > 0; got {tiny!r}")
    a, n = float(analytic), float(numeric)
    if not (math.isfinite(a) and math.isfinite(n)):
        return math.inf
    return abs(a - n) / max(abs(a), abs(n), tiny)


def _loss_value(loss_fn: LossFn) -> float:
    with torch.no_grad():
        out = loss_fn()
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise ValueError("`loss_fn` must return a tensor with a single element (the scalar loss)")
    return float(out.detach().double().reshape(()))


def observed_order(hs: Sequence[float], remainders: Sequence[float], floor: float = 0.0) -> float:
    """Least-squares slope of ``log(remainder)`` against ``log(h)``, over the points above ``floor``.

    NaN when fewer than two points are above the floor (the remainder is at rounding level: there is no
    order to observe, and nothing wrong either).
    """
    pts = [
        (math.log(h), math.log(r))
        for h, r in zip(hs, remainders, strict=True)
        if r > floor and r > 0 and h > 0
    ]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return math.nan
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


@dataclass
class TaylorResult:
    """Outcome of :func:`taylor_test`.

    Attributes:
        hs: the step sizes, largest first.
        remainders: ``|L(θ + h v) - L(θ) - h <g, v>|`` for each ``h``.
        order: the observed order (slope in log-log over the remainders above ``floor``); about 2 for a
            correct gradient, about 1 for a wrong one; NaN when every remainder is at rounding level.
        floor: the rounding level under which a remainder is treated as zero.
        directional: ``<g, v>``, the directional derivative autograd claims.
        linear_error: the part of the remainder that grows like ``h``, relative to the claimed
            directional derivative: ``remainder(h_min) / h_min / max(|<g, v>|, tiny)``. A wrong gradient
            makes it large (a missing factor 1/2: about 1); a correct one leaves only curvature
            (``O(h_min)``) and, in piecewise-linear models, the few kinks the steps cross.
        passed: ``order >= min_order``, or every remainder at rounding level, or ``linear_error <=
            tolerance`` (an order below 2 that comes from a kink, not from the gradient).
        evaluations: loss evaluations spent.
    """

    hs: list[float]
    remainders: list[float]
    order: float
    floor: float
    directional: float
    linear_error: float
    passed: bool
    evaluations: int


def _unit(tensors: Sequence[Tensor]) -> list[Tensor] | None:
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
    return [t / norm for t in tensors] if norm > 0 and math.isfinite(norm) else None


def taylor_test(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    *,
    direction: Sequence[Tensor] | None = None,
    h0: float = 1e-2,
    num_steps: int = 6,
    factor: float = 0.5,
    min_order: float = 1.5,
    tolerance: float = 1e-3,
    generator: torch.Generator | None = None,
) -> TaylorResult:
    """Taylor remainder test of ``grads`` against ``loss_fn`` along one direction.

    Args:
        loss_fn: recomputes the scalar loss from the current values of ``params``.
        params: the tensors ``grads`` claim to be the gradient for; perturbed in place and restored
            exactly.
        grads: autograd's gradient for each tensor of ``params`` (``None`` = zero).
        direction: the direction ``v``, one tensor per parameter. Default: a random direction tilted
            toward the claimed gradient, ``v ∝ g/|g| + r/|r|`` with ``r`` standard normal (from
            ``generator``), scaled to unit norm. The tilt keeps ``<g, v>`` large next to rounding noise
            and kinks even in a tensor with millions of entries, where a purely random direction is
            nearly orthogonal to the gradient; the random part still probes the gradient's errors.
        h0: the largest step; the others are ``h0 * factor**k``.
        num_steps: how many steps (at least 2).
        factor: ratio between successive steps, in (0, 1).
        min_order: the observed order below which the test fails (unless ``linear_error`` is small).
        tolerance: the ``linear_error`` up to which a low order is blamed on kinks, not on the gradient.
        generator: random source for the default direction.

    Returns:
        A :class:`TaylorResult`.
    """
    if num_steps < 2:
        raise ValueError(f"`num_steps` must be >= 2; got {num_steps!r}")
    if not 0 < factor < 1:
        raise ValueError(f"`factor` must be in (0, 1); got {factor!r}")
    if h0 <= 0:
        raise ValueError(f"`h0` must be > 0; got {h0!r}")
    if len(params) != len(grads):
        raise ValueError("`params` and `grads` must have the same length")
    if direction is None:
        noise = [
            torch.randn(p.shape, generator=generator, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
            for p in params
        ]
        rand = _unit(noise) or noise
        tilt = _unit(
            [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads, strict=True)]
        )
        direction = _unit([r + t for r, t in zip(rand, tilt, strict=True)]) if tilt is not None else rand
        direction = direction or rand
    directional = sum(
        float((g.double() * d.double()).sum()) for g, d in zip(grads, direction, strict=True) if g is not None
    )
    saved = [p.detach().clone() for p in params]
    hs = [h0 * factor**k for k in range(num_steps)]
    remainders: list[float] = []
    try:
        base = _loss_value(loss_fn)
        for h in hs:
            with torch.no_grad():
                for p, s, d in zip(params, saved, direction, strict=True):
                    p.copy_(s + h * d)
            remainders.append(abs(_loss_value(loss_fn) - base - h * directional))
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    # Rounding level of L(θ+hv) - L(θ): a few ulps of the loss (and of the linear term).
    floor = 64 * _EPS64 * max(abs(base), abs(hs[0] * directional), 1e-30)
    order = observed_order(hs, remainders, floor)
    linear_error = remainders[-1] / hs[-1] / max(abs(directional), floor / hs[-1], 1e-30)
    finite = all(math.isfinite(r) for r in remainders)
    passed = finite and (math.isnan(order) or order >= min_order or linear_error <= tolerance)
    return TaylorResult(hs, remainders, order, floor, directional, linear_error, passed, num_steps + 1)


def sample_coordinates(
    grad: Tensor | None, numel: int, k: int, generator: torch.Generator | None = None
) -> list[int]:
    """Up to ``k`` distinct flat indices: half the largest ``|grad|`` entries, the rest drawn at random.

    The largest entries make the comparison well-conditioned; the random ones catch a gradient that is
    zero where it should not be (a wrong transpose, a missing branch).
    """
    k = min(int(k), int(numel))
    if k <= 0:
        return []
    chosen: list[int] = []
    if grad is not None and k > 1:
        top = torch.topk(grad.detach().reshape(-1).abs().double().cpu(), k // 2).indices.tolist()
        chosen.extend(int(i) for i in top)
    taken = set(chosen)
    perm = torch.randperm(numel, generator=generator).tolist() if numel <= 1_000_000 else None
    while len(chosen) < k:
        i = int(perm.pop()) if perm is not None else int(torch.randint(numel, (1,), generator=generator))
        if i not in taken:
            taken.add(i)
            chosen.append(i)
    return chosen


@dataclass
class FiniteDifferenceResult:
    """Symmetric finite differences on sampled coordinates of one tensor.

    Attributes:
        indices: the flat indices checked.
        analytic: autograd's gradient at those indices.
        numeric: the finite-difference estimate at those indices.
        errors: the relative error at each index.
        max_error: the largest relative error (0 when nothing was checked).
        worst: position (in ``indices``) of the largest error, or -1.
        tiny: the denominator floor used for the relative error.
        evaluations: loss evaluations spent.
    """

    indices: list[int]
    analytic: list[float]
    numeric: list[float]
    errors: list[float] = field(default_factory=list)
    max_error: float = 0.0
    worst: int = -1
    tiny: float = 1e-8
    evaluations: int = 0


def finite_difference_check(
    loss_fn: LossFn,
    param: Tensor,
    grad: Tensor | None,
    indices: Sequence[int],
    *,
    eps: float = 1e-6,
    tiny: float | None = None,
) -> FiniteDifferenceResult:
    """Compare ``grad`` with ``(L(θ + ε e_i) - L(θ - ε e_i)) / (2 ε)`` at the flat ``indices`` of ``param``.

    Args:
        loss_fn: recomputes the scalar loss from the current value of ``param``.
        param: the tensor to perturb (in place; restored exactly). A contiguous tensor is needed.
        grad: autograd's gradient of the loss with respect to ``param`` (``None`` = zero).
        indices: flat indices to check, e.g. from :func:`sample_coordinates`.
        eps: the step, relative: coordinate ``i`` moves by ``eps * max(1, |θ_i|)``.
        tiny: the denominator floor of the relative error. Default: the larger of ``1e-8`` and the
            rounding noise of the estimate (``1e4 * eps64 * |L| / ε``), so two gradients that are both
            at rounding level do not count as a mismatch.

    Returns:
        A :class:`FiniteDifferenceResult`.
    """
    if eps <= 0:
        raise ValueError(f"`eps` must be > 0; got {eps!r}")
    if not param.is_contiguous():
        raise ValueError("`param` must be contiguous to be perturbed coordinate by coordinate")
    flat = param.detach().view(-1)
    g = grad.detach().reshape(-1) if grad is not None else None
    analytic: list[float] = []
    numeric: list[float] = []
    base = _loss_value(loss_fn)
    evaluations = 1
    for i in indices:
        orig = flat[i].clone()
        step = eps * max(1.0, abs(float(orig)))
        try:
            with torch.no_grad():
                flat[i] = orig + step
            plus = _loss_value(loss_fn)
            with torch.no_grad():
                flat[i] = orig - step
            minus = _loss_value(loss_fn)
        finally:
            with torch.no_grad():
                flat[i] = orig
        evaluations += 2
        numeric.append((plus - minus) / (2 * step))
        analytic.append(float(g[i]) if g is not None else 0.0)
    if tiny is None:
        tiny = max(1e-8, 1e4 * _EPS64 * max(abs(base), 1.0) / eps)
    errors = [relative_error(a, n, tiny) for a, n in zip(analytic, numeric, strict=True)]
    worst = max(range(len(errors)), key=errors.__getitem__) if errors else -1
    return FiniteDifferenceResult(
        indices=[int(i) for i in indices],
        analytic=analytic,
        numeric=numeric,
        errors=errors,
        max_error=errors[worst] if errors else 0.0,
        worst=worst,
        tiny=tiny,
        evaluations=evaluations,
    )
