"""The rules judge what the optimizer does with a gradient, not its raw magnitude: real Trainer runs of
the recipes of real architectures (LayerScale under AdamW, a clip on every step of a small model, a run
that fitted its data), each against the twin that is the fault, so that every test can fail both ways."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, random_loader, reference_total_norm
from torch import nn

from lightning_gradguard import DeadReLUMonitor, GradientNormLogger, LossSpikeGuard, OptimizerMonitor
from lightning_gradguard.monitors.vanishing.callback import VanishingExplodingDetector


class LayerScaleNet(pl.LightningModule):
    """Two residual MLP blocks whose branches are scaled by a learned per-channel ``gamma`` (LayerScale:
    ConvNeXt, CaiT, DINOv2 start it at 1e-6 or 1e-5): the branches' gradients are ``gamma`` times the rest.
    Trained by AdamW with ConvNeXt's recipe, a linear warm-up from 0 (here over 100 steps): ``gamma``
    stays near its start for the first steps. Records the branches' RMS gradient, independently of
    gradguard."""

    def __init__(self, gamma: float, optimizer: str = "adamw", lr: float = 1e-3) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in "ab"
        )
        self.gammas = nn.ParameterList(nn.Parameter(torch.full((32,), gamma)) for _ in "ab")
        self.optimizer, self.lr = optimizer, lr
        self.branch_rms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x)
        for block, gamma in zip(self.blocks, self.gammas, strict=True):
            h = h + gamma * block(h)
        return nn.functional.cross_entropy(self.head(h), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad.reshape(-1) for p in self.blocks.parameters() if p.grad is not None]
        self.branch_rms.append(float(torch.cat(grads).square().mean().sqrt()))

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 100))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def vanishing(det: VanishingExplodingDetector) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in det.alerts if a.kind == "vanishing_gradient"]


def test_layerscale_branches_under_adamw_are_healthy_and_named_under_sgd() -> None:
    """gamma = 1e-6: in the warm-up's first steps the branches' RMS gradient is ~1e-8, under the absolute
    floor (1e-7) that judges an SGD step; AdamW divides it by its own running size (eps 1e-8): its steps on
    them are ~lr, healthy (gamma grows by ~lr a step). Under SGD, whose step is the gradient's own scale,
    the same branches step ~1e-8 x lr: what the magnitude rule is for, named on the dense start."""
    adam = LayerScaleNet(gamma=1e-6)
    det = VanishingExplodingDetector()
    make_trainer([det], max_steps=30, max_epochs=-1).fit(adam, random_loader(n=240))
    assert max(adam.branch_rms[:3]) < 1e-7  # the premise: the magnitude rule calls the dense start vanishing
    assert min(adam.branch_rms) > 1e-9 and det.alerts == []
    assert float(adam.gammas[0].abs().mean()) > 10 * 1e-6  # AdamW moved gamma by ~lr a step

    sgd = LayerScaleNet(gamma=1e-6, optimizer="sgd", lr=0.05)
    det = VanishingExplodingDetector()
    make_trainer([det], max_steps=3, max_epochs=-1).fit(sgd, random_loader(n=24))
    assert max(sgd.branch_rms[:2]) < 1e-7
    assert vanishing(det)[:1] == [("vanishing_gradient", 1)]
    assert "blocks" in (det.alerts[0].where or "")


def test_under_adamw_a_branch_far_under_eps_is_vanishing() -> None:
    """gamma = 1e-11: the branches' RMS gradient at the warm-up's start (~1e-13) is far under a tenth of
    AdamW's eps (1e-8), so its steps there are ~1e-5 x lr: vanishing, in the words of the optimizer."""
    model = LayerScaleNet(gamma=1e-11)
    det = VanishingExplodingDetector()
    make_trainer([det], max_steps=2, max_epochs=-1).fit(model, random_loader(n=16))
    assert max(model.branch_rms) < 1e-10
    assert vanishing(det)[:1] == [("vanishing_gradient", 1)]
    assert "eps" in det.alerts[0].message and "AdamW" in det.alerts[0].message


