"""NaNSentinel on real runs with NaN/inf planted at known steps."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, RecordingMLP, make_trainer, random_loader
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_gradguard import GradientNormLogger, NaNSentinel, NonFiniteError


class Snapshots(pl.Callback):
    """Keeps a copy of the parameters after every completed optimizer step (independent of gradguard)."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.after[trainer.global_step - 1] = copy.deepcopy(pl_module.state_dict())


class PoisonedData(RecordingMLP):
    """The batch of optimizer step ``bad_step`` carries ``value`` in one entry."""

    def __init__(self, bad_step: int, value: float = float("nan")) -> None:
        super().__init__()
        self.bad_step, self.value = bad_step, value

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == self.bad_step:
            x = x.clone()
            x[0, 2] = self.value
        return super().training_step((x, y), batch_idx)


class ZeroStd(nn.Module):
    """A custom standardisation layer with no epsilon: a constant feature divides by zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


class CustomLayerModel(RecordingMLP):
    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.standardize = ZeroStd()
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == self.bad_step:
            x = x.clone()
            x[:, 3] = 1.5  # a constant column: std 0
        return nn.functional.cross_entropy(self.net(self.standardize(x)), y)


def _fit_expecting_failure(
    model: pl.LightningModule, tmp_path: Path, **kwargs: Any
) -> tuple[NonFiniteError, Snapshots]:
    snaps = Snapshots()
    sentinel = kwargs.pop("sentinel", None) or NaNSentinel()
    trainer = make_trainer(
        [sentinel, snaps], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path), **kwargs
    )
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(model, random_loader(n=128))
    return info.value, snaps


@pytest.mark.parametrize(
    ("value", "kind"),
    # an inf input saturates the tanh, so the loss stays finite and only the gradients go bad
    [(float("nan"), "nonfinite_loss"), (float("inf"), "nonfinite_gradient")],
)
def test_bad_data_fails_at_that_step_with_weights_and_forensics_intact(
    value: float, kind: str, tmp_path: Path
) -> None:
    model = PoisonedData(bad_step=5, value=value)
    err, snaps = _fit_expecting_failure(model, tmp_path)
    assert err.report["step"] == 5 and err.report["kind"] == kind
    assert "step 5" in str(err)
    # the poisoned update was never applied: weights equal the copy taken after step 4
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, snaps.after[4][name], rtol=0, atol=0)
    folder = Path(err.report_dir or "")
    report = json.loads((folder / "report.json").read_text())
    assert report["kind"] == kind and report["step"] == 5
    assert (
        report["origin"]["phase"] == "forward" and report["origin"]["in_input"] is True
    )  # the batch was bad
    assert report["nonfinite_parameters"][0]["name"] == "net.0.weight"
    assert [h["step"] for h in report["recent_total_grad_norms"]] == [0, 1, 2, 3, 4, 5]
    x, _ = torch.load(folder / "batch.pt")
    assert torch.isfinite(x).all()  # the batch as the dataloader gave it (the model poisons it itself)
    assert (folder / "last_good.ckpt").exists()
    alert = err.alerts[0]
    assert alert.kind == kind and alert.severity == "critical"
    assert "batch" in alert.hint  # the advice follows the origin: the data, not a backward op


def test_last_good_checkpoint_resumes(tmp_path: Path) -> None:
    err, _ = _fit_expecting_failure(PoisonedData(bad_step=3), tmp_path)
    ckpt = Path(err.report_dir or "") / "last_good.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    resumed = RecordingMLP()  # a healthy model resumes from the good weights
    trainer = make_trainer([NaNSentinel()], max_epochs=2)
    trainer.fit(resumed, random_loader(n=128), ckpt_path=str(ckpt))
    assert trainer.global_step > saved["global_step"]
    assert all(torch.isfinite(p).all() for p in resumed.parameters())


def test_origin_names_the_custom_layer_that_divides_by_zero(tmp_path: Path) -> None:
    err, _ = _fit_expecting_failure(CustomLayerModel(bad_step=2), tmp_path)
    origin = err.report["origin"]
    assert origin["module"] == "standardize" and origin["module_type"] == "ZeroStd"
    assert origin["in_input"] is False
    assert "`standardize` (ZeroStd)" in str(err)
    assert err.alerts[0].where == "standardize"


class SqrtAtZero(RecordingMLP):
    """Forward is finite (sqrt(0) = 0) but the derivative of sqrt at 0 is infinite."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[0](x)
        if self.trainer.global_step == 2:
            h = h - h.detach()  # exactly zero, still attached to the graph
        h = torch.sqrt(h.clamp_min(0) + 0.0) if self.trainer.global_step == 2 else torch.tanh(h)
        return nn.functional.cross_entropy(self.net[2](h), y)


