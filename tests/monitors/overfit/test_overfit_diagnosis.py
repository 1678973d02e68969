"""OverfitBatchSanity's diagnosis on real digits runs (issues 24 and 25).

* a head used only in validation_step is one INFO line, not a warning; a head no step uses still warns;
* SGD at 10x the LR blows the loss up above its start and leaves it at chance: "lower the learning
  rate", never "raise it" and never "passed ... kept learning";
* the gradient norm of a healthy cross-entropy classifier may grow while the loss falls to the default
  target (0.1x): no ``gradient_not_shrinking`` there; the case that rule was written for (Adam at lr 1
  bouncing into the target) is told by the loss curve itself (``overfit_unstable``).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_gradguard import OverfitBatchSanity, SanityCheckError
from lightning_gradguard.monitors.overfit.modules import used_outside_training
from lightning_gradguard.monitors.overfit.rules import not_shrinking
from tests.conftest import make_trainer

sys.path.insert(0, str(ROOT / "examples"))
from zoo import digits

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


@pytest.fixture(autouse=True)
def _quiet_and_in_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Alert files in tmp_path; tiny models on one thread (no pool to wake per kernel)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def raw_digits() -> Any:
    """The digits as raw intensities in [0, 1], in their file order (not shuffled): the first batch's
    labels are known, 0-9 then 0-5."""
    x, y = digits(standardize=False).dataset.tensors
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


class Digits(pl.LightningModule):
    """A ReLU MLP on the 8x8 digits with SGD; ``heads`` adds small heads: ``"val"`` used in
    validation_step only, ``"unused"`` used nowhere."""

    def __init__(
        self, sizes: tuple[int, ...] = (64, 64, 10), lr: float = 0.05, momentum: float = 0.9, heads: str = ""
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers += [nn.Linear(a, b), nn.ReLU()] if i < len(sizes) - 2 else [nn.Linear(a, b)]
        self.net = nn.Sequential(*layers)
        self.lr, self.momentum = lr, momentum
        if "val" in heads:
            self.aux = nn.Linear(64, 1)
        if "unused" in heads:
            self.spare = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        if hasattr(self, "aux"):
            self.log("val_aux", self._aux_score(x))

    def _aux_score(self, x: Tensor) -> Tensor:
        return self.aux(x).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _lines(caplog: pytest.LogCaptureFixture, level: int, words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lightning_gradguard" and r.levelno == level and words in r.getMessage()
    ]


# --------------------------------------------------------------------------- a validation-only head


def test_a_head_used_only_in_validation_and_a_head_used_nowhere_are_info_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    trainer = make_trainer([check], max_steps=2, limit_val_batches=1, val_check_interval=1)
    trainer.fit(Digits(heads="val"), raw_digits(), raw_digits())
    assert check.result is not None and check.result.passed
    assert [(a.kind, a.severity, a.where) for a in check.alerts] == [
        ("unused_parameter", "info", "aux.weight, aux.bias")
    ]
    (line,) = _lines(caplog, logging.INFO, "unused_parameter")
    assert "only validation_step uses their module" in line
    assert not [r for r in caplog.records if r.name == "lightning_gradguard" and r.levelno >= logging.WARNING]
    assert "val_aux" in trainer.callback_metrics  # the real run validated with it

    caplog.clear()
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    make_trainer([check], max_steps=2, limit_val_batches=1, val_check_interval=1).fit(
        Digits(heads="val unused"), raw_digits(), raw_digits()
    )
    assert sorted((a.severity, a.where) for a in check.alerts) == [
        ("info", "aux.weight, aux.bias"),
        ("info", "spare.weight, spare.bias"),
    ]
    spare = next(line for line in _lines(caplog, logging.INFO, "unused_parameter") if "spare.weight" in line)
    assert (
        "module never runs in training_step" in spare
        and "aux." not in spare
        and "of the trainable model" in spare
    )
    assert not _lines(caplog, logging.WARNING, "unused_parameter")


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.probe, self.idle = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def evaluate(self, x: Tensor) -> Tensor:
        return self.probe(self.body(x))


class _Reader(pl.LightningModule):
    """Modules reached from the other steps in every way the reader follows."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.helper_head, self.unused = nn.Linear(4, 2), nn.Linear(4, 1), nn.Linear(4, 1)
        self.heads = nn.ModuleDict({"main": nn.Linear(2, 2), "val": nn.Linear(4, 2)})
        self.inner, self.stack = _Inner(), nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)])

    def forward(self, x: Tensor) -> Tensor:
        return self.heads["main"](self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).sum() + self.inner(batch[0]).sum()

    def _helper(self, x: Tensor) -> Tensor:
        return self.helper_head(x)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0]
        self.log("h", self._helper(x).mean())
        return self.heads["val"](x) + self.inner.evaluate(x).sum() + self(x)


class _ReaderChild(_Reader):
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = super().validation_step(batch, batch_idx)
        return out + self.stack[1](batch[0][:, :1]).sum()

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.unused.weight.sum()