class Logits(pl.LightningModule):
    """An MLP whose logits are multiplied by ``out_scale`` and its loss by ``loss_scale(step)``."""

    def __init__(self, out_scale: float = 1.0, loss_scale: Any = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.out_scale, self.loss_scale = out_scale, loss_scale or (lambda s: 1.0)
        self.losses: list[float] = []
        self.true_total: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x) * self.out_scale, y) * self.loss_scale(
            self.global_step
        )
        self.losses.append(float(loss))
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.true_total.append(float(reference_total_norm(grads)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the gradients stay what the scales make them


def test_tiny_gradients_at_the_starting_loss_vanish_and_at_a_fitted_loss_do_not() -> None:
    """Both runs have gradients ~1e-12 from step 5 on. Logits scaled by 1e-12: the loss stays at ln 4, the
    model cannot learn: vanishing. A loss scaled by 1e-12 from step 5: it fell to 1e-12 of its start,
    which is what a run that fitted its data looks like: no vanishing."""
    stuck, fitted = Logits(out_scale=1e-12), Logits(loss_scale=lambda s: 1.0 if s < 5 else 1e-12)
    dets = [VanishingExplodingDetector(), VanishingExplodingDetector()]
    for model, det in zip((stuck, fitted), dets, strict=True):
        make_trainer([det], max_steps=40, max_epochs=-1).fit(model, random_loader(n=320))
    assert stuck.losses[-1] == pytest.approx(math.log(4), rel=1e-6) and max(stuck.true_total) < 1e-10
    assert vanishing(dets[0])[:1] == [("vanishing_gradient", 1)]
    assert max(fitted.true_total[5:]) < 1e-10 and fitted.losses[-1] < 1e-10
    assert vanishing(dets[1]) == []


def test_a_clipped_run_is_not_exploding_at_the_ceiling_and_an_unclipped_one_is() -> None:
    """Logits x300: a total norm over 100 at every step (a MobileNetV2 starts at ~800). Under
    ``gradient_clip_val=1`` every update is bounded by the user's own clip: no ceiling alert; without it
    the ceiling fires on the dense start."""
    runs = {}
    for clip in (1.0, None):
        model, det = Logits(out_scale=300.0), VanishingExplodingDetector()
        make_trainer([det], max_steps=12, max_epochs=-1, gradient_clip_val=clip).fit(
            model, random_loader(n=96)
        )
        assert min(model.true_total) > 100  # the premise (Lightning clips after this hook)
        runs[clip] = [(a.kind, a.step) for a in det.alerts]
    assert runs[1.0] == [] and runs[None] == [("exploding_gradient", 1)]


class Classifier(pl.LightningModule):
    """An MLP on 8 features; ``optimizer`` builds its optimizer from the parameters it is given."""

    def __init__(self, optimizer: str = "adamw", norm_inputs: bool = False) -> None:
        super().__init__()
        first: list[nn.Module] = [nn.LayerNorm(8)] if norm_inputs else []
        self.net = nn.Sequential(*first, nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize(("optimizer", "severity"), [("adamw", "info"), ("sgd", "warning")])
def test_a_clip_on_every_step_is_a_warning_under_sgd_and_a_note_under_adamw(
    optimizer: str, severity: str
) -> None:
    """``gradient_clip_val=1e-3`` clips all 100 steps of the window. SGD's step shrinks with the clip: it
    slows learning (a warning); AdamW's does not (the transformer recipe's clip at 1 on a small model):
    an INFO note with the same suggestion."""
    logger = GradientNormLogger()
    trainer = make_trainer([logger], max_steps=100, max_epochs=-1, gradient_clip_val=1e-3)
    trainer.fit(Classifier(optimizer), random_loader(n=800))
    found = [(a.kind, a.severity) for a in logger.alerts]
    assert found == [("clipping_always_active", severity)]
    assert ("AdamW" in logger.alerts[0].hint) == (optimizer == "adamw")


class LateHead(Classifier):
    """The classic bug: the head is replaced after ``configure_optimizers`` built the optimizer (here, at
    the start of training), so the optimizer still holds the old head and the new one never trains."""

    def on_train_start(self) -> None:
        self.net[2] = nn.Linear(32, 4)


class Frozen(Classifier):
    """A frozen first layer kept out of the optimizer on purpose: no gradient, not an orphan."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_parameters_no_optimizer_holds_are_named_at_the_first_step() -> None:
    model, monitor = LateHead(), OptimizerMonitor()
    make_trainer([monitor], max_steps=8, max_epochs=-1).fit(model, random_loader(n=64))
    assert [(a.kind, a.step, a.where) for a in monitor.alerts] == [
        ("parameters_not_in_optimizer", 0, "net.2")
    ]
    held = {id(p) for g in model.trainer.optimizers[0].param_groups for p in g["params"]}
    orphans = [n for n, p in model.named_parameters() if id(p) not in held]
    assert orphans == ["net.2.weight", "net.2.bias"]
    assert f"{32 * 4 + 4:,} entries" in monitor.alerts[0].message

    for twin in (Classifier(), Frozen()):
        monitor = OptimizerMonitor()
        make_trainer([monitor], max_steps=8, max_epochs=-1).fit(twin, random_loader(n=64))
        assert monitor.alerts == []


class CorruptAt(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``random_loader``'s data, the batch of step ``at`` multiplied by ``factor`` (batches of 8)."""

    def __init__(self, n: int, at: int, factor: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
        self.x[8 * at : 8 * (at + 1)] *= factor

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def test_corrupt_inputs_a_scale_invariant_model_hides_are_an_outlier() -> None:
    """A model that normalises its inputs (LayerNorm first, like a ViT's patches or a speech front end)
    learns the same from a batch x1000: the loss does not move, so no spike; its inputs' mean square is 1e6
    times the recent batches' median: batch_statistics_outlier at that step, and the skip drops it. The
    twin without the corrupt batch has no outlier."""
    guard = LossSpikeGuard(action="skip")
    data = CorruptAt(8 * 30, at=20, factor=1000.0)
    trainer = make_trainer([guard], max_steps=30, max_epochs=-1)
    trainer.fit(Classifier(norm_inputs=True), torch.utils.data.DataLoader(data, batch_size=8))
    assert [(a.kind, a.step) for a in guard.alerts] == [("batch_statistics_outlier", 20)]
    batches = data.x.reshape(30, 8, 8).square().mean(dim=(1, 2))
    expected = float(batches[20] / batches[max(0, 20 - guard.window_steps) : 20].median())
    record = guard.records[0]
    assert record.inputs_factor == pytest.approx(expected, rel=0.3) and record.inputs_factor > 1e5
    assert record.action == "skip" and guard.dropped_steps == 1

    twin = LossSpikeGuard(action="skip")
    make_trainer([twin], max_steps=30, max_epochs=-1).fit(Classifier(norm_inputs=True), random_loader(n=240))
    assert twin.alerts == [] and twin.records == []


class SideGate(pl.LightningModule):
    """A learnable task (the label is the largest of the first 4 features) and an MLP beside a 4-unit ReLU
    gate (a squeeze-excitation's bottleneck), three of whose units stop firing at step 80 (bias -100)."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.gate, self.gate_act, self.gate_out = nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 4)
        self.lr = lr

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 80:
            with torch.no_grad():
                self.gate.bias[1:] = -100.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        y = x[:, :4].argmax(dim=1)
        return nn.functional.cross_entropy(self.net(x) + self.gate_out(self.gate_act(self.gate(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def test_units_silent_in_a_run_that_learns_are_not_dead_relu_and_in_one_that_does_not_are() -> None:
    """The same gate, 3 of 4 units silent from step 80. Adam at 1e-2 has learned the task by then (the
    sampled loss near a quarter of its start, far under half): quiet. At lr 0 nothing is learned:
    dead_relu at the gate. The monitor reads the sampled steps' loss with its counts (a regression: it
    was cleared before it was read, so every run looked as if it did not learn)."""
    found = {}
    for lr in (1e-2, 0.0):
        monitor = DeadReLUMonitor(sample_every_n_steps=10)
        torch.manual_seed(0)
        make_trainer([monitor], max_steps=130, max_epochs=-1).fit(SideGate(lr), random_loader(n=1040))
        assert monitor.progress.first is not None and monitor.progress.level is not None
        found[lr] = ({a.where for a in monitor.alerts if a.kind == "dead_relu"}, monitor.progress)
    (learned, progress), (stuck, flat) = found[1e-2], found[0.0]
    assert progress.level is not None and progress.first is not None
    assert progress.level < 0.35 * progress.first
    assert learned == set() and stuck == {"gate_act"}
    assert not flat.learning()


def test_inputs_that_are_all_zero_have_no_scale_to_judge() -> None:
    """A batch of zeros against a median of zeros is no outlier (0/0): inputs without a scale are not
    judged (here every batch is zeros; a padded feature tensor can be mostly so)."""
    x, y = torch.zeros(160, 8), torch.randint(0, 4, (160,), generator=torch.Generator().manual_seed(0))
    guard = LossSpikeGuard(action="warn")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    make_trainer([guard], max_steps=20).fit(Classifier(), loader)
    assert guard.alerts == [] and len(guard.windows["inputs"]) == 20