def test_backward_only_nan_names_the_op(tmp_path: Path) -> None:
    err, _ = _fit_expecting_failure(SqrtAtZero(), tmp_path)
    assert err.report["kind"] == "nonfinite_gradient" and err.report["step"] == 2
    assert err.report["origin"]["phase"] == "backward"
    assert err.report["origin"]["op"] == "SqrtBackward0"
    assert "test_nan_sentinel.py" in err.report["origin"]["forward_trace"]
    assert "SqrtBackward0" in str(err)


def test_healthy_bf16_run_raises_nothing(tmp_path: Path) -> None:
    sentinel = NaNSentinel()
    make_trainer([sentinel], MemoryLogger(str(tmp_path)), precision="bf16-mixed", max_epochs=2).fit(
        RecordingMLP(), random_loader(n=128)
    )
    assert sentinel.alerts == []


class OverflowOnce(RecordingMLP):
    """Under a GradScaler, step ``overflow_step`` overflows (inf gradients): the scaler must skip it."""

    def __init__(self, overflow_steps: set[int]) -> None:
        super().__init__()
        self.overflow_steps = overflow_steps

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.overflow_steps:
            self.net[0].weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind


def _scaler_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


def test_grad_scaler_overflow_skip_is_not_a_failure(tmp_path: Path) -> None:
    sentinel = NaNSentinel()
    model = OverflowOnce({2, 5})
    make_trainer([sentinel], MemoryLogger(str(tmp_path)), plugins=[_scaler_plugin()]).fit(
        model, random_loader(n=128)
    )
    assert sentinel.alerts == []
    assert sentinel.skipped_steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_grad_scaler_that_keeps_skipping_is_a_collapse(tmp_path: Path) -> None:
    sentinel = NaNSentinel(max_consecutive_skips=4)
    err, _ = _fit_expecting_failure(
        OverflowOnce(set(range(2, 100))), tmp_path, sentinel=sentinel, plugins=[_scaler_plugin()]
    )
    assert err.report["kind"] == "loss_scale_collapse"
    assert err.report["step"] == 5  # the 4th consecutive skip: steps 2, 3, 4, 5
    assert err.report["grad_scaler"]["consecutive"] == 4


