"""core/ without a Trainer where it can be: the one transfer, the cadence rule, batches, trial steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_gradguard import DeadReLUMonitor, OptimizerMonitor, VanishingExplodingDetector
from lightning_gradguard.core.batch import batch_size_of, mismatched, slice_batch, tensors_in
from lightning_gradguard.core.cadence import check_due, next_due, on_logging_step, optimizer_index
from lightning_gradguard.core.collective import gather, reduce_any
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.trial import (
    NoTrialLoss,
    TrialClosure,
    loss_of,
    needs_closure,
    quiet_logging,
    seed_all,
    takes_closure,
    training_step_of,
    trial_optimizer_step,
)


class _OneProcess:
    """Just enough of a Trainer for the helpers that look at ``world_size`` and ``optimizers``."""

    world_size = 1

    def __init__(self, optimizers: list[Any] | None = None) -> None:
        self.optimizers = optimizers or []


def test_host_transfer_returns_every_tensor_in_its_shape_after_one_read() -> None:
    transfer = HostTransfer()
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.tensor(7, dtype=torch.int64)
    c = torch.tensor([True, False])
    for key, t in (("a", a), (("opt", 1), b), ("c", c)):
        transfer.add(key, t)
    assert len(transfer) == 3 and "a" in transfer and ("opt", 1) in transfer
    reads: list[int] = []
    original = torch.Tensor.cpu

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        reads.append(self.numel())
        return original(self, *args, **kwargs)

    torch.Tensor.cpu = counted  # type: ignore[method-assign]
    try:
        host = transfer.fetch()
    finally:
        torch.Tensor.cpu = original  # type: ignore[method-assign]
    assert reads == [9]  # one transfer of the packed 6 + 1 + 2 values
    torch.testing.assert_close(host["a"], a)
    assert host[("opt", 1)].shape == () and float(host[("opt", 1)]) == 7.0
    assert host["c"].tolist() == [1.0, 0.0]
    assert len(transfer) == 0 and transfer.fetch() == {}  # emptied: ready for the next step


def test_host_transfer_reduce_is_a_no_op_on_one_process() -> None:
    transfer = HostTransfer()
    transfer.add("flags", torch.tensor([1.0, 0.0]))
    assert transfer.fetch(_OneProcess(), reduce_op="sum")["flags"].tolist() == [1.0, 0.0]  # type: ignore[arg-type]
    assert reduce_any(_OneProcess(), True) is True  # type: ignore[arg-type]
    assert gather(_OneProcess(), {"x": 1}) == [{"x": 1}]  # type: ignore[arg-type]


def test_logging_rule_is_lightnings_plus_the_first_step_and_zero_is_never() -> None:
    assert [s for s in range(12) if on_logging_step(s, 4)] == [0, 3, 7, 11]
    assert [s for s in range(3) if on_logging_step(s, 1)] == [0, 1, 2]
    assert not any(on_logging_step(s, 0) for s in range(100))


def test_optimizer_index_sees_through_lightnings_wrapper() -> None:
    a = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    b = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    class Wrapped:  # a LightningOptimizer holds the real one in ``.optimizer``
        optimizer = b

    trainer = _OneProcess([a, b])
    assert optimizer_index(trainer, a) == 0 and optimizer_index(trainer, Wrapped()) == 1  # type: ignore[arg-type]


def test_batches_nested_tensors_sizes_and_slices() -> None:
    x, y, mask = torch.randn(8, 3), torch.arange(8), torch.ones(3)
    batch = {"inputs": [x, mask], "labels": y}
    assert [t.shape for t in tensors_in(batch)] == [x.shape, mask.shape, y.shape]
    assert batch_size_of(batch) == 8 and batch_size_of({"k": torch.tensor(1.0)}) is None
    cut = slice_batch(batch, 5)
    assert cut["inputs"][0].shape == (5, 3) and cut["labels"].tolist() == [0, 1, 2, 3, 4]
    assert cut["inputs"][1] is mask  # not batch-sized: untouched
    assert slice_batch(batch, None) is batch and slice_batch(batch, 100) is batch


def test_mismatched_batches_pair_each_samples_inputs_with_another_samples_targets() -> None:
    x, y, mask = torch.arange(8.0).reshape(4, 2), torch.arange(4), torch.ones(3)
    rolled = mismatched((x, y))
    assert isinstance(rolled, tuple) and rolled[0] is x  # the inputs stay where they are
    assert rolled[1].tolist() == [3, 0, 1, 2]  # sample i meets sample i-1's target
    weighted = mismatched([x, y, 2 * y, mask])  # every target moves together; a tensor not of the batch stays
    assert isinstance(weighted, list) and weighted[0] is x and weighted[3] is mask
    assert weighted[1].tolist() == [3, 0, 1, 2] and weighted[2].tolist() == [6, 0, 2, 4]
    named = mismatched({"input_ids": x, "attention_mask": x, "labels": y})
    assert named is not None and named["input_ids"] is x and named["attention_mask"] is x
    assert named["labels"].tolist() == [3, 0, 1, 2]
    # where inputs and targets cannot be told apart, or one sample has nobody to swap with: nothing
    assert mismatched(x) is None and mismatched({"a": x, "b": y}) is None and mismatched((x,)) is None
    assert mismatched((x[:1], y[:1])) is None and mismatched({"labels": y}) is None


def test_trial_calls_are_quiet_seeded_and_take_batch_idx_only_when_asked() -> None:
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logged: list[str] = []

        def log(self, name: str, value: Any) -> None:
            self.logged.append(name)

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            self.log("loss", 1.0)
            return {"loss": batch * batch_idx, "extra": 1}

    class NoIndex(nn.Module):
        def training_step(self, batch: Any) -> torch.Tensor:
            return batch + 1

    m = Module()
    with quiet_logging(m):
        out = training_step_of(m, torch.tensor(3.0), batch_idx=2)
    assert m.logged == [] and float(loss_of(out)) == 6.0  # type: ignore[arg-type]
    m.log("after", 0.0)
    assert m.logged == ["after"]  # the module's own log is back
    assert float(training_step_of(NoIndex(), torch.tensor(1.0))) == 2.0
    assert loss_of({"no": "loss"}) is None
    seed_all(7)
    first = torch.rand(3)
    seed_all(7)
    assert torch.equal(first, torch.rand(3))


@pytest.mark.parametrize("bad", [None, "string", 3])
def test_loss_of_refuses_what_is_not_a_loss(bad: Any) -> None:
    assert loss_of(bad) is None


# ---------------------------------------------------------------------------------------------- trial steps
class _TrialTrainer:
    """Just enough of a Trainer for a trial step: the clipping settings and a precision plugin."""

    def __init__(self, clip: float | None = None, scaler: Any = None) -> None:
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision

        self.gradient_clip_val = clip
        self.gradient_clip_algorithm = "norm"
        self.precision_plugin = Precision() if scaler is None else MixedPrecision("16-mixed", "cpu", scaler)


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)


def _batches(n: int) -> list[tuple[Any, int]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)), i) for i in range(n)]


def _closure(trainer: Any, model: _Regression, opt: Any, batches: list[tuple[Any, int]]) -> TrialClosure:
    source = iter(batches)
    return TrialClosure(trainer, model, opt, lambda: next(source), len(batches))


def test_trial_step_of_a_torch_optimizer_is_closure_clip_step_bit_for_bit() -> None:
    """SGD (momentum) and clipping: the step equals zero_grad, backward of the mean micro-batch loss,
    clip_grad_norm_, step(), written out by hand."""
    trainer = _TrialTrainer(clip=0.05)
    model, twin = _Regression(), _Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        batches = _batches(2 + step)
        done = trial_optimizer_step(trainer, opt, _closure(trainer, model, opt, batches))  # type: ignore[arg-type]
        twin_opt.zero_grad()
        losses = [nn.functional.mse_loss(twin.lin(x), y) for (x, y), _ in batches]
        for loss in losses:
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.05)
        twin_opt.step()
        assert done.evaluations == 1 and not done.skipped
        assert float(done.loss) == pytest.approx(
            sum(float(v.detach()) for v in losses) / len(batches), rel=1e-6
        )
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q)


def test_trial_step_of_lbfgs_reevaluates_its_closure_on_the_same_micro_batches() -> None:
    trainer = _TrialTrainer()
    model, twin = _Regression(), _Regression()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    twin_opt = torch.optim.LBFGS(twin.parameters(), lr=0.5, max_iter=4)
    batches = _batches(2)
    drawn: list[int] = []
    source = iter(batches)

    def draw() -> tuple[Any, int]:
        drawn.append(1)
        return next(source)

    closure = TrialClosure(trainer, model, opt, draw, 2)
    done = trial_optimizer_step(trainer, opt, closure)  # type: ignore[arg-type]

    def twin_closure() -> torch.Tensor:
        twin_opt.zero_grad()
        loss = sum(nn.functional.mse_loss(twin.lin(x), y) for (x, y), _ in batches) / 2
        loss.backward()  # type: ignore[union-attr]
        return loss  # type: ignore[return-value]

    twin_opt.step(twin_closure)
    assert len(drawn) == 2 and closure.calls == done.evaluations > 1  # drawn once, evaluated again
    assert model.calls == 2 * done.evaluations
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


class _NoClosureStep(torch.optim.SGD):
    """A step that takes no closure at all."""

    def step(self) -> None:  # type: ignore[override]
        super().step()


class _IgnoresClosure(torch.optim.SGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def test_trial_step_without_closure_parameter_and_with_a_closure_never_called() -> None:
    trainer = _TrialTrainer()
    model = _Regression()
    before = [p.detach().clone() for p in model.parameters()]
    opt = _NoClosureStep(model.parameters(), lr=0.1)
    done = trial_optimizer_step(trainer, opt, _closure(trainer, model, opt, _batches(1)))  # type: ignore[arg-type]
    assert done.evaluations == 1 and model.calls == 1
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    ignoring = _IgnoresClosure(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="never called its closure"):
        trial_optimizer_step(trainer, ignoring, _closure(trainer, model, ignoring, _batches(1)))  # type: ignore[arg-type]
    assert needs_closure(torch.optim.LBFGS(model.parameters())) and not needs_closure(opt)
    assert takes_closure(ignoring) and not takes_closure(opt)


def test_trial_step_refuses_a_closure_optimizer_under_a_gradscaler_and_a_missing_loss() -> None:
    model = _Regression()
    scaled = _TrialTrainer(scaler=torch.amp.GradScaler("cpu"))
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"`optimizer`.*LBFGS.*closure"):
        trial_optimizer_step(scaled, lbfgs, _closure(scaled, model, lbfgs, _batches(1)))  # type: ignore[arg-type]
    assert model.calls == 0  # refused before any evaluation

    class NoLoss(_Regression):
        def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            return None

    trainer, quiet = _TrialTrainer(), NoLoss()
    opt = torch.optim.SGD(quiet.parameters(), lr=0.1)
    with pytest.raises(NoTrialLoss):
        trial_optimizer_step(trainer, opt, _closure(trainer, quiet, opt, _batches(1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batches"):
        TrialClosure(trainer, quiet, opt, lambda: _batches(1)[0], 0)  # type: ignore[arg-type]


def test_one_due_in_the_base_reads_the_cadence_each_class_names() -> None:
    """``GradGuardCallback.due`` / ``next_due`` read the attributes ``cadence_every`` / ``cadence_dense``
    name: the detector's check interval, the dead-unit monitor's sampling interval and its dense start
    (window + patience - 1), the optimizer monitor's check interval (100 until a fit fixes its logging)."""
    det = VanishingExplodingDetector(check_every_n_steps=5, dense_steps=3)
    relu = DeadReLUMonitor(sample_every_n_steps=10, window_samples=2, patience=2)
    opt = OptimizerMonitor(dense_steps=2)
    for cb, every, dense in ((det, 5, 3), (relu, 10, 3), (opt, 100, 2)):
        assert [s for s in range(250) if cb.due(s)] == [s for s in range(250) if check_due(s, every, dense)]
        assert [cb.next_due(s) for s in range(250)] == [next_due(s, every, dense) for s in range(250)]
    assert [s for s in range(12) if relu.due(s)] == [0, 1, 2, 9]
