"""Audit of the pre-flight checks for false alarms and crashes: healthy Lightning setups of many shapes
must pass OverfitBatchSanity and GradientCheck with their DEFAULT arguments (action="raise"): no error
alert, no exception, and the check really ran (no "could not run the check" warning)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_gradguard import GradientCheck, OverfitBatchSanity
from tests.conftest import make_trainer

FEATURES, CLASSES = 8, 5


def data(n: int = 64, classes: int = CLASSES, seed: int = 0, imbalance: float = 0.0) -> tuple[Tensor, Tensor]:
    """Inputs with labels from a fixed random teacher (learnable), optionally mostly class 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, classes, generator=g)).argmax(dim=1)
    if imbalance:
        y = torch.where(torch.rand(n, generator=g) < imbalance, torch.zeros_like(y), y)
    return x, y


def loader(x: Tensor, *targets: Tensor, batch_size: int = 16, shuffle: bool = False) -> Any:
    ds = torch.utils.data.TensorDataset(x, *targets)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle)


class Model(pl.LightningModule):
    """A small classifier; the setups below change one thing each."""

    def __init__(self, net: nn.Module | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = net if net is not None else mlp()
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def mlp(out: int = CLASSES, hidden: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, out))


def run_checks(
    model: pl.LightningModule, train: Any = None, datamodule: Any = None, val: Any = None, **trainer_kw: Any
) -> tuple[OverfitBatchSanity, GradientCheck, pl.Trainer, list[str]]:
    """Fit with both checks at their defaults; return them, the trainer and the gradguard warnings."""
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    kw: dict[str, Any] = {"max_steps": 2, "limit_val_batches": 0, **trainer_kw}
    trainer = make_trainer([grads, overfit], **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if datamodule is not None:
            trainer.fit(model, datamodule=datamodule)
        else:
            trainer.fit(model, train, val)
    ours = [
        str(w.message) for w in caught if "Overfit" in str(w.message) or "GradientCheck" in str(w.message)
    ]
    return overfit, grads, trainer, ours


def assert_healthy(overfit: OverfitBatchSanity, grads: GradientCheck, ours: list[str]) -> None:
    """Both checks ran, passed, and reported nothing of severity error."""
    assert not [m for m in ours if "could not run" in m], ours
    errors = [a.format() for a in overfit.alerts + grads.alerts if a.severity in ("error", "critical")]
    assert not errors, errors
    assert overfit.result is not None and overfit.result.passed, overfit.result
    assert overfit.result.steps > 0
    assert grads.result is not None and grads.result.passed and grads.result.parameters


def fit_plain(build: Callable[[], tuple[pl.LightningModule, Any]], callbacks: list[Any], **kw: Any) -> Any:
    pl.seed_everything(7, verbose=False)
    model, train = build()
    trainer = make_trainer(callbacks, **{"max_epochs": 3, "limit_val_batches": 0, **kw})
    trainer.fit(model, train)
    return model, trainer


# --------------------------------------------------------------------------------------------- losses


class LabelSmoothing(Model):
    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y, label_smoothing=0.1)


class Binary(Model):
    def __init__(self) -> None:
        super().__init__(mlp(out=1))

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(out.squeeze(1), (y > 1).float())


class MultiLabel(Model):
    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(
            out, F.one_hot(y, CLASSES).float().roll(1, 1) + F.one_hot(y, CLASSES).float()
        )


class Regression(Model):
    def __init__(self) -> None:
        super().__init__(mlp(out=1))

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(out.squeeze(1), y.float())


@pytest.mark.parametrize(
    ("name", "model", "imbalance"),
    [
        ("label_smoothing", LabelSmoothing, 0.0),
        ("imbalanced", Model, 0.8),
        ("binary_bce_one_logit", Binary, 0.0),
        ("multi_label", MultiLabel, 0.0),
        ("regression_mse", Regression, 0.0),
    ],
)
def test_losses_of_many_shapes_pass(name: str, model: Callable[[], Model], imbalance: float) -> None:
    torch.manual_seed(0)
    x, y = data(imbalance=imbalance)
    overfit, grads, _, ours = run_checks(model(), loader(x, y))
    assert_healthy(overfit, grads, ours)
    r = overfit.result
    assert r is not None
    if name in ("binary_bce_one_logit", "regression_mse"):
        assert r.num_classes is None  # no [N, C] logits with integer labels: not judged as a classifier
    # no ln C judgement of a loss that is not the cross-entropy of the logits (multi-label BCE here)
    assert not [f for f in r.findings if f.kind == "initial_loss_mismatch"], r.findings
    if name == "label_smoothing":  # its floor (the smoothed targets' entropy) is above 0.1 x initial
        assert r.memorised and not r.reached_target and r.final_loss > 0.1 * r.initial_loss


