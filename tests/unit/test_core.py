"""core/ without a Trainer where it can be: the one transfer, the cadence rule, batches, trial steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_gradguard.core.batch import batch_size_of, slice_batch, tensors_in
from lightning_gradguard.core.cadence import on_logging_step, optimizer_index
from lightning_gradguard.core.collective import gather, reduce_any
from lightning_gradguard.core.transfer import HostTransfer
from lightning_gradguard.core.trial import loss_of, quiet_logging, seed_all, training_step_of


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
