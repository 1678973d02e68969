"""The gradient check of an ``nn.Module``: autograd against finite differences, in float64 on a copy.

No Trainer: :func:`gradcheck_module` takes the module, a closure that computes its loss and the
:class:`GradientCheckSettings`, and returns a :class:`GradientCheckResult` (one :class:`ParameterCheck`
per checked tensor). The model is deep-copied and the copy converted to float64
(:func:`~lightning_gradguard.monitors.gradcheck.graph.copy64`); the original and its gradients
are untouched. :func:`~lightning_gradguard.gradient_check`
(:mod:`~lightning_gradguard.monitors.gradcheck.callback`) is the face over it: it validates the
arguments, cuts the batch and converts it to float64, supplies the loss (a ``LightningModule``'s
``training_step`` by default) and restores the caller's RNG states;
:class:`~lightning_gradguard.GradientCheck` runs it at the start of ``fit``. The math is in
:mod:`~lightning_gradguard.functional.gradcheck`, the detection of the modules to check in
:mod:`~lightning_gradguard.monitors.gradcheck.graph`.

**How each tensor is checked.** (a) A Taylor test along a random unit direction ``v`` in that tensor,
tilted toward the claimed gradient (``h = 1e-2 * 0.5**k``, k = 0..5): the remainder should shrink with an
observed order of at least ``min_order``, or else its part linear in ``h`` stay within
``taylor_tolerance`` of the directional derivative. (b) Symmetric finite differences (step
``eps * max(1, |θ_i|)``) on up to ``samples_per_tensor`` coordinates (half the largest ``|grad|``, half
random), with relative error ``|a - n| / max(|a|, |n|, tiny)`` that must stay at or below ``tolerance``;
a coordinate above it is measured again with a 10x smaller step and keeps the smaller error (a loss
curved on the scale of ``eps``, a LayerNorm over a zero-initialized class token, leaves the first step's
linear regime; a wrong gradient disagrees at both steps).

A Taylor miss is not a verdict: steps that cross ReLU kinks (many of them where BatchNorm centres the
pre-activations on 0 and couples the samples) miss on correct gradients. After a miss, the symmetric
finite difference along the same ``v``, ``(L(θ + εv) - L(θ - εv)) / (2ε)``, is compared with
``<g, v>``: above ``tolerance`` the parameter fails. Otherwise the Taylor test is repeated with 100x
smaller steps (twice at most, budget permitting) until the remainder behaves; if it never does, the
Taylor test is *inconclusive* and the parameter passes on finite differences
(``ParameterCheck.taylor_inconclusive``); see :func:`~lightning_gradguard.functional.gradcheck.taylor_check`.
So a parameter fails when finite differences disagree with autograd: on a sampled coordinate, or along
the Taylor direction after a Taylor miss.

**Which tensors.** The target modules are ``modules`` when given (qualified names, ``""`` = the whole
model); otherwise the modules whose forward applies a custom ``autograd.Function`` (see
:func:`~lightning_gradguard.monitors.gradcheck.graph.find_custom_functions`) or that carry a
backward hook; if there are none, the whole model. Checked are the target modules' own parameters *and*
every parameter whose gradient flows through a custom Function or backward hook their forward created
(found by walking the autograd graph): a wrong *input* gradient of a custom Function (e.g. a
parameter-free custom activation) shows up only upstream. A target with neither and no parameters of its
own is checked through every parameter upstream of it. A parameter that autograd gives no gradient at
all is left out (``GradientCheckResult.not_in_graph``).

**The budget.** Each tensor is planned at 7 evaluations (the Taylor test) + 2 (the directional finite
difference after a miss) + 2k + 1 (k coordinates); the budget is ``max_evaluations``, and at most
``max_seconds`` over the time of one evaluation, timed on warm ones (the faster of two after the
first, which pays the graph walk and one-time costs). When it is short, fewer coordinates per tensor
are checked, then tensors spread evenly over the model are checked and the others left out
(``GradientCheckResult.skipped``). A Taylor test
repeated after a miss costs 6 and runs only on what the tensors after it leave over.

**One function.** Every evaluation sees the same function of the parameters: ``reseed(seed)`` first,
the buffers a forward pass updates (spectral norm's power-iteration vectors, BatchNorm's running
statistics, counters) put back, and, when the loss computation makes lower-precision tensors of its own,
every op's output promoted to float64
(:class:`~lightning_gradguard.monitors.gradcheck.graph.Float64Mode`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_gradguard.core.layers import user_name
from lightning_gradguard.functional.gradcheck import (
    KINK_RETRIES,
    finite_difference_check,
    sample_coordinates,
    taylor_check,
)
from lightning_gradguard.monitors.gradcheck.graph import (
    Float64Mode,
    GraphOwners,
    copy64,
    has_backward_hooks,
)

#: ``loss_fn(model)``: the scalar loss of ``model`` (the float64 copy) on a fixed float64 batch, or
#: ``None`` when there is none
ModuleLossFn = Callable[[nn.Module], Tensor | None]

_TAYLOR_STEPS = 6
#: After a Taylor miss: the evaluations of the directional finite difference that arbitrates it, with its
#: retries around kinks (reserved for every tensor), then up to this many Taylor tests with 100x smaller
#: steps (from what is left over).
_ARBITER_COST = 2 * (1 + KINK_RETRIES)
_TAYLOR_RETRIES = 2
_TAYLOR_SHRINK = 1e-2


# --------------------------------------------------------------------------------------------- results


@dataclass
class ParameterCheck:
    """The gradient check of one parameter tensor.

    Attributes:
        name: the parameter's qualified name.
        numel: its number of elements.
        checked: flat indices compared with finite differences.
        max_rel_error: the largest relative error ``|a - n| / max(|a|, |n|, tiny)`` over ``checked``.
        worst_index: the (multi-dimensional) index of that error, or ``None``.
        analytic: autograd's gradient at ``worst_index``.
        numeric: the finite-difference gradient at ``worst_index``.
        taylor_order: observed order of the Taylor remainder along a random direction in this tensor
            (about 2 when right, about 1 when wrong, NaN when the remainder is at rounding level), from
            the Taylor test that decided (the last one run when it was repeated with smaller steps).
        taylor_remainders: the remainders of that test, for ``h = taylor_h0[-1] * 0.5**k``.
        taylor_linear_error: the part of the remainder linear in ``h``, relative to the directional
            derivative (see :class:`~lightning_gradguard.functional.gradcheck.TaylorResult`).
        passed: ``max_rel_error <= tolerance`` and either the Taylor test passed or the directional
            finite difference along its direction agreed (``directional_error <= tolerance``). A Taylor
            miss alone never fails a parameter: kinks (ReLU, max-pooling) cause it on correct gradients.
        taylor_h0: the largest step of every Taylor test run: ``[1e-2]``, or after a miss
            ``[1e-2, 1e-4, ...]`` (repeated with 100x smaller steps, below the distance to the kinks).
        directional_error: relative error of the symmetric finite difference along the Taylor
            direction, ``(L(θ + εv) - L(θ - εv)) / (2ε)`` against ``<g, v>``; computed only after a
            Taylor miss (NaN otherwise). It covers every coordinate, not just the sampled ones.
        taylor_inconclusive: the Taylor test missed at every step size tried while finite differences
            agreed: passed, but the Taylor test showed nothing (the steps kept crossing kinks).
    """

    name: str
    numel: int
    checked: list[int]
    max_rel_error: float
    worst_index: tuple[int, ...] | None
    analytic: float
    numeric: float
    taylor_order: float
    taylor_remainders: list[float]
    taylor_linear_error: float
    passed: bool
    taylor_h0: list[float] = field(default_factory=list)
    directional_error: float = math.nan
    taylor_inconclusive: bool = False


@dataclass
class GradientCheckResult:
    """What :func:`gradient_check` found.

    Attributes:
        passed: every checked parameter passed.
        parameters: one :class:`ParameterCheck` per checked tensor.
        targets: the modules whose parameters were checked (``""`` = the whole model).
        custom_functions: ``{module: [custom Function names]}`` found in the forward pass.
        hooked_modules: modules with backward hooks.
        evaluations: loss evaluations spent.
        skipped: parameters left out because the evaluation budget ran out.
        not_in_graph: parameters left out because autograd gives them no gradient at all (used under
            ``torch.no_grad()``, behind a ``.detach()``, or not used).
        promoted: the loss computation made tensors of a lower floating precision (``y.float()``,
            ``torch.zeros(n)``); every evaluation then ran with those promoted to float64.
        loss: the float64 loss at the checked point.
        seconds: wall time.
    """

    passed: bool
    parameters: list[ParameterCheck] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    custom_functions: dict[str, list[str]] = field(default_factory=dict)
    hooked_modules: list[str] = field(default_factory=list)
    evaluations: int = 0
    skipped: list[str] = field(default_factory=list)
    promoted: bool = False
    not_in_graph: list[str] = field(default_factory=list)
    loss: float = math.nan
    seconds: float = 0.0

    @property
    def failures(self) -> list[ParameterCheck]:
        """The parameters whose gradient did not pass."""
        return [p for p in self.parameters if not p.passed]

    @property
    def inconclusive(self) -> list[ParameterCheck]:
        """The parameters that passed on finite differences alone: their Taylor test was inconclusive."""
        return [p for p in self.parameters if p.passed and p.taylor_inconclusive]


# ---------------------------------------------------------------------------------------------- engine


@dataclass(frozen=True, kw_only=True)
class GradientCheckSettings:
    """How :func:`gradcheck_module` checks each parameter tensor: the arguments of
    :func:`~lightning_gradguard.gradient_check` (which validates them) from ``samples_per_tensor`` on.

    Attributes:
        samples_per_tensor: coordinates compared with finite differences per parameter tensor.
        max_evaluations: bound on loss evaluations (how they are spent: the module's docstring).
        tolerance: the largest relative error accepted (seed texts: < 1e-5 correct, > 1e-3 a bug).
        min_order: the smallest observed Taylor order accepted.
        eps: the relative finite-difference step.
        seed: the seed for the batch-independent randomness (directions, coordinates, the model's RNG).
        taylor_tolerance: when the observed order is below ``min_order``, the largest part of the Taylor
            remainder linear in ``h`` (relative to the directional derivative) still blamed on kinks;
            above it the Taylor test missed and finite differences arbitrate. Healthy ReLU MLPs
            measured up to 8e-4, healthy Conv + BatchNorm + ReLU networks up to 0.12, wrong backwards
            0.5 and more.
        reseed: called with ``seed`` before every loss evaluation, so that any randomness in the loss is
            the same in every evaluation (the face re-seeds torch, NumPy and ``random``); ``None``:
            nothing is re-seeded.
        max_seconds: a bound on the check's time: the evaluations it may spend are at most this over the
            time of a warm one, the faster of two timed after the first (``None``: ``max_evaluations`` alone
            bounds it). Float64 convolutions
            on a CPU are slow: a 32-px MobileNetV2 took 6 minutes for 2000 evaluations.
    """

    samples_per_tensor: int = 6
    max_evaluations: int = 2000
    tolerance: float = 1e-3
    min_order: float = 1.5
    eps: float = 1e-6
    seed: int = 0
    taylor_tolerance: float = 1e-2
    reseed: Callable[[int], object] | None = torch.manual_seed
    max_seconds: float | None = 10.0


def gradcheck_module(
    module: nn.Module,
    loss_fn: ModuleLossFn,
    *,
    modules: list[str] | None = None,
    settings: GradientCheckSettings | None = None,
) -> GradientCheckResult:
    """Check autograd's gradients of ``module`` against finite differences, in float64, on a copy.

    How each tensor is checked, and which tensors: see the module's docstring.

    Args:
        module: the model; the float64 copy of it is what ``loss_fn`` receives.
        loss_fn: ``loss_fn(model) -> scalar loss`` of the float64 copy ``model`` on a fixed batch whose
            floating-point tensors are float64 (``None``, or a tensor with more than one element: a
            ``ValueError``).
        modules: qualified names of the modules to check (default: those with a custom
            ``autograd.Function`` or a backward hook, else the whole model).
        settings: how each tensor is checked (default: :class:`GradientCheckSettings`'s defaults).

    Returns:
        A :class:`GradientCheckResult` (``seconds`` left at 0: the caller times the whole check).
    """
    settings = settings if settings is not None else GradientCheckSettings()
    model = copy64(module)
    names = dict(model.named_modules())
    if modules is not None:  # the copy is uncompiled: ``net._orig_mod.0`` is ``net.0`` there
        by_user = {user_name(n): n for n in names}  # a module as users name it -> its name in the copy
        modules = [m if m in names else by_user.get(user_name(m), m) for m in modules]
        unknown = [m for m in modules if m not in names]
        if unknown:
            raise ValueError(f"`modules` names unknown modules {unknown}; known: {sorted(names)[:20]}")
    loss = _CopyLoss(model, loss_fn, settings)
    value, graph = _first_evaluation(model, loss, modules, names)
    result = GradientCheckResult(
        passed=True,
        custom_functions=graph.custom,
        hooked_modules=graph.hooked,
        evaluations=1,
        promoted=bool(loss.promoted),
        loss=float(value.detach()),
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return result
    grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
    del value
    result.targets = graph.targets
    # A parameter the loss's graph does not reach (used under no_grad, behind a .detach(), or not at all)
    # has no gradient to check: it is held constant on purpose (a teacher, a target network) or it is a
    # bug OverfitBatchSanity names (unused_parameter). Finite differences would only "discover" that the
    # loss depends on it.
    chosen = [(n, p, g) for (n, p), g in zip(named, grads, strict=True) if id(p) in graph.chosen]
    result.not_in_graph = [n for n, _, g in chosen if g is None]
    budget = _budget(result, loss, settings)
    _check_tensors(result, [(n, p, g) for n, p, g in chosen if g is not None], loss, settings, budget)
    result.passed = all(c.passed for c in result.parameters)
    return result


#: the warm evaluations timed to size the budget under ``max_seconds``
_TIMED = 2


def _budget(result: GradientCheckResult, loss: _CopyLoss, settings: GradientCheckSettings) -> int:
    """The evaluations the checks may spend after the first: ``max_evaluations`` less those spent, and
    under ``max_seconds`` no more than fit in it (the evaluations timed for it are spent too)."""
    budget = settings.max_evaluations - result.evaluations
    if settings.max_seconds is not None and budget > _TIMED:
        fit = _evaluations_within(loss, settings.max_seconds)
        result.evaluations += _TIMED
        budget = min(budget - _TIMED, fit)
    return budget


def _evaluations_within(loss: _CopyLoss, seconds: float) -> int:
    """How many evaluations of the Taylor tests and finite differences fit in ``seconds``: timed on warm
    ones, the faster of :data:`_TIMED`. The first evaluation is no measure of the others: it walks the
    graph, computes the gradients, and pays what happens once in a process (lazy imports, allocations),
    and one evaluation a loaded machine stalled would shrink the check to nothing."""
    fastest = math.inf
    for _ in range(_TIMED):
        started = time.perf_counter()
        loss.without_grad()
        fastest = min(fastest, time.perf_counter() - started)
    return int(seconds / max(fastest, 1e-9))


class _CopyLoss:
    """The loss of the float64 copy: the same function of its parameters at every evaluation.

    Before each evaluation: ``reseed(seed)``, and the buffers put back. The first evaluation runs under
    :class:`Float64Mode`; the later ones only when it promoted a tensor (``promoted``).
    """

    def __init__(self, model: nn.Module, loss_fn: ModuleLossFn, settings: GradientCheckSettings) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.seed = settings.seed
        self.reseed = settings.reseed
        # Buffers a forward pass updates (spectral norm's power-iteration vectors, BatchNorm's running
        # statistics, counters) are put back before every evaluation: each one sees the same function.
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.promoted: bool | None = None  # not known before the first evaluation

    def __call__(self) -> Tensor:
        if self.reseed is not None:
            self.reseed(self.seed)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        mode = Float64Mode() if self.promoted is not False else None
        with mode if mode is not None else nullcontext():
            loss = self.loss_fn(self.model)
        if mode is not None and self.promoted is None:
            self.promoted = mode.promoted  # nothing was promoted: the mode changes nothing, drop its cost
        if loss is None or loss.numel() != 1:
            raise ValueError("the loss must be a scalar tensor (training_step returned none)")
        return loss.reshape(())

    def without_grad(self) -> Tensor:
        """One evaluation without autograd: the closure of the Taylor tests and the finite differences."""
        with torch.no_grad():
            return self()


@dataclass(frozen=True, kw_only=True)
class _Graph:
    """What the first evaluation showed of the copy's autograd graph.

    Attributes:
        custom: ``{module: [custom Function names]}`` found in the forward pass.
        hooked: modules with backward hooks.
        targets: the modules whose parameters are checked (``""`` = the whole model).
        chosen: ``id`` of every parameter to check: the targets' own, and every one whose gradient
            passes through a custom Function or backward hook that a target's forward created.
    """

    custom: dict[str, list[str]]
    hooked: list[str]
    targets: list[str]
    chosen: set[int]


def _first_evaluation(
    model: nn.Module, loss: _CopyLoss, modules: list[str] | None, names: dict[str, nn.Module]
) -> tuple[Tensor, _Graph]:
    """The loss at the checked point, with its graph, and what the graph says about the modules."""
    owners = GraphOwners(model)
    try:
        with torch.enable_grad():
            value = loss()
            owners.claim(value, "")
    finally:
        owners.remove()
    custom = owners.custom_functions()
    hooked = [n for n, m in model.named_modules() if has_backward_hooks(m)]
    targets = list(modules) if modules is not None else sorted(set(custom) | set(hooked))
    if not targets:
        targets = [""]
    chosen = owners.upstream_parameters(targets, names)
    for t in targets:
        chosen.update(id(p) for p in names[t].parameters())
    return value, _Graph(custom=custom, hooked=hooked, targets=targets, chosen=chosen)


def _check_tensors(
    result: GradientCheckResult,
    tensors: list[tuple[str, nn.Parameter, Tensor]],
    loss: _CopyLoss,
    settings: GradientCheckSettings,
    budget: int,
) -> None:
    """Check each ``(name, parameter, gradient)`` in turn, within ``budget`` evaluations.

    Each tensor is planned at ``num_steps + 1`` evaluations for the Taylor test, 2 for the directional
    finite difference that arbitrates a miss and ``2k + 1`` for ``k`` coordinates. When the budget cannot
    plan every tensor at one coordinate, the tensors checked are spread evenly over the model (the first
    and the last among them: a bug at any depth has a checked tensor near it) and the others are
    ``skipped``. Repeating a missed Taylor test with smaller steps (``num_steps`` each) is paid from what
    the tensors after it leave over.
    """
    taylor_cost = _TAYLOR_STEPS + 1 + _ARBITER_COST
    fits = budget // (taylor_cost + 3)
    if fits < len(tensors):
        kept = {round(i * (len(tensors) - 1) / max(fits - 1, 1)) for i in range(fits)} if fits else set()
        result.skipped.extend(n for i, (n, _, _) in enumerate(tensors) if i not in kept)
        tensors = [t for i, t in enumerate(tensors) if i in kept]
    per_tensor = budget // max(len(tensors), 1)
    k = max(1, min(settings.samples_per_tensor, (per_tensor - taylor_cost - 1) // 2))
    costs = [taylor_cost + 2 * min(k, p.numel()) + 1 for _, p, _ in tensors]
    gen = torch.Generator().manual_seed(settings.seed)
    for i, (name, p, g) in enumerate(tensors):
        if budget < costs[i]:
            result.skipped.append(name)
            continue
        spare = budget - costs[i] - sum(costs[i + 1 :])
        retries = max(0, min(_TAYLOR_RETRIES, spare // _TAYLOR_STEPS))
        check, spent = _check_tensor(
            loss, name, p, g, k=min(k, p.numel()), retries=retries, gen=gen, settings=settings
        )
        budget -= spent
        result.evaluations += spent
        result.parameters.append(check)


def _check_tensor(
    loss: _CopyLoss,
    name: str,
    p: nn.Parameter,
    g: Tensor,
    *,
    k: int,
    retries: int,
    gen: torch.Generator,
    settings: GradientCheckSettings,
) -> tuple[ParameterCheck, int]:
    """The arbitrated Taylor test and finite differences on ``k`` coordinates of one tensor, and the loss
    evaluations they spent."""
    taylor = taylor_check(
        loss.without_grad,
        [p],
        [g],
        num_steps=_TAYLOR_STEPS,
        min_order=settings.min_order,
        taylor_tolerance=settings.taylor_tolerance,
        eps=settings.eps,
        tolerance=settings.tolerance,
        retries=retries,
        shrink=_TAYLOR_SHRINK,
        generator=gen,
    )
    coordinates = sample_coordinates(g, p.numel(), k, gen)
    fd = finite_difference_check(
        loss.without_grad, p, g, coordinates, eps=settings.eps, tolerance=settings.tolerance
    )
    worst = fd.worst >= 0
    check = ParameterCheck(
        name=name,
        numel=p.numel(),
        checked=fd.indices,
        max_rel_error=fd.max_error,
        worst_index=_unravel(fd.indices[fd.worst], tuple(p.shape)) if worst else None,
        analytic=fd.analytic[fd.worst] if worst else math.nan,
        numeric=fd.numeric[fd.worst] if worst else math.nan,
        taylor_order=taylor.taylor.order,
        taylor_remainders=taylor.taylor.remainders,
        taylor_linear_error=taylor.taylor.linear_error,
        passed=fd.max_error <= settings.tolerance and taylor.passed,
        taylor_h0=taylor.h0s,
        directional_error=math.nan if taylor.directional is None else taylor.directional.error,
        taylor_inconclusive=taylor.inconclusive,
    )
    return check, taylor.evaluations + fd.evaluations


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for dim in reversed(shape):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))