def test_fine_tuning_a_pretrained_model_is_not_an_initial_loss_error() -> None:
    """Weights trained for a few epochs first: the initial loss is far below ln C, as it should be."""
    torch.manual_seed(0)
    x, y = data()
    model = Model(lr=2e-2)
    make_trainer([], max_epochs=15).fit(model, loader(x, y))  # "pretraining", no checks
    overfit, grads, _, ours = run_checks(model, loader(x, y))  # a fresh Trainer: global_step 0
    assert_healthy(overfit, grads, ours)
    r = overfit.result
    assert r is not None and r.initial_loss < 0.5 * math.log(CLASSES)  # really pretrained
    assert not [a for a in overfit.alerts if a.severity != "info"], [a.format() for a in overfit.alerts]


# --------------------------------------------------------------------------------------------- layers


class BatchNormNet(Model):
    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))
        )


class DropoutNet(Model):
    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(
                nn.Linear(FEATURES, 64),
                nn.Dropout(0.5),
                nn.ReLU(),
                nn.Linear(64, 64),
                nn.Dropout(0.5),
                nn.ReLU(),
                nn.Linear(64, CLASSES),
            ),
            lr=3e-3,
        )


@pytest.mark.parametrize(
    ("model", "batch_size"),
    [(BatchNormNet, 2), (BatchNormNet, 64), (DropoutNet, 16)],
    ids=["batchnorm_bs2", "batchnorm_bs64_sliced", "dropout_heavy"],
)
def test_normalisation_and_dropout_pass(model: Callable[[], Model], batch_size: int) -> None:
    torch.manual_seed(0)
    x, y = data()
    overfit, grads, _, ours = run_checks(model(), loader(x, y, batch_size=batch_size))
    assert_healthy(overfit, grads, ours)
    assert overfit.result is not None and overfit.result.num_samples == min(batch_size, 16)


# --------------------------------------------------------------------------------------------- optimizers


