"""A wrong optimizer setting is named: Adam's beta2 / eps (OptimizerMonitor) and the learning rate
(GradientNormLogger), on real Trainers with the scikit-learn digits, beside healthy twins that stay quiet.

``Truth`` copies every weight in float64 before and after each step, without gradguard, and computes what the
rules read: each layer's largest per-entry step in units of its lr, and the total update/weight ratio.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, make_trainer
from floor import needs_argument
from torch import nn

from lightning_gradguard import GradientNormLogger, OptimizerMonitor

sys.path.insert(0, str(ROOT / "examples"))

from zoo import ZooModule, digits


class Truth(pl.Callback):
    """Per step: the largest ``|delta w| / lr`` of each layer and the total ``||delta w|| / ||w||``."""

    def __init__(self) -> None:
        self.max_step: dict[int, dict[str, float]] = {}
        self.ratio: dict[int, float] = {}
        self._before: dict[str, tuple[torch.Tensor, float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        lr = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        self._before = {
            n: (p.detach().double().clone(), lr[id(p)])
            for n, p in pl_module.named_parameters()
            if p.requires_grad
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        steps: dict[str, float] = {}
        update = weight = 0.0
        for name, p in pl_module.named_parameters():
            if name not in self._before:
                continue
            w0, lr = self._before[name]
            d = p.detach().double() - w0
            layer = name.rsplit(".", 1)[0]
            steps[layer] = max(steps.get(layer, 0.0), float(d.abs().max()) / lr)
            update, weight = update + float(d.square().sum()), weight + float(w0.square().sum())
        self.max_step[trainer.global_step - 1] = steps
        self.ratio[trainer.global_step - 1] = (update / weight) ** 0.5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _run(
    build: Callable[[], pl.LightningModule],
    monitors: list[pl.Callback],
    steps: int,
    root: Any,
    shape: tuple[int, ...] = (64,),
) -> Truth:
    """Train on the digits for ``steps`` steps, every step measured (the strictest cadence)."""
    pl.seed_everything(0, verbose=False)
    truth = Truth()
    make_trainer([truth, *monitors], max_steps=steps, max_epochs=-1, default_root_dir=root).fit(
        build(), digits(shape=shape)
    )
    return truth


def _zoo(net: Callable[[], nn.Module], make_opt: Callable[[Any], Any]) -> Callable[[], pl.LightningModule]:
    return lambda: ZooModule(net(), make_opt)


# ------------------------------------------------------------------------------------ Adam's beta2 and eps
def _adam(**kw: Any) -> Callable[[Any], Any]:
    return lambda params: torch.optim.Adam(params, lr=1e-3, **kw)


@pytest.mark.parametrize(
    ("kw", "named"),
    [({"betas": (0.9, 0.1)}, "beta2=0.1"), ({"betas": (0.9, 0.5), "eps": 1e-16}, "eps=1e-16")],
    ids=["beta2_0.1", "beta2_0.5_eps_1e-16"],
)
def test_a_too_small_beta2_is_named_within_ten_steps_of_its_onset(
    kw: dict[str, Any], named: str, tmp_path: Any
) -> None:
    """The blow-up starts when the per-entry step leaves the healthy band (2 x lr: every healthy run
    stayed under it); the alert comes within 10 steps, with the step that Truth measured."""
    monitor = OptimizerMonitor(log_every_n_steps=1)
    truth = _run(_zoo(_mlp, _adam(**kw)), [monitor], 30, tmp_path)
    onset = min(s for s, layers in truth.max_step.items() if max(layers.values()) > 2.0)
    alerts = [a for a in monitor.alerts if a.kind == "adam_step_too_large"]
    assert alerts, [a.format() for a in monitor.alerts]
    a = alerts[0]
    assert onset <= a.step <= onset + 10, (onset, a.step)
    assert a.data["step_over_lr"] == pytest.approx(truth.max_step[a.step][a.where], rel=1e-4)
    assert a.data["step_over_lr"] == max(truth.max_step[a.step].values()) or a.data["other_layers"] == 0
    assert a.data["step_over_lr"] > 10.0 and a.data["beta2"] == kw["betas"][1]
    assert "beta2 <= beta1^2" in a.message and named in a.message + a.hint
    assert "beta2" in a.hint and len({b.step for b in alerts}) == 1  # one alert: the cooldown holds


HEALTHY_ADAM = {  # the optimizer, and the largest per-entry step (x lr) it took: the measured band
    "adam": (_adam(), 2.0),
    "adam_beta2_0.9": (_adam(betas=(0.9, 0.9)), 1.0 + 1e-4),  # beta2 > beta1^2: at most 1 x lr (float32)
    "adam_eps_1e-16": (_adam(eps=1e-16), 2.0),  # eps only lowers the step
    "adamw_decay": (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), 2.0),
    "nadam": (lambda p: torch.optim.NAdam(p, lr=1e-3), 4.0),  # its bound: 3.8 x lr at step 40 (13.7 at 1000)
    "radam": (lambda p: torch.optim.RAdam(p, lr=1e-3), 1.0),
}


@pytest.mark.parametrize("name", HEALTHY_ADAM)
def test_healthy_adam_family_runs_stay_quiet(name: str, tmp_path: Any) -> None:
    make_opt, band = HEALTHY_ADAM[name]
    monitor = OptimizerMonitor(log_every_n_steps=1)
    truth = _run(_zoo(_mlp, make_opt), [monitor], 40, tmp_path)
    assert monitor.alerts == [], [a.format() for a in monitor.alerts]
    assert max(max(s.values()) for s in truth.max_step.values()) < band  # the limit is 10 x lr


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=100.0),
        pytest.param(
            lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=100.0, decoupled_weight_decay=True),
            marks=needs_argument(torch.optim.Adam, "decoupled_weight_decay"),
        ),
    ],
    ids=["adamw", "adam_decoupled"],
)
def test_a_strong_decoupled_weight_decay_is_not_read_as_adams_step(make_opt: Any, tmp_path: Any) -> None:
    """Regression: AdamW's decay moves an entry by lr * weight_decay * |w| beside Adam's step; with
    weight_decay=100 that is 12x lr for the largest weights at step 0, and the rule named beta2/eps for
    what is a weight-decay collapse (StallDetector's weight_decay_collapse names it). Adam's own part of
    the step stays within its bound."""
    monitor = OptimizerMonitor(log_every_n_steps=1)
    truth = _run(_zoo(_mlp, make_opt), [monitor], 12, tmp_path)
    assert max(truth.max_step[0].values()) > 10.0  # the move itself is over the 10 x lr limit
    assert [a.format() for a in monitor.alerts if a.kind == "adam_step_too_large"] == []


# ------------------------------------------------------------------------------------ the learning rate
def _sgd(lr: float, momentum: float = 0.9) -> Callable[[Any], Any]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def _kept(net: Callable[[], nn.Module], make_opt: Callable[[Any], Any], out: list[Any]) -> Any:
    """Like :func:`_zoo`, and the module built is kept in ``out`` (its losses are read afterwards)."""

    def build() -> pl.LightningModule:
        out.append(ZooModule(net(), make_opt))
        return out[-1]

    return build


def test_a_high_ratio_the_loss_follows_down_is_not_named(tmp_path: Any) -> None:
    """Regression (issue 39's search picked a learning rate this rule then called too high): the BatchNorm
    CNN at SGD 0.5 rewrites 4-6 % of its weights a step, yet its loss falls faster than at the zoo's 0.05.
    A ratio that the loss follows down is a fast learner: not named. (Named at step 40 before.)"""
    logger = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    fast: list[Any] = []
    truth = _run(_kept(_cnn, _sgd(0.5), fast), [logger], 41, tmp_path, (1, 8, 8))
    assert min(truth.ratio[s] for s in range(20, 41)) > 1.2 * 0.03  # the premise: above the ceiling
    slow: list[Any] = []
    _run(_kept(_cnn, _sgd(0.05), slow), [], 41, tmp_path, (1, 8, 8))
    assert statistics.fmean(fast[0].losses[-5:]) < statistics.fmean(slow[0].losses[-5:])  # it learns faster
    assert [a.format() for a in logger.alerts if a.kind == "update_ratio_high"] == []


@pytest.mark.parametrize(("net", "shape"), [(_mlp, (64,))], ids=["mlp"])
def test_a_learning_rate_ten_times_too_high_is_named(net: Any, shape: tuple[int, ...], tmp_path: Any) -> None:
    """SGD with momentum at 0.5, ten times the zoo's healthy 0.05: the ratio sits at 4-6e-2 for 20 steps
    (the healthy twin below: under 1.6e-2) while the loss climbs back above its start (it spikes to ~50),
    and the alert names lr=0.5 with the ratio Truth measured.

    The run ends at the alert's step: at lr 0.5 the trajectory is chaotic, and where it goes after the
    alert moves with the CPU's rounding (issue 28: on another machine the ratio fell under 0.03 by step
    44); what this test is about, the alert and the run of checks behind it, is all before that."""
    logger = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    truth = _run(_zoo(net, _sgd(0.5)), [logger], 41, tmp_path, shape)
    lowest = min(truth.ratio[s] for s in range(20, 41))
    assert lowest > 1.2 * 0.03  # the premise; measured: 0.040 cnn, 0.047-0.055 mlp across rounding
    alerts = [a for a in logger.alerts if a.kind == "update_ratio_high"]
    assert [a.step for a in alerts] == [40], [a.format() for a in logger.alerts]  # steps 20-40 above 0.03
    a = alerts[0]
    assert a.data["update_ratio"] == pytest.approx(truth.ratio[40], rel=1e-4)
    assert a.data["lowest"] == pytest.approx(lowest, rel=1e-4)
    assert a.data["lr"] == 0.5 and "lr=0.5" in a.message and "learning rate" in a.message
    assert "try lr=" in a.hint
    resumed = GradientNormLogger()  # the run of checks above the ceiling survives a checkpoint
    resumed.load_state_dict(logger.state_dict())
    assert resumed.state_dict()["update_ratio"] == logger.state_dict()["update_ratio"]
    assert logger.state_dict()["update_ratio"][""]["count"] == 41 - 20


def test_a_weight_decay_far_too_strong_is_named_instead_of_the_learning_rate(tmp_path: Any) -> None:
    """Regression: AdamW(lr=1e-3, weight_decay=50) removes 5 % of every weight a step; the ratio sits near
    that 0.05 and the alert told the user to lower a healthy learning rate. Now it names the weight
    decay, with lr * weight_decay."""
    logger = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=50.0)  # noqa: E731
    truth = _run(_zoo(_mlp, adamw), [logger], 45, tmp_path)
    alerts = [a for a in logger.alerts if a.kind == "update_ratio_high"]
    assert alerts, [a.format() for a in logger.alerts]
    a = alerts[0]
    assert a.data["update_ratio"] == pytest.approx(truth.ratio[a.step], rel=1e-4)
    assert a.data["decay_share"] == pytest.approx(0.05) and a.data["lowest"] <= 2 * 0.05
    assert "weight decay is far too strong" in a.message and "weight_decay=50" in a.message
    assert "Lower weight_decay" in a.hint and "try lr=" not in a.hint


@pytest.mark.parametrize(
    ("make_opt", "usual"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.5), "SGD's usual values are 1e-4 to 5e-4"),
        (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=50.0), "AdamW's usual values are 0.01-0.1"),
    ],
    ids=["sgd", "adamw"],
)
def test_the_weight_decay_advice_fits_the_optimizer(make_opt: Any, usual: str) -> None:
    """SGD's decay also removes lr * weight_decay a step; its advice is SGD's scale, not AdamW's."""
    from lightning_gradguard.monitors.gradients.ratio import RatioWatch
    from lightning_gradguard.monitors.gradients.rules import UPDATE_RATIO_HIGH, ratio_finding

    watch = RatioWatch()
    assert [watch.check(step, 0.06, 0.03) for step in (20, 30, 40)] == [False, False, True]
    finding = ratio_finding(watch, 40, 0.03, make_opt([nn.Parameter(torch.zeros(3))]))
    assert finding.rule is UPDATE_RATIO_HIGH
    assert "weight decay is far too strong" in finding.message and usual in finding.hint


class _Warmup(ZooModule):
    """AdamW with a linear warm-up over 20 steps."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 20))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _transformer() -> pl.LightningModule:
    from zoo import _TinyTransformer

    return _Warmup(_TinyTransformer(), lambda p: None)


def _frozen() -> pl.LightningModule:
    from zoo import frozen_backbone

    return frozen_backbone()[0]  # fine-tuning: Adam 1e-2 on a fresh head, the backbone frozen


HEALTHY_RATIO: dict[str, tuple[Callable[[], pl.LightningModule], tuple[int, ...]]] = {
    "cnn_sgd_momentum_0.05": (_zoo(_cnn, _sgd(0.05)), (1, 8, 8)),
    "mlp_sgd_momentum_0.05": (_zoo(_mlp, _sgd(0.05)), (64,)),
    "mlp_adam_1e-3": (_zoo(_mlp, _adam()), (64,)),
    "transformer_adamw_warmup": (_transformer, (8, 8)),
    "fine_tuning_adam_1e-2": (_frozen, (64,)),
}


@pytest.mark.parametrize("name", HEALTHY_RATIO)
def test_healthy_runs_never_sustain_a_high_update_ratio(name: str, tmp_path: Any) -> None:
    """The twins, and what a naive ratio rule would flag (Adam's first steps at ~lr per entry, the fresh
    head of a fine-tuned model at 4-7e-2 for its first 20 steps, zero-initialised attention biases)."""
    build, shape = HEALTHY_RATIO[name]
    logger = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    monitor = OptimizerMonitor(log_every_n_steps=1)
    truth = _run(build, [logger, monitor], 60, tmp_path, shape)
    assert logger.alerts == [] and monitor.alerts == [], [a.format() for a in logger.alerts + monitor.alerts]
    if name == "transformer_adamw_warmup":  # the zero-initialised attention biases, far above the median
        born = set(monitor.state_dict()["born_zero"][""])
        assert {b for b in born if b.endswith("in_proj_bias")} == {
            f"net.encoder.layers.{i}.self_attn.in_proj_bias" for i in (0, 1)
        }
    sustained = max(min(truth.ratio[s] for s in range(i, i + 21)) for i in range(20, 40))
    assert sustained < 0.025  # the level held for 20 steps from step 20 on: measured up to 0.024
