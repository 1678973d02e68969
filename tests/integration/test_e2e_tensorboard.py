"""End to end: a real training run with GradientNormLogger, read back through TensorBoard itself.

One tiny MLP is trained once (module-scoped fixture) with ``gradient_clip_val`` far below every gradient
norm, so ``clipping_always_active`` fires. The module records, independently of gradguard, the true
pre-clip gradients, the weights before and after every optimizer step. Then:

* ``test_tensorboard_server_serves_gradguard_data`` starts a real ``tensorboard`` server on 127.0.0.1
  and checks scalars, histograms, the alert text and the custom-scalars layout through its HTTP API;
* ``test_event_file_values_match_independent_norms`` reads the event file with ``EventAccumulator`` and
  checks every per-layer value at every logged step.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from browser_support import TensorBoardServer, tensorboard
from conftest import reference_total_norm
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import event_file_loader
from torch import nn

from lightning_gradguard import GradientNormLogger

N_STEPS = 24  # 192 samples / batch 8, one epoch
LOG_EVERY = 2
HIST_EVERY = 4
CLIP_VAL = 1e-4
CLIP_WINDOW = 10
LR = 0.1
RUN_NAME = "e2e/version_0"
LAYERS = ("net.0", "net.2")  # net.1 is the Tanh: no parameters
PARAMS = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
# Lightning's rule (step + 1) % every == 0, plus the very first step
LOGGED_STEPS = [s for s in range(N_STEPS) if s == 0 or (s + 1) % LOG_EVERY == 0]
HIST_STEPS = [s for s in LOGGED_STEPS if s == 0 or (s + 1) % HIST_EVERY == 0]
# the clip statistics need min(100, clip_window) steps; the first flush with 10 seen steps is step 9
ALERT_STEP = next(s for s in LOGGED_STEPS if s + 1 >= CLIP_WINDOW)
SERVER_TIMEOUT_S = 45.0
REL = 1e-5


def _layer(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors])))


class _Probe(pl.LightningModule):
    """A small classifier that records the true numbers of every optimizer step, without gradguard."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.total_norm: dict[int, float] = {}  # torch.nn.utils.get_total_norm of the pre-clip grads
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # pre-clip gradients
        self.before: dict[int, dict[str, torch.Tensor]] = {}  # weights before the update
        self.after: dict[int, dict[str, torch.Tensor]] = {}  # weights after the update
        self._current: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # runs after the callbacks' hook and before Lightning clips the gradients
        step = self.trainer.global_step
        assert step == self.trainer.fit_loop.epoch_loop._batches_that_stepped  # automatic optimization
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.total_norm[step] = float(reference_total_norm(grads))
        named = dict(self.named_parameters())
        self.grads[step] = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        self.before[step] = {n: p.detach().clone() for n, p in named.items()}
        self._current = step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self._current is not None
        self.after[self._current] = {n: p.detach().clone() for n, p in self.named_parameters()}
        self._current = None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