def test_the_source_reader_follows_helpers_containers_sub_module_methods_and_super() -> None:
    val = {"helper_head", "heads.val", "inner.probe", "inner.body"}
    assert used_outside_training(_Reader()) == dict.fromkeys(val, "validation_step")
    assert used_outside_training(_ReaderChild()) == {
        **dict.fromkeys(val | {"stack.1"}, "validation_step"),
        "unused": "test_step",
    }
    # shared code (forward, reached from training_step too) and modules no step names stay out
    assert not {"net", "heads.main", "inner.idle", "stack.0"} & set(used_outside_training(_ReaderChild()))


# --------------------------------------------------------------------------- a too-high LR


def _chance(labels: Tensor) -> float:
    """The entropy of the label frequencies, computed here from the batch the check cut."""
    freq = torch.bincount(labels, minlength=10).double() / labels.numel()
    return float(-(freq[freq > 0] * freq[freq > 0].log()).sum())


def test_sgd_at_ten_times_the_lr_blows_up_to_chance_and_is_told_to_lower_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 25: SGD at lr 0.5 (momentum 0.9) on a ReLU MLP: the loss jumps far above its start, then
    sits at chance. Adam(1e-3) from the same weights memorises the batch, which used to turn this into
    "the LR is slow ... raise the LR" and "passed ... kept learning"."""
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    trainer = make_trainer([check], max_steps=1)
    with pytest.raises(SanityCheckError, match="overfit_failed"):
        trainer.fit(Digits((64, 64, 64, 64, 10), lr=0.5), raw_digits())
    r = check.result
    assert r is not None and not r.passed and r.fallback_reached
    peak = max(r.losses)
    assert peak > 3 * r.losses[0]  # it blew up...
    labels = raw_digits().dataset.tensors[1][:16]
    assert labels.tolist() == [*range(10), *range(6)]
    assert abs(r.final_loss - _chance(labels)) < 0.01  # ...and settled at chance
    (alert,) = [a for a in check.alerts if a.kind == "overfit_failed"]
    assert alert.severity == "error"
    assert alert.hint.startswith("Lower the learning rate") and "raise the LR" not in alert.hint
    assert f"blew up to {peak:.4g}" in alert.message and "too high" in alert.message
    assert "slow" not in alert.message
    assert not _lines(caplog, logging.INFO, "passed")
    assert trainer.global_step == 0


def test_the_healthy_twin_at_a_tenth_of_that_lr_passes_as_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    make_trainer([check], max_steps=1).fit(Digits((64, 64, 64, 64, 10), lr=0.05), raw_digits())
    r = check.result
    assert r is not None and r.passed and r.reached_target and not r.findings and not check.alerts
    assert max(r.losses) == r.losses[0]
    (line,) = _lines(caplog, logging.INFO, "passed")
    assert "reached the target" in line


class _WarmedUp(Digits):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_blow_up_under_a_warm_up_the_check_skipped_is_a_warning_that_never_says_kept_learning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lightning_gradguard")
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    make_trainer([check], max_steps=1).fit(_WarmedUp((64, 64, 64, 64, 10), lr=0.5), raw_digits())
    r = check.result
    assert r is not None and r.passed and r.warm_up and max(r.losses) > 3 * r.losses[0]
    (alert,) = check.alerts
    assert (alert.kind, alert.severity) == ("overfit_failed", "warning")
    assert alert.hint.startswith("Lower the learning rate") and "warms up" in alert.message
    (line,) = _lines(caplog, logging.INFO, "passed")
    assert "kept learning" not in line and "rose to" in line


# --------------------------------------------------------------------------- the gradient norm


class _LeNet(Digits):
    """Conv-ReLU-pool twice, then two linear layers: on raw digits its gradient norm grows as the logits
    sharpen (0.34 -> 0.44 while the loss falls 2.30 -> 0.21, seed 0), the runs of issue 25."""

    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )


@pytest.mark.parametrize("seed", [0, 1])
def test_a_cross_entropy_gradient_growing_on_the_way_to_the_default_target_is_no_finding(seed: int) -> None:
    torch.manual_seed(seed)
    check = OverfitBatchSanity()
    make_trainer([check], max_steps=1).fit(_LeNet(lr=0.05), raw_digits())
    r = check.result
    assert r is not None and r.passed and r.reached_target
    g = r.grad_norms
    assert g[-1] >= max(g[0], statistics.median(g))  # what the old rule warned about
    assert not r.findings and not check.alerts


def test_the_gradient_is_judged_only_near_the_minimum() -> None:
    losses = [2.3] + [2.3 * 0.5**k for k in range(1, 9)]  # down to 0.4 % of the start
    rising = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]  # the gradient at losses[k], k = 0..7
    assert losses[7] <= 0.01 * losses[0]
    (finding,) = not_shrinking(losses, rising)
    assert finding.kind == "gradient_not_shrinking" and finding.data["final_grad_norm"] == 1.0
    assert not not_shrinking(losses, [1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05])  # shrinking
    stops_at_a_tenth = [2.3, 1.5, 1.0, 0.7, 0.5, 0.4, 0.3, 0.22]  # the default target
    assert not not_shrinking(stops_at_a_tenth, rising[:7])  # last gradient at 13 % of the start


class _Tanh(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1.0)


def test_adam_at_lr_one_bouncing_into_the_target_is_told_by_its_loss_curve() -> None:
    """The case gradient_not_shrinking was written for: the loss jumps to several times its start, then
    lands below the target by luck."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    torch.manual_seed(0)
    check = OverfitBatchSanity()
    make_trainer([check], max_steps=1).fit(_Tanh(), loader)
    r = check.result
    assert r is not None and r.passed and r.reached_target
    peak = max(r.losses)
    step = r.losses.index(peak)
    assert peak > 1.5 * r.losses[0] and 0 < step < len(r.losses) - 1
    (finding,) = r.findings
    assert (finding.kind, finding.severity) == ("overfit_unstable", "warning")
    assert finding.data == {"initial_loss": r.losses[0], "peak_loss": peak, "peak_step": float(step)}
    assert (
        f"{peak / r.losses[0]:.3g}x its start" in finding.message
        and "Lower the learning rate" in finding.hint
    )
    assert math.isfinite(r.final_loss) and r.final_loss <= r.target_loss


