"""NaNSentinel on real runs with NaN/inf planted at known steps."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Literal

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
    before = kwargs.pop("callbacks_before", [])
    trainer = make_trainer(
        [*before, sentinel, snaps], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path), **kwargs
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
    # the advice follows the origin: what reached `net`, not a backward op; and since the loader's batch
    # was finite (the model poisons its copy in training_step), the step's code is blamed, not the data
    assert report["origin"]["module"] == "net" and report["origin"]["inputs_finite"] is True
    assert alert.hint.startswith("The batch was finite but the input of `net` was not")
    assert "The batch itself holds NaN/inf" not in alert.hint


def test_a_batch_that_holds_nan_is_blamed_on_the_data(tmp_path: Path) -> None:
    sentinel = NaNSentinel(save_checkpoint=False)
    trainer = make_trainer([sentinel], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(RecordingMLP(), _loader_poisoned_at(4))
    origin = info.value.report["origin"]
    assert info.value.report["step"] == 4 and origin["in_input"] is True and origin["inputs_finite"] is False
    assert origin["module"] == "net"
    assert info.value.alerts[0].hint.startswith("The batch itself holds NaN/inf")


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


class NaNInOwnForward(RecordingMLP):
    """The LightningModule's own ``forward`` takes a log of negative values at ``bad_step``: no submodule
    is involved (issue 25: the origin used to be named ``""``)."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return torch.log(h - 10.0) if self.trainer.global_step == self.bad_step else h

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class NaNInStepCode(NaNInOwnForward):
    """``training_step`` itself divides by zero after the last module ran (no forward hook sees it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net(x)
        if self.trainer.global_step == self.bad_step:
            h = h / 0.0
        return nn.functional.cross_entropy(h, y)


def _texts_of(err: NonFiniteError, folder: Path) -> list[str]:
    """Every text a user reads of a finding: the error, the alert, report.json, and the report page."""
    from lightning_gradguard.report.page import render_html
    from lightning_gradguard.report.read import read_run

    alert = err.alerts[0]
    page = render_html(read_run(str(folder)))
    report = (Path(err.report_dir or "") / "report.json").read_text()
    return [str(err), alert.message, alert.hint, str(alert.where), report, page]


@pytest.mark.parametrize(
    ("model_type", "in_step", "code"),
    [(NaNInOwnForward, False, "forward"), (NaNInStepCode, True, "step code (training_step)")],
)
def test_a_nan_born_in_the_model_itself_is_named_by_its_class(
    model_type: type[NaNInOwnForward], in_step: bool, code: str, tmp_path: Path
) -> None:
    model = model_type(bad_step=3)
    err, snaps = _fit_expecting_failure(model, tmp_path, sentinel=NaNSentinel(save_checkpoint=False))
    name = type(model).__name__  # read independently of gradguard
    origin = err.report["origin"]
    assert err.report["step"] == 3 and err.report["kind"] == "nonfinite_loss"
    assert origin["module"] == name and origin["module_type"] == name
    assert origin["root"] is True and origin["in_input"] is False and origin["in_step"] is in_step
    # every logit of the batch went non-finite in forward (8 x 4); in training_step only the loss is seen
    assert origin["nonfinite"] == (1 if in_step else 8 * 4)
    assert err.alerts[0].where == name and f"`{name}` (the model itself" in str(err)
    assert err.alerts[0].hint.startswith(f"`{name}`'s own {code}, outside its submodules,")
    texts = _texts_of(err, tmp_path)
    assert all("``" not in t for t in texts), [t for t in texts if "``" in t]
    assert f"<td>{name}" in texts[-1]  # the report page's origin cell
    for key, tensor in model.state_dict().items():  # the poisoned update never ran
        torch.testing.assert_close(tensor, snaps.after[2][key], rtol=0, atol=0)


def test_a_nan_made_between_two_children_names_their_parent() -> None:
    """A container's own forward code makes the NaN between two children: the container is named, not
    the child that received it (the replay used to say `b`'s input was already non-finite)."""
    from lightning_gradguard.monitors.nan.forensics import find_forward_origin

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.log(self.a(x) - 10.0))

    model = nn.Sequential(nn.Linear(3, 3), Parent())
    x = torch.randn(4, 3)
    found = find_forward_origin(model, lambda: model(x), inputs=x)
    assert found is not None and (found.module, found.module_type) == ("1", "Parent")
    assert found.in_input is False and found.root is False and found.nonfinite == 4 * 3
    bad = x.clone()
    bad[0, 0] = float("nan")
    found = find_forward_origin(model, lambda: model(bad), inputs=bad)
    assert found is not None and found.in_input is True and found.inputs_finite is False
    assert (found.module, found.root) == ("Sequential", True)  # the root received it: named by its class


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


