"""Under ``torch.compile`` (inductor, on the CPU) every callback runs and costs the user's compiled model
nothing: the same graphs, frames and graph breaks as the run without callbacks (dynamo's counters), and the
same numbers as the uncompiled run.

Our hooks live inside :class:`~lightning_gradguard.core.compile.Uncompiled` scopes (the sampled
``training_step`` of DeadReLUMonitor, the detector's first forward pass, the pre-flight trials), where
compiled code runs eagerly; the gradient check works on an uncompiled copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, make_trainer, random_loader
from floor import needs_torch
from torch import nn
from torch._dynamo.utils import counters

from lightning_gradguard import (
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradientCheck,
    GradientNormLogger,
    LossSpikeGuard,
    LRFinderPlus,
    NaNSentinel,
    OverfitBatchSanity,
    VanishingExplodingDetector,
    gradient_check,
)
from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.monitors.vanishing.order import ForwardOrder
from tests.testkit import SEARCH_STEPS

STEPS = 30
pytestmark = pytest.mark.filterwarnings(
    "ignore:Using `torch.compile\\(module\\)` when there are global hooks"
)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].bias[:8] = -50.0  # half the first ReLU layer never fires
    return net


class Model(pl.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        net = _net()
        self.net = torch.compile(net) if compiled else net  # inductor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _counts() -> dict[str, Any]:
    """What dynamo compiled: graphs, frames (every recompile is one more), graph breaks by reason."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "frames": dict(counters["frames"]),
        "breaks": dict(counters["graph_break"]),
        "recompiles": dict(counters["recompiles"]),
    }


