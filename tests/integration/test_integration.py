"""Integration: all seven gradguard callbacks together on one real Trainer, as the README uses them.

The question every test asks is whether the callbacks stay out of each other's way: the pre-flight
checks (OverfitBatchSanity, GradientCheck) and the LR range test (LRFinderPlus) run their own training
loops before step 0; none of those trial steps may reach NaNSentinel, feed VanishingExplodingDetector's
baseline, trigger DeadReLUMonitor's sampling, add points to GradientNormLogger's clip window or shift the
x-axis of the charts. The run that follows must be the run one would have had by starting with the
suggested LR and no checks at all, bit for bit. Every alert lands in one JSONL file and the TensorBoard
custom-scalars layout holds every callback's charts exactly once.

Configurations: CPU 32-true, bf16-mixed, 16-mixed with a real GradScaler on CPU, gradient accumulation,
a LightningDataModule, resuming from a checkpoint, 2-process DDP (gloo), and a NaN injected mid-run.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from conftest import reference_total_norm, run_ddp_script
from floor import accepts, needs_torch_draws
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

from lightning_gradguard import LRFinderPlus
from lightning_gradguard.alerts import NonFiniteError
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.monitors.dead_units.callback import DeadReLUMonitor
from lightning_gradguard.monitors.gradcheck.callback import GradientCheck
from lightning_gradguard.monitors.gradients.callback import GradientNormLogger
from lightning_gradguard.monitors.nan.callback import NaNSentinel
from lightning_gradguard.monitors.overfit.callback import OverfitBatchSanity
from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector
from tests.conftest import MemoryLogger
from tests.testkit import SEARCH_STEPS

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
]

FEATURES, HIDDEN, CLASSES = 16, 32, 4
N_SAMPLES, BATCH = 256, 16
STEPS_PER_EPOCH = N_SAMPLES // BATCH  # 16
LOG_EVERY = 4
SWEEP = 30


def range_test() -> LRFinderPlus:
    """The range test of the README's callbacks, with a test's search budget."""
    return LRFinderPlus(
        min_lr=1e-4, max_lr=10.0, num_training=SWEEP, search_steps=SEARCH_STEPS, progress=False, plot=False
    )


def dataset(seed: int = 0) -> torch.utils.data.TensorDataset:
    """Learnable random data: the label is the argmax of a fixed linear map of the input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(dim=1))


def loader(shuffle: bool = True, seed: int = 0) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(dataset(seed), batch_size=BATCH, shuffle=shuffle)


class DataModule(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.data: torch.utils.data.TensorDataset | None = None

    def setup(self, stage: str) -> None:
        self.data = dataset()

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        assert self.data is not None
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH, shuffle=True)


