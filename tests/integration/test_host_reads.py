"""No host read on the steps a monitor does not measure: the CPU stand-in for a CUDA sync count.

On a GPU, reading a tensor's values on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``.to("cpu")``) is a device-to-host sync. A ``TorchFunctionMode`` opened at
the start of every batch and closed at its end counts those calls per optimizer step: everything the
step does, our hooks, forward hooks and tensor hooks included. The same run without the monitor gives
Lightning's own reads; the monitor must add none on a step it does not measure, and some on the steps
it does (else the test would prove nothing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader
from torch.overrides import TorchFunctionMode

from lightning_gradguard import (
    ActivationRangeMonitor,
    GradientNormLogger,
    OptimizerMonitor,
    StallDetector,
    VanishingExplodingDetector,
)

LOGGED = {0, 4, 9}  # Lightning's rule with an interval of 5 over 12 steps, plus step 0
DENSE = {0, 1, 2, 3, 4, 9}  # ... after a dense start of 5 steps (the detection rules' default)


_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
}


class _Count(TorchFunctionMode):
    def __init__(self, reads: Counter[int], step: int) -> None:
        super().__init__()
        self.reads, self.step = reads, step

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if func in _READS or to_host:
            self.reads[self.step] += 1
        return func(*args, **kwargs)


class _Open(pl.Callback):
    def __init__(self, reads: Counter[int]) -> None:
        self.reads, self.mode = reads, None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.mode = _Count(self.reads, trainer.global_step)
        self.mode.__enter__()


class _Close(pl.Callback):
    def __init__(self, opener: _Open) -> None:
        self.opener = opener

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.opener.mode is not None:
            self.opener.mode.__exit__(None, None, None)
            self.opener.mode = None


def _reads(monitors: list[pl.Callback]) -> Counter[int]:
    reads: Counter[int] = Counter()
    opener = _Open(reads)
    torch.manual_seed(0)
    trainer = make_trainer(
        [opener, *monitors, _Close(opener)], logger=False, max_steps=12, log_every_n_steps=5
    )
    trainer.fit(RecordingMLP(), random_loader(n=256))
    return reads


MONITORS: dict[str, tuple[Callable[[], pl.Callback], set[int]]] = {
    "GradientNormLogger": (lambda: GradientNormLogger(histogram_every_n_steps=0), LOGGED),
    "OptimizerMonitor": (OptimizerMonitor, DENSE),
    "ActivationRangeMonitor": (ActivationRangeMonitor, LOGGED),
    "StallDetector": (lambda: StallDetector(check_every_n_steps=5), DENSE),
}


@pytest.mark.parametrize("name", list(MONITORS))
def test_no_host_read_on_a_step_the_monitor_does_not_measure(name: str) -> None:
    bare = _reads([])
    monitor, measured = MONITORS[name]
    ours = _reads([monitor()])
    extra = {step: ours[step] - bare[step] for step in range(12)}
    assert {s for s, n in extra.items() if n > 0} == measured, extra
    assert all(n >= 0 for n in extra.values()), extra


def test_the_detector_reads_on_each_of_its_dense_first_checks() -> None:
    """VanishingExplodingDetector checks every step for 20 steps, so here: reads on every step."""
    bare = _reads([])
    ours = _reads([VanishingExplodingDetector()])
    assert all(ours[s] > bare[s] for s in range(12))