def test_warn_logs_and_continues(tmp_path: Path) -> None:
    sentinel = NaNSentinel(action="warn", save_checkpoint=False)
    trainer = make_trainer([sentinel], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    trainer.fit(PoisonedData(bad_step=3), random_loader(n=128))
    assert trainer.global_step == 16
    assert sentinel.alerts[0].kind == "nonfinite_loss" and sentinel.alerts[0].step == 3
    assert sentinel.last_report_dir is not None and (Path(sentinel.last_report_dir) / "report.json").exists()


class AdamModel(PoisonedData):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_skip_leaves_adam_state_untouched(tmp_path: Path) -> None:
    captured: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step == 4:
                captured["before"] = copy.deepcopy(trainer.optimizers[0].state_dict())
                captured["params"] = copy.deepcopy(pl_module.state_dict())

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 5:
                captured["after"] = copy.deepcopy(trainer.optimizers[0].state_dict())
                captured["params_after"] = copy.deepcopy(pl_module.state_dict())

    sentinel = NaNSentinel(action="skip", save_checkpoint=False, find_origin=False)
    model = AdamModel(bad_step=4)
    make_trainer([Capture(), sentinel], MemoryLogger(str(tmp_path))).fit(model, random_loader(n=128))
    before, after = captured["before"]["state"], captured["after"]["state"]
    for idx in before:
        assert float(before[idx]["step"]) == float(after[idx]["step"]) == 4.0
        torch.testing.assert_close(before[idx]["exp_avg"], after[idx]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(before[idx]["exp_avg_sq"], after[idx]["exp_avg_sq"], rtol=0, atol=0)
    for name in captured["params"]:
        torch.testing.assert_close(captured["params"][name], captured["params_after"][name], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [a.kind for a in sentinel.alerts] == ["nonfinite_loss"]


def test_accumulation_names_the_offending_micro_batch(tmp_path: Path) -> None:
    class PoisonMicroBatch(RecordingMLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if batch_idx == 7:  # optimizer step 2 (batches 6, 7, 8), its second micro-batch
                x = x.clone()
                x[1, 1] = float("nan")
            return super().training_step((x, y), batch_idx)

    model = PoisonMicroBatch()
    err, snaps = _fit_expecting_failure(model, tmp_path, accumulate_grad_batches=3)
    assert err.report["step"] == 2 and err.report["batch_idx"] == 7
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, snaps.after[1][name], rtol=0, atol=0)


def test_parameter_check_after_the_step(tmp_path: Path) -> None:
    class CorruptWeights(RecordingMLP):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if self.trainer.global_step == 3:  # gradients stay finite; the weights go bad
                with torch.no_grad():
                    self.net[2].bias[0] = float("nan")

    sentinel = NaNSentinel(check_gradients=False, check_loss=False, check_parameters_every_n_steps=1)
    err, _ = _fit_expecting_failure(CorruptWeights(), tmp_path, sentinel=sentinel)
    assert err.report["kind"] == "nonfinite_parameter" and err.report["step"] == 4
    assert [b["name"] for b in err.report["nonfinite_parameters"]] == ["net.2.bias"]


def test_shares_the_statistics_pass_with_the_logger(tmp_path: Path) -> None:
    """With GradientNormLogger on the same trainer, the per-parameter norms are computed once per step."""
    import lightning_gradguard._shared as shared

    calls: list[int] = []
    original = shared.foreach_norms

    def counting(tensors: Any, norm_type: float = 2.0) -> torch.Tensor:
        calls.append(len(tensors))
        return original(tensors, norm_type)

    shared.foreach_norms = counting  # type: ignore[assignment]
    try:
        logger = MemoryLogger(str(tmp_path))
        callbacks = [
            NaNSentinel(),
            GradientNormLogger(log_every_n_steps=1, log_weight_norms=False, log_update_ratio=False),
        ]
        make_trainer(callbacks, logger, max_steps=4).fit(RecordingMLP(), random_loader())
    finally:
        shared.foreach_norms = original  # type: ignore[assignment]
    assert len(calls) == 4  # one gradient pass per step for both callbacks
    assert len(logger.series("grad_norm/total")) == 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"action": "explode"}, "action"),
        ({"check_loss": 1}, "check_loss"),
        ({"check_parameters_every_n_steps": -1}, "check_parameters_every_n_steps"),
        ({"history_size": 0}, "history_size"),
        ({"loss_scale_floor": 0.0}, "loss_scale_floor"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"report_dir": 3}, "report_dir"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        NaNSentinel(**kwargs)


def test_nan_is_detected_not_assumed() -> None:
    assert math.isnan(float("nan"))  # sanity of the planted values used above
