"""Declared run state (``core.runstate``): the mechanism, the one ``Streaks``, and the monitors on it.

The monitors' state dicts are checked against what the hand-written methods wrote before (``old_states``,
written by main at 50abf70 for the fit below): loaded into fresh callbacks, they are written back as they
were; a fit writes the same keys in the same forms; ``reset_run`` gives a fresh callback's state; and a fit
resumed from a checkpoint ends with the state of one that never stopped.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from old_states import ADDED_SINCE, OLD_STATES
from torch import nn

import lightning_gradguard as gg
from lightning_gradguard.core.runstate import LEFT_OUT, RunField, Stateful, Streaks, nothing


# ---------------------------------------------------------------------------------------------- the mechanism
class _Inner(Stateful):
    count: RunField[int] = RunField(int)
    kept: RunField[int] = RunField(int, per_run=False)

    def __init__(self) -> None:
        self.reset_run()


class _Holder(Stateful):
    seen: RunField[set[str]] = RunField(set)
    window: RunField[deque[float]] = RunField(from_settings=lambda h: deque(maxlen=h.size))
    rollbacks: RunField[int] = RunField(int, key="counters.rollbacks", old_keys=("counters.restores",))
    first: RunField[float | None] = RunField(nothing, if_missing=lambda h: 7.0)
    result: RunField[str | None] = RunField(nothing, save=lambda _, r: LEFT_OUT if r is None else r)
    scratch: RunField[list[int]] = RunField(list, key=None)
    inner: RunField[_Inner] = RunField(_Inner, per_run=False)
    streaks: RunField[Streaks] = RunField(Streaks)

    def __init__(self, size: int) -> None:
        self.size = size
        self.changes = 0

    def state_changed(self) -> None:
        self.changes += 1


def test_declared_fields_round_trip_and_reset() -> None:
    h = _Holder(3)
    assert h.seen == set() and h.window.maxlen == 3 and h.first is None  # made on the first read
    h.seen |= {"b", "a"}
    h.window.extend([1.0, 2.0, 3.0, 4.0])
    h.rollbacks, h.first, h.scratch = 2, 1.5, [9]
    h.inner.count, h.inner.kept = 4, 5
    h.streaks.update("x", True)
    state = h.state_dict()
    assert state == {
        "seen": ["a", "b"],
        "window": [2.0, 3.0, 4.0],
        "counters": {"rollbacks": 2},
        "first": 1.5,
        "inner": {"count": 4, "kept": 5},
        "streaks": {"x": 1},
    }  # no "result" (LEFT_OUT), no "scratch" (key=None)
    other = _Holder(3)
    other.scratch = [1]
    other.load_state_dict(copy.deepcopy(state))
    assert (other.seen, list(other.window), other.window.maxlen) == ({"a", "b"}, [2.0, 3.0, 4.0], 3)
    assert (other.rollbacks, other.first, other.scratch, other.streaks) == (2, 1.5, [], {"x": 1})
    assert (other.inner.count, other.inner.kept, other.changes) == (4, 5, 1)
    assert other.state_dict() == state
    other.reset_run()  # the run's fields fresh; a kept state object forgets its own run only
    assert other.state_dict() == {
        "seen": [],
        "window": [],
        "counters": {"rollbacks": 0},
        "first": None,
        "inner": {"count": 0, "kept": 5},
        "streaks": {},
    }
    assert other.changes == 2


def test_an_older_key_a_missing_key_and_an_inline_field() -> None:
    h = _Holder(2)
    h.load_state_dict({"counters": {"restores": 3}, "seen": ["z"]})
    assert (h.rollbacks, h.first, h.seen) == (3, 7.0, {"z"})  # old key read; if_missing's value

    class Inline(Stateful):
        pair: RunField[tuple[int, int]] = RunField(
            lambda: (0, 0),
            key="",
            save=lambda _, p: {"a": p[0], "b": p[1]},
            load=lambda _, s: (s["a"], s["b"]),
        )

    i = Inline()
    i.pair = (1, 2)
    assert i.state_dict() == {"a": 1, "b": 2}
    j = Inline()
    j.load_state_dict({"a": 1, "b": 2})
    assert j.pair == (1, 2)
    with pytest.raises(TypeError, match="one of fresh= and from_settings="):
        RunField(dict, from_settings=lambda _: {})


def test_streaks_count_hits_in_a_row_and_start_over() -> None:
    s = Streaks()
    assert [s.update("a", held) for held in (True, True, False, True)] == [1, 2, 0, 1]
    s.hit("b")
    s.miss("a")
    assert s == {"a": 0, "b": 1} and s.reached(1) == {"b": 1}
    assert s.advance({"b", "c"}) == {"b": 2, "c": 1} and "a" not in s  # the rest start over
    assert dict(Streaks({"k": 3})) == {"k": 3} and len(s) == 2


# ---------------------------------------------------------------------------------------------- the monitors
class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def callbacks() -> dict[str, Any]:
    """The callbacks of ``old_states`` (the same arguments)."""
    return {
        "nan": gg.NaNSentinel(),
        "spike": gg.LossSpikeGuard(action="warn", warmup_steps=8, window_steps=8),
        "gradients": gg.GradientNormLogger(log_noise_scale=True),
        "vanishing": gg.VanishingExplodingDetector(check_every_n_steps=2),
        "dead_units": gg.DeadReLUMonitor(sample_every_n_steps=2),
        "activation_range": gg.ActivationRangeMonitor(),
        "optimizer": gg.OptimizerMonitor(),
        "stall": gg.StallDetector(),
    }


def _loader(n: int) -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(cbs: dict[str, Any], **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        log_every_n_steps=1,
        gradient_clip_val=1.0,
    )
    return pl.Trainer(callbacks=list(cbs.values()), **(settings | kwargs))


def fit() -> dict[str, Any]:
    """The fit ``old_states`` was written after: 12 steps of one epoch."""
    torch.manual_seed(0)
    cbs = callbacks()
    _trainer(cbs, max_steps=12).fit(Net(), _loader(96))
    return {k: cb.state_dict() for k, cb in cbs.items()}


def same(a: Any, b: Any) -> bool:
    """Equal, as a checkpoint would be compared: tensors by value (NaN equal to NaN), containers by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.nan_to_num(-1.25), b.nan_to_num(-1.25)))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def shape(value: Any) -> Any:
    """The form of a state dict: its keys and the kinds of its values, not the numbers."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return ["list", *{repr(shape(v)) for v in value}]
    return "tensor" if isinstance(value, torch.Tensor) else type(value).__name__


@pytest.mark.parametrize("name", sorted(OLD_STATES))
def test_a_checkpoint_of_the_hand_written_methods_loads_and_is_written_back_unchanged(name: str) -> None:
    old = OLD_STATES[name]
    cb = callbacks()[name]
    cb.load_state_dict(copy.deepcopy(old))
    assert same(_without_added(name, cb.state_dict()), old)
    cb.reset_run()  # a new run: what a fresh callback holds, but for the fields kept across runs
    fresh = callbacks()[name].state_dict()
    fresh.update({f.key: old[f.key] for f in type(cb).run_fields if not f.per_run and f.key in old})
    assert same(cb.state_dict(), fresh)


def _without_added(name: str, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the keys added after the hand-written methods (``old_states.ADDED_SINCE``)."""
    return {k: v for k, v in state.items() if k not in ADDED_SINCE.get(name, ())}


def test_a_fit_writes_the_keys_and_forms_the_hand_written_methods_wrote() -> None:
    new = {k: _without_added(k, v) for k, v in fit().items()}
    assert {k: shape(v) for k, v in new.items()} == {k: shape(v) for k, v in OLD_STATES.items()}


def test_a_resumed_fit_ends_with_the_state_of_one_that_never_stopped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = callbacks()
    _trainer(whole, max_epochs=2).fit(Net(), _loader(48))
    torch.manual_seed(0)
    first = callbacks()
    trainer = _trainer(first, max_epochs=1)
    trainer.fit(Net(), _loader(48))
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = callbacks()
    _trainer(resumed, max_epochs=2).fit(Net(), _loader(48), ckpt_path=tmp_path / "epoch1.ckpt")
    for name, cb in whole.items():
        assert same(resumed[name].state_dict(), cb.state_dict()), name
    assert not same(first["spike"].state_dict(), whole["spike"].state_dict())  # the second epoch counted