def _fit(
    callbacks: list[Any], compiled: bool, tmp_path: Any, name: str
) -> tuple[dict[str, Any], MemoryLogger]:
    torch._dynamo.reset()
    counters.clear()
    logger = MemoryLogger(str(tmp_path / name))
    trainer = make_trainer(
        callbacks, logger, default_root_dir=str(tmp_path / name), max_steps=STEPS, max_epochs=-1
    )
    trainer.fit(
        Model(compiled), random_loader(n=64)
    )  # 8 full batches an epoch: one shape, no dynamic recompile
    assert trainer.global_step == STEPS
    found = _counts()
    torch._dynamo.reset()
    return found, logger


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The compiled run without any callback."""
    found, _ = _fit([], True, tmp_path_factory.mktemp("bare"), "bare")
    assert found["graphs"] == 1 and not found["breaks"]  # the model compiles to one graph
    return found


def _monitors() -> list[Any]:
    # DeadReLUMonitor samples steps 0-4 (the start) and then 9, 19, 29: after the model was compiled
    return [
        GradientNormLogger(),
        NaNSentinel(),
        VanishingExplodingDetector(),
        DeadReLUMonitor(sample_every_n_steps=10),
    ]


def test_the_four_monitors_add_no_graph_no_recompile_no_break_and_log_the_eager_numbers(
    bare: dict[str, Any], tmp_path: Any
) -> None:
    compiled_cbs, eager_cbs = _monitors(), _monitors()
    found, logger = _fit(compiled_cbs, True, tmp_path, "compiled")
    assert found == bare
    _, eager_logger = _fit(eager_cbs, False, tmp_path, "eager")
    dead, eager_dead = compiled_cbs[-1], eager_cbs[-1]
    assert dead.sampled_batches == eager_dead.sampled_batches == 8
    assert dead.dead_fractions == eager_dead.dead_fractions
    assert dead.dead_fractions["net.1"] == 0.5  # found on the compiled model's sampled steps
    tags = {tag for _, metrics in eager_logger.calls for tag in metrics}
    assert "dead_relu/net.1" in tags and "grad_norm/net.0" in tags
    assert tags == {tag for _, metrics in logger.calls for tag in metrics}
    for tag in tags:
        assert logger.series(tag) == pytest.approx(eager_logger.series(tag), rel=1e-4, abs=1e-6), tag
    assert compiled_cbs[2].forward_order == eager_cbs[2].forward_order == {"net.0": 0, "net.2": 1, "net.4": 2}


def test_every_callback_together_adds_no_recompile_no_break_and_only_the_searchs_inference_graph(
    bare: dict[str, Any], tmp_path: Any
) -> None:
    check = GradientCheck()
    callbacks = [
        GradientNormLogger(),
        NaNSentinel(),
        VanishingExplodingDetector(),
        DeadReLUMonitor(sample_every_n_steps=10),
        LossSpikeGuard(),
        OverfitBatchSanity(action="warn"),
        check,
        LRFinderPlus(search_steps=SEARCH_STEPS),
        ranges := ActivationRangeMonitor(sample_every_n_steps=10),
    ]
    found, _ = _fit(callbacks, True, tmp_path, "all")
    # the range test's sweep is refused on these random labels, and its search runs blind: it scores its
    # candidates in eval mode without gradients, as a validation loop would, which compiles the model's
    # inference graph once; the training graph is neither broken nor recompiled
    frames = bare["frames"]
    inference = {"graphs": bare["graphs"] + 1, "frames": {k: v + 1 for k, v in frames.items()}}
    assert found == {**bare, **inference}
    assert ranges.sampled_steps == 4 and set(ranges.ranges) == {"net", "net.0", "net.2", "net.4"}
    assert check.result is not None and check.result.passed
    assert not [p.name for p in check.result.parameters if "_orig_mod" in p.name]


# ------------------------------------------------------------------------------------------ the pieces
def _counting_backend() -> tuple[Callable[..., Any], list[int]]:
    compiled: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        compiled.append(1)
        return gm.forward

    return backend, compiled


def _module_compile_compiles() -> bool:
    """Whether ``Module.compile()`` compiles an ``nn.Sequential`` with a hook on a layer on this torch, as
    the test below runs it (torch 2.13 does; torch 2.3 and 2.6 compile nothing of it: there is nothing to
    run eagerly then)."""
    torch._dynamo.reset()
    backend, compiled = _counting_backend()
    net = _net()
    net[0].register_forward_hook(lambda *_: None)
    net.compile(backend=backend)
    net(torch.randn(4, 8))
    torch._dynamo.reset()
    return bool(compiled)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("stance", marks=needs_torch((2, 6), "torch.compiler.set_stance")),
        "fallback",
    ],
)
@pytest.mark.parametrize("wrap", ["torch.compile", "Module.compile"])
def test_uncompiled_scopes_run_compiled_code_eagerly_nest_out_of_order_and_put_it_back(
    how: str, wrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if wrap == "Module.compile" and not _module_compile_compiles():
        pytest.skip(f"Module.compile() compiles no hooked nn.Sequential on torch {torch.__version__}")
    if how == "fallback":  # torch before 2.6: compiled calls swapped for their originals
        monkeypatch.delattr(torch.compiler, "set_stance", raising=False)
    torch._dynamo.reset()
    backend, compiled = _counting_backend()
    net = _net()
    model: nn.Module
    if wrap == "torch.compile":
        model = torch.compile(net, backend=backend)
    else:
        model = net
        model.compile(backend=backend)
    before = dict(vars(model))
    x = torch.randn(4, 8)
    seen: list[str] = []
    with ForwardOrder(model) as watch:  # hooks that dynamo would trace (and recompile for)
        a = Uncompiled(model).open()
        b = Uncompiled(model).open()
        net[0].register_forward_hook(lambda *_: seen.append("hook"))
        model(x)
        a.close()  # closed out of order: b is still open, so still eager
        model(x)
    b.close()
    assert seen == ["hook", "hook"] and watch.order == {"0": 0, "2": 1, "4": 2} and not compiled
    assert vars(model) == before  # nothing of the fallback is left on the model
    model(x)
    assert compiled == [1]  # compiled again once every scope closed
    torch._dynamo.reset()


class _WrongDouble(torch.autograd.Function):
    """y = 2x with a backward that forgets the 2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WrongDouble.apply(x)


@pytest.mark.parametrize("wrap", ["torch.compile", "Module.compile"])
def test_gradient_check_checks_an_uncompiled_copy_of_a_compiled_model(wrap: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    backend, compiled = _counting_backend()
    net = nn.Sequential(nn.Linear(4, 3), _Doubler())
    model: nn.Module
    if wrap == "torch.compile":
        model = torch.compile(net, backend=backend)
    else:
        model = net
        model.compile(backend=backend)
    x = torch.randn(5, 4)
    result = gradient_check(
        model, x, lambda m, b: m(b).pow(2).sum(), modules=["_orig_mod.1"] if wrap == "torch.compile" else None
    )
    assert not compiled and not counters["graph_break"]  # dynamo never saw the check
    assert not result.passed and result.targets == ["1"]
    assert sorted(p.name for p in result.failures) == ["0.bias", "0.weight"]  # the copy's weights, upstream
    torch._dynamo.reset()
