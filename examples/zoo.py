"""A zoo of small, real Lightning training setups: broken networks and healthy controls.

Each :class:`Case` builds a LightningModule and its data (scikit-learn's 8x8 digits, shipped with
scikit-learn, or small synthetic sequences), says which gradguard alerts it should raise and from which
step the pathology is present. ``examples/broken_networks.py`` trains the gallery and prints what the
detectors said; ``tests/integration/test_zoo.py`` asserts it (it puts this folder on ``sys.path``), so
the catalogue lives here, beside the example, and not inside the package.

The broken ones follow the classic deliberately-broken gallery: a learning rate of 10 with SGD, every
ReLU killed by its initialization (weights -1, biases -5), a deep sigmoid stack, a deep ReLU stack with
a far too large initialization, a vanilla RNN whose recurrent matrix has spectral radius 3, and tanh
units driven deep into saturation. Then faults that must be named at their onset, by their cause: a loss
that climbs from the first step (SGD at lr 2), Adam with beta2 far below beta1^2, attention that is
one-hot at initialization, a weight decay far too strong, a model whose output ignores its input, and
bfloat16 weights whose updates are rounded away.
The healthy controls are what people actually train, and the faults' twins: a ReLU MLP with Adam and
with SGD, a CNN with BatchNorm, a small GELU transformer with AdamW, an LSTM with gradient clipping, a
deep pre-LayerNorm residual network, a fine-tuned head on a frozen backbone and a bf16-mixed run.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CASES", "Case", "ZooModule", "digits", "monitors", "run_case"]


# ---------------------------------------------------------------------------------------------- data
@lru_cache(maxsize=1)
def _digits_arrays() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0  # pixel intensities in [0, 1]
    return x, torch.tensor(data.target, dtype=torch.long)


def digits(standardize: bool = True, shape: tuple[int, ...] = (64,), batch_size: int = 32) -> DataLoader[Any]:
    """The 1797 scikit-learn digits, shuffled with a fixed seed, as ``(x, label)`` batches.

    ``standardize`` gives every pixel zero mean and unit variance (healthy practice); without it the
    inputs are raw intensities in [0, 1]. ``shape`` reshapes each sample (``(1, 8, 8)`` for a CNN,
    ``(8, 8)`` for a sequence of 8 rows).
    """
    x, y = _digits_arrays()
    if standardize:
        x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    x = x.reshape(-1, *shape)
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g, drop_last=True)


def sequences(length: int = 40, features: int = 4, n: int = 512, batch_size: int = 32) -> DataLoader[Any]:
    """Synthetic sequences; the label is the sign of the very first input (a long-range dependency)."""
    g = torch.Generator().manual_seed(0)
    x = 0.5 * torch.randn(n, length, features, generator=g)
    y = (x[:, 0, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g, drop_last=True)


# ---------------------------------------------------------------------------------------------- module
class ZooModule(pl.LightningModule):
    """A classifier around any ``net``: cross-entropy, the optimizer from ``make_optimizer``."""

    def __init__(self, net: nn.Module, make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = make_optimizer
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer([p for p in self.parameters() if p.requires_grad])


def _mlp(sizes: list[int], act: Callable[[], nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def _adam(lr: float = 1e-3) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.Adam(params, lr=lr)


# ---------------------------------------------------------------------------------------------- broken
def sgd_lr10() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """A fine ReLU MLP trained with SGD at lr=10: every update overshoots and the norms run away."""
    net = _mlp([64, 64, 10], nn.ReLU)
    return ZooModule(net, lambda p: torch.optim.SGD(p, lr=10.0)), digits()


def dead_relu_init() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Weights -1 and biases -5 on non-negative inputs: every pre-activation is negative, every ReLU dead."""
    net = _mlp([64, 32, 32, 10], nn.ReLU)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Linear):
                m.weight.fill_(-1.0)
                m.bias.fill_(-5.0)
    return ZooModule(net, _adam()), digits(standardize=False)


