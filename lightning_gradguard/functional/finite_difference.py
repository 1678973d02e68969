"""Finite differences for gradient checking: the relative error, sampled coordinates, one direction.

Both tests take a closure ``loss_fn()`` that recomputes a scalar loss from the *current* values of some
tensors (usually parameters) and perturb those tensors in place, restoring them bit for bit afterwards.
Run them in float64 (see :mod:`lightning_gradguard.functional.gradcheck`, which builds the Taylor test on
them and re-exports them).

* :func:`finite_difference_check` compares ``g`` with ``(L(θ + ε e_i) - L(θ - ε e_i)) / (2 ε)`` on a
  bounded sample of coordinates ``i`` per tensor, with the relative error
  ``|a - n| / max(|a|, |n|, tiny)``.
* :func:`directional_difference` compares ``<g, v>`` with ``(L(θ + ε v) - L(θ - ε v)) / (2 ε)``: one
  finite difference that covers every coordinate the direction touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "EPS64",
    "DirectionalResult",
    "FiniteDifferenceResult",
    "directional_difference",
    "dot",
    "finite_difference_check",
    "loss_value",
    "relative_error",
    "sample_coordinates",
]

LossFn = Callable[[], Tensor]

#: float64 machine epsilon: the rounding level the noise floors below are built on.
EPS64 = float(torch.finfo(torch.float64).eps)


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
    with torch.no_grad():
        out = loss_fn()
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise ValueError("`loss_fn` must return a tensor with a single element (the scalar loss)")
    return float(out.detach().double().reshape(()))


def dot(grads: Sequence[Tensor | None], direction: Sequence[Tensor]) -> float:
    return sum(
        float((g.double() * d.double()).sum()) for g, d in zip(grads, direction, strict=True) if g is not None
    )


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

    Unlike :func:`finite_difference_check`, which samples a few coordinates, this covers every
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
    scale = max([1.0] + [float(p.detach().abs().max()) for p in params if p.numel()])
    step = eps * scale
    saved = [p.detach().clone() for p in params]
    evaluations = 2
    try:
        if base is None and tiny is None:
            base = loss_value(loss_fn)
            evaluations += 1
        with torch.no_grad():
            for p, s, d in zip(params, saved, direction, strict=True):
                p.copy_(s + step * d)
        plus_at = [p.detach().clone() for p in params]
        plus = loss_value(loss_fn)
        with torch.no_grad():
            for p, s, d in zip(params, saved, direction, strict=True):
                p.copy_(s - step * d)
        # the displacement actually applied, after rounding θ ± ε v to the parameter's precision
        moved = [a - p.detach() for a, p in zip(plus_at, params, strict=True)]
        minus = loss_value(loss_fn)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    analytic = dot(grads, moved) / (2 * step)
    numeric = (plus - minus) / (2 * step)
    if tiny is None:
        tiny = max(1e-8, 1e4 * EPS64 * max(abs(float(base or 0.0)), 1.0) / step)
    return DirectionalResult(
        analytic=analytic,
        numeric=numeric,
        error=relative_error(analytic, numeric, tiny),
        step=step,
        tiny=tiny,
        evaluations=evaluations,
    )


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
    base = loss_value(loss_fn)
    evaluations = 1
    for i in indices:
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
        evaluations += 2
        numeric.append((plus - minus) / (2 * step))
        analytic.append(float(g[i]) if g is not None else 0.0)
    if tiny is None:
        tiny = max(1e-8, 1e4 * EPS64 * max(abs(base), 1.0) / eps)
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
