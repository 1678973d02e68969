"""``include`` / ``exclude`` / ``max_layers`` on every monitor with per-layer output: real Trainer runs of a
deep network, the logged values checked against norms computed independently, the event file read back."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MemoryLogger, make_trainer, random_loader
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_gradguard import DeadReLUMonitor, GradientNormLogger, VanishingExplodingDetector
from lightning_gradguard.core.layers import LayerSelection
from lightning_gradguard.functional.layers import choose_layers, log_distance_scores, pinned_positions, spread
from lightning_gradguard.report.read import read_run

DEPTH, WIDTH = 24, 8
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


class DeepMLP(pl.LightningModule):
    """``DEPTH`` residual linear layers with ReLUs; ``blocked`` layers get almost no gradient (their branch
    is scaled by 1e-9: a vanishing layer), ``dead`` ReLU layers never fire (a bias of -100)."""

    def __init__(self, blocked: tuple[int, ...] = (), dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, 4)
        self.blocked = set(blocked)
        with torch.no_grad():
            for i in dead:
                self.blocks[i].bias.fill_(-100.0)
        self.true_layers: dict[int, dict[str, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, (block, act) in enumerate(zip(self.blocks, self.acts, strict=True)):
            y = act(block(h))
            h = h + (1e-9 if i in self.blocked else 0.2) * y
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        layers: dict[str, list[torch.Tensor]] = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                layers.setdefault(name.rsplit(".", 1)[0], []).append(p.grad.reshape(-1))
        self.true_layers[self.trainer.global_step] = {
            k: float(torch.linalg.vector_norm(torch.cat(v))) for k, v in layers.items()
        }

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def all_layers() -> list[str]:
    return ["inp", *(f"blocks.{i}" for i in range(DEPTH)), "out"]


def per_layer(calls: list[tuple[int | None, dict[str, float]]], family: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, metrics in calls:
        for tag, v in metrics.items():
            head, _, name = tag.partition("/")
            if head == family and name != "total" and not name.startswith("across_layers"):
                out.setdefault(int(step or 0), {})[name] = v
    return out


# ---------------------------------------------------------------------------------------------- pure parts
def test_pinned_positions_spread_from_first_to_last() -> None:
    assert pinned_positions(10, 3) == [0, 4, 9]
    assert (
        pinned_positions(5, 1) == [0] and pinned_positions(3, 7) == [0, 1, 2] and pinned_positions(4, 0) == []
    )
    assert pinned_positions(100, 10)[0] == 0 and pinned_positions(100, 10)[-1] == 99


def test_choose_layers_keeps_the_pinned_and_the_highest_scores() -> None:
    scores = [0.1] * 20
    scores[7], scores[12], scores[3] = 5.0, math.inf, 2.0
    chosen = choose_layers(scores, 5)
    assert len(chosen) == 5 and chosen == sorted(chosen)
    assert {0, 19} <= set(chosen)  # two pinned: first and last
    assert {12, 7, 3} <= set(chosen)  # the three outliers, the infinite one first
    assert choose_layers(scores, 1) == [12]
    assert choose_layers(scores, None) == list(range(20)) == choose_layers(scores, 20)


def test_log_distance_scores_and_spread_against_hand_values() -> None:
    s = log_distance_scores([1.0, 10.0, 100.0, 0.0, float("nan")])
    assert s[:3] == pytest.approx([1.0, 0.0, 1.0]) and s[3] == s[4] == math.inf
    assert spread([3.0, float("inf"), 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    assert spread([float("nan")]) == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"include": 3}, TypeError, "`include` must be a regular expression"),
        ({"exclude": ["ok", 1]}, TypeError, "`exclude` must be a regular expression"),
        (
            {"include": "blocks.(1"},
            ValueError,
            "`include` holds 'blocks.\\(1', not a valid regular expression",
        ),
        ({"max_layers": 0}, ValueError, "`max_layers` must be an integer >= 1"),
        ({"max_layers": 2.5}, TypeError, "`max_layers` must be an integer"),
    ],
)
@pytest.mark.parametrize("cls", [GradientNormLogger, VanishingExplodingDetector, DeadReLUMonitor])
def test_bad_layer_arguments_name_the_argument(
    cls: type, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        cls(**kwargs)


def test_a_selection_keeps_include_then_exclude() -> None:
    sel = LayerSelection(include=[r"^blocks\.", "out"], exclude=r"\.1\d$")
    assert sel.watched(all_layers()) == tuple(
        n for n in all_layers() if n == "out" or (n.startswith("blocks.") and not re.search(r"\.1\d$", n))
    )


# ------------------------------------------------------------------------------ GradientNormLogger
def test_patterns_cut_the_layer_tags_and_leave_the_totals_whole(memory_logger: MemoryLogger) -> None:
    model = DeepMLP()
    logger = GradientNormLogger(include=r"^blocks\.", exclude=r"^blocks\.(0|5)$")
    make_trainer([logger], logger=memory_logger, max_steps=3).fit(model, random_loader(n=24))
    expected = {f"blocks.{i}" for i in range(DEPTH) if i not in (0, 5)}
    grads = per_layer(memory_logger.calls, "grad_norm")
    for step, layers in grads.items():
        assert set(layers) == expected
        for name, v in layers.items():
            assert v == pytest.approx(model.true_layers[step][name], rel=1e-5)
        whole = math.sqrt(sum(x * x for x in model.true_layers[step].values()))
        assert memory_logger.series("grad_norm/total")[step] == pytest.approx(whole, rel=1e-5)
    assert set(per_layer(memory_logger.calls, "update_ratio")[0]) == expected
    assert not any("across_layers" in t for _, m in memory_logger.calls for t in m)  # no cap, no aggregates


def test_a_cap_shows_pinned_and_outlier_layers_and_sums_up_the_rest(memory_logger: MemoryLogger) -> None:
    blocked = 9  # its gradient is 1e-9 of the others': the most unusual layer of every step
    model = DeepMLP(blocked=(blocked,))
    make_trainer([GradientNormLogger(max_layers=6)], logger=memory_logger, max_steps=3).fit(
        model, random_loader(n=24)
    )
    names = all_layers()
    pinned = {names[i] for i in pinned_positions(len(names), 3)}
    grads = per_layer(memory_logger.calls, "grad_norm")
    assert set(grads) == {0, 1, 2}
    for step, shown in grads.items():
        assert len(shown) == 6 and pinned <= set(shown) and f"blocks.{blocked}" in shown
        assert set(per_layer(memory_logger.calls, "weight_norm")[step]) == set(shown)
        assert set(per_layer(memory_logger.calls, "update_ratio")[step]) == set(shown)
        true = list(model.true_layers[step].values())
        for key, expected in (("min", min(true)), ("median", statistics.median(true)), ("max", max(true))):
            got = memory_logger.series(f"grad_norm/across_layers/{key}")[step]
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-12)
        # the other outliers are the layers farthest from the median, in decades
        scores = dict(zip(model.true_layers[step], log_distance_scores(true), strict=True))
        others = sorted((n for n in scores if n not in pinned), key=lambda n: -scores[n])
        assert set(shown) - pinned >= {others[0]}
    assert "update_ratio/across_layers/median" in memory_logger.calls[0][1]


def test_histograms_and_the_report_follow_the_shown_layers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    guard = GradientNormLogger(max_layers=4, exclude="^out$", histogram_every_n_steps=1)
    make_trainer([guard], logger=logger, max_steps=2).fit(DeepMLP(), random_loader(n=16))
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()

    def layers_at(kind: str, step: int) -> set[str]:
        tags = events.Tags()["histograms" if kind == "grad/" else "scalars"]
        out = set()
        for t in tags:
            name = t[len(kind) :]
            if not t.startswith(kind) or name == "total" or name.startswith("across_layers"):
                continue
            records = events.Histograms(t) if kind == "grad/" else events.Scalars(t)
            if any(r.step == step for r in records):
                out.add(name.rsplit(".", 1)[0] if kind == "grad/" else name)
        return out

    shown = {step: layers_at("grad_norm/", step) for step in (0, 1)}
    assert all(len(s) == 4 and "out" not in s for s in shown.values())
    # histograms: before any logging step the pinned layers and the first; then the layers shown last
    assert layers_at("grad/", 0) == {"inp", f"blocks.{DEPTH - 1}", "blocks.0", "blocks.1"}
    assert layers_at("grad/", 1) == shown[0]
    run = read_run(logger.log_dir)
    assert "across_layers" not in " ".join(run.family("grad_norm/"))  # the heatmap's rows are layers only


# ---------------------------------------------------------------------------------------------- the detector
def test_the_detector_judges_only_watched_layers_and_caps_its_flow(memory_logger: MemoryLogger) -> None:
    blocked = 3
    seen = VanishingExplodingDetector(patience=1)
    make_trainer([seen], max_steps=3).fit(DeepMLP(blocked=(blocked,)), random_loader(n=24))
    assert any(a.kind == "vanishing_gradient" and f"blocks.{blocked}" in (a.where or "") for a in seen.alerts)

    model = DeepMLP(blocked=(blocked,))
    left_out = VanishingExplodingDetector(patience=1, exclude=rf"^blocks\.{blocked}$", max_layers=5)
    make_trainer([left_out], logger=memory_logger, max_steps=3).fit(model, random_loader(n=24))
    assert not any(f"blocks.{blocked}" in (a.where or "") for a in left_out.alerts)
    flows = per_layer(memory_logger.calls, "grad_flow")
    for step, shown in flows.items():
        assert len(shown) == 5 and f"blocks.{blocked}" not in shown
        true = {n: v for n, v in model.true_layers[step].items() if n != f"blocks.{blocked}"}
        top = max(true.values())
        expected_min = min(math.log10(v / top) for v in true.values())
        assert memory_logger.series("grad_flow/across_layers/min")[step] == pytest.approx(
            expected_min, abs=1e-5
        )


# ------------------------------------------------------------------------------ DeadReLUMonitor
def test_dead_relu_patterns_skip_layers_and_the_cap_shows_the_dead_one(memory_logger: MemoryLogger) -> None:
    dead = 17
    quiet = DeadReLUMonitor(window_samples=2, patience=1, exclude=rf"^acts\.{dead}$")
    make_trainer([quiet], max_steps=4).fit(DeepMLP(dead=(dead,)), random_loader(n=32))
    assert (
        quiet.alerts == []
        and f"acts.{dead}" not in quiet.dead_fractions
        and len(quiet.dead_fractions) == DEPTH - 1
    )

    capped = DeadReLUMonitor(window_samples=2, patience=1, max_layers=4, include=r"^acts\.")
    make_trainer([capped], logger=memory_logger, max_steps=4).fit(DeepMLP(dead=(dead,)), random_loader(n=32))
    assert [a.where for a in capped.alerts if a.kind == "dead_relu"] == [f"acts.{dead}"]
    shown = per_layer(memory_logger.calls, "dead_relu")
    last = shown[max(shown)]
    assert len(last) == 4 and last[f"acts.{dead}"] == 1.0 and {"acts.0", f"acts.{DEPTH - 1}"} <= set(last)
    assert memory_logger.series("dead_relu/across_layers/max")[max(shown)] == 1.0