class _LRJump(ZooModule):
    """SGD at a sane 0.05 until step 40, then a scheduler bug multiplies the learning rate by 200."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 40 else 200.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lr_jump() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """A healthy start, then lr=10 from step 40: the pathology begins mid-run, after the dense checks."""
    return _LRJump(_mlp([64, 64, 10], nn.ReLU), lambda p: torch.optim.SGD(p, lr=0.05)), digits()


class _FunctionalDead(nn.Module):
    """ReLUs called as ``F.relu`` / ``torch.relu`` inside ``forward``, with a dying bias on the first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10)
        with torch.no_grad():
            self.fc1.weight.abs_().neg_()
            self.fc1.bias.fill_(-5.0)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.relu(self.fc1(x))
        return self.out(torch.relu(self.fc2(h)))


def dead_functional_relu() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """The same death, but through functional ReLU calls: named by the module whose forward called them."""
    return ZooModule(_FunctionalDead(), _adam()), digits(standardize=False)


def deep_sigmoid() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Twelve sigmoid layers: each multiplies the backward signal by at most 0.25, so early layers starve."""
    net = _mlp([64] * 12 + [10], nn.Sigmoid)
    return ZooModule(net, lambda p: torch.optim.SGD(p, lr=0.1)), digits()


def too_large_init() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Eight ReLU layers initialised with std 1, not sqrt(2 / fan_in): activations and gradients blow up."""
    net = _mlp([64] * 8 + [10], nn.ReLU)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0)
                nn.init.zeros_(m.bias)
    return ZooModule(net, _adam()), digits()


class _VanillaRNN(nn.Module):
    def __init__(self, features: int = 4, hidden: int = 64, radius: float = 3.0) -> None:
        super().__init__()
        self.rnn = nn.RNN(features, hidden, nonlinearity="tanh", batch_first=True)
        self.head = nn.Linear(hidden, 2)
        with torch.no_grad():  # an orthogonal matrix times `radius`: every eigenvalue has modulus `radius`
            q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))
            self.rnn.weight_hh_l0.copy_(radius * q)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def rnn_spectral_radius() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """A vanilla tanh RNN over 40 steps, recurrent spectral radius 3: backprop through time explodes."""
    return ZooModule(_VanillaRNN(), _adam()), sequences()


def saturated_tanh() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Tanh units fed pre-activations in the hundreds: their outputs are stuck at +-1, their derivatives 0."""
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    with torch.no_grad():
        net[0].weight.mul_(400.0)
    return ZooModule(net, _adam()), digits()


# ---------------------------------------------------------------------------------------------- healthy
def relu_mlp() -> tuple[pl.LightningModule, DataLoader[Any]]:
    return ZooModule(_mlp([64, 128, 64, 10], nn.ReLU), _adam()), digits()


def sgd_mlp() -> tuple[pl.LightningModule, DataLoader[Any]]:
    return ZooModule(_mlp([64, 128, 64, 10], nn.ReLU), lambda p: torch.optim.SGD(p, lr=0.05)), digits()


def cnn_batchnorm() -> tuple[pl.LightningModule, DataLoader[Any]]:
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return ZooModule(net, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)), digits(shape=(1, 8, 8))


class _TinyTransformer(nn.Module):
    """Each digit as 8 tokens (its rows); pre-LN GELU encoder, mean pool, linear head."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 8, d))
        layer = nn.TransformerEncoderLayer(
            d, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos).mean(dim=1))


def gelu_transformer() -> tuple[pl.LightningModule, DataLoader[Any]]:
    return ZooModule(_TinyTransformer(), lambda p: torch.optim.AdamW(p, lr=1e-3)), digits(shape=(8, 8))


class _LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def lstm_clipped() -> tuple[pl.LightningModule, DataLoader[Any]]:
    return ZooModule(_LSTMClassifier(), _adam(3e-3)), digits(shape=(8, 8))


