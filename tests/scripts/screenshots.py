"""PNG screenshots of the TensorBoard dashboard for the docs: ``make screenshots`` (runs ``make demo`` first).

Serves the newest demo run (``runs/quickstart/version_<n>``, written by ``examples/quickstart.py``) with a
real ``tensorboard`` and photographs it in headless Chromium (Debian's ``chromium`` and
``chromium-driver``), 1280x800:

* ``tensorboard_custom_scalars.png``: Custom Scalars, the "GradGuard" section once the charts in the
  picture are drawn (1280x1100: its first three rows);
* ``tensorboard_histograms.png``: Histograms, the ``grad/`` section;
* ``tensorboard_text_alert.png``: Text, a ``gradguard/alerts`` entry with its hint. The demo is a healthy
  run and usually has no alert: then this page shows a short run with a NaN batch at step 7 instead
  (``build_faulty_run``, the same run the browser tests use), and the script says so.

Usage: ``python tests/scripts/screenshots.py [--runs runs] [--out docs/img]``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from browser_support import (  # noqa: E402
    FAULTY_RUN,
    TensorBoardServer,
    browser_missing,
    build_faulty_run,
    chrome,
    console_errors,
    custom_scalar_charts,
    histogram_cards,
    open_page,
    screenshot,
    scroll_into_view,
    set_viewport,
    tensorboard,
    text_entries,
    wait_until,
)

PAGE_TIMEOUT_S = 60.0
WIDTH, HEIGHT = 1280, 800
CUSTOM_SCALARS_HEIGHT = 1100  # three rows of charts: pre-flight, LR finder, gradient norms
SETTLE_S = 1.0  # let the last chart finish drawing before the picture


def newest_demo_run(runs: Path) -> Path:
    versions = [p for p in (runs / "quickstart").glob("version_*") if p.name.split("_")[-1].isdigit()]
    if not versions:
        raise SystemExit(f"no demo run under {runs / 'quickstart'}: run `make demo` first")
    return max(versions, key=lambda p: int(p.name.split("_")[-1]))


def shoot_custom_scalars(driver: Any, tb: TensorBoardServer, path: Path) -> None:
    layout = tb.get("/data/plugin/custom_scalars/layout")
    (section,) = [c for c in layout["category"] if c["title"] == "GradGuard"]
    titles = {chart["title"] for chart in section["chart"]}
    open_page(driver, tb.url + "/#custom_scalars")

    def drawn() -> bool:
        # every chart rendered, and those in the picture drawn (lines with data)
        page = custom_scalar_charts(driver)
        charts = page["charts"] if page else {}
        return titles <= set(charts) and all(c["lines"] for c in charts.values() if c["in_view"])

    def state() -> Any:
        page = custom_scalar_charts(driver) or {"charts": {}}
        return {t: {k: v for k, v in c.items() if k != "text"} for t, c in page["charts"].items()}

    set_viewport(driver, WIDTH, CUSTOM_SCALARS_HEIGHT)
    try:
        wait_until(drawn, PAGE_TIMEOUT_S, f"the {len(titles)} GradGuard charts drawn", show=state)
        time.sleep(SETTLE_S)
        screenshot(driver, path)
    finally:
        set_viewport(driver, WIDTH, HEIGHT)


def shoot_histograms(driver: Any, tb: TensorBoardServer, path: Path) -> None:
    open_page(driver, tb.url + "/#histograms")

    def drawn() -> bool:
        cards = histogram_cards(driver) or {}
        grads = [n for tag, n in cards.items() if tag.startswith("grad/")]
        return bool(grads) and all(grads)

    wait_until(drawn, PAGE_TIMEOUT_S, "the grad/ histograms drawn")
    if not scroll_into_view(driver, "tf-histogram-loader", "grad/", "tf-category-paginated-view"):
        raise RuntimeError("no grad/ histogram card to scroll to")
    time.sleep(SETTLE_S)
    screenshot(driver, path)


def shoot_text(driver: Any, tb: TensorBoardServer, path: Path) -> None:
    open_page(driver, tb.url + "/#text")
    entries = wait_until(lambda: text_entries(driver), PAGE_TIMEOUT_S, "the gradguard/alerts text")
    if not any("Hint:" in e["text"] for e in entries):
        raise RuntimeError(f"no alert with a hint on the Text tab: {entries!r}")
    time.sleep(SETTLE_S)
    screenshot(driver, path)


def has_alert_text(tb: TensorBoardServer) -> bool:
    tags = tb.get("/data/plugin/text/tags")
    return any("gradguard/alerts" in run_tags for run_tags in tags.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="where `make demo` writes its runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        raise SystemExit(f"cannot take screenshots: {missing}")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning_gradguard").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    demo = newest_demo_run(args.runs)
    out: Path = args.out
    written = []
    with tempfile.TemporaryDirectory(prefix="gradguard_screenshots_") as tmp, chrome(WIDTH, HEIGHT) as driver:
        # a logdir with the newest demo run only: the dashboard shows one run, named quickstart/version_<n>
        logdir = Path(tmp) / "demo" / "runs"
        shutil.copytree(demo, logdir / "quickstart" / demo.name)
        with tensorboard(logdir) as tb:
            shoot_custom_scalars(driver, tb, out / "tensorboard_custom_scalars.png")
            shoot_histograms(driver, tb, out / "tensorboard_histograms.png")
            written += ["tensorboard_custom_scalars.png", "tensorboard_histograms.png"]
            demo_alerts = has_alert_text(tb)
            if demo_alerts:
                shoot_text(driver, tb, out / "tensorboard_text_alert.png")
        if not demo_alerts:
            print(f"{demo} has no alert: the Text tab shows {FAULTY_RUN}, a short run with a NaN batch")
            faulty = Path(tmp) / "faulty" / "runs"
            build_faulty_run(faulty)
            with tensorboard(faulty) as tb:
                shoot_text(driver, tb, out / "tensorboard_text_alert.png")
        written.append("tensorboard_text_alert.png")
        errors = console_errors(driver)
        # the demo run's HTML report, its top: the verdicts, the loss and the gradient-flow heatmap
        from lightning_gradguard.report import build_report

        page = Path(build_report(str(demo), output=str(Path(tmp) / "report.html")))
        set_viewport(driver, WIDTH, 1500)
        open_page(driver, page.as_uri())
        screenshot(driver, out / "report.png")
        written.append("report.png")
        errors += console_errors(driver)
    for name in written:
        print(f"{out / name}  ({(out / name).stat().st_size // 1024} KB)")
    if errors:  # the pictures are still written: say loudly what the browser reported
        print("WARNING: the browser console reported errors:\n  " + "\n  ".join(errors), file=sys.stderr)


if __name__ == "__main__":
    main()