class AdamWDecay(Model):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class OneCycle(Model):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Warmup(Model):
    """Linear warm-up from exactly 0: the optimizer's LR at the first step is 0."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 100))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LinearWarmupEpochs(Model):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=10)
        return [opt], [sched]


@pytest.mark.parametrize("model", [AdamWDecay, OneCycle, Warmup, LinearWarmupEpochs])
def test_optimizers_and_schedulers_that_start_at_a_tiny_lr_pass(model: Callable[[], Model]) -> None:
    torch.manual_seed(0)
    x, y = data()
    m = model()
    overfit, grads, _, ours = run_checks(m, loader(x, y))
    assert_healthy(overfit, grads, ours)


# --------------------------------------------------------------------------------------------- parameters


class FrozenBackbone(Model):
    def __init__(self) -> None:
        super().__init__()
        for p in self.net[0].parameters():
            p.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class AuxHeadInValidation(Model):
    """A head used only in validation_step: never in the training graph, on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(FEATURES, 1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_aux", self.aux(batch[0]).mean())


class TiedLanguageModel(Model):
    """Next-token prediction; the output layer shares the embedding's weight; integer inputs."""

    def __init__(self, vocab: int = 11, dim: int = 16) -> None:
        super().__init__(lr=2e-2)
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight
        del self.net

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.gelu(self.mix(self.norm(self.emb(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class Standardise(nn.Module):
    """A module with buffers only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((FEATURES,), 0.1))
        self.register_buffer("std", torch.full((FEATURES,), 1.1))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class BufferOnly(Model):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(Standardise(), mlp()))


class WithMetric(Model):
    """A torchmetrics metric updated and logged in training_step; a dict is returned."""

    def __init__(self) -> None:
        super().__init__()
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.acc(logits, y)
        self.log("train_acc", self.acc, prog_bar=True)
        self.log_dict({"train_loss": loss})
        return {"loss": loss, "logits": logits.detach()}


def test_frozen_backbone_is_not_unused() -> None:
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(FrozenBackbone(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    assert overfit.result is not None and not overfit.result.findings
    assert {p.name for p in grads.result.parameters} == {"net.2.weight", "net.2.bias"}  # type: ignore[union-attr]


def test_a_head_used_only_in_validation_is_an_info_line_not_a_warning() -> None:
    torch.manual_seed(0)
    x, y = data()
    overfit, grads, trainer, ours = run_checks(
        AuxHeadInValidation(), loader(x, y), val=loader(x, y), limit_val_batches=1, val_check_interval=1
    )
    assert_healthy(overfit, grads, ours)
    assert [(a.kind, a.severity, a.where) for a in overfit.alerts] == [
        ("unused_parameter", "info", "aux.weight, aux.bias")
    ]
    assert "val_aux" in trainer.callback_metrics  # the real run validated with it


def test_tied_weights_embeddings_layernorm_gelu_pass() -> None:
    torch.manual_seed(0)
    columns = [torch.randint(0, 11, (32,), generator=torch.Generator().manual_seed(1))]
    for _ in range(6):  # each next token follows from the last one: learnable
        columns.append((3 * columns[-1] + 1) % 11)
    tokens = torch.stack(columns, dim=1)
    model = TiedLanguageModel()
    assert model.out.weight is model.emb.weight
    overfit, grads, _, ours = run_checks(model, loader(tokens))
    assert_healthy(overfit, grads, ours)
    names = {p.name for p in grads.result.parameters}  # type: ignore[union-attr]
    assert "emb.weight" in names and "out.weight" not in names  # one tensor, checked once
    assert model.out.weight is model.emb.weight  # the tie survives the restore


@pytest.mark.parametrize("model", [BufferOnly, WithMetric])
def test_buffers_and_metrics_and_dict_outputs_pass(model: Callable[[], Model]) -> None:
    torch.manual_seed(0)
    m = model()
    overfit, grads, _, ours = run_checks(m, loader(*data()))
    assert_healthy(overfit, grads, ours)
    assert overfit.result is not None and not overfit.result.findings


# --------------------------------------------------------------------------------------------- trainer setups


class DataModule(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = data()

    def train_dataloader(self) -> Any:
        return loader(self.x, self.y, shuffle=True)


class Stream(torch.utils.data.IterableDataset):
    """An IterableDataset that yields (x, y) samples generated on the fly from its own seed."""

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        x, y = data(n=48, seed=3)
        yield from zip(x, y, strict=True)


@pytest.mark.parametrize(
    ("setup", "trainer_kw"),
    [
        ("accumulate", {"accumulate_grad_batches": 2}),
        ("bf16", {"precision": "bf16-mixed"}),
        ("bf16_true", {"precision": "bf16-true"}),
        ("datamodule", {}),
        ("iterable", {}),
        ("clip", {"gradient_clip_val": 0.5}),
    ],
)
def test_trainer_features_and_data_sources_pass(setup: str, trainer_kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    x, y = data()
    kw: dict[str, Any] = {"train": loader(x, y)}
    if setup == "datamodule":
        kw = {"datamodule": DataModule()}
    if setup == "iterable":
        kw = {"train": torch.utils.data.DataLoader(Stream(), batch_size=16)}
    overfit, grads, trainer, ours = run_checks(Model(), **kw, **trainer_kw)
    assert_healthy(overfit, grads, ours)
    assert trainer.global_step == 2


class BatchNormCNN(Model):
    """Conv + BatchNorm + ReLU twice on 1x8x8 images (digits-sized), Adam at 1e-3."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(2),
                nn.Flatten(),
                nn.Linear(32, 10),
            ),
            lr=1e-3,
        )


def digits_like() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 8, 8, generator=g)
    return loader(x, (x.flatten(1) @ torch.randn(64, 10, generator=g)).argmax(dim=1))


def test_bf16_true_batchnorm_cnn_passes_with_a_precision_warning() -> None:
    """Under bf16-true, Adam's steps of about the LR (1e-3) are below half of bfloat16's spacing at the
    BatchNorm weights' 1.0 (2**-7 = 0.0078): rounding keeps them at 1.0 while the run learns. That is a
    precision warning with its numbers, not an un-updated parameter (an error that raised)."""
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(BatchNormCNN(), digits_like(), precision="bf16-true")
    assert_healthy(overfit, grads, ours)
    (alert,) = overfit.alerts
    assert (alert.kind, alert.severity) == ("update_below_precision", "warning")
    assert alert.where == "net.1.weight, net.4.weight"  # the BatchNorm weights, nothing else
    assert "bf16-mixed" in alert.hint and "bfloat16" in alert.message
    data = alert.data
    assert data["count"] == 2 and data["magnitude"] == 1.0  # BatchNorm weights start at exactly 1
    assert data["resolution"] == 2.0**-7 == torch.finfo(torch.bfloat16).eps
    assert 0.3e-3 < data["update"] < 3e-3 and data["update"] <= data["largest_update"] < 2.0**-7  # ~ lr
    # the counterfactual: with float32 weights (bf16-mixed) the same updates move them, and nothing is said
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(BatchNormCNN(), digits_like(), precision="bf16-mixed")
    assert_healthy(overfit, grads, ours)
    assert not overfit.alerts, [a.format() for a in overfit.alerts]


# --------------------------------------------------------------------------------------------- GradientCheck


class Cube(torch.autograd.Function):
    """x ** 3 with a hand-written (correct) backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


class CubeLayer(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return Cube.apply(x)


class ConvPool(Model):
    """Conv -> ReLU -> MaxPool on images with a zero background (ties inside pooling windows)."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(
                nn.Conv2d(1, 4, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(64, CLASSES),
            )
        )


class CustomActivation(Model):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(FEATURES, 16), CubeLayer(), nn.Linear(16, CLASSES)), lr=3e-3)


