"""``GradGuardCallback.apply_action``: what each ``action`` does, one implementation for every callback
(NaNSentinel and LossSpikeGuard included), checked on a real Trainer with a check of our own that fires at a
known step; the weights are compared against copies taken independently of gradguard."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader
from typing_extensions import override

from lightning_gradguard import GradGuardCallback, GradGuardError
from lightning_gradguard.core.skips import skipped_updates

FIRES_AT = 2


class FiresOnce(GradGuardCallback):
    """Reports an error at step ``FIRES_AT`` before the optimizer step and applies its action to it."""

    allowed_actions = ("warn", "skip", "stop", "raise")
    skip_cause = "custom"

    def __init__(self, *, action: str = "warn", poisoned: bool = False) -> None:
        super().__init__(action=action)
        self.poisoned = poisoned
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        step = trainer.global_step
        self.before[step] = [p.detach().clone() for p in pl_module.parameters()]
        if step == FIRES_AT:
            alert = self.report(trainer, "custom_fault", "error", None, "fired", "none")
            assert alert is not None
            self.apply_action(
                trainer, self.action, alerts=[alert], optimizer=optimizer, poisoned=self.poisoned
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]


def _fit(callback: FiresOnce) -> pl.Trainer:
    trainer = make_trainer([callback], max_steps=6)
    trainer.fit(RecordingMLP(), random_loader())
    return trainer


def _moved(callback: FiresOnce, step: int) -> bool:
    return any(
        not torch.equal(a, b) for a, b in zip(callback.before[step], callback.after[step], strict=True)
    )


@pytest.mark.parametrize(
    ("action", "poisoned"), [("warn", True), ("skip", False), ("stop", False), ("stop", True)]
)
def test_each_action_drops_stops_or_lets_the_update_be(action: str, poisoned: bool) -> None:
    callback = FiresOnce(action=action, poisoned=poisoned)
    trainer = _fit(callback)
    dropped = action == "skip" or (action == "stop" and poisoned)
    assert _moved(callback, FIRES_AT - 1) and _moved(callback, FIRES_AT) is not dropped
    assert skipped_updates(trainer).get("custom", 0) == int(dropped)
    assert trainer.global_step == (FIRES_AT + 1 if action == "stop" else 6)  # stop: after this batch


def test_raise_raises_before_the_update() -> None:
    callback = FiresOnce(action="raise")
    with pytest.raises(GradGuardError, match="fired"):
        _fit(callback)
    assert FIRES_AT not in callback.after  # the step never ended


def test_a_callback_that_drops_updates_names_their_cause() -> None:
    class NoCause(FiresOnce):
        skip_cause = ""

    with pytest.raises(TypeError, match="skip_cause"):
        _fit(NoCause(action="skip"))