class _PreLNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def deep_preln_residual() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Twenty pre-LayerNorm residual ReLU blocks: deep, yet the gradient reaches the first layer intact."""
    d = 64
    net = nn.Sequential(
        nn.Linear(64, d), *[_PreLNBlock(d) for _ in range(20)], nn.LayerNorm(d), nn.Linear(d, 10)
    )
    return ZooModule(net, lambda p: torch.optim.AdamW(p, lr=1e-3)), digits()


def frozen_backbone() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Fine-tuning: a frozen backbone (no gradients at all) and a trainable head."""
    backbone = _mlp([64, 128, 64], nn.ReLU)
    backbone.append(nn.ReLU())
    backbone.requires_grad_(False)
    net = nn.Sequential(backbone, nn.Linear(64, 10))
    return ZooModule(net, _adam(1e-2)), digits()


def bf16_mlp() -> tuple[pl.LightningModule, DataLoader[Any]]:
    return ZooModule(_mlp([64, 128, 64, 10], nn.ReLU), _adam()), digits()


# ---------------------------------------------------------------------------------------------- at onset
def sgd_lr_climb() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """SGD at lr 3 on the healthy MLP: the loss climbs from the third step on, to thousands by step 8 (the
    twin: ``sgd_mlp``, lr 0.05). At lr 2 the run was chaotic: where its loss first climbed (step 20, or
    33, or never within 40 steps) moved with the CPU's rounding; at 3 the climb starts at once on any
    machine, and the gradient norm grows with it."""
    return ZooModule(_mlp([64, 128, 64, 10], nn.ReLU), lambda p: torch.optim.SGD(p, lr=3.0)), digits()


def adam_small_beta2() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Adam with betas (0.9, 0.3): beta2 below beta1^2 = 0.81 leaves its step without a bound (the twin:
    ``relu_mlp``, default betas)."""
    net = _mlp([64, 128, 64, 10], nn.ReLU)
    return ZooModule(net, lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.9, 0.3))), digits()


def attention_one_hot() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """The transformer's query and key projections initialised 10x too large: attention is one-hot from
    step 0 (the twin: ``gelu_transformer``)."""
    net = _TinyTransformer()
    with torch.no_grad():
        for layer in net.encoder.layers:
            d = layer.self_attn.embed_dim
            layer.self_attn.in_proj_weight[: 2 * d].mul_(10.0)  # the q and k rows of the packed projection
    return ZooModule(net, lambda p: torch.optim.AdamW(p, lr=1e-3)), digits(shape=(8, 8))


def weight_decay_too_strong() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """AdamW with weight_decay=50: lr * weight_decay removes 5 % of every weight a step and the loss sits
    at chance (the twin: ``gelu_transformer``, AdamW's default 0.01)."""
    opt = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=50.0)  # noqa: E731
    return ZooModule(_TinyTransformer(), opt), digits(shape=(8, 8))


class _InputIgnored(_TinyTransformer):
    """A bug multiplies the embedded input by 0: the output depends on the positions only."""

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(0.0 * self.embed(x) + self.pos).mean(dim=1))


def input_ignored() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """The transformer with its input zeroed: nothing can be learned beyond the class frequencies (the
    twin: ``gelu_transformer``)."""
    return ZooModule(_InputIgnored(), lambda p: torch.optim.AdamW(p, lr=1e-3)), digits(shape=(8, 8))


def bf16_true_small_lr() -> tuple[pl.LightningModule, DataLoader[Any]]:
    """Adam at lr 1e-4 on bfloat16 weights (``precision="bf16-true"``): a step of about 1e-4 is below half
    the spacing of bfloat16 (2**-8 of |w|) for most weights, so most updates are rounded away (the twin:
    ``bf16_mixed``, whose float32 weights keep them)."""
    return ZooModule(_mlp([64, 128, 64, 10], nn.ReLU), _adam(1e-4)), digits()


# ---------------------------------------------------------------------------------------------- the catalogue
@dataclass(frozen=True)
class Case:
    """One setup of the zoo.

    Attributes:
        name: short identifier.
        build: returns ``(module, train loader)``, freshly seeded.
        expected: the alert kinds it must raise (empty for a healthy control).
        onset: the first step at which the pathology is present.
        steps: how many optimizer steps to train.
        trainer_kwargs: extra ``Trainer`` arguments (precision, clipping).
        description: one line for tables.
        max_delay: steps after ``onset`` by which the alert must come. After the dense start the
            gradient detector checks every 5th step and wants 2 checks in a row, hence 10 for a
            pathology that begins mid-run.
        also: other alert kinds that are right about this fault (a symptom or a second rule that sees
            it too): not counted as false alerts.
        cause: words the first expected alert must say (its message or hint): the cause, named.
    """

    name: str
    build: Callable[[], tuple[pl.LightningModule, DataLoader[Any]]]
    expected: tuple[str, ...]
    description: str
    onset: int = 0
    steps: int = 60
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    max_delay: int = 5
    also: tuple[str, ...] = ()
    cause: str = ""

    @property
    def healthy(self) -> bool:
        return not self.expected


