"""How parameters are grouped into layers and named in tags and alerts (issue 24, item 5), on real runs.

A parameter registered directly on a module that also has child modules with parameters (a ViT's
``pos_embed`` beside its blocks) is its own layer, named by its qualified name: it used to be named, and
grouped, as the whole module (``net``). A parameter on the LightningModule itself (``cls_token``) is its own
layer too; a parameter on a leaf (``Linear.weight``) still belongs to its module. The expected layers are
read here from the module tree itself, never from gradguard's names.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, MemoryLogger, make_trainer
from torch import nn

from lightning_gradguard import GradientNormLogger, VanishingExplodingDetector

sys.path.insert(0, str(ROOT / "examples"))

from zoo import digits

PATCHES, DIM, CLASSES = 4, 16, 10


class Encoder(nn.Module):
    """A ViT-like container: a patch projection, a position embedding held directly on the container,
    residual blocks and a head."""

    def __init__(self, pos_scale: float) -> None:
        super().__init__()
        self.patch = nn.Linear(64 // PATCHES, DIM)
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, PATCHES, DIM))
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)
        self.pos_scale = pos_scale  # 1e-12: the position embedding gets (almost) no gradient

    def forward(self, x: torch.Tensor, cls_token: torch.Tensor) -> torch.Tensor:
        h = self.patch(x.reshape(x.shape[0], PATCHES, -1)) + self.pos_scale * self.pos_embed
        h = torch.cat([cls_token.expand(x.shape[0], 1, DIM), h], dim=1)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h[:, 0] + h[:, 1:].mean(1))


class TinyViT(pl.LightningModule):
    def __init__(self, pos_scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, DIM))  # on the root
        self.net = Encoder(pos_scale)
        self.true_layers: dict[int, dict[str, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x, self.cls_token)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads: dict[str, list[torch.Tensor]] = {}
        for full, label in structural_layers(self):
            grads.setdefault(label, []).append(dict(self.named_parameters())[full].grad.reshape(-1))
        self.true_layers[self.trainer.global_step] = {
            k: float(torch.linalg.vector_norm(torch.cat(v))) for k, v in grads.items()
        }

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def structural_layers(model: nn.Module, depth: int | None = None) -> list[tuple[str, str]]:
    """``(parameter, layer)`` from the module tree: a parameter of a module with child modules that hold
    parameters (or of the root) is its own layer; a leaf's parameter belongs to the leaf."""
    out = []
    for owner_name, owner in model.named_modules():
        container = any(any(True for _ in c.parameters()) for c in owner.children())
        for local, _ in owner.named_parameters(recurse=False):
            full = f"{owner_name}.{local}" if owner_name else local
            label = full if container else owner_name
            out.append((full, label if depth is None else ".".join(label.split(".")[:depth])))
    return out


def _per_layer(logger: MemoryLogger, family: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, metrics in logger.calls:
        for tag, v in metrics.items():
            head, _, name = tag.partition("/")
            if head == family and name != "total":
                out.setdefault(int(step or 0), {})[name] = v
    return out


def test_a_parameter_on_a_container_is_its_own_layer_in_the_charts(tmp_path: Path) -> None:
    model, logger = TinyViT(), MemoryLogger(str(tmp_path))
    norms = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    make_trainer([norms], logger, max_steps=4, default_root_dir=str(tmp_path)).fit(model, digits())
    want = sorted({label for _, label in structural_layers(model)})
    assert want == ["cls_token", "net.blocks.0", "net.blocks.1", "net.head", "net.patch", "net.pos_embed"]
    logged = _per_layer(logger, "grad_norm")
    assert sorted(logged) == [0, 1, 2, 3]
    for step, values in logged.items():
        assert sorted(values) == want  # no "net": that name would stand for the whole encoder
        for layer, v in values.items():
            assert v == pytest.approx(model.true_layers[step][layer], rel=1e-5), (step, layer)


def test_depth_grouping_keeps_the_container_parameter_apart_from_its_siblings(tmp_path: Path) -> None:
    model, logger = TinyViT(), MemoryLogger(str(tmp_path))
    norms = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0, group_depth=2)
    make_trainer([norms], logger, max_steps=2, default_root_dir=str(tmp_path)).fit(model, digits())
    grads = {n: p.grad for n, p in model.named_parameters()}  # the last step's gradients
    groups: dict[str, list[torch.Tensor]] = {}
    for full, label in structural_layers(model, depth=2):
        groups.setdefault(label, []).append(grads[full].reshape(-1))
    logged = _per_layer(logger, "grad_norm")[1]
    assert sorted(logged) == sorted(groups)
    assert sorted(groups) == ["cls_token", "net.blocks", "net.head", "net.patch", "net.pos_embed"]
    for layer, parts in groups.items():
        assert logged[layer] == pytest.approx(float(torch.linalg.vector_norm(torch.cat(parts))), rel=1e-5)