class SentinelStates(pl.Callback):
    """The sentinel's ``state_dict`` at the start and at the end of every batch (placed after it)."""

    def __init__(self, sentinel: NaNSentinel) -> None:
        self.sentinel = sentinel
        self.start: dict[int, dict[str, Any]] = {}
        self.end: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start[trainer.global_step] = copy.deepcopy(self.sentinel.state_dict())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.end[trainer.global_step - 1] = copy.deepcopy(self.sentinel.state_dict())


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_last_good_checkpoint_holds_the_sentinel_before_the_bad_step_and_the_live_one_counts_it(
    action: Literal["skip", "stop"], tmp_path: Path
) -> None:
    """The failure path writes last_good.ckpt while the sentinel is still as it was before the bad step
    (the skip counters before it, no cooldown for the finding), and only then records the finding and
    counts the step. It used to record first and write the checkpoint through an override of its own
    ``state_dict``: this checks both sides, so that the loop cannot come back unnoticed.

    Under a GradScaler every step from 2 on overflows: step 5 is the 4th skip in a row, a collapse."""
    sentinel = NaNSentinel(action=action, max_consecutive_skips=4)
    states = SentinelStates(sentinel)
    trainer = make_trainer(
        [sentinel, states],
        MemoryLogger(str(tmp_path)),
        default_root_dir=str(tmp_path),
        plugins=[_scaler_plugin()],
    )
    trainer.fit(OverflowOnce(set(range(2, 100))), random_loader(n=128))
    assert [(a.kind, a.step) for a in sentinel.alerts] == [("loss_scale_collapse", 5)]
    assert trainer.global_step == (6 if action == "stop" else 16)
    before = {"last_reported": {}, "skipped_steps": 3, "consecutive_skips": 3, "alerts": []}
    assert states.start[5] == before
    saved = torch.load(tmp_path / "nan_report" / "step_5" / "last_good.ckpt", weights_only=False)
    assert saved["callbacks"][sentinel.state_key] == before
    after = {"last_reported": {"loss_scale_collapse": 5}, "skipped_steps": 4, "consecutive_skips": 4}
    # the live sentinel counts the bad step, and has it in its cooldown and its alerts
    assert {k: v for k, v in states.end[5].items() if k != "alerts"} == after
    assert [(a["kind"], a["step"]) for a in states.end[5]["alerts"]] == [("loss_scale_collapse", 5)]
    report = json.loads((tmp_path / "nan_report" / "step_5" / "report.json").read_text())
    assert report["grad_scaler"]["skipped_steps"] == report["grad_scaler"]["consecutive"] == 4


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


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_skip_leaves_adam_state_untouched(action: Literal["skip", "stop"], tmp_path: Path) -> None:
    """Actions "skip" and "stop" drop the poisoned update alike; "stop" then ends the run after it."""
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

    sentinel = NaNSentinel(action=action, save_checkpoint=False, find_origin=False)
    model = AdamModel(bad_step=4)
    trainer = make_trainer([Capture(), sentinel], MemoryLogger(str(tmp_path)))
    trainer.fit(model, random_loader(n=128))
    assert trainer.global_step == (5 if action == "stop" else 16)  # a dropped update still counts as a step
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
    started = StartedBatches()
    err, snaps = _fit_expecting_failure(
        model, tmp_path, accumulate_grad_batches=3, callbacks_before=[started]
    )
    assert err.report["step"] == 2 and err.report["batch_idx"] == 7
    assert started.batch_indices[-1] == 7  # raised at the poisoned micro-batch, not at the step's end
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, snaps.after[1][name], rtol=0, atol=0)


class StartedBatches(pl.Callback):
    """The batch indices the training loop started, in order (independent of gradguard)."""

    def __init__(self) -> None:
        self.batch_indices: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batch_indices.append(batch_idx)


class GradsAtStep(pl.Callback):
    """Whether every gradient was ``None`` when the optimizer was about to step (runs after the sentinel)."""

    def __init__(self) -> None:
        self.all_none: dict[int, bool] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.all_none[trainer.global_step] = all(p.grad is None for p in pl_module.parameters())


