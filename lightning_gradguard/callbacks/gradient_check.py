r"""
GradientCheck
=============

Pre-flight check of the backward pass: compares autograd's gradients with finite differences, in
float64 on a tiny slice of a batch, for the modules most likely to be wrong (those with a custom
``torch.autograd.Function`` or a backward hook). Usable as a callback (at the start of ``fit``) or as a
plain function on any module and batch.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_gradguard.alerts import Alert, SanityCheckError
from lightning_gradguard.callbacks.overfit_batch import preflight_applies
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.core.batch import first_train_batch, slice_batch, tensors_in
from lightning_gradguard.core.collective import reduce_any
from lightning_gradguard.core.snapshot import RNGState, train_loader_generators
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.trial import loss_of, quiet_logging, seed_all, training_step_of
from lightning_gradguard.core.validate import check_float, check_int, check_str_list
from lightning_gradguard.functional.gradcheck import (
    finite_difference_check,
    sample_coordinates,
    taylor_check,
)

__all__ = [
    "GradientCheck",
    "GradientCheckResult",
    "ParameterCheck",
    "find_custom_functions",
    "gradient_check",
]

log = logging.getLogger("lightning_gradguard")

LossFn = Callable[[nn.Module, Any], Tensor]

_TAYLOR_STEPS = 6
#: After a Taylor miss: the evaluations of the directional finite difference that arbitrates it (reserved
#: for every tensor), then up to this many Taylor tests with 100x smaller steps (from what is left over).
_ARBITER_COST = 2
_TAYLOR_RETRIES = 2
_TAYLOR_SHRINK = 1e-2

_HINT = (
    "The backward pass of this parameter disagrees with the loss it differentiates. In a custom "
    "autograd.Function check: a missing factor (chain rule, a constant, the 1/N of a mean), a missing "
    "transpose (grad_input = grad_output @ W, grad_W = grad_output.T @ x), the wrong saved tensor, a "
    "missing sum over a broadcast dimension, or a sign. A backward hook must return a gradient of the "
    "same meaning, not a rescaled one."
)


# --------------------------------------------------------------------------------------------- detection


def _is_custom_node(node: Any) -> bool:
    from torch.autograd.function import BackwardCFunction

    return isinstance(node, BackwardCFunction) and type(node).__name__ != "BackwardHookFunctionBackward"


class _GraphOwners:
    """Forward hooks that attribute every autograd node to the innermost module whose forward created it.

    When a module's forward starts, every node reachable from its inputs that nobody owns yet belongs to
    the module that is running (its parent, or "" outside any module); when it ends, every new node
    reachable from its outputs belongs to it. Children end before their parent, so a node goes to the
    innermost module. Nodes made outside any module (e.g. the loss in ``training_step``) belong to ``""``.
    """

    def __init__(self, root: nn.Module) -> None:
        self.owner: dict[Any, str] = {}
        self.stack: list[str] = []
        self.handles: list[Any] = []
        for name, m in root.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name)))

    def claim(self, obj: Any, owner: str) -> None:
        todo = [t.grad_fn for t in tensors_in(obj) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.owner:
                continue
            self.owner[node] = owner
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.claim(args, self.stack[-1] if self.stack else "")
            self.stack.append(name)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.claim(output, name)
            if self.stack:
                self.stack.pop()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def upstream_parameters(self, targets: list[str], names: dict[str, nn.Module]) -> set[int]:
        """``id`` of every leaf tensor whose gradient passes through a hand-written backward in ``targets``.

        The walk starts at the custom-Function and backward-hook nodes created inside each target (a
        target with neither and no parameters of its own: at every node it created) and follows the
        graph to the leaves.
        """
        from torch.autograd.function import BackwardCFunction

        todo: list[Any] = []
        for t in targets:
            own = [n for n, o in self.owner.items() if t == "" or o == t or o.startswith(t + ".")]
            custom = [n for n in own if isinstance(n, BackwardCFunction)]
            has_params = any(True for _ in names[t].parameters())
            todo.extend(custom if custom or has_params else own)
        seen: set[int] = set()
        found: set[int] = set()
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if isinstance(variable, Tensor):
                found.add(id(variable))
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return found

    def custom_functions(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for node, owner in self.owner.items():
            if _is_custom_node(node):
                name = type(node).__name__.removesuffix("Backward")
                if name not in found.setdefault(owner, []):
                    found[owner].append(name)
        return found


def find_custom_functions(module: nn.Module, closure: Callable[[], Any]) -> dict[str, list[str]]:
    """Which module's forward applies which custom ``torch.autograd.Function``.

    Runs ``closure()`` (which must call ``module`` and return its output or loss) with forward hooks on
    every sub-module, walks the autograd graph of what it returns, and maps every node of a custom
    ``Function`` (a ``BackwardCFunction``) to the innermost module whose forward created it (``""``:
    the root module or code outside any module).

    Returns:
        ``{module name: [Function class names]}``.
    """
    owners = _GraphOwners(module)
    try:
        out = closure()
        owners.claim(out, "")
    finally:
        owners.remove()
    return owners.custom_functions()


class _Float64Mode(TorchFunctionMode):
    """Every floating-point tensor an op returns comes back in float64; ``promoted`` says if one was not.

    The model is copied to float64, but code in ``training_step`` often makes float32 tensors of its own
    (``y.float()``, ``torch.zeros(n)``, ``.to(torch.float32)``): a loss that passes through one is rounded
    to float32, and finite differences at ``eps = 1e-6`` then measure rounding noise, not the gradient.
    """

    def __init__(self) -> None:
        super().__init__()
        self.promoted = False

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return self._to64(func(*args, **(kwargs or {})))

    def _to64(self, out: Any) -> Any:
        if isinstance(out, Tensor):
            if out.is_floating_point() and out.dtype != torch.float64:
                self.promoted = True
                return out.double()
            return out
        if type(out) in (tuple, list):
            return type(out)(self._to64(o) for o in out)
        return out


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


# --------------------------------------------------------------------------------------------- function


def _validate(
    max_samples: int | None,
    samples_per_tensor: int,
    max_evaluations: int,
    tolerance: float,
    min_order: float,
    eps: float,
    seed: int,
    taylor_tolerance: float,
) -> None:
    check_int("max_samples", max_samples, 1, allow_none=True)
    check_int("samples_per_tensor", samples_per_tensor, 1)
    check_int("max_evaluations", max_evaluations, 1)
    check_float("tolerance", tolerance, 0.0, low_open=True)
    check_float("min_order", min_order, 0.0)
    check_float("eps", eps, 0.0, 1.0, low_open=True)
    check_int("seed", seed, 0)
    check_float("taylor_tolerance", taylor_tolerance, 0.0, low_open=True)


def _has_backward_hooks(m: nn.Module) -> bool:
    return bool(m._backward_hooks) or bool(getattr(m, "_backward_pre_hooks", None))


def gradient_check(
    module: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    modules: list[str] | None = None,
    max_samples: int | None = 4,
    samples_per_tensor: int = 6,
    max_evaluations: int = 2000,
    tolerance: float = 1e-3,
    min_order: float = 1.5,
    eps: float = 1e-6,
    seed: int = 0,
    taylor_tolerance: float = 1e-2,
) -> GradientCheckResult:
    """Check autograd's gradients of ``module`` against finite differences, in float64.

    The module is deep-copied and the copy converted to float64; the original, its gradients and the
    caller's RNG states are untouched. The copy stays in train mode, so BatchNorm normalises with the
    statistics of the (fixed) batch slice, a deterministic function of the parameters; its running
    statistics change on the copy only. ``nn.Dropout`` modules are switched to eval, and before every
    loss evaluation torch, NumPy and ``random`` are re-seeded with ``seed``, so any randomness left
    (functional dropout, noise) is the same in every evaluation and the finite differences see one
    deterministic function.

    For each checked parameter tensor: (a) a Taylor test along a random unit direction ``v`` in that
    tensor, tilted toward the claimed gradient (``h = 1e-2 * 0.5**k``, k = 0..5): the remainder should
    shrink with an observed order of at least ``min_order``, or else its part linear in ``h`` stay
    within ``taylor_tolerance`` of the directional derivative; (b) symmetric finite differences (step
    ``eps * max(1, |θ_i|)``) on up to ``samples_per_tensor`` coordinates (half the largest ``|grad|``,
    half random), with relative error ``|a - n| / max(|a|, |n|, tiny)`` that must stay at or below
    ``tolerance``.

    A Taylor miss is not a verdict: steps that cross ReLU kinks (many of them where BatchNorm centres
    the pre-activations on 0 and couples the samples) miss on correct gradients. After a miss, the
    symmetric finite difference along the same ``v``, ``(L(θ + εv) - L(θ - εv)) / (2ε)``, is compared
    with ``<g, v>``: above ``tolerance`` the parameter fails. Otherwise the Taylor test is repeated with
    100x smaller steps (twice at most, budget permitting) until the remainder behaves; if it never does,
    the Taylor test is *inconclusive* and the parameter passes on finite differences
    (``ParameterCheck.taylor_inconclusive``). See
    :func:`~lightning_gradguard.functional.gradcheck.taylor_check`.

    A parameter fails when finite differences disagree with autograd: on a sampled coordinate, or along
    the Taylor direction after a Taylor miss.

    Which parameters: the target modules are ``modules`` when given (qualified names, ``""`` = the whole
    model); otherwise the modules whose forward applies a custom ``autograd.Function`` (see
    :func:`find_custom_functions`) or that carry a backward hook; if there are none, the whole model.
    Checked are the target modules' own parameters *and* every parameter whose gradient flows through
    a custom Function or backward hook their forward created (found by walking the autograd graph): a
    wrong *input* gradient of a custom Function (e.g. a parameter-free custom activation) shows up only
    upstream. A target with neither and no parameters of its own is checked through every parameter
    upstream of it.

    Args:
        module: the model (a ``LightningModule`` or any ``nn.Module``).
        batch: one batch, as ``training_step`` / ``loss_fn`` takes it.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``; default for a ``LightningModule``: its
            ``training_step(batch, 0)`` (``self.log`` calls are swallowed).
        modules: qualified names of the modules to check (default: detected, see above).
        max_samples: cut the batch to this many samples (``None``: keep it whole).
        samples_per_tensor: coordinates compared with finite differences per parameter tensor.
        max_evaluations: bound on loss evaluations; when the budget is short, fewer coordinates per
            tensor are checked, then tensors are left out (listed in ``skipped``). Each tensor is planned
            at 7 (Taylor test) + 2 (the directional finite difference after a miss) + 2k + 1 (k
            coordinates); a Taylor test repeated after a miss costs 6 and runs only on what is left over.
        tolerance: the largest relative error accepted (seed texts: < 1e-5 correct, > 1e-3 a bug).
        min_order: the smallest observed Taylor order accepted.
        eps: the relative finite-difference step.
        seed: the seed for the batch-independent randomness (directions, coordinates, the model's RNG).
        taylor_tolerance: when the observed order is below ``min_order``, the largest part of the Taylor
            remainder linear in ``h`` (relative to the directional derivative) still blamed on kinks;
            above it the Taylor test missed and finite differences arbitrate. Healthy ReLU MLPs
            measured up to 8e-4, healthy Conv + BatchNorm + ReLU networks up to 0.12, wrong backwards
            0.5 and more.

    Returns:
        A :class:`GradientCheckResult`.

    Example::

        from lightning_gradguard.callbacks.gradient_check import gradient_check

        result = gradient_check(model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
        for p in result.failures:
            print(p.name, p.max_rel_error, p.taylor_order)
    """
    _validate(
        max_samples, samples_per_tensor, max_evaluations, tolerance, min_order, eps, seed, taylor_tolerance
    )
    modules = check_str_list("modules", modules)
    if loss_fn is None and not isinstance(module, pl.LightningModule):
        raise ValueError(
            "`loss_fn` is required unless `module` is a LightningModule (then training_step is used)"
        )
    started = time.perf_counter()
    rng = RNGState()
    try:
        result = _check(
            module,
            batch,
            loss_fn,
            modules,
            max_samples,
            samples_per_tensor,
            max_evaluations,
            tolerance,
            min_order,
            eps,
            seed,
            taylor_tolerance,
        )
    finally:
        rng.restore()
    result.seconds = time.perf_counter() - started
    return result


def _copy64(module: nn.Module) -> nn.Module:
    trainer = module.__dict__.get("_trainer")
    clone = copy.deepcopy(module)
    if isinstance(module, pl.LightningModule):
        clone.__dict__["_trainer"] = trainer
    clone.to(torch.float64)
    clone.train()
    for m in clone.modules():
        if isinstance(m, (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)):
            m.eval()
        if _power_iterates(m):
            m.eval()
    return clone


def _power_iterates(m: nn.Module) -> bool:
    """A spectral-norm module: in train mode each forward runs a power-iteration step under ``no_grad``.

    Training differentiates ``W / (u^T W v)`` with ``u, v`` held constant; in eval mode the forward *is*
    that function of ``W`` (no iteration step), so the comparison with finite differences is exact.
    """
    from torch.nn.utils.spectral_norm import SpectralNorm

    return type(m).__name__ == "_SpectralNorm" or any(
        isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()
    )


def _check(
    module: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    modules: list[str] | None,
    max_samples: int | None,
    samples_per_tensor: int,
    max_evaluations: int,
    tolerance: float,
    min_order: float,
    eps: float,
    seed: int,
    taylor_tolerance: float,
) -> GradientCheckResult:
    model = _copy64(module)
    names = dict(model.named_modules())
    if modules is not None:
        unknown = [m for m in modules if m not in names]
        if unknown:
            raise ValueError(f"`modules` names unknown modules {unknown}; known: {sorted(names)[:20]}")
    batch = slice_batch(batch, max_samples)
    batch = apply_to_collection(batch, Tensor, lambda t: t.detach().double() if t.is_floating_point() else t)

    promote = [True]  # the first evaluation finds out whether float64 must be enforced
    # Buffers a forward pass updates (spectral norm's power-iteration vectors, BatchNorm's running
    # statistics, counters) are put back before every evaluation: each one sees the same function.
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def raw_loss() -> Tensor:
        seed_all(seed)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        mode = _Float64Mode() if promote[0] else None
        with mode if mode is not None else nullcontext():
            if loss_fn is not None:
                out = loss_fn(model, batch)
            else:
                with quiet_logging(model):
                    out = training_step_of(model, batch)
        if mode is not None and len(promote) == 1:
            promote.append(mode.promoted)
            promote[0] = mode.promoted  # nothing was promoted: the mode changes nothing, drop its cost
        loss = loss_of(out)
        if loss is None or loss.numel() != 1:
            raise ValueError("the loss must be a scalar tensor (training_step returned none)")
        return loss.reshape(())

    owners = _GraphOwners(model)
    try:
        with torch.enable_grad():
            loss = raw_loss()
            owners.claim(loss, "")
    finally:
        owners.remove()
    custom = owners.custom_functions()
    hooked = [n for n, m in model.named_modules() if _has_backward_hooks(m)]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    result = GradientCheckResult(passed=True, custom_functions=custom, hooked_modules=hooked, evaluations=1)
    result.promoted = promote[0]
    result.loss = float(loss.detach())
    if not params:
        return result
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    del loss
    grad_of = {id(p): g for p, g in zip(params, grads, strict=True)}

    targets = list(modules) if modules is not None else sorted(set(custom) | set(hooked))
    if not targets:
        targets = [""]
    chosen = owners.upstream_parameters(targets, names)
    del owners
    for t in targets:
        chosen.update(id(p) for p in names[t].parameters())
    # A parameter the loss's graph does not reach (used under no_grad, behind a .detach(), or not at all)
    # has no gradient to check: it is held constant on purpose (a teacher, a target network) or it is a
    # bug OverfitBatchSanity names (unused_parameter). Finite differences would only "discover" that the
    # loss depends on it.
    result.not_in_graph = [n for n, p in named if id(p) in chosen and grad_of[id(p)] is None]
    check_list = [(n, p) for n, p in named if id(p) in chosen and grad_of[id(p)] is not None]
    result.targets = targets

    # Evaluation budget: (num_steps + 1) for the Taylor test and 2 for the directional finite difference
    # that arbitrates a miss, 2k + 1 for k finite-difference coordinates. Repeating a missed Taylor test
    # with smaller steps (num_steps each) is paid from what the other tensors leave over.
    taylor_cost = _TAYLOR_STEPS + 1 + _ARBITER_COST
    budget = max_evaluations - 1
    per_tensor = budget // max(len(check_list), 1)
    k = max(1, min(samples_per_tensor, (per_tensor - taylor_cost - 1) // 2))
    costs = [taylor_cost + 2 * min(k, p.numel()) + 1 for _, p in check_list]

    def closure() -> Tensor:
        with torch.no_grad():
            return raw_loss()

    gen = torch.Generator().manual_seed(seed)
    for i, (name, p) in enumerate(check_list):
        g = grad_of[id(p)]
        kk = min(k, p.numel())
        if budget < costs[i]:
            result.skipped.append(name)
            continue
        spare = budget - costs[i] - sum(costs[i + 1 :])
        taylor = taylor_check(
            closure,
            [p],
            [g],
            num_steps=_TAYLOR_STEPS,
            min_order=min_order,
            taylor_tolerance=taylor_tolerance,
            eps=eps,
            tolerance=tolerance,
            retries=max(0, min(_TAYLOR_RETRIES, spare // _TAYLOR_STEPS)),
            shrink=_TAYLOR_SHRINK,
            generator=gen,
        )
        idx = sample_coordinates(g, p.numel(), kk, gen)
        fd = finite_difference_check(closure, p, g, idx, eps=eps)
        budget -= taylor.evaluations + fd.evaluations
        result.evaluations += taylor.evaluations + fd.evaluations
        worst = fd.indices[fd.worst] if fd.worst >= 0 else None
        check = ParameterCheck(
            name=name,
            numel=p.numel(),
            checked=fd.indices,
            max_rel_error=fd.max_error,
            worst_index=None if worst is None else _unravel(worst, tuple(p.shape)),
            analytic=fd.analytic[fd.worst] if fd.worst >= 0 else math.nan,
            numeric=fd.numeric[fd.worst] if fd.worst >= 0 else math.nan,
            taylor_order=taylor.taylor.order,
            taylor_remainders=taylor.taylor.remainders,
            taylor_linear_error=taylor.taylor.linear_error,
            passed=fd.max_error <= tolerance and taylor.passed,
            taylor_h0=taylor.h0s,
            directional_error=math.nan if taylor.directional is None else taylor.directional.error,
            taylor_inconclusive=taylor.inconclusive,
        )
        result.parameters.append(check)
    result.passed = all(c.passed for c in result.parameters)
    return result


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for dim in reversed(shape):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))


def describe(check: ParameterCheck) -> str:
    """One line: the parameter, its largest relative error with the two values, the Taylor order and,
    when a Taylor miss was arbitrated, the finite difference along the Taylor direction."""
    at = f"[{', '.join(map(str, check.worst_index))}]" if check.worst_index else ""
    order = "n/a" if math.isnan(check.taylor_order) else f"{check.taylor_order:.2f}"
    along = (
        ""
        if math.isnan(check.directional_error)
        else f"; along the Taylor direction finite differences give a relative error of "
        f"{check.directional_error:.2e}"
    )
    return (
        f"`{check.name}`{at}: relative error {check.max_rel_error:.2e} (autograd {check.analytic:.6g}, "
        f"finite differences {check.numeric:.6g}; {len(check.checked)} coordinates checked), Taylor order "
        f"{order} (2 expected), linear Taylor remainder {check.taylor_linear_error:.2e} of the directional "
        f"derivative{along}"
    )


def _passed_line(result: GradientCheckResult) -> str:
    """One line on a check that passed: how many tensors, of what, the largest relative error, the time."""
    n = len(result.parameters)
    whole = result.targets in ([""], [])
    where = "of the whole model" if whole else f"(targets {', '.join(repr(t) for t in result.targets)})"
    if n == 0:
        return f"GradientCheck: passed - no parameter tensor {where} to check ({result.seconds:.1f} s)."
    worst = max(p.max_rel_error for p in result.parameters)
    line = (
        f"GradientCheck: passed - {n} parameter tensor{'s' if n != 1 else ''} {where} checked against "
        f"finite differences in float64, largest relative error {worst:.1e} ({result.seconds:.1f} s)"
    )
    unsure = result.inconclusive
    if unsure:
        names = ", ".join(f"`{p.name}`" for p in unsure[:3]) + (", ..." if len(unsure) > 3 else "")
        line += (
            f"; Taylor test inconclusive for {len(unsure)} ({names}): its steps kept crossing kinks, "
            "finite differences along its direction agree"
        )
    return line + "."


def pattern(check: ParameterCheck) -> str:
    """A sentence on what the two gradient values look like, when they match a known pattern, else ``""``.

    Some backwards differ from the derivative on purpose: a straight-through estimator (forward rounds,
    backward passes the gradient through; finite differences see no dependence), a gradient-reversal
    layer (the sign flipped). Those are reported too — they are mismatches — but the hint says so.
    """
    a, n = check.analytic, check.numeric
    if not (math.isfinite(a) and math.isfinite(n)) or a == 0:
        return ""
    if abs(n) <= 1e-3 * abs(a):
        return (
            " Finite differences see almost no dependence where autograd sees one: a straight-through "
            "estimator (or an `x + (q - x).detach()` trick) does this on purpose — if so, leave that module "
            "out of `modules`."
        )
    if abs(a + n) <= 1e-2 * abs(a):
        return (
            " The two agree up to the sign: a gradient-reversal layer does this on purpose — if so, leave "
            "that module out of `modules`; otherwise a sign is lost in the backward."
        )
    ratio = a / n if n else math.inf
    if abs(ratio) < 1e3 and abs(ratio - round(ratio)) <= 1e-2 * abs(ratio) and round(ratio) not in (0, 1):
        return f" Autograd is {round(ratio)}x the true gradient: a constant factor is wrong."
    inverse = n / a
    if (
        abs(inverse) < 1e3
        and abs(inverse - round(inverse)) <= 1e-2 * abs(inverse)
        and round(inverse) not in (0, 1)
    ):
        return f" Autograd is 1/{round(inverse)} of the true gradient: a constant factor is missing."
    return ""


# --------------------------------------------------------------------------------------------- callback


class GradientCheck(GradGuardCallback):
    r"""Pre-flight gradient check at the start of ``fit``: autograd against finite differences in float64.

    Runs :func:`gradient_check` once per ``fit`` in ``on_train_start`` (after Lightning set up the model
    and the dataloaders, before the first real batch) on the first batch of a fresh pass over the train
    dataloader, cut to ``max_samples`` samples, through ``training_step``. The real model is never
    touched (the check works on a float64 deep copy) and the RNG states, including the dataloader
    sampler's, are restored, so the real run is the one it would have been without the check.

    A parameter fails when finite differences disagree with autograd (on a sampled coordinate, or along
    the Taylor direction after a Taylor miss); a Taylor miss alone, which ReLU kinks cause on correct
    gradients, is arbitrated and at worst *inconclusive* (see :func:`gradient_check`). Each failing
    parameter gives an alert ``gradient_mismatch`` (severity error) naming the parameter, the relative
    error, the two gradient values and the observed Taylor order. With ``action="raise"`` (default)
    every rank raises :class:`~lightning_gradguard.SanityCheckError` after the verdict was reduced
    across ranks; ``"warn"`` reports and trains on. A check that passed says so in one INFO line on
    the ``lightning_gradguard`` logger (global rank zero): how many tensors, the largest relative
    error, the time, and any inconclusive Taylor tests.

    Args:
        modules: qualified names of the modules to check (default: the modules with a custom
            ``autograd.Function`` or a backward hook, else all).
        max_samples: samples of the first batch used.
        samples_per_tensor: coordinates checked with finite differences per parameter tensor.
        max_evaluations: bound on the number of loss evaluations.
        tolerance: largest relative error accepted.
        min_order: smallest observed Taylor order accepted before finite differences arbitrate.
        eps: relative finite-difference step.
        seed: seed of the check's own randomness.
        taylor_tolerance: see :func:`gradient_check`.
        action: ``"raise"`` (default), ``"warn"`` or ``"stop"``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard.callbacks.gradient_check import GradientCheck

        check = GradientCheck()           # checks the layers with custom autograd Functions
        Trainer(callbacks=[check]).fit(model, datamodule=dm)
        print(check.result.targets, [(p.name, p.max_rel_error) for p in check.result.parameters])
    """

    error_type = SanityCheckError
    state_key_args = ("modules",)

    def __init__(
        self,
        modules: list[str] | None = None,
        max_samples: int | None = 4,
        samples_per_tensor: int = 6,
        max_evaluations: int = 2000,
        tolerance: float = 1e-3,
        min_order: float = 1.5,
        eps: float = 1e-6,
        seed: int = 0,
        taylor_tolerance: float = 1e-2,
        action: Literal["raise", "warn", "stop"] = "raise",
    ) -> None:
        super().__init__(action=action, cooldown_steps=0)
        _validate(
            max_samples,
            samples_per_tensor,
            max_evaluations,
            tolerance,
            min_order,
            eps,
            seed,
            taylor_tolerance,
        )
        self.modules: list[str] | None = check_str_list("modules", modules)
        self.max_samples: int | None = None if max_samples is None else int(max_samples)
        self.samples_per_tensor = int(samples_per_tensor)
        self.max_evaluations = int(max_evaluations)
        self.tolerance = float(tolerance)
        self.min_order = float(min_order)
        self.eps = float(eps)
        self.seed = int(seed)
        self.taylor_tolerance = float(taylor_tolerance)
        self.result: GradientCheckResult | None = None
        self._in_checkpoint = False  # set by load_state_dict: the resumed run had this check

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checked_before, self._in_checkpoint = self._in_checkpoint, False
        if not preflight_applies(self, trainer, pl_module, checked_before):
            return
        gens = train_loader_generators(trainer)
        if self.modules is not None:
            unknown = [m for m in self.modules if m not in dict(pl_module.named_modules())]
            if unknown:
                raise ValueError(f"`modules` names modules that {type(pl_module).__name__} lacks: {unknown}")
        rng = RNGState(gens)
        self.result = None
        try:
            batch, _ = first_train_batch(trainer)
            rng.restore()
            self.result = gradient_check(
                pl_module,
                batch,
                modules=self.modules,
                max_samples=self.max_samples,
                samples_per_tensor=self.samples_per_tensor,
                max_evaluations=self.max_evaluations,
                tolerance=self.tolerance,
                min_order=self.min_order,
                eps=self.eps,
                seed=self.seed,
                taylor_tolerance=self.taylor_tolerance,
            )
        except Exception as err:  # a model or loader we cannot drive: warn, never crash
            warn_once(
                trainer,
                "gradient_check_error",
                f"GradientCheck could not run the check ({type(err).__name__}: {err}); skipped.",
            )
        finally:
            rng.restore()
        self._conclude(trainer, self.result)  # on every rank, even a skipped one: the verdict is collective

    def _conclude(self, trainer: pl.Trainer, result: GradientCheckResult | None) -> None:
        alerts: list[Alert] = []
        ran = result is not None
        if result is None:
            result = GradientCheckResult(passed=True)
        if result.skipped:
            warn_once(
                trainer,
                "gradient_check_budget",
                f"GradientCheck: max_evaluations={self.max_evaluations} left {len(result.skipped)} parameter "
                f"tensor(s) unchecked: {result.skipped[:8]}",
            )
        for check in result.failures:
            alert = self.report(
                trainer,
                "gradient_mismatch",
                "error",
                check.name,
                "Autograd and finite differences disagree: " + describe(check) + ".",
                _HINT + pattern(check),
                {
                    "relative_error": check.max_rel_error,
                    "analytic": check.analytic,
                    "numeric": check.numeric,
                    "taylor_order": check.taylor_order,
                    "taylor_linear_error": check.taylor_linear_error,
                    "directional_error": check.directional_error,
                },
            )
            if alert is not None:
                alerts.append(alert)
        failed_anywhere = reduce_any(trainer, not result.passed)
        if failed_anywhere and result.passed:
            alert = self.report(
                trainer,
                "gradient_mismatch",
                "error",
                None,
                "The gradient check failed on another rank.",
                "See the alerts of the other ranks.",
            )
            if alert is not None:
                alerts.append(alert)
        if ran and not failed_anywhere and trainer.is_global_zero:
            log.info(_passed_line(result))  # silence after success reads as "did it run?"
        self.act(trainer, alerts)

    # ------------------------------------------------------------------ state
    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._in_checkpoint = True  # the run being resumed had this check: it is not repeated
