"""One vocabulary across the callbacks (docs/index.md, "One vocabulary"), checked for every exported one.

* Cadences are named for what they time: ``log_every_n_steps`` (charts), ``check_every_n_steps``
  (detection), ``sample_every_n_steps`` (sampled forward passes); never a bare ``every_n_steps``.
* ``action`` means the same everywhere, is never part of the ``state_key``, and every action a callback
  allows has an effect on a real run (checked here on a run that triggers the callback's finding).
* One ``cooldown_steps`` default (1000), except LossSpikeGuard's (0: each spike is an intervention).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, public_callbacks
from torch import nn

from lightning_gradguard import (
    DeadReLUMonitor,
    GradGuardError,
    GradientCheck,
    LossSpikeGuard,
    NaNSentinel,
    OverfitBatchSanity,
    StallDetector,
    VanishingExplodingDetector,
)
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS
from lightning_gradguard.core.skips import skipped_updates

ALL = public_callbacks()
CADENCES = {"log_every_n_steps", "check_every_n_steps", "sample_every_n_steps"}
#: cadences of one specific thing, named for it
SPECIFIC = {"histogram_every_n_steps", "snapshot_every_n_steps", "check_parameters_every_n_steps"}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls.__init__).parameters)


def test_cadences_are_named_for_what_they_time() -> None:
    for cls in ALL:
        names = {n for n in _parameters(cls) if n.endswith("every_n_steps")}
        assert names <= CADENCES | SPECIFIC, cls.__name__
    assert {n for cls in ALL for n in _parameters(cls)} >= CADENCES  # each is in use


def test_action_is_never_part_of_the_state_key() -> None:
    for cls in ALL:
        assert "action" not in cls.state_key_args, cls.__name__
        if "action" not in _parameters(cls):
            continue
        keys = {cls(action=a).state_key for a in cls.allowed_actions}
        assert len(keys) == 1, cls.__name__


def test_every_action_is_a_literal_of_the_allowed_actions() -> None:
    acting = [cls for cls in ALL if "action" in _parameters(cls)]
    assert len(acting) == 7
    for cls in acting:
        hint = typing.get_type_hints(cls.__init__)["action"]
        assert typing.get_origin(hint) is typing.Literal
        assert set(typing.get_args(hint)) == set(cls.allowed_actions), cls.__name__


def test_one_cooldown_default() -> None:
    defaults = {
        cls.__name__: _parameters(cls)["cooldown_steps"].default
        for cls in ALL
        if "cooldown_steps" in _parameters(cls)
    }
    assert defaults.pop("LossSpikeGuard") == 0
    assert set(defaults.values()) == {DEFAULT_COOLDOWN_STEPS} and len(defaults) == 7


# ------------------------------------------------------------------------------------ actions have effects
class WrongBackward(torch.autograd.Function):
    """``x @ w.T`` whose weight gradient is half the true one (what GradientCheck must find)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return grad @ w, 0.5 * grad.t() @ x