CASES: list[Case] = [
    Case(
        "sgd_lr10",
        sgd_lr10,
        ("exploding_gradient",),
        "ReLU MLP, SGD lr=10",
        steps=12,
        also=("early_divergence",),
    ),
    Case(
        "lr_jump",
        lr_jump,
        ("exploding_gradient", "lr_jump"),
        "ReLU MLP, SGD lr 0.05 then x200 at step 40",
        onset=40,
        steps=60,
        max_delay=10,
        also=("early_divergence", "loss_spike"),
    ),
    Case(
        "dead_relu_init", dead_relu_init, ("dead_relu",), "weights -1, biases -5: every ReLU dead", steps=12
    ),
    Case(
        "dead_functional_relu", dead_functional_relu, ("dead_relu",), "dying F.relu inside forward", steps=12
    ),
    Case("deep_sigmoid", deep_sigmoid, ("vanishing_gradient",), "12 sigmoid layers", steps=12),
    Case("too_large_init", too_large_init, ("exploding_gradient",), "8 ReLU layers, init std 1", steps=12),
    Case(
        "rnn_spectral_radius",
        rnn_spectral_radius,
        ("exploding_gradient",),
        "vanilla tanh RNN, recurrent spectral radius 3, 40 steps",
        steps=12,
    ),
    Case(
        "saturated_tanh",
        saturated_tanh,
        ("saturated_activation",),
        "tanh fed pre-activations ~100s",
        steps=12,
    ),
    Case(
        "sgd_lr_climb",
        sgd_lr_climb,
        ("early_divergence",),
        "ReLU MLP, SGD lr=3: the loss climbs from step 3",
        steps=40,
        max_delay=30,
        cause="learning rate",
        also=("exploding_gradient", "nonfinite_loss", "nonfinite_gradient"),  # where the climb leads
    ),
    Case(
        "adam_small_beta2",
        adam_small_beta2,
        ("adam_step_too_large",),
        "ReLU MLP, Adam betas (0.9, 0.3)",
        steps=20,
        max_delay=10,
        cause="beta2",
    ),
    Case(
        "attention_one_hot",
        attention_one_hot,
        ("attention_entropy_collapse",),
        "GELU transformer, q/k init x10",
        steps=5,
        max_delay=0,
        also=("attention_logit_growth",),
        cause="initialization",
    ),
    Case(
        "weight_decay_too_strong",
        weight_decay_too_strong,
        ("update_ratio_high", "weight_decay_collapse"),
        "GELU transformer, AdamW weight_decay=50",
        steps=80,
        max_delay=70,
        also=("chance_level",),
        cause="weight decay is far too strong",
    ),
    Case(
        "input_ignored",
        input_ignored,
        ("chance_level",),
        "GELU transformer whose input is zeroed",
        steps=80,
        max_delay=60,
        cause="Nothing about the inputs is being learned",
    ),
    Case(
        "bf16_true_small_lr",
        bf16_true_small_lr,
        ("update_below_precision",),
        "ReLU MLP in bf16-true, Adam lr=1e-4",
        steps=30,
        max_delay=20,
        trainer_kwargs={"precision": "bf16-true"},
        cause="bfloat16",
    ),
    Case("relu_mlp", relu_mlp, (), "ReLU MLP, Adam", steps=120),
    Case("sgd_mlp", sgd_mlp, (), "ReLU MLP, SGD lr=0.05", steps=120),
    Case("cnn_batchnorm", cnn_batchnorm, (), "CNN + BatchNorm + (in-place) ReLU, SGD momentum", steps=120),
    Case("gelu_transformer", gelu_transformer, (), "2-layer pre-LN GELU transformer, AdamW", steps=120),
    Case(
        "lstm_clipped",
        lstm_clipped,
        (),
        "LSTM, Adam, gradient_clip_val=1",
        steps=120,
        trainer_kwargs={"gradient_clip_val": 1.0},
    ),
    Case(
        "deep_preln_residual",
        deep_preln_residual,
        (),
        "20 pre-LayerNorm residual ReLU blocks, AdamW",
        steps=120,
    ),
    Case("frozen_backbone", frozen_backbone, (), "frozen backbone, trainable head", steps=120),
    Case(
        "bf16_mixed",
        bf16_mlp,
        (),
        "ReLU MLP in bf16-mixed",
        steps=120,
        trainer_kwargs={"precision": "bf16-mixed"},
    ),
]


