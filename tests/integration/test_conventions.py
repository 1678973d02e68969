"""Lightning's conventions, for every public callback at once: arguments, state keys, fast_dev_run, logging.

* Bad input gets ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the argument; NumPy
  scalars are accepted and stored as Python numbers; non-finite bounds are refused.
* Options with fixed choices are ``Literal`` types, so LightningCLI shows and checks them.
* Every stateful callback has a ``state_key`` from its identifying arguments: two instances with other
  settings save and resume side by side.
* ``fast_dev_run`` skips the LR sweep and the pre-flight checks, saying so once.
* ``Trainer(log_every_n_steps=0)`` turns our periodic logging off; detection goes on.
* A monitor's own failure never crashes the run it watches.
"""

from __future__ import annotations

import inspect
import logging
import math
import typing
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import MemoryLogger, RecordingMLP, make_trainer, public_callbacks, random_loader
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_gradguard import (
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradientCheck,
    GradientNormLogger,
    LossSpikeGuard,
    LRFinderPlus,
    NaNSentinel,
    OptimizerMonitor,
    OverfitBatchSanity,
    StallDetector,
    VanishingExplodingDetector,
    gradient_check,
)

ALL = public_callbacks()
INF, NAN = float("inf"), float("nan")

# ------------------------------------------------------------------------------------------ validation
# (callback, kwargs, the error, the argument it must name)
BAD: list[tuple[type, dict[str, Any], type[Exception], str]] = [
    (GradientNormLogger, {"log_every_n_steps": -1}, ValueError, "log_every_n_steps"),
    (GradientNormLogger, {"log_every_n_steps": 2.5}, TypeError, "log_every_n_steps"),
    (GradientNormLogger, {"log_every_n_steps": "5"}, TypeError, "log_every_n_steps"),
    (GradientNormLogger, {"histogram_every_n_steps": -1}, ValueError, "histogram_every_n_steps"),
    (GradientNormLogger, {"norm_type": 1}, ValueError, "norm_type"),
    (GradientNormLogger, {"norm_type": "two"}, ValueError, "norm_type"),
    (GradientNormLogger, {"norm_type": [2]}, TypeError, "norm_type"),
    (GradientNormLogger, {"group_depth": 0}, ValueError, "group_depth"),
    (GradientNormLogger, {"per_parameter": "yes"}, TypeError, "per_parameter"),
    (GradientNormLogger, {"histogram_bins": 1}, ValueError, "histogram_bins"),
    (GradientNormLogger, {"clip_window": 3}, ValueError, "clip_window"),
    (GradientNormLogger, {"cooldown_steps": -5}, ValueError, "cooldown_steps"),
    (NaNSentinel, {"action": "explode"}, ValueError, "action"),
    (NaNSentinel, {"action": 1}, TypeError, "action"),
    (NaNSentinel, {"check_loss": 1}, TypeError, "check_loss"),
    (NaNSentinel, {"check_parameters_every_n_steps": -1}, ValueError, "check_parameters_every_n_steps"),
    (NaNSentinel, {"history_size": 0}, ValueError, "history_size"),
    (NaNSentinel, {"loss_scale_floor": 0.0}, ValueError, "loss_scale_floor"),
    (NaNSentinel, {"loss_scale_floor": NAN}, ValueError, "loss_scale_floor"),
    (NaNSentinel, {"loss_scale_floor": "1"}, TypeError, "loss_scale_floor"),
    (NaNSentinel, {"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips"),
    (NaNSentinel, {"report_dir": 3}, TypeError, "report_dir"),
    (VanishingExplodingDetector, {"max_norm": 0.0}, ValueError, "max_norm"),
    (VanishingExplodingDetector, {"max_norm": INF}, ValueError, "max_norm"),
    (VanishingExplodingDetector, {"spike_factor": 1.0}, ValueError, "spike_factor"),
    (VanishingExplodingDetector, {"growth_factor": 0.5}, ValueError, "growth_factor"),
    (VanishingExplodingDetector, {"growth_window": 2}, ValueError, "growth_window"),
    (VanishingExplodingDetector, {"warmup_checks": 0}, ValueError, "warmup_checks"),
    (VanishingExplodingDetector, {"history_size": 1}, ValueError, "history_size"),
    (VanishingExplodingDetector, {"depth_ratio_floor": -1.0}, ValueError, "depth_ratio_floor"),
    (VanishingExplodingDetector, {"first_layer_floor": 0.0}, ValueError, "first_layer_floor"),
    (VanishingExplodingDetector, {"min_rms": "small"}, TypeError, "min_rms"),
    (VanishingExplodingDetector, {"relative_floor": 0}, ValueError, "relative_floor"),
    (VanishingExplodingDetector, {"patience": 0}, ValueError, "patience"),
    (VanishingExplodingDetector, {"patience": 2.0}, TypeError, "patience"),
    (VanishingExplodingDetector, {"log_every_n_steps": -1}, ValueError, "log_every_n_steps"),
    (VanishingExplodingDetector, {"log_gradient_flow": "yes"}, TypeError, "log_gradient_flow"),
    (VanishingExplodingDetector, {"action": "skip"}, ValueError, "action"),
    (VanishingExplodingDetector, {"cooldown_steps": -1}, ValueError, "cooldown_steps"),
    (DeadReLUMonitor, {"sample_every_n_steps": 0}, ValueError, "sample_every_n_steps"),
    (DeadReLUMonitor, {"window_samples": 0}, ValueError, "window_samples"),
    (DeadReLUMonitor, {"threshold": 1.5}, ValueError, "threshold"),
    (DeadReLUMonitor, {"threshold": NAN}, ValueError, "threshold"),
    (DeadReLUMonitor, {"patience": 0}, ValueError, "patience"),
    (DeadReLUMonitor, {"check_saturation": 1}, TypeError, "check_saturation"),
    (DeadReLUMonitor, {"saturation_threshold": -0.1}, ValueError, "saturation_threshold"),
    (DeadReLUMonitor, {"log_histograms": "no"}, TypeError, "log_histograms"),
    (DeadReLUMonitor, {"histogram_bins": 1}, ValueError, "histogram_bins"),
    (DeadReLUMonitor, {"action": "panic"}, ValueError, "action"),
    (LRFinderPlus, {"min_lr": 0.0}, ValueError, "min_lr"),
    (LRFinderPlus, {"min_lr": "1e-7"}, TypeError, "min_lr"),
    (LRFinderPlus, {"max_lr": INF}, ValueError, "max_lr"),
    (LRFinderPlus, {"min_lr": 1.0, "max_lr": 0.5}, ValueError, "max_lr"),
    (LRFinderPlus, {"num_training": 2}, ValueError, "num_training"),
    (LRFinderPlus, {"num_training": 100.0}, TypeError, "num_training"),
    (LRFinderPlus, {"mode": "log"}, ValueError, "mode"),
    (LRFinderPlus, {"method": "best"}, ValueError, "method"),
    (LRFinderPlus, {"beta": 1.0}, ValueError, "beta"),
    (LRFinderPlus, {"max_sweeps": 0}, ValueError, "max_sweeps"),
    (LRFinderPlus, {"divergence_threshold": 0.0}, ValueError, "divergence_threshold"),
    (LRFinderPlus, {"divergence_threshold": INF}, ValueError, "divergence_threshold"),
    (LRFinderPlus, {"milestones": [-1]}, ValueError, "milestones"),
    (LRFinderPlus, {"milestones": 3}, TypeError, "milestones"),
    (LRFinderPlus, {"milestones": ["0"]}, TypeError, "milestones"),
    (LRFinderPlus, {"apply": "yes"}, TypeError, "apply"),
    (LRFinderPlus, {"min_points": 1}, ValueError, "min_points"),
    (OverfitBatchSanity, {"max_steps": 0}, ValueError, "max_steps"),
    (OverfitBatchSanity, {"max_steps": "200"}, TypeError, "max_steps"),
    (OverfitBatchSanity, {"target": 1.5}, ValueError, "target"),
    (OverfitBatchSanity, {"target": 0.0}, ValueError, "target"),
    (OverfitBatchSanity, {"target": INF, "target_mode": "absolute"}, ValueError, "target"),
    (OverfitBatchSanity, {"target_mode": "percent"}, ValueError, "target_mode"),
    (OverfitBatchSanity, {"max_samples": 0}, ValueError, "max_samples"),
    (OverfitBatchSanity, {"num_classes": 1}, ValueError, "num_classes"),
    (OverfitBatchSanity, {"initial_loss_tolerance": 0}, ValueError, "initial_loss_tolerance"),
    (OverfitBatchSanity, {"fallback_lr": -1.0}, ValueError, "fallback_lr"),
    (OverfitBatchSanity, {"ignore_parameters": "aux.*"}, TypeError, "ignore_parameters"),
    (OverfitBatchSanity, {"check_batch_mixing": "yes"}, TypeError, "check_batch_mixing"),
    (OverfitBatchSanity, {"action": "explode"}, ValueError, "action"),
    (GradientCheck, {"max_samples": 0}, ValueError, "max_samples"),
    (GradientCheck, {"samples_per_tensor": 0}, ValueError, "samples_per_tensor"),
    (GradientCheck, {"max_evaluations": 0}, ValueError, "max_evaluations"),
    (GradientCheck, {"tolerance": 0.0}, ValueError, "tolerance"),
    (GradientCheck, {"tolerance": INF}, ValueError, "tolerance"),
    (GradientCheck, {"min_order": -1.0}, ValueError, "min_order"),
    (GradientCheck, {"eps": 0.0}, ValueError, "eps"),
    (GradientCheck, {"seed": -1}, ValueError, "seed"),
    (GradientCheck, {"seed": 0.5}, TypeError, "seed"),
    (GradientCheck, {"taylor_tolerance": 0.0}, ValueError, "taylor_tolerance"),
    (GradientCheck, {"modules": "2"}, TypeError, "modules"),
    (GradientCheck, {"action": "explode"}, ValueError, "action"),
    (LossSpikeGuard, {"action": "stop"}, ValueError, "action"),
    (LossSpikeGuard, {"loss_threshold": 0.0}, ValueError, "loss_threshold"),
    (LossSpikeGuard, {"grad_norm_threshold": INF}, ValueError, "grad_norm_threshold"),
    (LossSpikeGuard, {"min_ratio": 0.5}, ValueError, "min_ratio"),
    (LossSpikeGuard, {"window_steps": 4}, ValueError, "window_steps"),
    (LossSpikeGuard, {"window_steps": 128.0}, TypeError, "window_steps"),
    (LossSpikeGuard, {"warmup_steps": 2}, ValueError, "warmup_steps"),
    (LossSpikeGuard, {"escalate_after": 0}, ValueError, "escalate_after"),
    (LossSpikeGuard, {"snapshot_every_n_steps": -1}, ValueError, "snapshot_every_n_steps"),
    (LossSpikeGuard, {"snapshot_device": "gpu"}, ValueError, "snapshot_device"),
    (LossSpikeGuard, {"lr_cooldown_factor": 2.0}, ValueError, "lr_cooldown_factor"),
    (LossSpikeGuard, {"lr_cooldown_steps": 0}, ValueError, "lr_cooldown_steps"),
    (LossSpikeGuard, {"skip_batches_path": 3}, TypeError, "skip_batches_path"),
    (OptimizerMonitor, {"log_every_n_steps": -1}, ValueError, "log_every_n_steps"),
    (OptimizerMonitor, {"epsilon_ratio": 0.0}, ValueError, "epsilon_ratio"),
    (OptimizerMonitor, {"epsilon_ratio": "1"}, TypeError, "epsilon_ratio"),
    (OptimizerMonitor, {"outlier_factor": 1.0}, ValueError, "outlier_factor"),
    (OptimizerMonitor, {"outlier_factor": INF}, ValueError, "outlier_factor"),
    (OptimizerMonitor, {"patience": 0}, ValueError, "patience"),
    (OptimizerMonitor, {"max_layers": 0}, ValueError, "max_layers"),
    (OptimizerMonitor, {"include": 3}, TypeError, "include"),
    (OptimizerMonitor, {"cooldown_steps": -1}, ValueError, "cooldown_steps"),
    (ActivationRangeMonitor, {"sample_every_n_steps": 0}, ValueError, "sample_every_n_steps"),
    (ActivationRangeMonitor, {"sample_every_n_steps": 2.0}, TypeError, "sample_every_n_steps"),
    (ActivationRangeMonitor, {"attention": "yes"}, TypeError, "attention"),
    (ActivationRangeMonitor, {"min_headroom_bits": -1.0}, ValueError, "min_headroom_bits"),
    (ActivationRangeMonitor, {"max_attention_logit": 0.0}, ValueError, "max_attention_logit"),
    (ActivationRangeMonitor, {"max_attention_logit": INF}, ValueError, "max_attention_logit"),
    (ActivationRangeMonitor, {"logit_growth_factor": 1.0}, ValueError, "logit_growth_factor"),
    (ActivationRangeMonitor, {"growth_window": 0}, ValueError, "growth_window"),
    (ActivationRangeMonitor, {"include": 3}, TypeError, "include"),
    (ActivationRangeMonitor, {"max_layers": 0}, ValueError, "max_layers"),
    (ActivationRangeMonitor, {"cooldown_steps": -1}, ValueError, "cooldown_steps"),
    (StallDetector, {"check_every_n_steps": 0}, ValueError, "check_every_n_steps"),
    (StallDetector, {"check_every_n_steps": 1.5}, TypeError, "check_every_n_steps"),
    (StallDetector, {"patience": 0}, ValueError, "patience"),
    (StallDetector, {"num_classes": 1}, ValueError, "num_classes"),
    (StallDetector, {"collapse_factor": 1.0}, ValueError, "collapse_factor"),
    (StallDetector, {"clip_factor": "100"}, TypeError, "clip_factor"),
    (StallDetector, {"lr_jump_factor": 0.5}, ValueError, "lr_jump_factor"),
    (StallDetector, {"warmup_lr_fraction": 1.5}, ValueError, "warmup_lr_fraction"),
    (StallDetector, {"plateau_checks": 0}, ValueError, "plateau_checks"),
    (StallDetector, {"action": "skip"}, ValueError, "action"),
]


@pytest.mark.parametrize(("cls", "kwargs", "error", "name"), BAD, ids=lambda v: getattr(v, "__name__", None))
def test_bad_arguments_raise_the_right_error_naming_them(
    cls: type, kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=f"`{name}"):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [(kw, err, name) for cls, kw, err, name in BAD if cls is GradientCheck and name != "action"]
    + [({"max_evaluations": 10.0}, TypeError, "max_evaluations"), ({"eps": INF}, ValueError, "eps")],
)
def test_gradient_check_function_validates_like_the_callback(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    net = nn.Linear(3, 2)
    batch = (torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    with pytest.raises(error, match=f"`{name}"):
        gradient_check(net, batch, loss, **kwargs)


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers() -> None:
    gnl = GradientNormLogger(log_every_n_steps=np.int64(5), clip_window=np.int32(20), norm_type=np.float64(2))
    assert type(gnl.log_every_n_steps) is int and type(gnl.clip_window) is int and gnl.norm_type == 2.0
    finder = LRFinderPlus(
        min_lr=np.float32(1e-6), max_lr=np.float64(1.0), num_training=np.int64(20), milestones=[np.int64(0)]
    )
    assert type(finder.min_lr) is float and type(finder.num_training) is int
    assert finder.milestones == [0] and type(finder.milestones[0]) is int
    det = VanishingExplodingDetector(max_norm=np.float64(50.0), patience=np.int16(3))
    assert type(det.max_norm) is float and type(det.patience) is int
    sentinel = NaNSentinel(check_loss=np.bool_(True), history_size=np.uint8(7))
    assert sentinel.check_loss is True and type(sentinel.history_size) is int
    check = OverfitBatchSanity(max_steps=np.int64(10), target=np.float32(0.25))
    assert type(check.max_steps) is int and type(check.target) is float
    assert type(DeadReLUMonitor(threshold=np.float32(0.5)).threshold) is float
    assert type(GradientCheck(seed=np.int64(3)).seed) is int


# ------------------------------------------------------------------------------------------ Literal choices
CHOICES = [
    (NaNSentinel, "action", {"raise", "stop", "warn", "skip"}),
    (VanishingExplodingDetector, "action", {"warn", "stop", "raise"}),
    (DeadReLUMonitor, "action", {"warn", "stop", "raise"}),
    (LRFinderPlus, "mode", {"exponential", "linear"}),
    (LRFinderPlus, "method", {"auto", "valley", "steep", "minimum", "slide", "peak"}),
    (OverfitBatchSanity, "action", {"raise", "warn", "stop"}),
    (OverfitBatchSanity, "target_mode", {"relative", "absolute"}),
    (GradientCheck, "action", {"raise", "warn", "stop"}),
    (StallDetector, "action", {"warn", "stop", "raise"}),
    (LossSpikeGuard, "action", {"skip", "rollback", "warn", "raise"}),
    (LossSpikeGuard, "snapshot_device", {"cpu", "same"}),
]


def _choice_id(value: object) -> str:
    """A stable id (a set's order changes with the hash seed: pytest-xdist's workers must agree)."""
    if isinstance(value, (set, frozenset)):
        return "|".join(sorted(map(str, value)))
    return getattr(value, "__name__", str(value))


@pytest.mark.parametrize(("cls", "arg", "choices"), CHOICES, ids=_choice_id)
def test_options_with_fixed_choices_are_literal_types(cls: type, arg: str, choices: set[str]) -> None:
    hint = typing.get_type_hints(cls.__init__)[arg]
    assert typing.get_origin(hint) is typing.Literal
    assert set(typing.get_args(hint)) == choices
    for choice in choices:  # every choice the type shows is one the callback takes
        cls(**{arg: choice})
    if arg == "action":
        assert set(cls.allowed_actions) == choices


def test_every_callback_is_validated_and_every_action_is_a_literal() -> None:
    assert {cls for cls, *_ in BAD} == set(ALL)
    for cls in ALL:
        if "action" in inspect.signature(cls).parameters:
            hint = typing.get_type_hints(cls.__init__)["action"]
            assert typing.get_origin(hint) is typing.Literal
            assert set(typing.get_args(hint)) == set(cls.allowed_actions)


def test_every_constructor_is_keyword_only() -> None:
    """``NaNSentinel(True, False)`` says nothing a reader can check; every argument is named."""
    for cls in ALL:
        kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
        assert kinds <= {inspect.Parameter.KEYWORD_ONLY}, cls.__name__
    with pytest.raises(TypeError):
        NaNSentinel(True)  # type: ignore[misc]


def test_norm_type_shows_inf_as_a_choice() -> None:
    hint = typing.get_type_hints(GradientNormLogger.__init__)["norm_type"]
    assert typing.Literal["inf"] in typing.get_args(hint)


def test_lightning_cli_shows_and_checks_the_choices(tmp_path: Path, capsys: Any) -> None:
    args = ["--trainer.callbacks=lightning_gradguard.NaNSentinel", "--trainer.callbacks.help"]
    with pytest.raises(SystemExit):
        LightningCLI(RecordingMLP, run=False, args=[*args, "lightning_gradguard.NaNSentinel"])
    assert "{raise,stop,warn,skip}" in capsys.readouterr().out
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  logger: false\n  callbacks:\n"
        "    - class_path: lightning_gradguard.LRFinderPlus\n      init_args:\n        method: best\n"
    )
    with pytest.raises(SystemExit):
        LightningCLI(RecordingMLP, run=False, args=["--config", str(config)], save_config_callback=None)


# ------------------------------------------------------------------------------------------ state_key
def test_every_callback_has_a_state_key_from_its_identifying_arguments() -> None:
    pairs = [
        (GradientNormLogger(), GradientNormLogger(log_every_n_steps=10)),
        (VanishingExplodingDetector(), VanishingExplodingDetector(check_every_n_steps=10)),
        (DeadReLUMonitor(), DeadReLUMonitor(sample_every_n_steps=10)),
        (ActivationRangeMonitor(), ActivationRangeMonitor(sample_every_n_steps=10)),
        (LRFinderPlus(), LRFinderPlus(milestones=[0, 5])),
        (GradientCheck(), GradientCheck(modules=["net.0"])),
        (OptimizerMonitor(), OptimizerMonitor(log_every_n_steps=10)),
        (StallDetector(), StallDetector(check_every_n_steps=5)),
    ]
    for a, b in pairs:
        assert a.state_key != b.state_key, type(a).__name__
        assert a.state_key.startswith(type(a).__name__)
        assert (
            a.state_key == type(a)().state_key
        )  # the same settings: the same key (and Lightning refuses it)
    # one per Trainer: resuming with other settings (NaNSentinel(action="skip") after a failure) keeps state
    one_per_trainer = {NaNSentinel, OverfitBatchSanity, LossSpikeGuard}
    for cls in one_per_trainer:
        assert cls().state_key == f"{cls.__name__}{{}}"
    assert {type(a) for a, _ in pairs} | one_per_trainer == set(ALL)  # every callback
    assert NaNSentinel(action="skip", max_consecutive_skips=3).state_key == NaNSentinel().state_key
    assert VanishingExplodingDetector(max_norm=10.0).state_key == VanishingExplodingDetector().state_key


def test_two_instances_save_and_resume_side_by_side(tmp_path: Path) -> None:
    """Two loggers with other cadences and two finders with other milestones in one checkpoint."""
    torch.manual_seed(0)

    def callbacks() -> list[Any]:
        return [
            GradientNormLogger(log_every_n_steps=2, clip_window=10),
            GradientNormLogger(log_every_n_steps=3, clip_window=20),
            LRFinderPlus(num_training=10, milestones=[0], progress=False, plot=False),
            LRFinderPlus(num_training=10, milestones=[1], progress=False, plot=False),
        ]

    first = callbacks()
    trainer = make_trainer(first, MemoryLogger(str(tmp_path)), gradient_clip_val=1.0, max_epochs=2)
    trainer.fit(RecordingMLP(), random_loader(n=96))
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    assert [len(cb.results) for cb in first[2:]] == [1, 1]
    assert first[0]._clip_seen == first[1]._clip_seen == 24

    second = callbacks()
    resumed = make_trainer(second, MemoryLogger(str(tmp_path)), gradient_clip_val=1.0, max_epochs=3)
    resumed.fit(RecordingMLP(), random_loader(n=96), ckpt_path=str(ckpt))
    # each instance got its own state back: the windows differ in size, the milestones were done once
    assert second[0]._clip_norms is not None and second[0]._clip_norms.numel() == 10
    assert second[1]._clip_norms is not None and second[1]._clip_norms.numel() == 20
    assert second[0]._clip_seen == second[1]._clip_seen == 36
    assert second[2]._done_epochs == {0} and second[3]._done_epochs == {1}
    assert [len(cb.results) for cb in second[2:]] == [0, 0]  # no milestone ran again after the resume


# ------------------------------------------------------------------------------------------ fast_dev_run
def test_fast_dev_run_skips_the_sweep_and_the_preflight_checks(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    finder = LRFinderPlus(num_training=20, progress=False, plot=False)
    overfit, grad = OverfitBatchSanity(), GradientCheck()
    model = RecordingMLP(lr=0.1)
    trainer = pl.Trainer(
        accelerator="cpu",
        fast_dev_run=True,
        callbacks=[finder, overfit, grad],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        trainer.fit(model, random_loader(n=64))
    assert trainer.global_step == 1  # the smoke test stayed a smoke test
    assert finder.results == [] and overfit.result is None and grad.result is None
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1
    lines = [r.getMessage() for r in caplog.records if "fast_dev_run" in r.getMessage()]
    assert len(lines) == 3 and all("skipping" in line for line in lines)


# ---------------------------------------------------------------------------------- log_every_n_steps=0
class DeadAndExploding(pl.LightningModule):
    """A ReLU layer whose units all have bias -100 (dead for any input) and a loss scaled to explode."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.out = nn.Linear(16, 4)
        self.skip = nn.Linear(8, 4)
        with torch.no_grad():
            self.inp.bias.fill_(-100.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.out(self.act(self.inp(x))) + self.skip(x)
        return 1e4 * nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_log_every_n_steps_zero_logs_nothing_periodic_while_detection_goes_on() -> None:
    logger = MemoryLogger()
    det, dead = VanishingExplodingDetector(), DeadReLUMonitor()
    make_trainer([det, dead, GradientNormLogger()], logger, log_every_n_steps=0, max_steps=12).fit(
        DeadAndExploding(), random_loader(n=200)
    )
    tags = {tag for _, metrics in logger.calls for tag in metrics}
    periodic = ("grad_flow", "dead_relu", "saturated", "grad_norm", "weight_norm", "update_ratio")
    assert not [t for t in tags if t.split("/")[0] in periodic], sorted(tags)
    assert {a.kind for a in det.alerts} == {"exploding_gradient"}
    assert {a.kind for a in dead.alerts} == {"dead_relu"} and dead.alerts[0].where == "act"
    assert tags >= {"alerts/exploding_gradient", "alerts/dead_relu"}  # findings still reach the loggers


# ------------------------------------------------------------------------------------------ never crash
def test_a_monitor_failure_is_one_warning_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("a statistic our code did not expect")

    monkeypatch.setattr(GradientNormLogger, "_emit_step", broken)
    monkeypatch.setenv("GRADGUARD_STRICT", "0")
    trainer = make_trainer([GradientNormLogger()], MemoryLogger(), max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RecordingMLP(), random_loader())
    assert trainer.global_step == 6
    ours = [w for w in caught if "GradientNormLogger._flush failed" in str(w.message)]
    assert len(ours) == 1 and "KeyError" in str(ours[0].message)
    monkeypatch.setenv("GRADGUARD_STRICT", "1")  # our tests see the error itself
    with pytest.raises(KeyError):
        make_trainer([GradientNormLogger()], MemoryLogger(), max_steps=2).fit(RecordingMLP(), random_loader())


class BrokenLogger(MemoryLogger):
    """A logger whose writes fail (a full disk, a tracking server that is down)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise OSError("the tracking server is down")


def test_a_failing_logger_costs_its_copy_of_the_alert_never_the_action(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alert sinks and logger writes come before ``act()``: a logger error must not swallow the decision
    (under DDP the other ranks would act on it alone)."""
    from lightning_gradguard import GradGuardError

    monkeypatch.setenv("GRADGUARD_STRICT", "0")
    det = VanishingExplodingDetector(action="raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(GradGuardError):
            make_trainer([det], BrokenLogger(), max_steps=12).fit(DeadAndExploding(), random_loader(n=200))
    assert [a.kind for a in det.alerts] == ["exploding_gradient"]
    assert any("could not write" in str(w.message) and "OSError" in str(w.message) for w in caught)


def test_the_overfit_check_says_that_it_passed(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    check = OverfitBatchSanity(max_steps=300)
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([check], max_steps=1).fit(RecordingMLP(lr=0.5), random_loader())
    assert check.result is not None and check.result.passed
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OverfitBatchSanity")]
    assert "passed" in line and f"in {check.result.steps} steps" in line
    assert math.isfinite(check.result.final_loss) and f"{check.result.final_loss:.4g}" in line
