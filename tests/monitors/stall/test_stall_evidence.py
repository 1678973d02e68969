"""StallDetector's evidence that a classifier at chance is learning (issue 38, item 2): real Trainer runs
on the digits.

A tanh MLP started from small weights sits on the saddle at the origin (Saxe et al. 2014): its loss stays
at the chance level for about 80 steps while its outputs already lean toward the labels, then it learns.
Its twins that cannot learn (labels shuffled once, an input of zeros, which a model that returns a Hugging
Face-style output with ``.logits`` sees) keep the loss there with outputs that do not lean, and are named.
The lean and its p are read back from the TensorBoard event file; the hooks are checked to leave the model.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_file_loader
from test_stall import Digits, kinds, loader
from torch import nn

from lightning_gradguard.core.compile import holds_compiled
from lightning_gradguard.monitors.stall.callback import StallDetector
from lightning_gradguard.monitors.stall.state import StallState


class Saddle(Digits):
    """A 64-32-32-10 tanh MLP whose weights start at a tenth of PyTorch's (biases 0), SGD 0.05 with
    momentum 0.9; ``fault``: ``"shuffled"`` (labels permuted once: not the inputs'), ``"zeros"`` (every
    input 0) or ``None``. Its output is an object with ``.logits``, as a Hugging Face model's."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
        )
        with torch.no_grad():
            for p in self.net.parameters():
                p.mul_(0.1) if p.dim() > 1 else p.zero_()
        self.saddle_fault = fault
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> Any:
        return SimpleNamespace(logits=self.net(torch.zeros_like(x) if self.saddle_fault == "zeros" else x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).logits, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def shuffled_loader() -> Any:
    base = loader()
    x, y = base.dataset.tensors
    y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(1))]
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, drop_last=True, generator=g)


class Hooks(Callback):
    """The forward hooks on the model's modules at given steps and after the fit."""

    def __init__(self, at: tuple[int, ...]) -> None:
        self.at, self.seen = at, {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step - 1 in self.at:
            self.seen[trainer.global_step - 1] = sum(len(m._forward_hooks) for m in pl_module.modules())

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen["end"] = sum(len(m._forward_hooks) for m in pl_module.modules())


def run(
    model: Saddle, steps: int, tmp_path: Path | None = None, data: Any = None
) -> tuple[StallDetector, Hooks]:
    detector, hooks = StallDetector(), Hooks((5, 59, 119))
    logger = TensorBoardLogger(str(tmp_path), name="", version="") if tmp_path is not None else None
    make_trainer([detector, hooks], logger=logger, max_steps=steps, max_epochs=-1, log_every_n_steps=10).fit(
        model, data if data is not None else loader()
    )
    return detector, hooks


def scalars(log_dir: Path, tag: str) -> dict[int, float]:
    out = {}
    for path in log_dir.rglob("events.out.tfevents.*"):
        for event in event_file_loader.EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                if v.tag == tag:
                    out[event.step] = v.simple_value if v.HasField("simple_value") else v.tensor.float_val[0]
    return out


def test_a_plateau_at_chance_whose_outputs_lean_toward_the_labels_is_not_called_stuck(tmp_path: Path) -> None:
    model = Saddle()
    detector, hooks = run(model, 120, tmp_path)
    chance = math.log(10)
    # the premise, from the losses the model saw: at chance (within 2 %) through step 59, learned after
    assert all(
        abs(v - chance) < 0.02 * chance for v in [sum(model.losses[i : i + 10]) / 10 for i in (30, 40, 50)]
    )
    assert sum(model.losses[-10:]) / 10 < 0.7 * chance
    assert detector.alerts == []  # was: chance_level at step 59
    # the evidence, read back from TensorBoard: the labels' lean beats every one of 2,000 relabelings
    p = scalars(tmp_path, "stall/label_lean_p")
    assert p[59] <= 0.05 and scalars(tmp_path, "stall/label_lean")[59] > 0
    # one hook while the loss sits at chance; none once it left (a run that learns pays nothing), none after
    assert hooks.seen[59] == 1 and hooks.seen[119] == 0 and hooks.seen["end"] == 0


@pytest.mark.parametrize("fault", ["zeros", "shuffled"])
def test_a_model_that_cannot_learn_the_labels_is_still_named_at_chance(fault: str) -> None:
    model = Saddle(fault)
    detector, hooks = run(model, 80, data=shuffled_loader() if fault == "shuffled" else None)
    chance_level = [a for a in detector.alerts if a.kind == "chance_level"]
    assert chance_level and chance_level[0].step <= 69, kinds(detector)  # 59, or one check later
    alert = chance_level[0]
    assert "Nor do its outputs lean toward the labels" in alert.message
    assert alert.data["label_lean_p"] > 0.05
    if fault == "zeros":  # outputs the same for every input (up to rounding): no lean at all
        assert abs(alert.data["label_lean"]) < 1e-3
    assert hooks.seen["end"] == 0


def test_the_profiles_of_the_window_survive_a_checkpoint() -> None:
    detector, _ = run(Saddle(), 45)
    saved = detector.state.state_dict()
    assert saved["profiles"] and len(saved["profiles"][-1][1]) == 10  # 10 x 10 sums, as lists
    restored = StallState(detector.state.thresholds)
    restored.load_state_dict(saved)
    assert restored.leaning() == detector.state.leaning() and detector.state.leaning() is not None


def test_a_compiled_model_is_recognized_without_running_it() -> None:
    net = nn.Linear(3, 2)
    assert not holds_compiled(net) and not holds_compiled(nn.Sequential(net))
    assert holds_compiled(nn.Sequential(torch.compile(net)))  # an OptimizedModule inside
    other = nn.Linear(3, 2)
    other.compile()  # Module.compile(): its calls go through a compiled impl
    assert holds_compiled(nn.Sequential(other))


def test_a_failure_of_the_measuring_inside_the_forward_is_one_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_gradguard.monitors.stall.evidence as evidence

    def broken(*args: Any) -> Any:
        raise RuntimeError("an output we did not expect")

    monkeypatch.delenv("GRADGUARD_STRICT", raising=False)  # a user's run, not the tests' strict mode
    monkeypatch.setattr(evidence, "class_profile", broken)
    model = Saddle()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        detector, hooks = run(model, 70)
    assert len(model.losses) == 70  # every step of the user's forward ran
    said = [str(w.message) for w in caught if "an output we did not expect" in str(w.message)]
    assert len(said) == 1 and "judge the loss alone" in said[0]
    # no evidence: the plateau is judged on its loss, as before the evidence existed
    assert (
        kinds(detector)[0] == ("chance_level", 59) and "Nor do its outputs" not in detector.alerts[0].message
    )
    assert hooks.seen["end"] == 0