class Net(pl.LightningModule):
    """A ReLU MLP that records, without gradguard, what the real optimizer steps saw.

    ``steps`` holds ``global_step`` at every real ``on_before_optimizer_step`` (Lightning calls the
    module hook only for the run's own steps), ``norms`` the true pre-clip total gradient norm there and
    ``losses`` the loss of every real training batch (``on_train_batch_end``).
    """

    def __init__(self, lr: float = 0.05, nan_at: int | None = None, nan_rank: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self.lr = lr
        self.nan_at = nan_at
        self.nan_rank = nan_rank
        self.steps: list[int] = []
        self.norms: dict[int, float] = {}
        self.losses: list[float] = []
        self._poison = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Poison real batches only (the pre-flight checks call training_step before any of them)."""
        self._poison = (
            self.nan_at is not None
            and self.trainer.global_step == self.nan_at
            and self.nan_rank in (None, self.global_rank)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self._poison:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self.net(x), y))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        step = int(self.trainer.global_step)
        self.steps.append(step)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms[step] = float(reference_total_norm(grads))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def seven(**sentinel: Any) -> list[GradGuardCallback]:
    """The README's callbacks plus GradientCheck, in the README's order (pre-flight first)."""
    return [
        OverfitBatchSanity(),
        GradientCheck(),
        range_test(),
        GradientNormLogger(histogram_every_n_steps=8),
        VanishingExplodingDetector(),
        DeadReLUMonitor(sample_every_n_steps=5),
        NaNSentinel(**sentinel),
    ]


def by_type(callbacks: list[Any], cls: type) -> Any:
    return next(cb for cb in callbacks if isinstance(cb, cls))


def trainer_for(callbacks: list[Any], tmp_path: Path, logger: Any = None, **kw: Any) -> pl.Trainer:
    args: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        logger=logger if logger is not None else False,
    )
    args.update(kw)
    return pl.Trainer(callbacks=callbacks, **args)


def layout_of(log_dir: Path) -> list[layout_pb2.Layout]:
    """Every custom-scalars layout written to the TensorBoard event files under ``log_dir``."""
    layouts = []
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in event_file_loader.EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "custom_scalars":
                    layouts.append(layout_pb2.Layout.FromString(value.tensor.string_val[0]))
    return layouts


def jsonl_alerts(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "gradguard_alerts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------- configurations
CONFIGS: dict[str, dict[str, Any]] = {
    "32-true": {},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "16-mixed-scaler": {},  # plugins built per test (a GradScaler is stateful)
    "accumulate-2": {"accumulate_grad_batches": 2},
    "datamodule": {},  # the data comes from a LightningDataModule
    "validation": {"num_sanity_val_steps": 2},  # a val loader, sanity check before the pre-flight checks
}


def fit(trainer: pl.Trainer, model: pl.LightningModule, config: str, **kw: Any) -> None:
    if config == "datamodule":
        trainer.fit(model, datamodule=DataModule(), **kw)
    elif config == "validation":
        trainer.fit(model, loader(), loader(shuffle=False, seed=1), **kw)
    else:
        trainer.fit(model, loader(), **kw)


def config_kwargs(name: str) -> dict[str, Any]:
    kw = dict(CONFIGS[name])
    if name == "16-mixed-scaler":
        kw["plugins"] = [MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))]
    return kw


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trial_steps_reach_no_monitor_and_charts_start_at_step_zero(config: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    callbacks = seven()
    memory = MemoryLogger(str(tmp_path / "tb" / "run"))
    tb = TensorBoardLogger(str(tmp_path), name="tb", version="run")
    kw = config_kwargs(config)
    trainer = trainer_for(callbacks, tmp_path, logger=[tb, memory], gradient_clip_val=1.0, **kw)
    model = Net()
    fit(trainer, model, config)

    accumulate = kw.get("accumulate_grad_batches", 1)
    n_steps = STEPS_PER_EPOCH // accumulate
    # the pre-flight checks and the sweep ran, and passed / suggested
    overfit, gcheck, finder = (
        by_type(callbacks, c) for c in (OverfitBatchSanity, GradientCheck, LRFinderPlus)
    )
    gnl, vx, relu, sentinel = (
        by_type(callbacks, c)
        for c in (GradientNormLogger, VanishingExplodingDetector, DeadReLUMonitor, NaNSentinel)
    )
    assert overfit.result is not None and overfit.result.passed and overfit.result.steps > 1
    assert gcheck.result is not None and gcheck.result.passed
    assert finder.result is not None and finder.result.suggestion is not None
    assert len(finder.result.lrs) >= 10
    # the run's own optimizer steps are exactly 0..n-1 (the module hook fires only for real steps)
    assert model.steps == list(range(n_steps))
    assert trainer.global_step == n_steps
    # NaNSentinel: the sweep's divergence (max_lr=10) did not reach it; its norm history is the real steps'
    assert sentinel.alerts == []
    assert sentinel.norm_history.steps == list(range(n_steps))
    history = [r.total_grad_norm for r in sentinel.norm_history.records()]
    for step, value in zip(sentinel.norm_history.steps, history, strict=True):
        if math.isfinite(model.norms[step]):
            assert value == pytest.approx(model.norms[step], rel=1e-4)  # unscaled, as the module saw it
    # VanishingExplodingDetector: its baseline holds the checked real steps' norms only
    checked = [s for s in range(n_steps) if vx.due(s)]
    expected_baseline = [model.norms[s] for s in checked if math.isfinite(model.norms[s])]
    assert vx.history.get(0, []) == pytest.approx(expected_baseline[-vx.history_size :], rel=1e-4)
    # DeadReLUMonitor: one sample per due optimizer step (its micro-batches pooled), none of the trial steps
    assert relu.sampled_batches == len([s for s in range(n_steps) if relu.due(s)])
    # GradientNormLogger: one clip-window point per real step, charts at the trainer's step axis
    assert gnl._clip_seen == n_steps
    logged = memory.series("grad_norm/total")
    expected_steps = [s for s in range(n_steps) if s == 0 or (s + 1) % LOG_EVERY == 0]
    assert sorted(logged) == expected_steps
    for step, value in logged.items():
        assert value == pytest.approx(model.norms[step], rel=1e-4)
    # Lightning's own train/loss shares the axis: at step s it shows batch s's loss (no trial loss leaks in)
    train_loss = memory.series("train/loss")
    assert sorted(train_loss) == [s for s in range(n_steps) if (s + 1) % LOG_EVERY == 0]
    if accumulate == 1:
        for step, value in train_loss.items():
            assert value == pytest.approx(model.losses[step], rel=1e-6)


# ---------------------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("config", list(CONFIGS))
def test_run_after_checks_and_finder_equals_a_plain_run_at_the_suggested_lr(
    config: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    callbacks = seven()
    checked = Net()
    kw = config_kwargs(config)
    fit(trainer_for(callbacks, tmp_path / "a", max_epochs=2, gradient_clip_val=1.0, **kw), checked, config)
    finder = by_type(callbacks, LRFinderPlus)
    assert finder.result is not None and finder.result.applied
    suggested = finder.result.suggestion
    assert suggested != Net().lr  # the finder changed the LR: the comparison below is not trivial

    torch.manual_seed(0)
    plain = Net(lr=suggested)
    kw = config_kwargs(config)
    fit(trainer_for([], tmp_path / "b", max_epochs=2, gradient_clip_val=1.0, **kw), plain, config)
    assert len(checked.losses) == len(plain.losses) == 2 * STEPS_PER_EPOCH
    assert checked.losses == plain.losses  # exact floats, every batch, shuffled order included
    for (name, a), b in zip(checked.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class RichNet(Net):
    """BatchNorm (running buffers), Dropout (random draws) and a torchmetrics metric in training_step:
    everything the trial loops touch that must be put back."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.BatchNorm1d(HIDDEN),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN, CLASSES),
        )
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)
        self.epoch_acc: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.acc.update(logits, y)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_acc.append(float(self.acc.compute()))
        self.acc.reset()