@dataclass
class _Run:
    logdir: Path
    event_dir: Path
    model: _Probe
    callback: GradientNormLogger


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> _Run:
    logdir = tmp_path_factory.mktemp("tb_e2e")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_STEPS * 8, 8, generator=g)
    y = torch.randint(0, 4, (N_STEPS * 8,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with torch.random.fork_rng():  # a fixed init without touching the global seed of other tests
        torch.manual_seed(1234)
        model = _Probe()
    cb = GradientNormLogger(
        log_every_n_steps=LOG_EVERY, histogram_every_n_steps=HIST_EVERY, clip_window=CLIP_WINDOW
    )
    logger = TensorBoardLogger(save_dir=str(logdir), name="e2e", version=0, default_hp_metric=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[cb],
        logger=logger,
        log_every_n_steps=LOG_EVERY,
        gradient_clip_val=CLIP_VAL,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(logdir),
    )
    trainer.fit(model, loader)
    assert trainer.global_step == N_STEPS
    assert sorted(model.total_norm) == list(range(N_STEPS))
    # the threshold really is below every norm, so clipping is always active
    assert min(model.total_norm.values()) > 100 * CLIP_VAL
    assert [a.kind for a in cb.alerts] == ["clipping_always_active"]
    return _Run(logdir=logdir, event_dir=Path(logger.log_dir), model=model, callback=cb)


# ---------------------------------------------------------------------------------------------- truths
def _true_layer_norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    groups: dict[str, list[torch.Tensor]] = {}
    for name, t in tensors.items():
        groups.setdefault(_layer(name), []).append(t)
    return {layer: _norm(ts) for layer, ts in groups.items()}


def _true_update_ratios(model: _Probe, step: int) -> dict[str, float]:
    before, after = model.before[step], model.after[step]
    out: dict[str, float] = {}
    for layer in LAYERS:
        names = [n for n in PARAMS if _layer(n) == layer]
        out[layer] = _norm([before[n] - after[n] for n in names]) / _norm([before[n] for n in names])
    out["total"] = _norm([before[n] - after[n] for n in PARAMS]) / _norm([before[n] for n in PARAMS])
    return out


def _true_clip_quantile(model: _Probe, step: int, q: float) -> float:
    window = [model.total_norm[s] for s in range(max(0, step - CLIP_WINDOW + 1), step + 1)]
    return float(torch.quantile(torch.tensor(window, dtype=torch.float32).double(), q))


# ---------------------------------------------------------------------------------------------- server
def _last_scalar_written(event_dir: Path) -> tuple[str, int]:
    """``(tag, step)`` of the last scalar point in the run's event file, read straight from disk."""
    (path,) = event_dir.glob("events.out.tfevents.*")
    last: tuple[str, int] | None = None
    for event in event_file_loader.LegacyEventFileLoader(str(path)).Load():
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":
                last = (value.tag, int(event.step))
    assert last is not None, "the event file holds no scalar"
    return last


def _wait_until_loaded(tb: TensorBoardServer, event_dir: Path, deadline: float) -> None:
    """Poll until the server serves the last scalar point of the file (TensorBoard reads it in order)."""
    last_tag, last_step = _last_scalar_written(event_dir)
    seen: Any = None
    while True:
        if tb.proc is not None and tb.proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {tb.proc.returncode}:\n{tb.log()}")
        try:
            seen = tb.get("/data/plugin/scalars/tags")
            if last_tag in seen.get(RUN_NAME, {}):
                points = tb.get("/data/plugin/scalars/scalars", run=RUN_NAME, tag=last_tag)
                if any(p[1] == last_step for p in points):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            seen = repr(e)
        if time.monotonic() > deadline:
            pytest.fail(f"tensorboard did not load the run in time; last answer: {seen!r}\n{tb.log()}")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- tests
def test_tensorboard_server_serves_gradguard_data(run: _Run) -> None:
    model = run.model
    with tensorboard(run.logdir, wait=False) as tb:
        deadline = time.monotonic() + SERVER_TIMEOUT_S
        _wait_until_loaded(tb, run.event_dir, deadline)

        assert RUN_NAME in tb.get("/data/runs")

        # (a) scalars: the tags, and values equal to the module's own pre-clip total norm
        scalar_tags = set(tb.get("/data/plugin/scalars/tags")[RUN_NAME])
        expected = {
            "grad_norm/total",
            "grad_norm/net.0",
            "grad_norm/net.2",
            "weight_norm/total",
            "weight_norm/net.0",
            "update_ratio/total",
            "update_ratio/net.2",
            "grad_clip/fraction_clipped",
            "grad_clip/pre_clip_norm_p50",
            "alerts/clipping_always_active",
        }
        assert expected <= scalar_tags, sorted(expected - scalar_tags)
        assert not any(t.startswith("grad_norm/net.1") for t in scalar_tags)  # the Tanh owns nothing

        points = tb.get("/data/plugin/scalars/scalars", run=RUN_NAME, tag="grad_norm/total")
        assert [p[1] for p in points] == LOGGED_STEPS
        for _, step, value in points:
            assert value == pytest.approx(model.total_norm[step], rel=REL), f"step {step}"
            # pre-clip: orders of magnitude above the clip threshold
            assert value > 100 * CLIP_VAL

        fraction = tb.get("/data/plugin/scalars/scalars", run=RUN_NAME, tag="grad_clip/fraction_clipped")
        assert [(p[1], p[2]) for p in fraction] == [(s, 1.0) for s in LOGGED_STEPS]
        count = tb.get("/data/plugin/scalars/scalars", run=RUN_NAME, tag="alerts/clipping_always_active")
        assert [(p[1], p[2]) for p in count] == [(ALERT_STEP, 1.0)]

        # (b) histograms: bucket counts add up to the parameter's size, edges match the true extremes
        hist_tags = set(tb.get("/data/plugin/histograms/tags")[RUN_NAME])
        for name in PARAMS:
            for kind in ("grad", "grad_log10", "weight"):
                assert f"{kind}/{name}" in hist_tags, sorted(hist_tags)
        for name in PARAMS:
            for kind in ("grad", "grad_log10", "weight"):
                events = tb.get("/data/plugin/histograms/histograms", run=RUN_NAME, tag=f"{kind}/{name}")
                assert [e[1] for e in events] == HIST_STEPS, f"{kind}/{name}"
                for _, step, buckets in events:
                    source = model.before[step] if kind == "weight" else model.grads[step]
                    t = source[name].double()
                    if kind == "grad_log10":
                        t = t.abs()[t != 0].log10()
                    where = f"{kind}/{name} at step {step}"
                    assert sum(b[2] for b in buckets) == t.numel(), where
                    assert all(b[0] <= b[1] for b in buckets), where
                    # the first bucket starts at the minimum, the last ends at the maximum (float32)
                    assert buckets[0][0] == pytest.approx(float(t.min()), rel=1e-5, abs=1e-6), where
                    assert buckets[-1][1] == pytest.approx(float(t.max()), rel=1e-5, abs=1e-6), where
        # grad histograms show the pre-clip gradients, not the clipped ones
        step = HIST_STEPS[-1]
        events = tb.get("/data/plugin/histograms/histograms", run=RUN_NAME, tag="grad/net.2.bias")
        assert max(abs(events[-1][2][0][0]), abs(events[-1][2][-1][1])) > 10 * CLIP_VAL
        assert float(model.grads[step]["net.2.bias"].abs().max()) > 10 * CLIP_VAL

        # (c) the alert text
        # exactly the documented tag (SummaryWriter.add_text alone would append "/text_summary")
        text_tags = tb.get("/data/plugin/text/tags").get(RUN_NAME, [])
        alert_tags = [t for t in text_tags if t.startswith("gradguard/alerts")]
        assert alert_tags == ["gradguard/alerts"], text_tags
        texts = tb.get("/data/plugin/text/text", run=RUN_NAME, tag=alert_tags[0])
        assert [t["step"] for t in texts] == [ALERT_STEP]
        html = texts[0]["text"]
        assert "clipping_always_active" in html
        assert f"gradient_clip_val={CLIP_VAL:g} clipped 100% of the last {CLIP_WINDOW} steps" in html

        # (d) the custom-scalars layout, resolved by TensorBoard's own regex matching
        layout = tb.get("/data/plugin/custom_scalars/layout")
        categories = {c["title"]: c for c in layout["category"]}
        assert "GradGuard" in categories, sorted(categories)
        charts = {c["title"]: c["multiline"]["tag"] for c in categories["GradGuard"]["chart"]}
        matched: dict[str, dict[str, Any]] = {}
        for title, regexes in charts.items():
            matched[title] = {}
            for regex in regexes:
                body = tb.get("/data/plugin/custom_scalars/scalars", run=RUN_NAME, tag=regex)
                assert body["regex_valid"], regex
                matched[title].update(body["tag_to_events"])
            assert matched[title], f"chart {title!r} ({regexes}) matches no logged tag"
        total_charts = [title for title, tags in matched.items() if "grad_norm/total" in tags]
        assert "Gradient norm: total" in total_charts, charts
        assert set(matched["Gradient norm: total"]) == {"grad_norm/total"}
        served = matched["Gradient norm: total"]["grad_norm/total"]
        assert [(p[1], p[2]) for p in served] == [(p[1], p[2]) for p in points]
        assert set(matched["Gradient norm per layer"]) == {"grad_norm/net.0", "grad_norm/net.2"}  # no total
        assert "weight_norm/total" not in matched["Weight norm per layer"]
        assert any("alerts/clipping_always_active" in tags for tags in matched.values())


def test_event_file_values_match_independent_norms(run: _Run) -> None:
    model = run.model
    files = sorted(run.event_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = ea.EventAccumulator(str(files[0]), size_guidance=dict.fromkeys(ea.DEFAULT_SIZE_GUIDANCE, 0))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def series(tag: str) -> dict[int, float]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step was logged twice: {steps}"
        return {e.step: e.value for e in events}

    per_layer = {t.split("/", 1)[1] for t in tags if t.split("/", 1)[0] == "grad_norm"} - {"total"}
    assert per_layer == set(LAYERS)
    for prefix in ("weight_norm", "update_ratio"):
        assert {t.split("/", 1)[1] for t in tags if t.startswith(prefix + "/")} == {*LAYERS, "total"}

    checked = 0
    for layer in LAYERS:
        grad, weight, ratio = (series(f"{p}/{layer}") for p in ("grad_norm", "weight_norm", "update_ratio"))
        assert sorted(grad) == sorted(weight) == sorted(ratio) == LOGGED_STEPS, layer
        for step in LOGGED_STEPS:
            where = f"{layer} at step {step}"
            assert grad[step] == pytest.approx(_true_layer_norms(model.grads[step])[layer], rel=REL), where
            assert weight[step] == pytest.approx(_true_layer_norms(model.before[step])[layer], rel=REL), where
            assert ratio[step] == pytest.approx(_true_update_ratios(model, step)[layer], rel=REL), where
            checked += 3
    assert checked == 3 * len(LAYERS) * len(LOGGED_STEPS)

    grad_total, weight_total = series("grad_norm/total"), series("weight_norm/total")
    ratio_total = series("update_ratio/total")
    for step in LOGGED_STEPS:
        assert grad_total[step] == pytest.approx(model.total_norm[step], rel=REL), step
        weights = list(model.before[step].values())
        assert weight_total[step] == pytest.approx(_norm(weights), rel=REL), step
        assert ratio_total[step] == pytest.approx(_true_update_ratios(model, step)["total"], rel=REL), step
        # SGD on clipped gradients: the update is lr * clip value (up to Lightning's 1e-6 epsilon)
        update = _norm([model.before[step][n] - model.after[step][n] for n in PARAMS])
        assert update == pytest.approx(LR * CLIP_VAL, rel=1e-3), step
    assert series("grad_nonfinite/total") == dict.fromkeys(LOGGED_STEPS, 0.0)

    # the clip statistics cover the last clip_window pre-clip norms
    assert series("grad_clip/fraction_clipped") == dict.fromkeys(LOGGED_STEPS, 1.0)
    for q in (50, 90, 99):
        logged = series(f"grad_clip/pre_clip_norm_p{q}")
        assert sorted(logged) == LOGGED_STEPS
        for step in LOGGED_STEPS:
            truth = _true_clip_quantile(model, step, q / 100)
            assert logged[step] == pytest.approx(truth, rel=REL), f"p{q} at step {step}"
    assert series("alerts/clipping_always_active") == {ALERT_STEP: 1.0}
    assert not math.isnan(series("grad_clip/suggested_clip_val")[LOGGED_STEPS[-1]])