def images() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    img = torch.zeros(64, 1, 8, 8)
    img[:, :, 2:6, 2:6] = torch.randn(64, 1, 4, 4, generator=g)  # zero border: exact ties when pooling
    return img, torch.randint(0, CLASSES, (64,), generator=g)


@pytest.mark.parametrize("model", [ConvPool, CustomActivation])
def test_gradient_check_on_maxpool_and_a_correct_custom_function(model: Callable[[], Model]) -> None:
    torch.manual_seed(0)
    x, y = images() if model is ConvPool else data()
    overfit, grads, _, ours = run_checks(model(), loader(x, y))
    assert_healthy(overfit, grads, ours)
    r = grads.result
    assert r is not None
    if model is CustomActivation:  # the custom Function is found and everything upstream of it checked
        assert r.custom_functions == {"net.1": ["Cube"]} and r.targets == ["net.1"]
        assert {p.name for p in r.parameters} == {"net.0.weight", "net.0.bias"}
    assert max(p.max_rel_error for p in r.parameters) < 1e-5


def test_float32_tensors_made_in_training_step_are_promoted_not_blamed() -> None:
    """`y.float()` in training_step used to round the float64 loss to float32: a false mismatch."""
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(Binary(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    assert grads.result is not None and grads.result.promoted
    assert max(p.max_rel_error for p in grads.result.parameters) < 1e-5
    overfit, grads, _, ours = run_checks(Model(), loader(*data()))
    assert grads.result is not None and not grads.result.promoted  # nothing to promote: no mode, no cost


# --------------------------------------------------------------------------------------------- randomness


class Denoiser(Model):
    """A diffusion-style objective: a random timestep and random noise drawn in every training_step."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(FEATURES + 1, 64), nn.SiLU(), nn.Linear(64, FEATURES)))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        t = torch.rand(x.shape[0], 1)
        noise = torch.randn_like(x)
        noisy = (1 - t).sqrt() * x + t.sqrt() * noise
        return F.mse_loss(self.net(torch.cat([noisy, t], dim=1)), noise)


class Mixup(Model):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        lam = float(torch.rand(()))
        perm = torch.randperm(x.shape[0])
        out = self(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])


@pytest.mark.parametrize("model", [Denoiser, Mixup])
def test_randomness_inside_training_step_is_frozen_during_the_check(model: Callable[[], Model]) -> None:
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(model(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    r = overfit.result
    assert r is not None and r.randomness == "inputs"
    if model is Denoiser:
        assert r.reached_target
    else:  # mixed inputs with two labels: the loss has a floor; Adam converges to it
        assert r.converged and r.final_loss > r.target_loss and r.grad_norms[-1] < 0.05 * r.grad_norms[0]


# --------------------------------------------------------------------------------------------- verdicts


class FineTuneLR(Model):
    """A fresh head on a model trained at a typical fine-tuning LR: too slow to memorise in 200 steps."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=2e-5)


def test_a_slow_fine_tuning_lr_is_a_warning_when_adam_can_memorise_the_batch() -> None:
    torch.manual_seed(0)
    overfit, grads, trainer, ours = run_checks(FineTuneLR(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    r = overfit.result
    assert r is not None and not r.reached_target and not r.memorised and r.fallback_reached
    assert r.steps == 200 and r.optimizer == "AdamW" and r.final_loss > r.target_loss
    (alert,) = overfit.alerts
    assert (alert.kind, alert.severity) == ("overfit_failed", "warning") and "Adam(lr=0.001)" in alert.message
    assert trainer.global_step == 2


class MomentumTeacher(Model):
    """A teacher network run under no_grad and updated by hand (EMA), left out of the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = mlp()  # requires_grad stays True: the user forgot to freeze it

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        with torch.no_grad():
            soft = self.teacher(x).softmax(dim=1)
        out = self(x)
        return F.cross_entropy(out, y) + 0.1 * F.kl_div(out.log_softmax(dim=1), soft, reduction="batchmean")

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters(), strict=True):
                t.lerp_(s, 0.01)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)


def test_a_teacher_outside_the_optimizer_without_gradient_is_an_info_line() -> None:
    """A momentum teacher left at requires_grad=True is as large as the student, but in no param group: it
    is not part of what the optimizer trains, so it is said (INFO, with its share and the DDP cost), not
    counted toward "most of the model never learns"."""
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(MomentumTeacher(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    found = [(a.kind, a.severity, a.where) for a in overfit.alerts]
    where = "teacher.0.weight, teacher.0.bias, teacher.2.weight, teacher.2.bias"
    assert found == [("unused_parameter", "info", where)]
    assert (
        "no param group" in overfit.alerts[0].message
        and "50.0% of the trainable model" in overfit.alerts[0].message
    )
    assert grads.result is not None and grads.result.not_in_graph == where.split(", ")


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Linear(4, FEATURES)
        self.disc = nn.Linear(FEATURES, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        x = batch[0]
        fake = self.gen(torch.randn(x.shape[0], 4))
        d_loss = F.softplus(-self.disc(x)).mean() + F.softplus(self.disc(fake.detach())).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = F.softplus(-self.disc(fake)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.gen.parameters()), torch.optim.Adam(self.disc.parameters())]


def test_manual_optimization_with_two_optimizers_is_one_info_line_and_skips(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GAN's two optimizers are a design: no warning, one INFO line for both checks saying what to run
    instead."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        overfit, grads, trainer, ours = run_checks(GAN(), loader(*data()))
    assert overfit.result is None and grads.result is None
    assert not overfit.alerts and not grads.alerts
    assert not [m for m in ours if "automatic optimization" in m]  # no warning
    said = [r.getMessage() for r in caplog.records if "need automatic optimization" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("OverfitBatchSanity, GradientCheck and LRFinderPlus")
    assert all(r.levelno == logging.INFO for r in caplog.records if "need automatic" in r.getMessage())
    assert "gradient_check(model, batch, loss_fn)" in said[0] and "overfit_batches=1" in said[0]
    assert trainer.global_step == 2  # two optimizer steps per batch count twice: the run went on


# --------------------------------------------------------------------------------------------- restore


class Busy(Model):
    """BatchNorm + Dropout + a torchmetrics metric, SGD with momentum and a per-step OneCycle schedule."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(
                nn.Linear(FEATURES, 32),
                nn.BatchNorm1d(32),
                nn.ReLU(),
                nn.Dropout(0.3),
                nn.Linear(32, CLASSES),
            )
        )
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        noisy = x + 0.1 * torch.randn_like(x)  # randomness inside training_step: frozen during the check
        out = self(noisy)
        self.acc(out, y)
        self.log("acc", self.acc)
        return {"loss": F.cross_entropy(out, y, label_smoothing=0.1)}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def busy() -> tuple[pl.LightningModule, Any]:
    return Busy(), loader(*data(), shuffle=True)


def lm() -> tuple[pl.LightningModule, Any]:
    columns = [torch.randint(0, 11, (32,))]
    for _ in range(6):
        columns.append((3 * columns[-1] + 1) % 11)
    return TiedLanguageModel(), loader(torch.stack(columns, dim=1))


@pytest.mark.parametrize("build", [busy, lm], ids=["busy", "tied_lm"])
def test_the_real_run_after_both_checks_is_bit_identical_to_one_without(
    build: Callable[[], tuple[pl.LightningModule, Any]],
) -> None:
    base, base_trainer = fit_plain(build, [], accumulate_grad_batches=2)
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    after, trainer = fit_plain(build, [grads, overfit], accumulate_grad_batches=2)
    assert overfit.result is not None and overfit.result.passed and overfit.result.steps > 0
    assert grads.result is not None and grads.result.passed
    assert trainer.global_step == base_trainer.global_step > 2
    a, b = base.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # bit for bit
        assert torch.equal(a[k], b[k]), k
    opt_a, opt_b = base_trainer.optimizers[0], trainer.optimizers[0]
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    for p, q in zip(base.parameters(), after.parameters(), strict=True):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def persistent() -> tuple[pl.LightningModule, Any]:
    ds = torch.utils.data.TensorDataset(*data())
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=1, persistent_workers=True)
    return Model(lr=0.1), dl


def test_persistent_workers_keep_the_run_bit_identical() -> None:
    """A DataLoader with persistent workers makes its iterator once and only resets it for later passes,
    which draws one random number fewer. When a check's pass made it, every epoch's order shifted by one
    draw (weights 1.6 % apart after 3 epochs); the checks now draw from an iterator of their own."""
    base, _ = fit_plain(persistent, [])
    overfit, grads = OverfitBatchSanity(), GradientCheck()
    after, trainer = fit_plain(persistent, [grads, overfit])
    assert overfit.result is not None and overfit.result.passed and grads.result is not None
    assert trainer.global_step == 12
    for (k, a), b in zip(base.state_dict().items(), after.state_dict().values(), strict=True):
        assert torch.equal(a, b), k  # bit for bit


# --------------------------------------------------------------------------------------------- more layers


class Recurrent(Model):
    def __init__(self) -> None:
        super().__init__(nn.Linear(16, CLASSES))
        self.rnn = nn.LSTM(2, 16, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x.view(x.shape[0], 4, 2))
        return self.net(out[:, -1])


class Attention(Model):
    """A Transformer encoder layer: multi-head attention with (functional) dropout, LayerNorm, GELU."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, CLASSES))
        self.inp = nn.Linear(2, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 32, dropout=0.1, activation="gelu", batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.enc(self.inp(x.view(x.shape[0], 4, 2))).mean(dim=1))


def _normed(wrap: Callable[[nn.Module], nn.Module]) -> Callable[[], Model]:
    return lambda: Model(nn.Sequential(wrap(nn.Linear(FEATURES, 32)), nn.ReLU(), nn.Linear(32, CLASSES)))


@pytest.mark.parametrize(
    "model",
    [
        Recurrent,
        Attention,
        _normed(nn.utils.parametrizations.spectral_norm),
        _normed(nn.utils.spectral_norm),
        _normed(nn.utils.parametrizations.weight_norm),
    ],
    ids=["lstm", "transformer_layer", "spectral_norm", "spectral_norm_hook", "weight_norm"],
)
def test_recurrent_attention_and_reparametrised_layers_pass(model: Callable[[], Model]) -> None:
    """Spectral norm used to fail GradientCheck: its power iteration moved u, v at every evaluation."""
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(model(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    assert grads.result is not None and max(p.max_rel_error for p in grads.result.parameters) < 1e-4
    # a gradient norm that rises, then falls back to a little above its start (the LSTM) is shrinking
    assert not overfit.alerts, [a.format() for a in overfit.alerts]


def test_a_slow_steady_curve_is_not_called_oscillating() -> None:
    from lightning_gradguard import OverfitResult
    from lightning_gradguard.monitors.overfit.rules import failed_finding

    def shape(losses: list[float]) -> str:
        r = OverfitResult(
            passed=False, reached_target=False, memorised=False, steps=len(losses) - 1,
            initial_loss=losses[0], final_loss=losses[-1], target_loss=0.1 * losses[0], losses=losses,
            grad_norms=[], seconds=0.0, num_samples=16, optimizer="Adam",
        )  # fmt: skip
        return failed_finding(r).message.split("curve ")[1]

    steady = [1.6 * 0.993**k for k in range(200)]  # 1.6 -> 0.39: more than 1.5x between the halves
    assert shape(steady).startswith("slow")
    bouncing = [*steady[:150], *[1.0, 0.5] * 25]
    assert shape(bouncing).startswith("oscillating")


class WithNegatives(torch.utils.data.Dataset):
    """Fixed features and label, plus negatives drawn at random on every access (as recommenders do)."""

    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], torch.randint(0, CLASSES, (3,))


class NegativeAware(Model):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, negatives = batch
        out = self(x)
        return F.cross_entropy(out, y) + 0.1 * out.gather(1, negatives).sigmoid().mean()


def test_random_negatives_in_the_dataset_are_not_unstable_labels() -> None:
    torch.manual_seed(0)
    data_loader = torch.utils.data.DataLoader(WithNegatives(), batch_size=16, shuffle=True)
    overfit, grads, _, ours = run_checks(NegativeAware(), data_loader)
    assert_healthy(overfit, grads, ours)
    assert not [f for f in overfit.result.findings if f.kind == "labels_unstable"]  # type: ignore[union-attr]


class NoBatchIdx(Model):
    def training_step(self, batch: Any) -> Any:  # type: ignore[override]
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_a_training_step_without_batch_idx_is_checked_too() -> None:
    """Lightning passes batch_idx only when training_step takes it; the checks used to skip such models."""
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(NoBatchIdx(), loader(*data()))
    assert_healthy(overfit, grads, ours)


class VAE(Model):
    """A variational autoencoder: reparametrisation noise, an ELBO that takes long to memorise a batch."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 8)), lr=1e-3)
        self.dec = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, FEATURES))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        mu, logvar = self.net(x).chunk(2, dim=1)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        rec = F.mse_loss(self.dec(z), x, reduction="sum") / x.shape[0]
        kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum() / x.shape[0]
        return rec + kl


