"""The gradient noise scale (GradientNormLogger(log_noise_scale=True)) against brute force.

The model is least squares on fixed synthetic data with ``lr=0``: the weights stay put, so the true
gradient G and the per-example gradient covariance Sigma are fixed and computed here exactly from the
per-example gradients ``2 r_i [x_i, 1]`` of the whole data set. Every micro-batch's samples are recorded,
so each step's estimate is also replayed here from those gradients, with our own algebra (a 2x2 solve of
E|G_x|^2 = |G|^2 + tr(Sigma) / x at the two sizes), not the package's.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, MemoryLogger, make_trainer, run_ddp_script
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_gradguard import GradientNormLogger
from lightning_gradguard.functional.noise_scale import b_simple, effective_batch_sizes, noise_scale_terms
from lightning_gradguard.monitors.gradients.noise_scale import NoiseScaleEMA

_spec = importlib.util.spec_from_file_location("ddp_noise_scale", SCRIPTS / "ddp_noise_scale.py")
assert _spec is not None and _spec.loader is not None
setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup)

TAGS = ("grad_sq", "trace_sigma", "b_simple", "batch_size")


# ------------------------------------------------------------------------------------------ brute force
def per_example_grads(model: Any, data: Any) -> torch.Tensor:
    """(N, features + 1): the gradient of each sample's squared error, in float64."""
    x, y = data.tensors[0].double(), data.tensors[1].double()
    w, c = model.lin.weight.detach().double().reshape(-1), float(model.lin.bias.detach())
    r = x @ w + c - y
    return 2 * r[:, None] * torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)


def population(grads: torch.Tensor) -> tuple[float, float]:
    """E of the two estimates when every step draws its samples without replacement (a shuffled epoch).

    For a mean of x samples drawn without replacement from N, Var = c (1/x - 1/N) with c the covariance
    trace normalised by N - 1: so the tr(Sigma) estimate has mean c and the |G|^2 estimate |G|^2 - c / N.
    """
    n = len(grads)
    mean = grads.mean(0)
    c = float(((grads - mean) ** 2).sum(1).sum() / (n - 1))
    return float(mean @ mean) - c / n, c


def replay(
    grads: torch.Tensor,
    batches: list[tuple[int, torch.Tensor]],
    beta: float,
    skip: frozenset[int] = frozenset(),
) -> tuple[dict[int, tuple[float, float]], list[tuple[float, float]]]:
    """Per step: the bias-corrected EMA of the two estimates (and the raw samples), from the micro-batches."""
    steps: dict[int, list[torch.Tensor]] = {}
    for step, index in batches:
        steps.setdefault(step, []).append(index)
    num = torch.zeros(2, dtype=torch.float64)
    weight, series, samples = 0.0, {}, []
    for step in sorted(steps):
        if step in skip:
            series[step] = (float(num[0] / weight), float(num[1] / weight))
            continue
        means = [grads[index].mean(0) for index in steps[step]]
        small = sum(float(g @ g) for g in means) / len(means)
        big_grad = torch.stack(means).mean(0)
        inv = [1.0 / len(index) for index in steps[step]]
        u, big_u = sum(inv) / len(inv), sum(inv) / len(inv) ** 2
        system = torch.tensor([[1.0, u], [1.0, big_u]], dtype=torch.float64)
        sample = torch.linalg.solve(
            system, torch.tensor([small, float(big_grad @ big_grad)], dtype=torch.float64)
        )
        samples.append((float(sample[0]), float(sample[1])))
        num, weight = beta * num + (1 - beta) * sample, beta * weight + (1 - beta)
        series[step] = (float(num[0] / weight), float(num[1] / weight))
    return series, samples


def logged(logger: MemoryLogger) -> dict[str, dict[int, float]]:
    return {tag: logger.series(f"noise_scale/{tag}") for tag in TAGS}