class Toy(pl.LightningModule):
    """A small classifier with one switchable fault, each triggering one callback's finding."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.fault = fault
        if fault == "dead":
            with torch.no_grad():
                self.net[0].bias.fill_(-100.0)  # every ReLU unit of the first layer is silent

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[1](self.net[0](x))
        if self.fault == "detach":
            h = h.detach()
        logits = (
            WrongBackward.apply(h, self.net[2].weight) if self.fault == "wrong_backward" else self.net[2](h)
        )
        loss = nn.functional.cross_entropy(logits, y)
        if self.fault == "nan" and self.trainer.global_step == 3:
            loss = loss * float("nan")
        if self.fault == "spike" and self.trainer.global_step == 12:
            loss = loss * 1e3
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0 if self.fault == "lr_zero" else 0.05)


def _loader() -> Any:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=16)


MAX_STEPS = 16
#: callback -> (how to build it with an action, the fault that triggers its finding, the finding's kind)
TRIGGERS: dict[str, tuple[Any, str, str]] = {
    "NaNSentinel": (
        lambda a, d: NaNSentinel(action=a, report_dir=d, save_checkpoint=False, find_origin=False),
        "nan",
        "nonfinite_loss",
    ),
    "LossSpikeGuard": (
        lambda a, d: LossSpikeGuard(action=a, warmup_steps=8, window_steps=8),
        "spike",
        "loss_spike",
    ),
    "VanishingExplodingDetector": (
        lambda a, d: VanishingExplodingDetector(action=a, max_norm=1e-4, patience=1, check_every_n_steps=1),
        None,
        "exploding_gradient",
    ),
    "DeadReLUMonitor": (
        lambda a, d: DeadReLUMonitor(action=a, sample_every_n_steps=1, window_samples=1, patience=1),
        "dead",
        "dead_relu",
    ),
    "StallDetector": (
        lambda a, d: StallDetector(action=a, check_every_n_steps=1, patience=1),
        "lr_zero",
        "no_update",
    ),
    "OverfitBatchSanity": (
        lambda a, d: OverfitBatchSanity(action=a, max_steps=20),
        "detach",
        "overfit_failed",
    ),
    # every tensor checked, however loaded the machine: this test is about actions, not the time budget
    "GradientCheck": (
        lambda a, d: GradientCheck(action=a, max_seconds=None),
        "wrong_backward",
        "gradient_mismatch",
    ),
}
CASES = [(name, a) for name, (make, *_) in TRIGGERS.items() for a in make("warn", None).allowed_actions]


def test_every_acting_callback_is_triggered_here() -> None:
    assert set(TRIGGERS) == {cls.__name__ for cls in ALL if "action" in _parameters(cls)}


@pytest.mark.parametrize(("name", "action"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_every_action_has_its_effect(name: str, action: str, tmp_path: Any) -> None:
    make, fault, kind = TRIGGERS[name]
    torch.manual_seed(0)
    callback, model = make(action, str(tmp_path)), Toy(fault)
    trainer = make_trainer([callback], max_steps=MAX_STEPS, num_sanity_val_steps=0)
    if action == "raise":
        with pytest.raises(GradGuardError):
            trainer.fit(model, _loader())
        assert kind in {a.kind for a in callback.alerts}
        return
    trainer.fit(model, _loader())
    assert kind in {a.kind for a in callback.alerts}, [a.kind for a in callback.alerts]
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if action == "warn":  # reported, and nothing else: the run trains to its end
        assert trainer.global_step == MAX_STEPS and not trainer.should_stop
    elif action == "stop":  # the run ends early
        assert trainer.should_stop and trainer.global_step < MAX_STEPS
    elif action == "skip":  # the update is dropped, the run goes on
        assert trainer.global_step == MAX_STEPS and finite and sum(skipped_updates(trainer).values()) >= 1
    elif action == "rollback":
        assert trainer.global_step == MAX_STEPS and callback.rollbacks == 1
    if name == "NaNSentinel":  # the poisoned update is applied under "warn" only
        assert finite is (action != "warn")


# ------------------------------------------------------------------------------------- one meaning per name
#: argument names two or more callbacks share, and the one thing each means (a word its docstring says)
SHARED_NAMES: dict[str, str] = {
    "patience": "consecutive",  # consecutive checks (or full windows) before a finding is reported
    "dense_steps": "every step",
    "warmup_steps": "step",
    "history_size": "recent",
    "growth_window": "look",  # sampled steps or checks the growth rule looks back over
}
#: names that meant two things across callbacks before 0.2, and what each became (the old name is only a
#: deprecated keyword now)
RENAMED = {
    LossSpikeGuard: {"window": "window_steps", "patience": "escalate_after"},
    DeadReLUMonitor: {"window": "window_samples"},
}


def _documented(cls: type) -> dict[str, str]:
    """The ``Args:`` entries of a callback's docstring: name -> its text, on one line."""
    doc = (cls.__doc__ or "").split("Args:", 1)[-1].split("\n\n", 1)[0]
    found: dict[str, str] = {}
    for line in doc.splitlines():
        head, _, text = line.strip().partition(": ")
        if line.startswith("        ") and not line.startswith("            ") and head.isidentifier():
            found[head] = text
        elif found:
            found[list(found)[-1]] += " " + line.strip()
    return found


def test_one_meaning_per_shared_argument_name() -> None:
    """A name two callbacks take means one thing: ``window`` is gone (``window_steps`` counts optimizer
    steps, ``window_samples`` sampled ones) and ``patience`` always counts checks before an alert."""
    users: dict[str, list[type]] = {}
    for cls in ALL:
        for name in _parameters(cls):
            users.setdefault(name, []).append(cls)
    for name, word in SHARED_NAMES.items():
        assert len(users.get(name, [])) >= 2, name
        for cls in users[name]:
            assert word in _documented(cls)[name], (cls.__name__, name)
    assert "window" not in users and "skipped_steps" not in vars(LossSpikeGuard).get("__annotations__", {})
    for cls, renames in RENAMED.items():
        for old, new in renames.items():
            assert new in _parameters(cls) and old not in _parameters(cls), (cls.__name__, old)


@pytest.mark.parametrize("cls", list(RENAMED), ids=lambda c: c.__name__)
def test_a_renamed_argument_is_accepted_once_more_with_a_deprecation_warning(cls: type) -> None:
    for old, new in RENAMED[cls].items():
        with pytest.warns(DeprecationWarning, match=rf"\b{new}\b"):
            callback = cls(**{old: 9})
        assert getattr(callback, new) == 9
        with pytest.raises(TypeError, match=new):
            cls(**{old: 9, new: 9})


def test_the_guard_counts_its_own_drops_as_dropped_steps() -> None:
    """``skipped_steps`` is the GradScaler's count (NaNSentinel, the LR finder's result); the guard's own
    drops are ``dropped_steps``, and its old ``skipped_steps`` reads them with a warning."""
    guard = LossSpikeGuard()
    guard.dropped_steps = 3
    with pytest.warns(DeprecationWarning, match="dropped_steps"):
        assert guard.skipped_steps == 3
    assert isinstance(vars(NaNSentinel)["skipped_steps"], property)  # the GradScaler's skips, not renamed


def test_lightning_cli_shows_the_new_names_only(capsys: Any) -> None:
    from conftest import RecordingMLP
    from lightning.pytorch.cli import LightningCLI

    args = ["--trainer.callbacks=lightning_gradguard.LossSpikeGuard", "--trainer.callbacks.help"]
    with pytest.raises(SystemExit):
        LightningCLI(RecordingMLP, run=False, args=[*args, "lightning_gradguard.LossSpikeGuard"])
    out = capsys.readouterr().out
    assert "--trainer.callbacks.window_steps" in out and "--trainer.callbacks.escalate_after" in out
    assert "callbacks.window " not in out and "callbacks.patience " not in out


def test_action_is_the_first_argument_wherever_it_exists() -> None:
    for cls in ALL:
        names = list(_parameters(cls))[1:]  # after self
        if "action" in names:
            assert names[0] == "action", cls.__name__