@needs_torch_draws  # the sweep's suggestion exists for torch 2.13's init and dropout masks
@pytest.mark.parametrize("config", ["32-true", "16-mixed-scaler"])
def test_batchnorm_dropout_and_metrics_come_back_exactly_after_the_trial_loops(
    config: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    callbacks = seven()
    checked = RichNet()
    trainer_for(callbacks, tmp_path / "a", max_epochs=2, **config_kwargs(config)).fit(checked, loader())
    assert by_type(callbacks, OverfitBatchSanity).result.passed
    suggested = by_type(callbacks, LRFinderPlus).result.suggestion
    assert suggested is not None and suggested != checked.lr

    torch.manual_seed(0)
    plain = RichNet(lr=suggested)
    trainer_for([], tmp_path / "b", max_epochs=2, **config_kwargs(config)).fit(plain, loader())
    assert checked.losses == plain.losses
    assert checked.epoch_acc == plain.epoch_acc  # the metric saw the real batches only
    for (name, a), b in zip(checked.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # BatchNorm running statistics included


# ---------------------------------------------------------------------------------------- one alert path
class DyingNet(Net):
    """Most hidden units start dead (bias -20), so several callbacks have something to say."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        with torch.no_grad():
            first: nn.Linear = self.net[0]  # type: ignore[assignment]
            first.bias[: HIDDEN * 3 // 4] = -20.0


def test_every_alert_in_one_jsonl_and_every_chart_once_in_the_layout(tmp_path: Path) -> None:
    torch.manual_seed(0)
    callbacks = [
        OverfitBatchSanity(action="warn", max_steps=20),
        GradientCheck(),
        range_test(),
        GradientNormLogger(histogram_every_n_steps=8, clip_window=10),
        VanishingExplodingDetector(),
        DeadReLUMonitor(sample_every_n_steps=2),
        NaNSentinel(action="warn", save_checkpoint=False),
    ]
    tb = TensorBoardLogger(str(tmp_path), name="tb", version="run")
    trainer = trainer_for(callbacks, tmp_path, logger=tb, gradient_clip_val=1e-4)
    trainer.fit(DyingNet(nan_at=12), loader())
    log_dir = Path(tb.log_dir)

    sources = {a.source for cb in callbacks for a in cb.alerts}
    assert {"OverfitBatchSanity", "GradientNormLogger", "DeadReLUMonitor", "NaNSentinel"} <= sources
    written = jsonl_alerts(log_dir)
    expected = sorted((a.source, a.kind, a.step, a.where) for cb in callbacks for a in cb.alerts)
    assert sorted((r["source"], r["kind"], r["step"], r["where"]) for r in written) == expected
    assert [p.name for p in tmp_path.rglob("gradguard_alerts.jsonl")] == ["gradguard_alerts.jsonl"]

    layouts = layout_of(log_dir)
    assert len(layouts) == 2  # the full layout at fit start, the one without empty charts at train end
    (category,) = layouts[0].category
    assert category.title == "GradGuard"
    titles = [chart.title for chart in category.chart]
    expected_titles = [t for cb in callbacks for t in cb.layout_charts()]
    expected_titles.append("Alerts (cumulative count per kind)")
    assert sorted(titles) == sorted(expected_titles)
    assert len(set(titles)) == len(titles)
    for cb in callbacks:
        assert cb.layout_charts() or isinstance(cb, (NaNSentinel, GradientCheck)), type(cb).__name__
    tags = {
        v.tag
        for p in log_dir.rglob("events.out.tfevents.*")
        for e in event_file_loader.EventFileLoader(str(p)).Load()
        for v in e.summary.value
    }
    (final,) = layouts[-1].category
    kept = {chart.title for chart in final.chart}
    for chart in category.chart:  # a chart is kept exactly when one of its regexes matches a logged tag
        regexes = list(chart.multiline.tag)
        assert (chart.title in kept) == any(re.match(r, t) for r in regexes for t in tags), chart.title
    assert "Saturated sigmoid/tanh units per layer" not in kept  # the model has no sigmoid or tanh


# ---------------------------------------------------------------------------------------- resume
def test_resume_from_checkpoint_repeats_no_preflight_or_sweep_and_continues_exactly(tmp_path: Path) -> None:
    """Resuming restores every callback's state; the checks and the sweep belong to the fresh start only.

    The resumed run equals the uninterrupted one bit for bit (unshuffled data: Lightning does not restore
    a sampler's random order), and the LR is the one the finder applied before the checkpoint. The
    callbacks' states load under ``weights_only=True`` (plain tensors, numbers, lists and dicts).
    """
    torch.manual_seed(0)
    whole = Net()
    whole_cbs = seven()
    trainer_for(whole_cbs, tmp_path / "whole", max_epochs=2, gradient_clip_val=1.0).fit(
        whole, loader(shuffle=False)
    )

    torch.manual_seed(0)
    first = Net()
    first_cbs = seven()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer_for(
        [*first_cbs, ckpt], tmp_path / "first", max_epochs=1, enable_checkpointing=True, gradient_clip_val=1.0
    ).fit(first, loader(shuffle=False))
    suggested = by_type(first_cbs, LRFinderPlus).result.suggestion
    assert suggested is not None

    torch.manual_seed(1)  # a different process state: everything must come from the checkpoint
    resumed = Net()
    cbs = seven()
    memory = MemoryLogger(str(tmp_path / "resumed"))
    trainer = trainer_for(
        [*cbs, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)],
        tmp_path / "resumed",
        logger=memory,
        max_epochs=2,
        enable_checkpointing=True,
        gradient_clip_val=1.0,
    )
    last = str(tmp_path / "ckpt" / "last.ckpt")
    # Lightning 2.6 takes weights_only (before it, torch.load's default: weights_only from torch 2.6 on)
    strict_load = {"weights_only": True} if accepts(pl.Trainer.fit, "weights_only") else {}
    trainer.fit(resumed, loader(shuffle=False), ckpt_path=last, **strict_load)

    assert by_type(cbs, LRFinderPlus).results == []  # not repeated: epoch 0's test is in the checkpoint
    assert trainer.optimizers[0].param_groups[0]["lr"] == suggested
    assert resumed.steps == list(range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH))
    sentinel = by_type(cbs, NaNSentinel)
    assert sentinel.alerts == [] and sentinel.norm_history.steps == resumed.steps
    assert sorted(memory.series("grad_norm/total")) == [
        s for s in resumed.steps if (s + 1) % LOG_EVERY == 0
    ]  # the step axis continues where the first run stopped
    vx_whole = by_type(whole_cbs, VanishingExplodingDetector)
    vx_resumed = by_type(cbs, VanishingExplodingDetector)
    assert vx_resumed.history[0] == vx_whole.history[0]  # the baseline was carried over
    gnl_whole = by_type(whole_cbs, GradientNormLogger)
    gnl_resumed = by_type(cbs, GradientNormLogger)
    assert gnl_resumed._clip_seen == gnl_whole._clip_seen == 2 * STEPS_PER_EPOCH  # the clip window too
    assert torch.equal(gnl_resumed._clip_norms.isnan(), gnl_whole._clip_norms.isnan())
    assert torch.equal(gnl_resumed._clip_norms.nan_to_num(), gnl_whole._clip_norms.nan_to_num())
    assert resumed.losses == whole.losses[STEPS_PER_EPOCH:]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------- NaN mid-run
NAN_AT = 5  # a step DeadReLUMonitor samples (its capture mode is active when the loss is checked)


@pytest.mark.parametrize(
    ("sentinel_first", "accumulate", "config"),
    [
        (False, 1, "32-true"),
        (True, 1, "32-true"),
        (True, 2, "32-true"),
        (False, 1, "16-mixed-scaler"),
        (False, 1, "bf16-mixed"),
    ],
    ids=["sentinel-last", "sentinel-first", "sentinel-first-accumulate-2", "16-mixed-scaler", "bf16-mixed"],
)
def test_nan_at_step_k_fails_with_nonfinite_error_and_leaves_no_hook_behind(
    sentinel_first: bool, accumulate: int, config: str, tmp_path: Path
) -> None:
    """With accumulation the sentinel raises in ``on_before_backward`` of the micro-batch, before the
    other callbacks' ``on_before_backward``: DeadReLUMonitor's capture mode is still active then."""
    torch.manual_seed(0)
    callbacks = seven()
    if sentinel_first:
        callbacks = callbacks[-1:] + callbacks[:-1]
    tb = TensorBoardLogger(str(tmp_path), name="tb", version="run")
    model = Net(nan_at=NAN_AT)
    kw = config_kwargs(config)
    trainer = trainer_for(
        callbacks, tmp_path, logger=tb, max_epochs=2, accumulate_grad_batches=accumulate, **kw
    )
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(model, loader())
    report = info.value.report
    assert report["kind"] == "nonfinite_loss" and report["step"] == NAN_AT
    # the real steps' norms; without accumulation the loss is judged with the gradients, so the
    # poisoned step's NaN norm closes the list; with it, the first poisoned micro-batch stops the run
    history = report["recent_total_grad_norms"]
    judged = list(range(NAN_AT + 1)) if accumulate == 1 else list(range(NAN_AT))
    assert [h["step"] for h in history] == judged
    assert [h["total_grad_norm"] for h in history[:NAN_AT]] == pytest.approx(
        [model.norms[s] for s in range(NAN_AT)]
    )
    assert accumulate > 1 or math.isnan(history[-1]["total_grad_norm"])
    assert report["origin"]["in_input"] is True
    assert model.steps == list(range(NAN_AT))  # the poisoned update never ran
    # every other callback is quiet and left nothing attached
    for cb in callbacks:
        if not isinstance(cb, NaNSentinel):
            assert [a.kind for a in cb.alerts] == [], type(cb).__name__
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert info.value.report_dir is not None
    folder = Path(info.value.report_dir)
    assert {"report.json", "batch.pt", "last_good.ckpt"} <= {p.name for p in folder.iterdir()}
    kinds = [r["kind"] for r in jsonl_alerts(Path(tb.log_dir))]
    assert kinds == ["nonfinite_loss"]
    # the model works after the failure: a plain forward pass, no hook or mode left to fire
    assert torch.isfinite(model.net(torch.randn(2, FEATURES))).all()


# ---------------------------------------------------------------------------------------- DDP
def test_ddp_two_ranks_all_callbacks_agree_rank_zero_logs_and_nan_fails_both(tmp_path: Path) -> None:
    proc = run_ddp_script("ddp_all_callbacks.py", tmp_path, timeout=180)  # a hang would time out here
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # healthy fit: 192 samples / 2 ranks / batch 8 = 12 steps; the same verdicts and numbers on both ranks
    assert r0["steps"] == r1["steps"] == list(range(12))
    for key in (
        "norms",
        "weights",
        "lr",
        "gradient_check",
        "finder",
        "vx_history",
        "relu_sampled",
        "relu_dead",
    ):
        assert r0[key] == r1[key], key
    assert r0["overfit"][0] is True and r1["overfit"][0] is True  # each rank checks its own first batch
    assert r0["gradient_check"] is True
    suggestion, lrs, _ = r0["finder"]
    assert suggestion is not None and r0["lr"] == suggestion and len(lrs) >= 5
    assert r0["sentinel_history_steps"] == r1["sentinel_history_steps"] == list(range(12))
    assert r0["vx_history"] == pytest.approx(r0["norms"], rel=1e-5)  # real steps only, all-reduced norms
    assert r0["clip_seen"] == 12 and r1["clip_seen"] == 0  # the logger works on rank 0 only
    assert r0["weights"] == r0["plain_weights"]  # = a plain DDP run started at the suggested LR, bit for bit
    assert r0["alerts"] == r1["alerts"] and not any(r0["alerts"].values())
    # rank 0 wrote the logs: one event file, one layout, the all-reduced norms on Lightning's step axis
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(events) == 1
    assert len(layout_of(tmp_path / "tb")) == 2  # rank 0 only: full at fit start, pruned at train end
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("grad_norm/total")]
    logged = {int(r["step"]): float(r["grad_norm/total"]) for r in rows}
    assert sorted(logged) == [0, 1, 3, 5, 7, 9, 11]
    for step, value in logged.items():
        assert value == pytest.approx(r0["norms"][step], rel=1e-5)
    # NaN in rank 1's batch at step 3: NonFiniteError on both ranks, nothing else raised or reported
    n0, n1 = r0["nan"], r1["nan"]
    assert n0["error"] == n1["error"] == "NonFiniteError", (n0, n1)
    assert n0["message"] == n1["message"]
    for report in (n0["report"], n1["report"]):
        assert report["kind"] == "nonfinite_loss" and report["step"] == 3 and report["rank"] == 1
        assert report["origin"]["in_input"] is True
    assert abs(n0["time"] - n1["time"]) < 10
    for alerts in (n0["alerts"], n1["alerts"]):
        assert {k: v for k, v in alerts.items() if v} == {"NaNSentinel": ["nonfinite_loss"]}
    assert [r["kind"] for r in jsonl_alerts(tmp_path / "nan")] == ["nonfinite_loss"]  # rank 0 only
    assert {"report.json", "batch.pt", "last_good.ckpt"} <= {
        p.name for p in (tmp_path / "nan" / "nan_report" / "step_3").iterdir()
    }


def test_resume_from_the_sentinels_last_good_checkpoint_with_all_callbacks(tmp_path: Path) -> None:
    """The NaN workflow: fail at step k, resume from last_good.ckpt; the run continues at step k.

    Meeting the same NaN again (the data was not fixed) gives the full report once more: the checkpoint
    holds the sentinel as it was before the failure, so the failure is not inside a restored cooldown.
    """
    torch.manual_seed(0)
    cbs = seven()
    with pytest.raises(NonFiniteError) as first:
        trainer_for(cbs, tmp_path / "a", max_epochs=1).fit(Net(nan_at=NAN_AT), loader(shuffle=False))
    suggested = by_type(cbs, LRFinderPlus).result.suggestion
    assert first.value.report_dir is not None
    ckpt = str(Path(first.value.report_dir) / "last_good.ckpt")

    again = seven()
    tb = TensorBoardLogger(str(tmp_path), name="b", version="run")
    with pytest.raises(NonFiniteError) as second:
        trainer_for(again, tmp_path / "b", logger=tb, max_epochs=1).fit(
            Net(nan_at=NAN_AT), loader(shuffle=False), ckpt_path=ckpt
        )
    assert second.value.report["step"] == NAN_AT
    assert second.value.report_dir is not None and [a.kind for a in second.value.alerts] == ["nonfinite_loss"]
    assert {"report.json", "batch.pt", "last_good.ckpt"} <= {
        p.name for p in Path(second.value.report_dir).iterdir()
    }
    assert [r["kind"] for r in jsonl_alerts(Path(tb.log_dir))] == ["nonfinite_loss"]
    assert by_type(again, LRFinderPlus).results == []

    fixed = seven()
    model = Net()
    trainer = trainer_for(fixed, tmp_path / "c", max_epochs=1)
    trainer.fit(model, loader(shuffle=False), ckpt_path=ckpt)
    assert model.steps == list(range(NAN_AT, STEPS_PER_EPOCH))
    assert trainer.optimizers[0].param_groups[0]["lr"] == suggested
    assert by_type(fixed, LRFinderPlus).results == []
    assert all(cb.alerts == [] for cb in fixed)
    assert by_type(fixed, NaNSentinel).norm_history.steps == model.steps


def test_the_same_callbacks_serve_a_second_fresh_fit_as_a_new_run(tmp_path: Path) -> None:
    """A retry after a failure (or a notebook re-run) with the same callback instances is a new run:
    the first run's cooldowns do not silence its alerts, and its report and clip window hold its steps."""
    cbs = seven()
    errors = []
    for attempt in range(2):
        torch.manual_seed(0)
        with pytest.raises(NonFiniteError) as info:
            trainer_for(cbs, tmp_path / str(attempt), max_epochs=1, gradient_clip_val=1.0).fit(
                Net(nan_at=NAN_AT), loader()
            )
        errors.append(info.value)
        assert info.value.report_dir is not None and Path(info.value.report_dir).is_dir()
        assert str(tmp_path / str(attempt)) in info.value.report_dir
        assert [h["step"] for h in info.value.report["recent_total_grad_norms"]] == list(range(NAN_AT + 1))
        assert by_type(cbs, GradientNormLogger)._clip_seen == NAN_AT + 1
    assert errors[1].alerts and errors[1].alerts[0] is not errors[0].alerts[0]
    assert [a.step for a in by_type(cbs, NaNSentinel).alerts] == [NAN_AT, NAN_AT]


def test_a_sweep_that_ends_in_nan_trips_no_monitor(tmp_path: Path) -> None:
    """The range test runs to LRs where the loss overflows; the NaN stays inside the sweep."""
    torch.manual_seed(0)
    callbacks = seven()
    callbacks[2] = LRFinderPlus(
        # 40 points over 6 decades: the descent (lr 0.1-1) has enough of them to stand out of its noise
        min_lr=1e-3,
        max_lr=1e3,
        num_training=40,
        divergence_threshold=None,
        progress=False,
        plot=False,
    )
    memory = MemoryLogger(str(tmp_path))
    model = Net()
    trainer_for(callbacks, tmp_path, logger=memory).fit(model, loader())
    finder = by_type(callbacks, LRFinderPlus)
    assert finder.result.stop_reason == "non-finite loss" and finder.result.suggestion is not None
    assert all(cb.alerts == [] for cb in callbacks)
    assert model.steps == list(range(STEPS_PER_EPOCH)) and all(math.isfinite(v) for v in model.losses)
    assert by_type(callbacks, NaNSentinel).norm_history.steps == model.steps
    assert all(math.isfinite(v) for v in memory.series("grad_norm/total").values())


def test_resume_does_not_rerun_the_preflight_checks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer_for([*seven(), ckpt], tmp_path / "first", max_epochs=1, enable_checkpointing=True).fit(
        Net(), loader(shuffle=False)
    )
    cbs = seven()
    trainer_for(cbs, tmp_path / "resumed", max_epochs=2).fit(
        Net(), loader(shuffle=False), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert by_type(cbs, OverfitBatchSanity).result is None
    assert by_type(cbs, GradientCheck).result is None


def test_second_fresh_fit_with_the_same_finder_runs_the_range_test_again(tmp_path: Path) -> None:
    finder = LRFinderPlus(
        min_lr=1e-4, max_lr=10.0, num_training=30, search_steps=SEARCH_STEPS, progress=False, plot=False
    )
    for attempt in range(2):
        torch.manual_seed(0)
        trainer_for([finder], tmp_path / str(attempt)).fit(Net(), loader())
        assert len(finder.results) == attempt + 1


class Scheduled(Net):
    """AdamW under a per-step scheduler built from the module's ``lr`` (the configured LR)."""

    def __init__(self, kind: str, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.kind = kind
        self.lrs: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched: Any
        if self.kind == "warmup":
            sched = torch.optim.lr_scheduler.SequentialLR(
                opt,
                [
                    torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 5),
                    torch.optim.lr_scheduler.CosineAnnealingLR(opt, 27),
                ],
                [5],
            )
        elif self.kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=32)
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=32)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("kind", ["cosine", "warmup", "onecycle"])
def test_the_finder_applies_its_suggestion_as_the_configured_lr_under_a_scheduler(
    kind: str, tmp_path: Path
) -> None:
    """After the finder the schedule is the one a run started with ``lr=suggestion`` follows."""
    torch.manual_seed(0)
    callbacks = seven()
    checked = Scheduled(kind)
    trainer_for(callbacks, tmp_path / "a", max_epochs=2).fit(checked, loader())
    suggested = by_type(callbacks, LRFinderPlus).result.suggestion
    torch.manual_seed(0)
    plain = Scheduled(kind, lr=suggested)
    trainer_for([], tmp_path / "b", max_epochs=2).fit(plain, loader())
    assert checked.lrs == pytest.approx(plain.lrs, rel=1e-9)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_all_seven_callbacks_under_true_precisions(precision: str, tmp_path: Path) -> None:
    """Lightning converts the batch to the precision's dtype (precision_plugin.convert_input) before
    training_step; the range test's own loop must too (it crashed: float batch, double weights)."""
    torch.manual_seed(0)
    callbacks = seven()
    model = Net()
    trainer_for(callbacks, tmp_path, precision=precision).fit(model, loader())
    assert by_type(callbacks, LRFinderPlus).result.suggestion is not None
    assert by_type(callbacks, OverfitBatchSanity).result.passed
    assert model.steps == list(range(16))


class Exploding(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1e5


def test_second_fresh_fit_with_the_same_detector_alerts_again(tmp_path: Path) -> None:
    vx = VanishingExplodingDetector()
    for attempt in range(2):
        torch.manual_seed(0)
        trainer_for([vx], tmp_path / str(attempt)).fit(Exploding(), loader())
        assert len([a for a in vx.alerts if a.kind == "exploding_gradient"]) == attempt + 1


def test_second_fresh_fit_with_the_same_relu_monitor_judges_its_own_samples(tmp_path: Path) -> None:
    relu = DeadReLUMonitor(sample_every_n_steps=2)
    for attempt in range(2):
        torch.manual_seed(0)
        trainer_for([relu], tmp_path / str(attempt)).fit(DyingNet(), loader())
    assert [(a.kind, a.step) for a in relu.alerts] == [("dead_relu", 4), ("dead_relu", 4)]