def _loader_poisoned_at(batch_idx: int, value: float = float("nan"), n: int = 128) -> Any:
    """``random_loader`` whose batch ``batch_idx`` (size 8, not shuffled) holds ``value`` in one entry."""
    x, y = random_loader(n=n).dataset.tensors
    x = x.clone()
    x[batch_idx * 8 + 1, 1] = value
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


@pytest.mark.parametrize("action", ["skip", "warn", "stop"])
def test_accumulation_one_poisoned_micro_batch_is_one_finding_with_its_own_report(
    action: Literal["skip", "warn", "stop"], tmp_path: Path
) -> None:
    """Issue: under accumulation a NaN micro-batch gave two critical alerts for one optimizer step (the
    second one claiming "the loss was finite"), and the report and batch.pt were the clean last micro-batch's.
    """
    loader = _loader_poisoned_at(7)  # optimizer step 2 is made of batches 6, 7, 8: 7 is not the last
    sentinel, snaps, grads = NaNSentinel(action=action), Snapshots(), GradsAtStep()
    extra: dict[str, Any] = {"min_epochs": 1} if action == "stop" else {}  # "stop" then ends with the epoch
    trainer = make_trainer(
        [sentinel, grads, snaps],
        MemoryLogger(str(tmp_path)),
        default_root_dir=str(tmp_path),
        accumulate_grad_batches=3,
        **extra,
    )
    trainer.fit(RecordingMLP(), loader)
    assert [(a.kind, a.step) for a in sentinel.alerts if a.step <= 2] == [("nonfinite_loss", 2)]
    assert "loss was finite" not in sentinel.alerts[0].hint
    folder = Path(tmp_path, "nan_report", "step_2")
    report = json.loads((folder / "report.json").read_text())
    assert report["kind"] == "nonfinite_loss" and report["step"] == 2 and report["batch_idx"] == 7
    assert math.isnan(report["loss"])
    assert report["origin"]["phase"] == "forward" and report["origin"]["in_input"] is True
    x, y = torch.load(folder / "batch.pt")
    expected_x, expected_y = list(loader)[7]
    assert torch.isnan(x[1, 1]) and torch.equal(y, expected_y)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0, equal_nan=True)
    if action == "warn":  # warn only reports: the poisoned update goes through
        assert grads.all_none[2] is False
        return
    # skip and stop drop the whole update of step 2 (NaN-summed gradients of batches 6-8)
    assert grads.all_none[2] is True and not any(grads.all_none[s] for s in grads.all_none if s != 2)
    _assert_same_weights(snaps.after[2], snaps.after[1])
    assert trainer.global_step == 6


def test_accumulation_gradient_finding_names_the_micro_batch_that_poisoned_the_gradients(
    tmp_path: Path,
) -> None:
    """An inf input saturates the tanh: every loss stays finite but micro-batch 7's backward makes NaN
    gradients. With ``check_micro_batches`` the finding names batch 7 (its batch, its replay), not the
    clean last micro-batch 8."""
    loader = _loader_poisoned_at(7, float("inf"))
    sentinel, snaps, grads = NaNSentinel(action="skip", check_micro_batches=True), Snapshots(), GradsAtStep()
    trainer = make_trainer(
        [sentinel, grads, snaps],
        MemoryLogger(str(tmp_path)),
        default_root_dir=str(tmp_path),
        accumulate_grad_batches=3,
    )
    trainer.fit(RecordingMLP(), loader)
    assert [(a.kind, a.step) for a in sentinel.alerts] == [("nonfinite_gradient", 2)]
    report = json.loads((Path(sentinel.last_report_dir or "") / "report.json").read_text())
    assert report["batch_idx"] == 7 and math.isfinite(report["loss"])
    assert report["origin"]["phase"] == "forward" and report["origin"]["in_input"] is True
    assert report["nonfinite_parameters"][0]["name"] == "net.0.weight"
    x, _ = torch.load(Path(sentinel.last_report_dir or "") / "batch.pt")
    torch.testing.assert_close(x, list(loader)[7][0], rtol=0, atol=0)
    assert grads.all_none[2] is True
    _assert_same_weights(snaps.after[2], snaps.after[1])
    assert all(torch.isfinite(t).all() for t in snaps.after[5].values())