@pytest.mark.parametrize("pos_scale", [1e-12, 1.0])
def test_a_vanishing_position_embedding_is_named_by_its_own_name(pos_scale: float, tmp_path: Path) -> None:
    detector = VanishingExplodingDetector(check_every_n_steps=1, log_gradient_flow=False)
    trainer = make_trainer(
        [detector], MemoryLogger(str(tmp_path)), max_steps=6, default_root_dir=str(tmp_path)
    )
    trainer.fit(TinyViT(pos_scale), digits())
    if pos_scale == 1.0:  # the healthy twin
        assert detector.alerts == []
        return
    alert = detector.alerts[0]
    assert alert.kind == "vanishing_gradient" and alert.step <= 2
    assert alert.where == "net.pos_embed" and "net.pos_embed" in alert.message


class OwnForward(pl.LightningModule):
    """Attention and a ReLU called in the LightningModule's own forward, outside every submodule: the
    attention's queries and keys far too large (near one-hot), the ReLU fed only negative values (dead)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 3 * DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x.reshape(x.shape[0], 8, 8)).chunk(3, dim=-1)
        h = nn.functional.scaled_dot_product_attention(60.0 * q, 60.0 * k, v)
        h = h + torch.relu(-h.abs() - 1.0)  # every unit dead
        return self.head(h.mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_work_done_in_the_lightning_modules_own_forward_is_named_by_its_class() -> None:
    """Regression: attention called in the LightningModule's own forward was named '' (alerts 'in ``', tags
    'attention/max_logit/'): the root module is named by its class. A functional ReLU there keeps its
    documented root name, the ReLU and the child whose output it got (``relu(proj)``)."""
    from lightning_gradguard import ActivationRangeMonitor, DeadReLUMonitor

    logger = MemoryLogger()
    monitors = [ActivationRangeMonitor(), DeadReLUMonitor(sample_every_n_steps=1)]
    make_trainer(monitors, logger=logger, max_steps=6).fit(OwnForward(), digits())
    alerts = [a for m in monitors for a in m.alerts]
    assert {a.kind for a in alerts} >= {"attention_entropy_collapse", "dead_relu"}
    for alert in alerts:
        assert "``" not in alert.message + alert.hint, alert
    where = {a.kind: a.where for a in alerts}
    assert where["attention_entropy_collapse"] == "OwnForward" and where["dead_relu"] == "relu(proj)"
    tags = {tag for _, metrics in logger.calls for tag in metrics}
    assert "attention/max_logit/OwnForward" in tags
    assert not any(tag.endswith("/") for tag in tags)


class _SpareBranch(nn.Module):
    """A container with a parameter of its own (``pos``) and a trainable child unused in this forward (a
    branch taken only sometimes): the child's parameters have no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(64, 32)
        self.pos = nn.Parameter(0.1 * torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos


class _WithSpare(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = _SpareBranch(), nn.Linear(64, CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.enc(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_container_parameter_keeps_its_layer_when_a_sibling_gets_no_gradient(tmp_path: Path) -> None:
    """Regression: the layers of the parameters with a gradient were decided among those alone, so with
    ``enc.spare`` unused, ``enc`` no longer looked like a container and ``enc.pos`` was charted as
    ``grad_norm/enc`` while its weight was ``weight_norm/enc.pos``: one parameter, two layer names (the
    gradient flow too)."""
    logger = MemoryLogger(str(tmp_path))
    norms = GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=0)
    detector = VanishingExplodingDetector()
    make_trainer([norms, detector], logger, max_steps=2, default_root_dir=str(tmp_path)).fit(
        _WithSpare(), digits()
    )
    grads, weights = _per_layer(logger, "grad_norm")[1], _per_layer(logger, "weight_norm")[1]
    assert sorted(grads) == ["enc.pos", "head"]
    assert set(grads) <= set(weights) and "enc" not in weights
    flow = _per_layer(logger, "grad_flow")
    assert all(set(layers) <= set(weights) for layers in flow.values()), flow
