"""The TensorBoard dashboard in a real browser: headless Chromium (Selenium) against a real ``tensorboard``.

One short real run is trained once per module (``build_faulty_run``: GradientNormLogger logging every step
with histograms every 5 steps and gradient clipping, VanishingExplodingDetector, and NaNSentinel skipping a
NaN batch at step 7, which reports ``nonfinite_loss`` with a hint). A real ``tensorboard`` subprocess
serves it on 127.0.0.1 and one headless Chromium opens its tabs. The tests read what the page renders
(through the shadow roots of TensorBoard's Polymer elements), not the HTTP API:

* Custom Scalars: the "GradGuard" section holds a chart for every title the callbacks declare
  (``layout_charts()`` plus the alerts chart), each with SVG lines that carry data;
* Text: the alert, rendered from Markdown, with its message and hint;
* Histograms: a ``grad/<param>`` card for every parameter, one drawn outline per histogram step.

Each page is saved as a PNG under the test's ``tmp_path``, and the browser console must stay free of
errors. Without Chromium, chromedriver or selenium the tests skip and say what is missing; CI installs
Chromium from Debian (``.ci/run``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from browser_support import (
    FAULTY_RUN,
    TensorBoardServer,
    broken_images,
    browser_missing,
    build_faulty_run,
    chrome,
    console_errors,
    custom_scalar_charts,
    histogram_cards,
    open_page,
    screenshot,
    scroll_into_view,
    tensorboard,
    text_entries,
    wait_until,
)

from lightning_gradguard import GradGuardCallback

MISSING = browser_missing()
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(MISSING is not None, reason=f"browser tests: {MISSING}"),
]

STEPS = 30
HIST_EVERY = 5
# GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=5): step 0, then (x + 1) % 5 == 0
HIST_STEPS = [s for s in range(STEPS) if s == 0 or (s + 1) % HIST_EVERY == 0]
PAGE_TIMEOUT_S = 30.0


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class _Run:
    logdir: Path
    alerts: list[Any]
    chart_titles: list[str]
    params: list[str]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> _Run:
    logdir = tmp_path_factory.mktemp("tb_browser")
    trainer, callbacks = build_faulty_run(logdir, steps=STEPS)
    assert trainer.global_step == STEPS
    alerts = [a for cb in callbacks for a in cb.alerts]
    assert [a.kind for a in alerts] == ["nonfinite_loss"], [a.format() for a in alerts]
    assert alerts[0].hint
    # every chart the code declares for these callbacks (the layout written at fit start)
    titles = list(GradGuardCallback._layout(trainer))
    params = [name for name, _ in trainer.lightning_module.named_parameters()]
    return _Run(logdir=logdir, alerts=alerts, chart_titles=titles, params=params)


@pytest.fixture(scope="module")
def server(run: _Run) -> Iterator[TensorBoardServer]:
    with tensorboard(run.logdir) as tb:
        yield tb


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chrome() as d:
        yield d


def test_custom_scalars_draws_every_gradguard_chart(
    run: _Run, server: TensorBoardServer, driver: Any, tmp_path: Path
) -> None:
    open_page(driver, server.url + "/#custom_scalars")

    def drawn() -> dict[str, Any] | None:
        page = custom_scalar_charts(driver)
        if not page or not set(run.chart_titles) <= set(page["charts"]):
            return None
        if not all(page["charts"][t]["lines"] for t in run.chart_titles):
            return None
        return page

    def state() -> Any:
        page = custom_scalar_charts(driver) or {"charts": {}}
        return {t: {k: v for k, v in c.items() if k != "text"} for t, c in page["charts"].items()}

    try:
        page = wait_until(drawn, PAGE_TIMEOUT_S, "every GradGuard chart drawn", show=state)
    finally:
        screenshot(driver, tmp_path / "custom_scalars.png")
    assert page["sections"] == ["GradGuard"]
    assert sorted(page["charts"]) == sorted(run.chart_titles)  # nothing more either
    for title in run.chart_titles:
        chart = page["charts"][title]
        # lines with data: segments between logged steps, or the markers of single points (an alert)
        assert chart["lines"] > 0 and chart["segments"] + chart["symbols"] > 0, (title, chart)
    # the total norm is logged on all 30 steps: its raw line joins them (the NaN step breaks it once)
    total = page["charts"]["Gradient norm: total"]
    assert total["segments"] >= STEPS - 3, total
    assert f"grad_norm/total ({FAULTY_RUN})" in total["text"]
    assert (
        f"alerts/nonfinite_loss ({FAULTY_RUN})"
        in page["charts"]["Alerts (cumulative count per kind)"]["text"]
    )
    assert console_errors(driver) == []


def test_text_tab_shows_the_alert_and_its_hint(
    run: _Run, server: TensorBoardServer, driver: Any, tmp_path: Path
) -> None:
    open_page(driver, server.url + "/#text")
    try:
        entries = wait_until(lambda: text_entries(driver), PAGE_TIMEOUT_S, "the gradguard/alerts text")
    finally:
        screenshot(driver, tmp_path / "text.png")
    assert len(entries) == len(run.alerts)
    for entry, alert in zip(entries, run.alerts, strict=True):
        text = _squash(entry["text"])
        for part in (alert.severity.upper(), alert.kind, alert.where, f"step {alert.step}", alert.source):
            assert part in text, (part, text)
        assert _squash(alert.message) in text
        assert f"Hint: {_squash(alert.hint)}" in text
        assert "Hint:" in entry["em"] and "*Hint:*" not in text  # rendered Markdown, not its source
    assert console_errors(driver) == []


def test_histograms_tab_lists_grad_tags(
    run: _Run, server: TensorBoardServer, driver: Any, tmp_path: Path
) -> None:
    expected = {f"grad/{p}" for p in run.params}

    def listed() -> dict[str, int] | None:
        cards = histogram_cards(driver) or {}
        grads = {tag: n for tag, n in cards.items() if tag.startswith("grad/")}
        return grads if set(grads) == expected and all(grads.values()) else None

    open_page(driver, server.url + "/#histograms")
    try:
        grads = wait_until(listed, PAGE_TIMEOUT_S, f"histogram cards for {sorted(expected)}")
        # the screenshot shows the "grad" section (TensorBoard lists "grad_log10" first)
        assert scroll_into_view(driver, "tf-histogram-loader", "grad/", "tf-category-paginated-view")
    finally:
        screenshot(driver, tmp_path / "histograms.png")
    # one outline per histogram step (0, 4, 9, ...) in every card
    assert grads == dict.fromkeys(sorted(expected), len(HIST_STEPS))
    assert console_errors(driver) == []


def test_the_html_report_opens_with_every_image_and_no_console_error(
    run: _Run, driver: Any, tmp_path: Path
) -> None:
    """``gradguard report`` on the same run, opened from disk: every embedded image decodes
    (``naturalWidth > 0``), the console stays clean, and the page names the alert and its monitor."""
    from lightning_gradguard.report import build_report

    page = Path(build_report(str(run.logdir), output=str(tmp_path / "report.html")))
    open_page(driver, page.as_uri(), timeout=PAGE_TIMEOUT_S)
    images = int(driver.execute_script("return document.images.length;"))
    assert images >= 5  # loss and alerts, gradient flow, update ratio, dead units, clipping
    assert broken_images(driver) == []
    text = _squash(driver.execute_script("return document.body.innerText;"))
    assert "NaNSentinel" in text and "nonfinite_loss at step 7" in text and run.alerts[0].hint[:40] in text
    screenshot(driver, tmp_path / "report.png")
    assert console_errors(driver) == []


# ------------------------------------------------------------------------------------- the deeper signals
SIGNAL_CHARTS = {
    "Critical batch size (B_simple) vs the batch in use",
    "Gradient noise scale terms: smoothed norm(G)^2 and tr(Sigma) (use the log y axis)",
    "Optimizer step size (update norm / lr): total",
    "Optimizer step size (update norm / lr) per layer",
    "cos(update, -gradient) per layer and total (1 = plain SGD)",
    "Adam RMS of sqrt(v_hat) per layer, to compare with eps (use the log y axis)",
    "Skipped optimizer updates by cause (cumulative)",
    "Activations: max abs per block (use the log y axis)",
    "Activations: kurtosis per block (Gaussian = 3)",
    "Activations: fp16 headroom per block in bits (0 = overflow)",
    "Attention: largest logit per attention module",
    "Stalled learning: training loss vs the chance level",
    "Stalled learning: median update/weight ratio and clip ratio (use the log y axis)",
    "Stalled learning: the outputs' lean toward the labels while the loss is at chance, and its p",
}


def test_the_deeper_signals_draw_their_charts(driver: Any, tmp_path: Path) -> None:
    """The demo transformer (examples/transformer_signals.py) for 24 optimizer steps of 2 micro-batches,
    with the noise scale, OptimizerMonitor, ActivationRangeMonitor and StallDetector measuring every
    other step: every chart of theirs that the run fills is drawn, with lines, in a real TensorBoard."""
    import sys

    import lightning.pytorch as pl
    from conftest import ROOT
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_gradguard import (
        ActivationRangeMonitor,
        GradientNormLogger,
        OptimizerMonitor,
        StallDetector,
    )

    sys.path.insert(0, str(ROOT / "examples"))
    import transformer_signals as demo

    pl.seed_everything(0, verbose=False)
    train, _ = demo.digits_sequences()
    callbacks = [
        GradientNormLogger(log_every_n_steps=2, histogram_every_n_steps=12, log_noise_scale=True),
        OptimizerMonitor(log_every_n_steps=2),
        ActivationRangeMonitor(sample_every_n_steps=2),
        StallDetector(check_every_n_steps=2),
    ]
    logdir = tmp_path / "tb"
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=24,
        accumulate_grad_batches=2,
        logger=TensorBoardLogger(str(logdir), name="signals", version="v0", default_hp_metric=False),
        callbacks=callbacks,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(demo.DigitsTransformer(), train)
    declared = set(GradGuardCallback._layout(trainer))
    assert declared >= SIGNAL_CHARTS
    with tensorboard(logdir) as server:
        open_page(driver, server.url + "/#custom_scalars")

        def drawn() -> dict[str, Any] | None:
            page = custom_scalar_charts(driver)
            if not page or not set(page["charts"]) >= SIGNAL_CHARTS:
                return None
            blank = [t for t, c in page["charts"].items() if not c["lines"]]
            for title in blank[:1]:  # a chart below the fold is drawn once scrolled to
                scroll_into_view(driver, "tf-card-heading", title, "tf-custom-scalar-multi-line-chart-card")
            return None if blank else page

        try:
            page = wait_until(drawn, PAGE_TIMEOUT_S, "the deeper signals' charts drawn")
        finally:
            screenshot(driver, tmp_path / "signals.png")
    for title in SIGNAL_CHARTS:
        chart = page["charts"][title]
        assert chart["lines"] > 0 and chart["segments"] + chart["symbols"] > 0, (title, chart)
    # every chart left in the layout (the empty ones are dropped at the end of fit) carries data
    for title, chart in page["charts"].items():
        assert chart["lines"] > 0, (title, chart)
    attention = page["charts"]["Attention: largest logit per attention module"]["text"]
    assert "attention/max_logit/encoder.layers.0.self_attn" in attention
    assert console_errors(driver) == []
