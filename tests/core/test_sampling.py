"""The sampled-step lifecycle DeadReLUMonitor and ActivationRangeMonitor share (core.sampling).

Both monitors end a sample in the same places (the batch that stepped, the epoch's end, the next step
after one that never stepped), drop it on an exception, and never let a failure of their own reading
crash the run, wherever the sample ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader

from lightning_gradguard import ActivationRangeMonitor, DeadReLUMonitor
from lightning_gradguard.core.sampling import SamplingMonitor

MONITORS = [
    lambda: DeadReLUMonitor(sample_every_n_steps=1, window_samples=1, patience=1),
    lambda: ActivationRangeMonitor(sample_every_n_steps=1),
]


class StopsEarly(RecordingMLP):
    """Ends the epoch from ``on_train_batch_start`` at batch 2: the sample armed for it ends at epoch end."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx == 2 else None


@pytest.mark.parametrize("make", MONITORS, ids=["dead_relu", "activation_range"])
def test_both_monitors_end_every_sample_where_the_lifecycle_says(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = make()
    assert isinstance(monitor, SamplingMonitor)
    ended: list[tuple[int, int]] = []
    real = type(monitor).end_sample

    def spy(self: Any, trainer: Any, capture: Any, sampled_at: tuple[int, int]) -> None:
        ended.append(sampled_at)
        real(self, trainer, capture, sampled_at)

    monkeypatch.setattr(type(monitor), "end_sample", spy)
    torch.manual_seed(0)
    make_trainer([monitor], max_epochs=1).fit(StopsEarly(), random_loader(n=64))
    # steps 0 and 1 end with their batch; the sample armed for batch 2 (which never ran) ends with the epoch
    assert ended == [(0, 0), (1, 1), (2, 2)]
    assert monitor._capture is None and monitor._sampled_at is None


@pytest.mark.parametrize("make", MONITORS, ids=["dead_relu", "activation_range"])
def test_a_failing_reading_is_one_warning_wherever_the_sample_ends(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADGUARD_STRICT", "0")
    monitor = make()

    def broken(self: Any, trainer: Any, capture: Any, sampled_at: tuple[int, int]) -> None:
        raise RuntimeError("a statistic we did not expect")

    monkeypatch.setattr(type(monitor), "end_sample", broken)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="a statistic we did not expect") as caught:
        trainer = make_trainer([monitor], max_epochs=1)
        trainer.fit(StopsEarly(), random_loader(n=64))
    said = [str(w.message) for w in caught if "failed" in str(w.message)]
    name = type(monitor).__name__
    assert len(said) == 1 and said[0].startswith(f"{name}._end_step failed")  # one warning, every end
    assert trainer.global_step == 2  # the run went on