def run_case(
    case: Case, callbacks: list[Any], root_dir: str | None = None, logger: Any = False
) -> pl.Trainer:
    """Train ``case`` for ``case.steps`` optimizer steps on CPU with ``callbacks``; returns the trainer."""
    pl.seed_everything(0, verbose=False)
    module, loader = case.build()
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=case.steps,
        max_epochs=-1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=10,
        default_root_dir=root_dir,
    )
    kwargs.update(case.trainer_kwargs)
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        trainer.fit(module, loader)
    return trainer


# ---------------------------------------------------------------------------------------------- detection
@dataclass
class Result:
    """What the detectors said about one case, at their default arguments."""

    case: Case
    alerts: list[Any]
    seconds: float
    losses: list[float]
    stopped: str = (
        ""  # the error a monitor stopped the run with (LossSpikeGuard, NaNSentinel; no losses then)
    )

    @property
    def serious(self) -> list[Any]:
        """Alerts of severity warning or above."""
        return [a for a in self.alerts if a.severity != "info"]

    def first_step(self, kind: str) -> int | None:
        steps = [a.step for a in self.serious if a.kind == kind]
        return min(steps) if steps else None

    @property
    def detected(self) -> dict[str, int]:
        """Expected kind -> first step it was raised (missing kinds are absent)."""
        return {k: s for k in self.case.expected if (s := self.first_step(k)) is not None}

    @property
    def false_alerts(self) -> list[Any]:
        """Alerts of a kind the case does not expect (for a healthy case: every alert)."""
        right = {*self.case.expected, *self.case.also}
        return [a for a in self.serious if a.kind not in right]


def monitors() -> list[pl.Callback]:
    """Every training monitor of gradguard at its default arguments (the pre-flight checks and the LR
    finder run before training and are not part of the zoo)."""
    from lightning_gradguard import (
        ActivationRangeMonitor,
        DeadReLUMonitor,
        GradientNormLogger,
        LossSpikeGuard,
        NaNSentinel,
        OptimizerMonitor,
        StallDetector,
        VanishingExplodingDetector,
    )

    return [
        GradientNormLogger(),
        VanishingExplodingDetector(),
        DeadReLUMonitor(),
        ActivationRangeMonitor(),
        OptimizerMonitor(),
        StallDetector(),
        NaNSentinel(),
        LossSpikeGuard(),
    ]


def detect(case: Case, root_dir: str | None = None) -> Result:
    """Train ``case`` with every training monitor at its defaults (:func:`monitors`); a run a monitor
    stops (LossSpikeGuard escalating to ``raise``) is a verdict, kept in ``Result.stopped``."""
    import time

    from lightning_gradguard import GradGuardError

    watching = monitors()
    start = time.perf_counter()
    stopped = ""
    try:
        trainer = run_case(case, list(watching), root_dir=root_dir)
        module = trainer.lightning_module
    except GradGuardError as err:  # LossSpikeError, NonFiniteError: the monitor's verdict
        stopped, module = type(err).__name__, None
    seconds = time.perf_counter() - start
    alerts = sorted((a for m in watching for a in getattr(m, "alerts", [])), key=lambda a: a.step)
    return Result(case, alerts, seconds, list(getattr(module, "losses", [])), stopped)
