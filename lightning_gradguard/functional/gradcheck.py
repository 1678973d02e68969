"""Gradient checking math: finite differences and the Taylor test, with one relative error.

Every test here takes a closure ``loss_fn()`` that recomputes a scalar loss from the *current* values of
some tensors (usually parameters), perturbs those tensors in place and restores them bit for bit
afterwards. Run them in float64: in float32 a finite-difference estimate drowns in rounding error before
it gets accurate enough to be compared with autograd. No Trainer, no Lightning: usable on any closure.

* :func:`relative_error` is the one comparison: ``|a - n| / max(|a|, |n|, tiny)``; :func:`slope_error`
  applies it to a finite difference that knows ``L(θ)``: where the one-sided differences disagree with
  each other the loss has a kink within ``ε``, and a slope between them is not an error.
* :func:`finite_difference_check` compares ``g`` with ``(L(θ + ε e_i) - L(θ - ε e_i)) / (2 ε)`` on a
  bounded sample of coordinates ``i`` per tensor (:func:`sample_coordinates`: the largest ``|g|`` and
  random ones).
* :func:`directional_difference` compares ``<g, v>`` with ``(L(θ + ε v) - L(θ - ε v)) / (2 ε)``: one
  finite difference that covers every coordinate the direction touches.
* :func:`taylor_test` follows the loss along one random direction ``v``. With a correct gradient ``g``
  the remainder ``|L(θ + h v) - L(θ) - h <g, v>|`` shrinks like ``h**2``; with a wrong one it shrinks
  only like ``h`` once ``h`` is small. The observed order (:func:`observed_order`) is the slope of
  ``log(remainder)`` against ``log(h)``.
* :func:`taylor_check` is the Taylor test made safe for piecewise-linear models (ReLU, max-pooling):
  a step that crosses a kink adds a remainder linear in ``h`` although the gradient is right. When the
  Taylor test misses, the directional finite difference along the same ``v`` decides (a wrong gradient
  disagrees, a kink does not), and the Taylor test is repeated with smaller steps, below the distance
  to the nearest kink. A miss that finite differences do not confirm is at worst *inconclusive*, never
  a failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

LossFn = Callable[[], Tensor]

#: float64 machine epsilon: the rounding level the noise floors below are built on.
EPS64 = float(torch.finfo(torch.float64).eps)


# ----------------------------------------------------------------------------------------- shared parts


def slope_error(
    analytic: float, plus: float, minus: float, base: float | None, step: float, tiny: float
) -> float:
    """The relative error of a claimed slope against the loss at ``θ - ε``, ``θ`` and ``θ + ε``.

    On a smooth loss the symmetric difference ``(L₊ - L₋) / 2ε`` measures the slope to ``O(ε²)``. A kink
    within ``ε`` (a ReLU6 at its clip, a BatchNorm'd unit at exactly 0, a max-pooling tie: a piecewise-linear
    model with batch statistics has them at almost every scale) makes the symmetric difference an average
    of two slopes that autograd never gives; there the one-sided differences ``(L₊ - L) / ε`` and
    ``(L - L₋) / ε`` disagree with each other, and a correct gradient is one of them or, at the kink
    itself, a subgradient between them. So the error is the smaller of the error against the symmetric
    difference and the distance of the claimed slope from the interval the one-sided differences span
    (relative to the largest of the slopes): the same number as before on a smooth loss (the one-sided
    differences are ``O(ε)`` apart), and a wrong gradient beside a kink still falls outside the interval.
    Without ``base`` (``L(θ)``), the symmetric error alone.
    """
    symmetric = relative_error(analytic, (plus - minus) / (2 * step), tiny)
    if base is None:
        return symmetric
    low, high = sorted(((plus - base) / step, (base - minus) / step))
    if not (math.isfinite(low) and math.isfinite(high)):
        return symmetric
    outside = max(low - analytic, analytic - high, 0.0)
    return min(symmetric, outside / max(abs(low), abs(high), abs(analytic), tiny))


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


def loss_value(loss_fn: LossFn) -> float:
    """``loss_fn()`` without autograd, as a Python float (float64); a ``ValueError`` unless a scalar."""
    with torch.no_grad():
        out = loss_fn()
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise ValueError("`loss_fn` must return a tensor with a single element (the scalar loss)")
    return float(out.detach().double().reshape(()))


def dot(grads: Sequence[Tensor | None], direction: Sequence[Tensor]) -> float:
    """``<g, v>`` over every tensor, in float64 (a ``None`` gradient counts as zero)."""
    return sum(
        float((g.double() * d.double()).sum()) for g, d in zip(grads, direction, strict=True) if g is not None
    )


def _noise_floor(loss: float, step: float) -> float:
    """The default ``tiny``: at least ``1e-8``, and the rounding noise of a difference quotient of ``loss``
    with ``step`` (``1e4 * eps64 * |L| / step``), so two gradients both at rounding level agree."""
    return max(1e-8, 1e4 * EPS64 * max(abs(loss), 1.0) / step)


def _place(params: Sequence[Tensor], saved: Sequence[Tensor], direction: Sequence[Tensor], h: float) -> None:
    """Set every tensor of ``params`` to ``saved + h * direction``, in place."""
    with torch.no_grad():
        for p, s, d in zip(params, saved, direction, strict=True):
            p.copy_(s + h * d)


def _restore(params: Sequence[Tensor], saved: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)


# ------------------------------------------------------------------------- finite differences, per index


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
    tolerance: float | None = None,
) -> FiniteDifferenceResult:
    """Compare ``grad`` with ``(L(θ + ε e_i) - L(θ - ε e_i)) / (2 ε)`` at the flat ``indices`` of ``param``.

    With ``tolerance``, a coordinate whose error is above it is measured again with a step
    :data:`RECHECK_SHRINK` times ``ε`` and keeps the smaller of its two errors: a loss curved on the scale
    of ``ε`` (a LayerNorm over a row that starts at 0, a zero-initialized class token: its scale is
    ``sqrt(eps_LN)``) puts the symmetric difference outside its linear regime, and the smaller step, with
    a truncation error 100x smaller, agrees with a correct gradient; a wrong gradient disagrees at both.

    Args:
        loss_fn: recomputes the scalar loss from the current value of ``param``.
        param: the tensor to perturb (in place; restored exactly). A contiguous tensor is needed.
        grad: autograd's gradient of the loss with respect to ``param`` (``None`` = zero).
        indices: flat indices to check, e.g. from :func:`sample_coordinates`.
        eps: the step, relative: coordinate ``i`` moves by ``eps * max(1, |θ_i|)``.
        tiny: the denominator floor of the relative error. Default: the larger of ``1e-8`` and the
            rounding noise of the estimate (``1e4 * eps64 * |L| / ε``), so two gradients that are both
            at rounding level do not count as a mismatch (at the smaller step: its own, 10x larger).
        tolerance: the error above which a coordinate is measured again (``None``: never).

    Returns:
        A :class:`FiniteDifferenceResult` (``numeric``: the estimate of the step whose error was kept).
    """
    if eps <= 0:
        raise ValueError(f"`eps` must be > 0; got {eps!r}")
    if tolerance is not None and not tolerance > 0:
        raise ValueError(f"`tolerance` must be > 0 or None; got {tolerance!r}")
    if not param.is_contiguous():
        raise ValueError("`param` must be contiguous to be perturbed coordinate by coordinate")
    flat = param.detach().view(-1)
    g = grad.detach().reshape(-1) if grad is not None else None
    base = loss_value(loss_fn)
    analytic = [float(g[i]) if g is not None else 0.0 for i in indices]
    used = tiny if tiny is not None else _noise_floor(base, eps)
    numeric, errors, evaluations = _coordinate_errors(loss_fn, flat, indices, g, base, eps, used, tolerance)
    worst = max(range(len(errors)), key=errors.__getitem__) if errors else -1
    return FiniteDifferenceResult(
        indices=[int(i) for i in indices],
        analytic=analytic,
        numeric=numeric,
        errors=errors,
        max_error=errors[worst] if errors else 0.0,
        worst=worst,
        tiny=used,
        evaluations=1 + evaluations,
    )


def _coordinate_errors(
    loss_fn: LossFn,
    flat: Tensor,
    indices: Sequence[int],
    grad: Tensor | None,
    base: float,
    eps: float,
    tiny: float,
    tolerance: float | None,
) -> tuple[list[float], list[float], int]:
    """:func:`finite_difference_check`'s estimates and errors at ``indices`` (each coordinate above
    ``tolerance`` measured again with the smaller step), and the evaluations spent."""
    measured = [_coordinate_error(loss_fn, flat, i, grad, base, eps, tiny) for i in indices]
    numeric, errors = [n for n, _ in measured], [e for _, e in measured]
    again = [j for j, e in enumerate(errors) if tolerance is not None and e > tolerance]
    small = eps * RECHECK_SHRINK
    floor = max(tiny, _noise_floor(base, small))  # the smaller step's own rounding noise
    for j in again:  # outside the linear regime, or wrong
        n, e = _coordinate_error(loss_fn, flat, indices[j], grad, base, small, floor)
        if e < errors[j]:  # a wrong gradient disagrees at both steps
            numeric[j], errors[j] = n, e
    return numeric, errors, 2 * (len(indices) + len(again))


#: the step, relative to ``eps``, at which :func:`finite_difference_check` measures a coordinate again
RECHECK_SHRINK = 0.1


def _coordinate_error(
    loss_fn: LossFn, flat: Tensor, i: int, grad: Tensor | None, base: float, eps: float, tiny: float
) -> tuple[float, float]:
    """The symmetric difference at coordinate ``i`` with the relative step ``eps``, and its
    :func:`slope_error` against the flat gradient ``grad`` there (``None``: zero)."""
    plus, minus, step = _coordinate_difference(loss_fn, flat, i, eps)
    analytic = float(grad[i]) if grad is not None else 0.0
    return (plus - minus) / (2 * step), slope_error(analytic, plus, minus, base, step, tiny)


def _coordinate_difference(loss_fn: LossFn, flat: Tensor, i: int, eps: float) -> tuple[float, float, float]:
    """``L(θ + ε e_i)``, ``L(θ - ε e_i)`` and ``ε = eps * max(1, |θ_i|)``; ``θ_i`` put back."""
    orig = flat[i].clone()
    step = eps * max(1.0, abs(float(orig)))
    try:
        with torch.no_grad():
            flat[i] = orig + step
        plus = loss_value(loss_fn)
        with torch.no_grad():
            flat[i] = orig - step
        minus = loss_value(loss_fn)
    finally:
        with torch.no_grad():
            flat[i] = orig
    return plus, minus, step


# ------------------------------------------------------------------ a finite difference along a direction


@dataclass
class DirectionalResult:
    """Outcome of :func:`directional_difference`.

    Attributes:
        analytic: ``<g, d> / (2 ε)``, the directional derivative autograd claims, over the displacement
            ``d = θ₊ - θ₋`` actually applied (``2 ε v`` up to the rounding of ``θ ± ε v``).
        numeric: ``(L(θ₊) - L(θ₋)) / (2 ε)``.
        error: ``|analytic - numeric| / max(|analytic|, |numeric|, tiny)``.
        step: ``ε``.
        tiny: the denominator floor of the relative error.
        evaluations: loss evaluations spent.
    """

    analytic: float
    numeric: float
    error: float
    step: float
    tiny: float
    evaluations: int


def directional_difference(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    direction: Sequence[Tensor],
    *,
    eps: float = 1e-6,
    tiny: float | None = None,
    base: float | None = None,
) -> DirectionalResult:
    """Compare ``<g, v>`` with the symmetric difference ``(L(θ + ε v) - L(θ - ε v)) / (2 ε)``.

    The error is :func:`slope_error`'s: a kink within ``ε`` of ``θ`` is told from a wrong gradient by the
    one-sided differences (with ``base`` known). Unlike :func:`finite_difference_check`, which samples a
    few coordinates, this covers every
    coordinate ``v`` touches: a gradient wrong on coordinates the sample missed still moves ``<g, v>``
    (with the default direction of :func:`taylor_test`, tilted toward ``g``, by about the share of
    ``|g|²`` that is wrong). Its error is ``O(ε²)`` on a smooth loss, and a kink matters only if it lies
    within ``ε`` of ``θ`` along ``v``, whereas a Taylor step crosses every kink within ``h``.

    Args:
        loss_fn: recomputes the scalar loss from the current values of ``params``.
        params: the tensors to move (in place; restored exactly).
        grads: autograd's gradient for each tensor of ``params`` (``None`` = zero).
        direction: one tensor per parameter, usually of unit norm (e.g. ``TaylorResult.direction``).
        eps: the step, relative: ``ε = eps * max(1, max |θ|)``.
        tiny: the denominator floor of the relative error. Default: as in
            :func:`finite_difference_check`, the larger of ``1e-8`` and ``1e4 * eps64 * |L| / ε``.
        base: ``L(θ)`` when already known (only used for the default ``tiny``; saves an evaluation).

    Returns:
        A :class:`DirectionalResult`.
    """
    if eps <= 0:
        raise ValueError(f"`eps` must be > 0; got {eps!r}")
    if len(params) != len(grads) or len(params) != len(direction):
        raise ValueError("`params`, `grads` and `direction` must have the same length")
    step = eps * max([1.0] + [float(p.detach().abs().max()) for p in params if p.numel()])
    evaluations = 2
    if base is None and tiny is None:
        base = loss_value(loss_fn)
        evaluations += 1
    plus, minus, moved = _symmetric_difference(loss_fn, params, direction, step)
    analytic = dot(grads, moved) / (2 * step)
    numeric = (plus - minus) / (2 * step)
    if tiny is None:
        tiny = _noise_floor(base or 0.0, step)
    return DirectionalResult(
        analytic=analytic,
        numeric=numeric,
        error=slope_error(analytic, plus, minus, base, step, tiny),
        step=step,
        tiny=tiny,
        evaluations=evaluations,
    )


def _symmetric_difference(
    loss_fn: LossFn, params: Sequence[Tensor], direction: Sequence[Tensor], step: float
) -> tuple[float, float, list[Tensor]]:
    """``L(θ + ε v)``, ``L(θ - ε v)`` and the displacement ``θ₊ - θ₋`` actually applied; ``θ`` put back."""
    saved = [p.detach().clone() for p in params]
    try:
        _place(params, saved, direction, step)
        plus_at = [p.detach().clone() for p in params]
        plus = loss_value(loss_fn)
        _place(params, saved, direction, -step)
        # the displacement actually applied, after rounding θ ± ε v to the parameter's precision
        moved = [a - p.detach() for a, p in zip(plus_at, params, strict=True)]
        minus = loss_value(loss_fn)
    finally:
        _restore(params, saved)
    return plus, minus, moved


# ---------------------------------------------------------------------------------------- the Taylor test


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
        direction: the unit direction ``v`` used, one tensor per parameter (to repeat the test, or to
            check ``<g, v>`` with :func:`directional_difference`, along the same line).
        loss: ``L(θ)``, the loss at the unperturbed point.
    """

    hs: list[float]
    remainders: list[float]
    order: float
    floor: float
    directional: float
    linear_error: float
    passed: bool
    evaluations: int
    direction: list[Tensor] = field(default_factory=list, repr=False, compare=False)
    loss: float = math.nan


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

    On a piecewise-linear model (ReLU, max-pooling) a miss does not prove a wrong gradient: the steps
    may have crossed kinks. :func:`taylor_check` arbitrates a miss with finite differences.
    """
    line = _taylor_line(
        loss_fn,
        params,
        grads,
        direction=direction,
        generator=generator,
        h0=h0,
        num_steps=num_steps,
        factor=factor,
        min_order=min_order,
        tolerance=tolerance,
    )
    return line.test(h0, base=None)


def _taylor_line(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    *,
    direction: Sequence[Tensor] | None,
    generator: torch.Generator | None,
    h0: float,
    num_steps: int,
    factor: float,
    min_order: float,
    tolerance: float,
) -> _TaylorLine:
    """The arguments of :func:`taylor_test`, checked, with the direction fixed (default: tilted toward g)."""
    if num_steps < 2:
        raise ValueError(f"`num_steps` must be >= 2; got {num_steps!r}")
    if not 0 < factor < 1:
        raise ValueError(f"`factor` must be in (0, 1); got {factor!r}")
    if h0 <= 0:
        raise ValueError(f"`h0` must be > 0; got {h0!r}")
    if len(params) != len(grads):
        raise ValueError("`params` and `grads` must have the same length")
    if direction is None:
        direction = _default_direction(params, grads, generator)
    return _TaylorLine(
        loss_fn=loss_fn,
        params=params,
        grads=grads,
        direction=list(direction),
        num_steps=num_steps,
        factor=factor,
        min_order=min_order,
        tolerance=tolerance,
    )


def _default_direction(
    params: Sequence[Tensor], grads: Sequence[Tensor | None], generator: torch.Generator | None
) -> list[Tensor]:
    """A random unit direction tilted toward the claimed gradient: ``v ∝ g/|g| + r/|r|``."""
    noise = [
        torch.randn(p.shape, generator=generator, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
        for p in params
    ]
    rand = _unit(noise) or noise
    tilt = _unit(
        [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads, strict=True)]
    )
    direction = _unit([r + t for r, t in zip(rand, tilt, strict=True)]) if tilt is not None else rand
    return direction or rand


def _unit(tensors: Sequence[Tensor]) -> list[Tensor] | None:
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
    return [t / norm for t in tensors] if norm > 0 and math.isfinite(norm) else None


@dataclass(frozen=True, kw_only=True)
class _TaylorLine:
    """The line ``θ + h v`` Taylor tests run along, and how they step and judge (see :func:`taylor_test`)."""

    loss_fn: LossFn
    params: Sequence[Tensor]
    grads: Sequence[Tensor | None]
    direction: list[Tensor]
    num_steps: int
    factor: float
    min_order: float
    tolerance: float

    def test(self, h0: float, base: float | None) -> TaylorResult:
        """One Taylor test from the largest step ``h0``; ``base`` is ``L(θ)`` when known (one evaluation
        fewer)."""
        directional = dot(self.grads, self.direction)
        hs = [h0 * self.factor**k for k in range(self.num_steps)]
        evaluations = self.num_steps
        if base is None:
            base = loss_value(self.loss_fn)
            evaluations += 1
        remainders = self._remainders(hs, base, directional)
        # Rounding level of L(θ+hv) - L(θ): a few ulps of the loss (and of the linear term).
        floor = 64 * EPS64 * max(abs(base), abs(hs[0] * directional), 1e-30)
        order = observed_order(hs, remainders, floor)
        linear_error = remainders[-1] / hs[-1] / max(abs(directional), floor / hs[-1], 1e-30)
        finite = all(math.isfinite(r) for r in remainders)
        passed = finite and (math.isnan(order) or order >= self.min_order or linear_error <= self.tolerance)
        return TaylorResult(
            hs=hs,
            remainders=remainders,
            order=order,
            floor=floor,
            directional=directional,
            linear_error=linear_error,
            passed=passed,
            evaluations=evaluations,
            direction=self.direction,
            loss=base,
        )

    def _remainders(self, hs: list[float], base: float, directional: float) -> list[float]:
        """``|L(θ + h v) - L(θ) - h <g, v>|`` for each ``h``; ``θ`` put back."""
        saved = [p.detach().clone() for p in self.params]
        remainders: list[float] = []
        try:
            for h in hs:
                _place(self.params, saved, self.direction, h)
                remainders.append(abs(loss_value(self.loss_fn) - base - h * directional))
        finally:
            _restore(self.params, saved)
        return remainders


# --------------------------------------------------------------- the Taylor test, arbitrated at a miss


@dataclass
class TaylorCheckResult:
    """Outcome of :func:`taylor_check`.

    Attributes:
        taylor: the Taylor test that decided: the first one when it passed, else the last one run
            (the one that passed at smaller steps, or the one with the smallest steps).
        h0s: the largest step of every Taylor test run, in order (``[h0]`` when the first passed).
        directional: the directional finite difference that arbitrated a Taylor miss, or ``None`` when
            the first Taylor test passed.
        passed: the first Taylor test passed, or it missed and the directional finite difference
            agreed with ``<g, v>`` within ``tolerance``.
        inconclusive: the Taylor test missed at every step size tried while the directional finite
            difference agreed: passed, but the Taylor test itself showed nothing (kinks crossed even by
            the smallest steps, or rounding noise above the floor).
        evaluations: loss evaluations spent.
    """

    taylor: TaylorResult
    h0s: list[float]
    directional: DirectionalResult | None
    passed: bool
    inconclusive: bool
    evaluations: int


def taylor_check(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    *,
    direction: Sequence[Tensor] | None = None,
    h0: float = 1e-2,
    num_steps: int = 6,
    factor: float = 0.5,
    min_order: float = 1.5,
    taylor_tolerance: float = 1e-2,
    eps: float = 1e-6,
    tolerance: float = 1e-3,
    retries: int = 2,
    shrink: float = 1e-2,
    generator: torch.Generator | None = None,
) -> TaylorCheckResult:
    """A Taylor test that a kink cannot fail: finite differences arbitrate a miss.

    1. :func:`taylor_test` along ``v`` (default: random, tilted toward ``g``); if it passes, done
       (``num_steps + 1`` evaluations).
    2. It missed: ``g`` is wrong along ``v``, or the steps crossed kinks (ReLU, max-pooling, absolute
       values; batch statistics couple every sample, so one kink moves the whole batch's loss).
       :func:`directional_difference` along ``v`` decides: off ``<g, v>`` by more than ``tolerance`` at
       ``ε`` and at 100x and 10,000x smaller steps (:data:`KINK_RETRIES`), the check fails.
    3. It agreed: the Taylor test is repeated ``retries`` times along ``v``, each time with the largest
       step ``shrink`` times the previous one, until the steps stay clear of the kinks and the remainder
       behaves (``num_steps`` evaluations each). If none passes, the check passes as *inconclusive*.

    The arguments ``loss_fn`` to ``min_order`` and ``generator`` are those of :func:`taylor_test`.

    Args:
        taylor_tolerance: the ``tolerance`` of :func:`taylor_test` (the linear remainder blamed on kinks).
        eps: the relative step of the directional finite difference.
        tolerance: the largest relative error of the directional finite difference accepted.
        retries: how many Taylor tests with smaller steps to try after a miss (0: none).
        shrink: the ratio between the largest steps of successive tries, in (0, 1).

    Returns:
        A :class:`TaylorCheckResult`.
    """
    if retries < 0:
        raise ValueError(f"`retries` must be >= 0; got {retries!r}")
    if not 0 < shrink < 1:
        raise ValueError(f"`shrink` must be in (0, 1); got {shrink!r}")
    if tolerance <= 0:
        raise ValueError(f"`tolerance` must be > 0; got {tolerance!r}")
    line = _taylor_line(
        loss_fn,
        params,
        grads,
        direction=direction,
        generator=generator,
        h0=h0,
        num_steps=num_steps,
        factor=factor,
        min_order=min_order,
        tolerance=taylor_tolerance,
    )
    return _arbitrated(line, h0, eps=eps, tolerance=tolerance, retries=retries, shrink=shrink)


def _around_kinks(
    line: _TaylorLine, base: float, *, eps: float, tolerance: float, tries: int
) -> tuple[DirectionalResult, int]:
    """The directional finite difference along the line, taken again with ``ε`` 100x smaller while it
    disagrees (``tries`` times at most): a direction that moves a whole tensor of a piecewise-linear model
    meets kinks within ``ε`` of ``θ`` on both sides, whose slopes :func:`slope_error`'s one-sided
    differences can no longer separate; a smaller step leaves every kink behind but those at ``θ`` itself.
    A wrong gradient stays wrong at every step. Returns the last difference and the evaluations spent."""
    spent = 0
    for k in range(tries):
        result = directional_difference(
            line.loss_fn, line.params, line.grads, line.direction, eps=eps * _KINK_SHRINK**k, base=base
        )
        spent += result.evaluations
        if result.error <= tolerance:
            break
    return result, spent


#: how much smaller each directional finite difference taken again around kinks steps
_KINK_SHRINK = 1e-2
#: how many times a directional finite difference that disagrees is taken again with a smaller step
KINK_RETRIES = 2


def _arbitrated(
    line: _TaylorLine, h0: float, *, eps: float, tolerance: float, retries: int, shrink: float
) -> TaylorCheckResult:
    """:func:`taylor_check` along ``line``: a miss goes to the directional finite difference, then the
    Taylor test is repeated with smaller steps."""
    first = line.test(h0, base=None)
    if first.passed:
        return TaylorCheckResult(
            taylor=first,
            h0s=[h0],
            directional=None,
            passed=True,
            inconclusive=False,
            evaluations=first.evaluations,
        )
    # the directional difference's own retries around kinks are paid whatever the Taylor retries: a kink
    # within ε of θ (a LayerNorm over a row near 0: its scale is sqrt(eps_LN) = 1e-6) is no wrong gradient
    tries = 1 + KINK_RETRIES
    arbiter, spent = _around_kinks(line, first.loss, eps=eps, tolerance=tolerance, tries=tries)
    evaluations = first.evaluations + spent
    agreed = arbiter.error <= tolerance  # else the gradient is wrong along v: no retry
    last, h0s = first, [h0]
    for _ in range(retries if agreed else 0):
        h0s.append(h0s[-1] * shrink)
        last = line.test(h0s[-1], base=first.loss)
        evaluations += last.evaluations
        if last.passed:
            break
    return TaylorCheckResult(
        taylor=last,
        h0s=h0s,
        directional=arbiter,
        passed=agreed,
        inconclusive=agreed and not last.passed,
        evaluations=evaluations,
    )