def _missed(losses: list[float], **kw: Any) -> Any:
    from lightning_gradguard import OverfitResult

    return OverfitResult(
        passed=False, reached_target=False, memorised=False, steps=len(losses) - 1, initial_loss=losses[0],
        final_loss=losses[-1], target_loss=0.1 * losses[0], losses=losses, grad_norms=[], seconds=0.0,
        num_samples=16, optimizer="SGD", **kw,
    )  # fmt: skip


def test_a_curve_that_rose_above_its_start_is_never_called_slow() -> None:
    """The verdict from the curve alone (no classifier, so no chance level to compare with)."""
    from lightning_gradguard.monitors.overfit.rules import missed_target

    stuck = [1.0, 0.9, 4.0, 2.0, *[1.1] * 20]  # blew up, then sat above its start
    came_down = [1.0, 0.9, 4.0, 2.0, *[0.4] * 20]  # blew up, then fell to 40 % of its start
    steady = [1.0 * 0.99**k for k in range(24)]  # never rose: slow
    for losses, fallback, severity, words in [
        (stuck, True, "error", "blew up to 4 (4x its start) at step 2, then stuck near or above its start"),
        (stuck, None, "error", "then stuck near or above its start"),
        (came_down, True, "warning", "blew up to 4 (4x its start) at step 2, then fell again"),
        (steady, True, "warning", "curve slow"),
    ]:
        finding = missed_target(_missed(losses, fallback_reached=fallback), fallback_lr=1e-3)
        assert (finding.severity, words in finding.message) == (severity, True), finding.message
        rose = max(losses) > 1.5 * losses[0]
        assert ("slow" in finding.message) == (not rose)
        assert ("too high" in finding.message or "Lower the" in finding.hint) == rose
    halved = [1.0 * 0.95**k for k in range(24)]  # the user's own curve learns: 1.0 -> 0.31, steadily
    for fallback in (True, False, None):  # whatever Adam(fallback_lr) did (Lion at its usual lr, a fine-tune)
        finding = missed_target(_missed(halved, fallback_reached=fallback), fallback_lr=1e-3)
        assert finding.severity == "info" and "still falling steadily" in finding.message
    warmed = missed_target(_missed(stuck, fallback_reached=True, warm_up=True), fallback_lr=1e-3)
    assert warmed.severity == "warning" and "warms up" in warmed.message


def test_a_validation_head_left_out_of_the_optimizer_is_an_info_line_too() -> None:
    from lightning_gradguard.monitors.overfit.findings import ParameterRecord
    from lightning_gradguard.monitors.overfit.rules import parameter_findings

    model = _Reader()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    trained = [p for n, p in model.named_parameters() if n.startswith(("net.", "heads.main.", "inner.body."))]
    record = ParameterRecord(
        names=names,
        params=params,
        start=[p.detach().clone() for p in params],
        got_grad=[any(p is t for t in trained) for p in params],
        nonzero_grad=[any(p is t for t in trained) for p in params],
        called={"", "net", "heads", "heads.main", "inner", "inner.body"},
        elsewhere=lambda: used_outside_training(model),
    )
    with torch.no_grad():  # every trained parameter moved
        for p in trained:
            p.add_(1.0)
    optimizer = torch.optim.SGD([*trained, *model.helper_head.parameters()], lr=0.1)  # heads.val left out
    found = parameter_findings(optimizer, record, ignore=[])
    assert {f.severity for f in found} == {"info"}  # modules that never run are a design, said with a share
    assert {n for f in found for n in f.names} == {
        "helper_head.weight", "helper_head.bias", "heads.val.weight", "heads.val.bias",
        "inner.probe.weight", "inner.probe.bias",
        "unused.weight", "unused.bias", "inner.idle.weight", "inner.idle.bias",
        "stack.0.weight", "stack.0.bias", "stack.1.weight", "stack.1.bias",
    }  # fmt: skip
