"""A second ``fit()`` on one Trainer continues its run: the monitors keep what the first fit measured.

Lightning keeps a Trainer's progress across ``fit()`` calls (a second call with the same ``max_epochs``
trains nothing; one with a higher limit continues at the step the first reached), and its own callbacks
(``EarlyStopping``, ``ModelCheckpoint``) keep their state. Ours do too; only a fit that starts a new run
(a new Trainer, no ``ckpt_path``) starts their windows and histories afresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import MemoryLogger, RecordingMLP, make_trainer, random_loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gradguard import (
    DeadReLUMonitor,
    GradientNormLogger,
    LossSpikeGuard,
    NaNSentinel,
    StallDetector,
    VanishingExplodingDetector,
)
from lightning_gradguard.core.base import GradGuardCallback


def _callbacks() -> list[Any]:
    return [
        GradientNormLogger(log_every_n_steps=2, clip_window=10),
        VanishingExplodingDetector(check_every_n_steps=1),
        DeadReLUMonitor(sample_every_n_steps=1, window_samples=2, patience=1),
        NaNSentinel(),
        LossSpikeGuard(warmup_steps=8, window_steps=8),
        StallDetector(check_every_n_steps=2),
    ]


def _state(callbacks: list[Any]) -> dict[str, Any]:
    gnl, ved, relu, nan, spike, stall = callbacks
    return {
        "clip_seen": gnl._clip_seen,
        "ved_history": list(ved.history.get(0, [])),
        "relu_sampled": relu.sampled_batches,
        "nan_history": [r.step for r in nan.norm_history.records()],
        "spike_judged": spike.judged,
        "stall_checks": len(stall.state.lr_history),
    }


def _model() -> RecordingMLP:
    model = RecordingMLP()
    model.net[1] = torch.nn.ReLU()
    return model


def test_a_second_fit_that_trains_nothing_keeps_every_monitor_state() -> None:
    torch.manual_seed(0)
    callbacks, model = _callbacks(), _model()
    trainer = make_trainer(callbacks, MemoryLogger(), gradient_clip_val=1.0, max_epochs=1)
    trainer.fit(model, random_loader(n=96))
    first = _state(callbacks)
    assert first["clip_seen"] == 12 and first["relu_sampled"] == 12 and len(first["ved_history"]) == 12
    trainer.fit(model, random_loader(n=96))  # max_epochs reached: Lightning trains nothing
    assert trainer.global_step == 12
    assert _state(callbacks) == first


def test_a_continued_fit_goes_on_counting_where_the_first_stopped() -> None:
    torch.manual_seed(0)
    callbacks, model = _callbacks(), _model()
    trainer = make_trainer(callbacks, MemoryLogger(), gradient_clip_val=1.0, max_epochs=1)
    trainer.fit(model, random_loader(n=96))
    first = _state(callbacks)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, random_loader(n=96))  # continues at step 12
    assert trainer.global_step == 24
    second = _state(callbacks)
    assert second["clip_seen"] == 24 and second["relu_sampled"] == 24 and second["spike_judged"] == 24
    assert second["ved_history"][:12] == first["ved_history"]  # the history goes on, not afresh
    assert second["nan_history"] == list(range(24))[-len(second["nan_history"]) :]
    assert second["stall_checks"] == first["stall_checks"] + 6


def test_a_new_trainer_starts_a_new_run() -> None:
    torch.manual_seed(0)
    callbacks = _callbacks()
    make_trainer(callbacks, MemoryLogger(), gradient_clip_val=1.0, max_epochs=1).fit(
        _model(), random_loader(n=96)
    )
    make_trainer(callbacks, MemoryLogger(), gradient_clip_val=1.0, max_epochs=1).fit(
        _model(), random_loader(n=96)
    )
    again = _state(callbacks)
    assert again["clip_seen"] == 12 and again["relu_sampled"] == 12 and len(again["ved_history"]) == 12


class _Counting(GradGuardCallback):
    """The base's lifecycle seen from a subclass: how often it asked for a fresh-run reset."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset_run(self) -> None:
        super().reset_run()
        self.resets += 1


def test_the_base_resets_a_new_run_and_never_a_continued_or_resumed_one(tmp_path: Path) -> None:
    """``reset_run`` is the one fresh-run hook: the base calls it when a fit starts a new run (a new
    Trainer at step 0, no ``ckpt_path``) and neither on a second ``fit()`` that continues the Trainer's
    run nor on a resume from a checkpoint; it also forgets the cooldowns of the earlier run."""
    counting = _Counting()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    trainer = make_trainer([counting, ckpt], max_epochs=1, enable_checkpointing=True)
    counting._last_reported["kind@where"] = 0
    trainer.fit(_model(), random_loader(n=32))
    assert counting.resets == 1 and counting._last_reported == {}
    counting._last_reported["kind@where"] = 3
    trainer.fit_loop.max_epochs = 2
    trainer.fit(_model(), random_loader(n=32))  # continues the Trainer's run
    assert counting.resets == 1 and counting._last_reported == {"kind@where": 3}
    resumed = make_trainer([counting], max_epochs=3)
    resumed.fit(_model(), random_loader(n=32), ckpt_path=str(tmp_path / "last.ckpt"))
    assert counting.resets == 1 and resumed.global_step > trainer.global_step
    make_trainer([counting], max_epochs=1).fit(_model(), random_loader(n=32))  # a new run
    assert counting.resets == 2