def test_accumulation_gradient_finding_by_default_lists_the_step_and_blames_no_clean_micro_batch(
    tmp_path: Path,
) -> None:
    """The default judges gradients once per optimizer step (no extra pass per micro-batch): the report
    lists the step's micro-batches instead of blaming the clean last one, and saves no batch of its own."""
    loader = _loader_poisoned_at(7, float("inf"))
    sentinel, grads = NaNSentinel(action="skip"), GradsAtStep()
    trainer = make_trainer(
        [sentinel, grads],
        MemoryLogger(str(tmp_path)),
        default_root_dir=str(tmp_path),
        accumulate_grad_batches=3,
    )
    trainer.fit(RecordingMLP(), loader)
    (alert,) = sentinel.alerts
    assert (alert.kind, alert.step) == ("nonfinite_gradient", 2)
    assert "micro-batches 6-8" in alert.message and "check_micro_batches=True" in alert.message
    folder = Path(sentinel.last_report_dir or "")
    report = json.loads((folder / "report.json").read_text())
    assert report["batch_idx"] is None and report["micro_batches"] == [6, 7, 8] and report["loss"] is None
    assert not (folder / "batch.pt").exists() and report["origin"] is None
    assert grads.all_none[2] is True  # the update of the step was dropped all the same


def test_stop_ends_the_run_with_the_weights_of_the_last_good_step(tmp_path: Path) -> None:
    """Issue: action="stop" let the poisoned update through, so the run ended with NaN weights."""
    model = PoisonedData(bad_step=5)
    sentinel, snaps = NaNSentinel(action="stop", save_checkpoint=False), Snapshots()
    trainer = make_trainer([sentinel, snaps], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    trainer.fit(model, random_loader(n=128))
    assert trainer.should_stop and trainer.global_step == 6  # ended after the bad step (16 without it)
    assert [(a.kind, a.step) for a in sentinel.alerts] == [("nonfinite_loss", 5)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _assert_same_weights(model.state_dict(), snaps.after[4])


@pytest.mark.parametrize("min_epochs", [None, 1])
def test_stop_under_accumulation_never_applies_the_poisoned_step(
    min_epochs: int | None, tmp_path: Path
) -> None:
    """NaN loss at micro-batch 7 of step 2 (batches 6, 7, 8). Alone, "stop" ends the run right after batch 7,
    before the step. With min_epochs=1 Lightning ignores should_stop until the epoch ends, so the step
    made of batches 6-8 must be dropped (batch 8 alone is clean, the summed gradients are not); the later
    steps train as usual and the run ends with the weights of the last good step."""
    model = RecordingMLP()
    sentinel, snaps = NaNSentinel(action="stop", save_checkpoint=False), Snapshots()
    trainer = make_trainer(
        [sentinel, snaps],
        MemoryLogger(str(tmp_path)),
        default_root_dir=str(tmp_path),
        accumulate_grad_batches=3,
        min_epochs=min_epochs,
    )
    trainer.fit(model, _loader_poisoned_at(7))
    assert [(a.kind, a.step) for a in sentinel.alerts] == [("nonfinite_loss", 2)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if min_epochs is None:
        assert trainer.global_step == 2
        _assert_same_weights(model.state_dict(), snaps.after[1])
    else:
        assert trainer.global_step == 6  # 16 batches: 5 full windows and a last one of one batch
        _assert_same_weights(snaps.after[2], snaps.after[1])  # step 2's update was dropped
        _assert_same_weights(model.state_dict(), snaps.after[5])  # the last good step
        assert not torch.equal(snaps.after[5]["net.0.weight"], snaps.after[1]["net.0.weight"])


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


def test_parameter_check_runs_once_per_optimizer_step_under_accumulation(tmp_path: Path) -> None:
    """Weights change only where an optimizer stepped: the other micro-batches of a step are not checked.

    Counted independently of the sentinel's code: every ``torch._foreach_norm`` over the model's own
    parameter storage is one parameter check.
    """
    from torch.overrides import TorchFunctionMode

    model = RecordingMLP()
    first = model.net[0].weight

    class CountParameterPasses(TorchFunctionMode):
        passes = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch._foreach_norm and args[0] and args[0][0].data_ptr() == first.data_ptr():
                CountParameterPasses.passes += 1
            return func(*args, **(kwargs or {}))

    class Counted(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            self.mode.__exit__(None, None, None)

        def on_train_batch_start(self, *args: Any) -> None:
            self.mode = CountParameterPasses()
            self.mode.__enter__()

    sentinel = NaNSentinel(check_loss=False, check_gradients=False, check_parameters_every_n_steps=1)
    trainer = make_trainer([sentinel, Counted()], accumulate_grad_batches=3)  # the mode spans our hook
    trainer.fit(model, random_loader(n=96))  # 12 batches = 4 optimizer steps
    assert trainer.global_step == 4
    assert CountParameterPasses.passes == 4  # once after every optimizer step (10 on the old code)


def test_a_warn_run_that_keeps_meeting_nans_replays_once_per_cooldown(tmp_path: Path) -> None:
    """Within the cooldown a repeated finding costs no replay (hooks, anomaly mode) and writes no files."""
    import lightning_gradguard.monitors.nan.forensics as module  # the replay looks it up there

    class NanFrom(PoisonedData):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.bad_step = max(self.trainer.global_step, 3)  # NaN data on every step from 3 on
            return super().training_step(batch, batch_idx)

    replays: list[int] = []
    original = module.find_forward_origin

    def counted(*args: Any, **kwargs: Any) -> Any:
        replays.append(1)
        return original(*args, **kwargs)

    sentinel = NaNSentinel(action="skip", save_checkpoint=False, cooldown_steps=5)
    trainer = make_trainer([sentinel], MemoryLogger(str(tmp_path)), default_root_dir=str(tmp_path))
    try:
        module.find_forward_origin = counted
        trainer.fit(NanFrom(bad_step=3), random_loader(n=128))
    finally:
        module.find_forward_origin = original
    assert trainer.global_step == 16
    steps = [a.step for a in sentinel.alerts]
    assert steps == [3, 8, 13] and len(replays) == 3  # one full finding (and replay) per cooldown
    assert sorted(p.name for p in (tmp_path / "nan_report").iterdir()) == ["step_13", "step_3", "step_8"]


def test_the_reports_recent_norms_are_the_latest_steps_after_the_ring_wrapped(tmp_path: Path) -> None:
    """With history_size=3 and a NaN at step 7, the report lists steps 5, 6, 7 with their own norms
    (the ring used to write every norm after the third into slot 0 and pair steps with the wrong slots)."""
    model = PoisonedData(bad_step=7)
    sentinel = NaNSentinel(history_size=3, save_checkpoint=False, save_batch=False)
    err, _ = _fit_expecting_failure(model, tmp_path, sentinel=sentinel)
    listed = err.report["recent_total_grad_norms"]
    assert [r["step"] for r in listed] == [5, 6, 7]
    for record in listed[:2]:  # the finite ones, against the module's own independent norms
        assert record["total_grad_norm"] == pytest.approx(model.true_total[record["step"]], rel=1e-5)
    assert math.isnan(listed[2]["total_grad_norm"])  # the poisoned step itself


def test_shares_the_statistics_pass_with_the_logger(tmp_path: Path) -> None:
    """With GradientNormLogger on the same trainer, the per-parameter norms are computed once per step."""
    import lightning_gradguard.core.stats as shared

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


def test_nan_is_detected_not_assumed() -> None:
    assert math.isnan(float("nan"))  # sanity of the planted values used above


class HugeButFinite(pl.LightningModule):
    """Gradient entries of 1e25 and weights of 1e20: every value finite, yet their float32 norms overflow
    to inf (a sum of squares past 3.4e38). The loss is 1 (its gradient is what is huge); ``poison_at``
    makes one step's loss a true NaN."""

    def __init__(self, poison_at: int | None = None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((64,), 1e20))
        self.poison_at = poison_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = 1e25 * (self.w - self.w.detach()).sum() + 1.0 + 0.0 * batch[0].sum()
        if self.poison_at is not None and self.global_step == self.poison_at:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_norm_that_overflows_is_no_nan() -> None:
    """Regression: the sentinel judged gradients and parameters by their norms, and a finite tensor whose
    float32 norm overflows to inf was reported as non-finite (a false ``nonfinite_gradient`` that stops
    the run). The norms now only say when to look; the entries decide."""
    model = HugeButFinite()
    assert math.isinf(float(torch.linalg.vector_norm(model.w.detach())))  # the premise: the norm overflows
    sentinel = NaNSentinel(action="raise", check_parameters_every_n_steps=1)
    make_trainer([sentinel], max_steps=4).fit(model, random_loader(n=32))
    assert sentinel.alerts == [] and sentinel.norm_history.steps == [0, 1, 2, 3]
    assert all(math.isinf(r.total_grad_norm) for r in sentinel.norm_history.records())  # the float32 norm

    poisoned = NaNSentinel(action="raise", check_parameters_every_n_steps=1, report_dir="nan_reports")
    with pytest.raises(NonFiniteError):  # a true NaN among the huge values is still found, at its step
        make_trainer([poisoned], max_steps=4).fit(HugeButFinite(poison_at=2), random_loader(n=32))
    assert [(a.kind, a.step) for a in poisoned.alerts] == [("nonfinite_loss", 2)]