def test_a_slowly_but_steadily_learning_vae_is_an_info_line_and_passes() -> None:
    """A healthy objective that is slow to memorise one batch (a VAE's ELBO, Cohere's 1/16 logit scale)
    is no fault of the pipeline: the check passes and says so in an INFO line, no warning."""
    torch.manual_seed(0)
    overfit, grads, trainer, ours = run_checks(VAE(), loader(*data()))
    assert_healthy(overfit, grads, ours)
    r = overfit.result
    assert r is not None and r.randomness == "inputs" and not r.reached_target and r.steps == 200
    assert r.final_loss <= 0.5 * r.initial_loss and r.fallback_reached is False  # Adam(1e-3) is the same
    (alert,) = overfit.alerts
    assert (alert.kind, alert.severity) == ("overfit_failed", "info") and "still falling" in alert.message
    assert r.passed and trainer.global_step == 2


# --------------------------------------------------------------------------------------------- deliberate


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class Reverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): identity forward, negated backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return -grad


class Apply(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn.apply(x)


@pytest.mark.parametrize(("fn", "words"), [(RoundSTE, "straight-through"), (Reverse, "up to the sign")])
def test_deliberate_surrogate_gradients_are_reported_with_a_hint_that_names_them(fn: Any, words: str) -> None:
    """A backward that differs from the derivative on purpose is a mismatch; the hint names its shape."""
    from lightning_gradguard import gradient_check
    from lightning_gradguard.monitors.gradcheck.findings import pattern

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 16), Apply(fn), nn.Tanh(), nn.Linear(16, CLASSES))
    x, y = data(n=8)
    result = gradient_check(net, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert result.targets == ["1"] and {p.name for p in result.failures} == {"0.weight", "0.bias"}
    assert all(words in pattern(p) for p in result.failures), [pattern(p) for p in result.failures]


class DictBatch(Model):
    """Hugging Face style: a dict batch, the loss computed inside forward, integer token inputs."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, CLASSES))
        self.emb = nn.Embedding(20, 16)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        h = (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.net(h)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self(**batch)["loss"]


def test_a_dict_batch_with_the_loss_inside_forward_passes() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (64, 6), generator=g)
    mask = torch.ones(64, 6, dtype=torch.long)
    mask[:, 4:] = (torch.rand(64, 2, generator=g) > 0.5).long()
    labels = torch.randint(0, CLASSES, (64,), generator=g)
    samples = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(64)]
    torch.manual_seed(0)
    overfit, grads, _, ours = run_checks(DictBatch(), torch.utils.data.DataLoader(samples, batch_size=16))
    assert_healthy(overfit, grads, ours)
    assert overfit.result is not None and overfit.result.num_classes == CLASSES and not overfit.alerts