def gnl(**kwargs: Any) -> GradientNormLogger:
    defaults: dict[str, Any] = dict(log_every_n_steps=1, histogram_every_n_steps=0, log_noise_scale=True)
    return GradientNormLogger(**{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------ pure math
def test_estimator_recovers_both_terms_from_exact_expectations() -> None:
    """Closed form: feed E|G_b|^2 and E|G_B|^2 of a known population (sampling with replacement, micro-
    batches of unequal sizes) and the estimates are exactly |G|^2 and tr(Sigma)."""
    g = torch.Generator().manual_seed(3)
    pop = torch.randn(50, 4, generator=g, dtype=torch.float64) + 0.7
    mean = pop.mean(0)
    grad_sq, trace = float(mean @ mean), float(((pop - mean) ** 2).sum(1).mean())
    sizes, ranks = [8, 8, 5], 2
    inv = [1 / b for b in sizes]
    e_small = grad_sq + trace * sum(inv) / len(inv)  # E mean_i |g_i|^2
    e_big = (
        grad_sq + trace * sum(inv) * ranks / (len(sizes) * ranks) ** 2
    )  # E |mean over every micro-batch|^2
    b, big = effective_batch_sizes(sizes, ranks)
    assert effective_batch_sizes([8, 8, 8, 8], 2) == (8.0, 64.0)
    est_g, est_t = noise_scale_terms(e_small, e_big, b, big)
    assert est_g == pytest.approx(grad_sq, rel=1e-12) and est_t == pytest.approx(trace, rel=1e-12)
    assert b_simple(est_g, est_t) == pytest.approx(trace / grad_sq)
    assert b_simple(-1.0, 5.0) is None and b_simple(1.0, math.inf) is None
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        noise_scale_terms(1.0, 1.0, 8, 8)


def test_ema_is_bias_corrected_masked_and_linear() -> None:
    ema = NoiseScaleEMA(beta=0.9)
    for _ in range(3):  # a constant sample reads back as itself at once: no pull towards 0
        ema.update(torch.tensor(2.0), torch.tensor(30.0))
    assert ema.state is not None
    est = NoiseScaleEMA.read(ema.state)
    assert (est.grad_sq, est.trace_sigma, est.b_simple) == pytest.approx((2.0, 30.0, 15.0))
    assert est.weight == pytest.approx(1 - 0.9**3)
    before = ema.state.clone()
    ema.update(torch.tensor(float("inf")), torch.tensor(1.0))  # a skipped step leaves the average alone
    assert torch.equal(ema.state, before)
    # the mean of two ranks' states is the state of the mean samples (what a DDP read relies on)
    a, b, mean = NoiseScaleEMA(0.8), NoiseScaleEMA(0.8), NoiseScaleEMA(0.8)
    for x, y in [(1.0, 3.0), (4.0, -2.0), (0.5, 7.0)]:
        a.update(torch.tensor(x), torch.tensor(10 * x))
        b.update(torch.tensor(y), torch.tensor(10 * y))
        mean.update(torch.tensor((x + y) / 2), torch.tensor(5 * (x + y)))
    assert a.state is not None and b.state is not None and mean.state is not None
    torch.testing.assert_close((a.state + b.state) / 2, mean.state)


# ------------------------------------------------------------------------------------------ real runs
def test_accumulation_matches_brute_force_within_sampling_error(memory_logger: MemoryLogger) -> None:
    """accumulate_grad_batches=4 of 8 samples (b = 8, B = 32) over shuffled epochs of 620 samples: the last
    window of each epoch has two micro-batches (8 and 4 samples). Each logged step equals the replay; the
    final averages lie within 4 standard errors of the population values."""
    beta, data = 0.98, setup.dataset(620)
    model = setup.LeastSquares()
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    make_trainer([gnl(noise_scale_beta=beta)], memory_logger, accumulate_grad_batches=4, max_epochs=8).fit(
        model, loader
    )
    grads = per_example_grads(model, data)
    series, samples = replay(grads, model.batches, beta)
    got = logged(memory_logger)
    assert sorted(got["grad_sq"]) == sorted(series) and len(series) == 8 * 20
    for step, (g, t) in series.items():
        assert got["grad_sq"][step] == pytest.approx(g, rel=1e-4, abs=1e-4 * abs(t)), step
        assert got["trace_sigma"][step] == pytest.approx(t, rel=1e-4), step
        if g > 0 and t > 0:
            assert got["b_simple"][step] == pytest.approx(got["trace_sigma"][step] / got["grad_sq"][step])
        else:  # undefined while an average is not positive: not logged, rather than a negative batch size
            assert step not in got["b_simple"], step
    assert set(got["batch_size"].values()) == {32.0, 12.0}  # the short window: 8 + 4 samples
    # sampling error of the final EMA: the spread of one step's estimate times sqrt(sum of squared weights)
    n = len(samples)
    weights = torch.tensor([(1 - beta) * beta ** (n - 1 - i) for i in range(n)], dtype=torch.float64)
    weights /= weights.sum()
    spread = torch.tensor(samples, dtype=torch.float64).std(0)
    se = spread * float(weights.square().sum().sqrt())
    truth = population(grads)
    last = max(series)
    assert abs(got["grad_sq"][last] - truth[0]) < 4 * float(se[0])
    assert abs(got["trace_sigma"][last] - truth[1]) < 4 * float(se[1])
    assert 8 < truth[1] / truth[0] < 32  # B_simple lies between the two batch sizes here: a fair test


def test_ddp_equals_one_process_accumulating_the_same_batches(
    tmp_path: Path, memory_logger: MemoryLogger
) -> None:
    """2 ranks x 2 micro-batches of 8 (per-rank gradients are seen before DDP's all-reduce) against one
    process accumulating the same 4 micro-batches per step, and against the replay."""
    proc = run_ddp_script("ddp_noise_scale.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    torch.testing.assert_close(torch.tensor(ranks[0]["ema"]), torch.tensor(ranks[1]["ema"]))  # one average
    per_step: dict[int, list[list[int]]] = {}
    for rank in ranks:
        for step, index in rank["batches"]:
            per_step.setdefault(step, []).append(index)
    order = [index for step in sorted(per_step) for index in per_step[step]]
    data = setup.dataset()
    loader = torch.utils.data.DataLoader(data, batch_sampler=order)
    model = setup.LeastSquares()
    make_trainer([gnl(noise_scale_beta=setup.BETA)], memory_logger, accumulate_grad_batches=4).fit(
        model, loader
    )
    single = logged(memory_logger)
    series, _ = replay(per_example_grads(model, data), model.batches, setup.BETA)
    ddp = {int(step): values for step, values in ranks[0]["logged"].items()}
    assert sorted(ddp) == sorted(series) == sorted(single["grad_sq"]) and len(series) == 20
    for step, (g, t) in series.items():
        for tag, truth in (("grad_sq", g), ("trace_sigma", t)):
            assert ddp[step][f"noise_scale/{tag}"] == pytest.approx(single[tag][step], rel=1e-5), (step, tag)
            assert single[tag][step] == pytest.approx(truth, rel=1e-4, abs=1e-4 * t), (step, tag)
        assert ddp[step]["noise_scale/batch_size"] == single["batch_size"][step] == 32.0


def test_16_mixed_grad_scaler_is_divided_out_and_skipped_steps_left_out(memory_logger: MemoryLogger) -> None:
    """The hooks see gradients scaled by the GradScaler: divided by the scale. Its first steps overflow
    (scale 2^40) and are skipped by the optimizer: they must not enter the average either."""

    class Watch(setup.LeastSquares):  # which steps the scaler skipped: its scale dropped during the step
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.scale_before = float(self.trainer.precision_plugin.scaler.get_scale())

        def on_train_batch_end(self, *args: Any) -> None:
            if float(self.trainer.precision_plugin.scaler.get_scale()) < getattr(self, "scale_before", 0.0):
                self.skipped.add(self.trainer.global_step - 1)
            self.scale_before = 0.0

    beta, data = 0.9, setup.dataset(320)
    model = Watch()
    model.skipped = set()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-8)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    make_trainer(
        [gnl(noise_scale_beta=beta)], memory_logger, accumulate_grad_batches=4, plugins=[plugin]
    ).fit(model, loader)
    assert 1 <= len(model.skipped) <= 4 and 0 in model.skipped
    series, _ = replay(per_example_grads(model, data), model.batches, beta, skip=frozenset(model.skipped))
    got = logged(memory_logger)
    assert min(got["grad_sq"]) == max(model.skipped) + 1  # nothing to log before the first sample
    # float16 keeps 11 significant bits (unit roundoff u = 2^-11) in the matmuls, so a squared micro-batch
    # norm (~ |G|^2 + tr(Sigma) / 8 =: scale) is off by ~2u relative: the |G|^2 estimate by up to
    # 2u (B + b) / (B - b) x scale, the tr(Sigma) estimate by up to 2u / (1/b - 1/B) x scale
    u, b, big = 2.0**-11, 8, 32
    for step, (g, t) in series.items():
        if step in got["grad_sq"]:
            scale = abs(g) + t / b
            assert got["grad_sq"][step] == pytest.approx(g, abs=2 * u * (big + b) / (big - b) * scale), step
            assert got["trace_sigma"][step] == pytest.approx(t, abs=2 * u / (1 / b - 1 / big) * scale), step


def test_resume_keeps_the_averages(tmp_path: Path) -> None:
    """One epoch, a checkpoint, a second epoch from it: the same averages as two epochs in one go."""
    loader = torch.utils.data.DataLoader(setup.dataset(320), batch_size=8)
    whole_cb, whole_log = gnl(), MemoryLogger()
    make_trainer([whole_cb], whole_log, accumulate_grad_batches=4, max_epochs=2).fit(
        setup.LeastSquares(lr=0.01), loader
    )
    first = make_trainer([gnl()], MemoryLogger(), accumulate_grad_batches=4, max_epochs=1)
    first.fit(setup.LeastSquares(lr=0.01), loader)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed_cb, resumed_log = gnl(), MemoryLogger()
    make_trainer([resumed_cb], resumed_log, accumulate_grad_batches=4, max_epochs=2).fit(
        setup.LeastSquares(lr=0.01), loader, ckpt_path=tmp_path / "epoch1.ckpt"
    )
    whole, resumed = logged(whole_log), logged(resumed_log)
    assert sorted(resumed["grad_sq"]) == list(range(10, 20))
    for tag in ("grad_sq", "trace_sigma", "b_simple"):
        for step in resumed[tag]:
            assert resumed[tag][step] == pytest.approx(whole[tag][step], rel=1e-5), (tag, step)
    # a fresh fit with the same callback starts a new average
    assert resumed_cb._noise.ema.state is not None
    make_trainer([resumed_cb], MemoryLogger(), accumulate_grad_batches=4, max_steps=1).fit(
        setup.LeastSquares(lr=0.01), loader
    )
    assert float(resumed_cb._noise.ema.state[2]) == pytest.approx(1 - 0.99)  # one sample


def test_one_batch_size_logs_nothing_and_says_so_once(
    memory_logger: MemoryLogger, caplog: pytest.LogCaptureFixture
) -> None:
    cb = gnl()
    loader = torch.utils.data.DataLoader(setup.dataset(64), batch_size=8)
    model = setup.LeastSquares()
    with caplog.at_level(logging.INFO, logger="lightning_gradguard"):
        make_trainer([cb], memory_logger).fit(model, loader)
    assert memory_logger.series("grad_norm/total") and not any(logged(memory_logger).values())
    said = [r for r in caplog.records if "noise scale is not logged" in r.getMessage()]
    assert len(said) == 1 and "one batch size" in said[0].getMessage()
    assert not any(p._backward_hooks for p in model.parameters())  # no hook was attached
    charts = cb.layout_charts()
    assert charts["Critical batch size (B_simple) vs the batch in use"] == [
        "noise_scale/b_simple",
        "noise_scale/batch_size",
    ]
    assert not any("B_simple" in title for title in GradientNormLogger().layout_charts())


def test_hooks_are_removed_after_the_fit_and_off_costs_nothing(memory_logger: MemoryLogger) -> None:
    model = setup.LeastSquares()
    loader = torch.utils.data.DataLoader(setup.dataset(64), batch_size=8)
    make_trainer([gnl()], memory_logger, accumulate_grad_batches=2).fit(model, loader)
    assert logged(memory_logger)["grad_sq"]
    assert not any(p._backward_hooks for p in model.parameters())
    off = MemoryLogger()
    make_trainer([GradientNormLogger(log_every_n_steps=1)], off, accumulate_grad_batches=2).fit(
        setup.LeastSquares(), loader
    )
    assert not any(tag.startswith("noise_scale/") for _, m in off.calls for tag in m)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"log_noise_scale": "yes"}, TypeError, "log_noise_scale"),
        ({"noise_scale_beta": 1.0}, ValueError, "noise_scale_beta"),
        ({"noise_scale_beta": -0.1}, ValueError, "noise_scale_beta"),
        ({"noise_scale_beta": "0.9"}, TypeError, "noise_scale_beta"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=f"`{name}"):
        GradientNormLogger(**kwargs)
