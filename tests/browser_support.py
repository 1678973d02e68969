"""Real-browser helpers: headless Chromium through Selenium, a real TensorBoard server, a small faulty run.

Shared by ``tests/integration/test_browser.py`` and ``tests/scripts/screenshots.py`` (``make screenshots``).
Nothing here is TensorBoard-specific except :class:`TensorBoardServer` and :func:`build_faulty_run`, so a
test of a local HTML page can do::

    with chrome() as driver:
        driver.get(path.as_uri())
        wait_until(lambda: page_ready(driver), 10, "the page")
        assert broken_images(driver) == []
        assert console_errors(driver) == []

Chromium and its driver come from Debian (``apt-get install chromium chromium-driver``), never from a
download at run time: :func:`browser_missing` says what is missing so that a test can skip with that reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: Debian's packages; override with GRADGUARD_CHROMIUM / GRADGUARD_CHROMEDRIVER
CHROMIUM = os.environ.get("GRADGUARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("GRADGUARD_CHROMEDRIVER", "/usr/bin/chromedriver")
WINDOW = (1280, 800)


def browser_missing() -> str | None:
    """Why a browser test cannot run here (what is missing), or ``None`` when everything is installed."""
    missing = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the Python package selenium (pip install -e '.[dev]')")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            missing.append(f"{path} (apt-get install {package})")
    return "missing " + ", ".join(missing) if missing else None


# ---------------------------------------------------------------------------------------------- waiting
def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.25,
    show: Callable[[], Any] | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy; return it. After ``timeout`` s raise
    ``TimeoutError`` naming ``what`` and the last value seen (an exception counts as a falsy value), or
    what ``show()`` returns then (the state of the page, say)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = condition()
            if last:
                return last
        except Exception as e:  # a page still loading: a stale element, a script error
            last = e
        if time.monotonic() > deadline:
            if show is not None:
                with contextlib.suppress(Exception):
                    last = show()
            raise TimeoutError(f"{what}: not within {timeout:g} s; last seen: {last!r}"[:3000])
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------- browser
@contextlib.contextmanager
def chrome(width: int = WINDOW[0], height: int = WINDOW[1]) -> Iterator[Any]:
    """A headless Chromium session (Selenium ``WebDriver``) that records the browser console; always quit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-proxy-server",  # loopback only: never through a proxy from the environment
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--window-size={width},{height}",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        set_viewport(driver, width, height)
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def set_viewport(driver: Any, width: int, height: int) -> None:
    """The page's viewport (what a screenshot holds) is exactly ``width`` x ``height`` CSS pixels."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def console_errors(driver: Any) -> list[str]:
    """The browser console's SEVERE entries since the last call (uncaught exceptions, failed loads)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def page_ready(driver: Any) -> bool:
    return bool(driver.execute_script("return document.readyState === 'complete'"))


def open_page(driver: Any, url: str, timeout: float = 30.0) -> None:
    """Load ``url`` afresh (a new document even when only the ``#fragment`` differs) and wait for it."""
    driver.get("about:blank")
    driver.get(url)
    wait_until(lambda: page_ready(driver), timeout, f"{url} loaded")


# A JavaScript prelude that sees through shadow roots (TensorBoard's Polymer elements live in them).
_DEEP_JS = """
const deepAll = (root, selector) => {
  const out = [];
  const visit = (node) => {
    out.push(...node.querySelectorAll(selector));
    for (const el of node.querySelectorAll('*')) if (el.shadowRoot) visit(el.shadowRoot);
  };
  if (root.shadowRoot) visit(root.shadowRoot);
  visit(root);
  return out;
};
const deepText = (root) => {
  const parts = [];
  const visit = (node) => {
    if (node.nodeType === Node.TEXT_NODE) { parts.push(node.textContent); return; }
    if (node.nodeName === 'STYLE' || node.nodeName === 'SCRIPT') return;
    if (node.shadowRoot) visit(node.shadowRoot);
    for (const child of node.childNodes) visit(child);
  };
  visit(root);
  return parts.join(' ').replace(/\\s+/g, ' ');
};
const visible = (el) => {
  const r = el.getBoundingClientRect();
  return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== 'hidden';
};
"""


def run_js(driver: Any, body: str, *args: Any) -> Any:
    """Run ``body`` (a function body using ``arguments``) with ``deepAll``, ``deepText``, ``visible``."""
    return driver.execute_script(_DEEP_JS + body, *args)


def deep_text(driver: Any) -> str:
    """All text of the page, shadow roots included, whitespace collapsed."""
    return str(run_js(driver, "return deepText(document.documentElement);"))


def deep_count(driver: Any, selector: str) -> int:
    """How many visible elements match ``selector`` anywhere in the page, shadow roots included."""
    return int(run_js(driver, "return deepAll(document, arguments[0]).filter(visible).length;", selector))


def broken_images(driver: Any) -> list[str]:
    """The ``src`` of every ``<img>`` (shadow roots included) that did not load (``naturalWidth == 0``)."""
    return list(
        run_js(
            driver,
            "return deepAll(document, 'img').filter(i => !i.complete || i.naturalWidth === 0)"
            ".map(i => i.currentSrc || i.src || i.outerHTML.slice(0, 200));",
        )
    )


def scroll_into_view(driver: Any, selector: str, text: str, ancestor: str | None = None) -> bool:
    """Scroll the first visible ``selector`` element whose text starts with ``text`` (or its nearest
    ``ancestor`` element, across shadow roots) to the top of its scroll container; whether one was found."""
    return bool(
        run_js(
            driver,
            """
            const [selector, text, ancestor] = arguments;
            let el = deepAll(document, selector).filter(visible)
              .find(e => deepText(e).trim().startsWith(text));
            if (!el) return false;
            if (ancestor) {
              let up = el;
              while (up && !(up.matches && up.matches(ancestor))) up = up.parentNode || up.host;
              if (up) el = up;
            }
            el.scrollIntoView({block: 'start'});
            return true;
            """,
            selector,
            text,
            ancestor,
        )
    )


def screenshot(driver: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not driver.save_screenshot(str(path)):
        raise RuntimeError(f"could not save a screenshot to {path}")
    return path


# ---------------------------------------------------------------------------------------------- TensorBoard
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tensorboard_executable() -> str:
    beside = Path(sys.executable).with_name("tensorboard")  # the venv's own
    return str(beside) if beside.exists() else (shutil.which("tensorboard") or "tensorboard")


class TensorBoardServer:
    """A real ``tensorboard --logdir ... --host 127.0.0.1 --port <free port>`` subprocess."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        # never send loopback requests through an HTTP proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def start(self) -> None:
        cmd = [
            tensorboard_executable(),
            "--logdir",
            str(self.logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load_fast=false",
            "--reload_interval=1",
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def log(self) -> str:
        return "".join(self.output)[-4000:]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def get(self, route: str, timeout: float = 10.0, **params: str) -> Any:
        url = self.url + route + ("?" + urllib.parse.urlencode(params) if params else "")
        with self._opener.open(url, timeout=timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def wait_for(self, condition: Callable[[TensorBoardServer], T], timeout: float, what: str) -> T:
        """Poll ``condition(self)`` (HTTP errors count as "not yet"); fail early if the server died."""

        def check() -> T:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tensorboard exited with {self.proc.returncode}:\n{self.log()}")
            return condition(self)

        try:
            return wait_until(check, timeout, what)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\ntensorboard output:\n{self.log()}") from None

    def wait_loaded(self, timeout: float = 60.0) -> None:
        """Wait until the server answers and has loaded the GradGuard layout and the histograms."""

        def loaded(tb: TensorBoardServer) -> bool:
            layout = tb.get("/data/plugin/custom_scalars/layout")
            categories = [c.get("title") for c in layout.get("category", [])]
            return "GradGuard" in categories and bool(tb.get("/data/plugin/histograms/tags"))

        self.wait_for(loaded, timeout, f"tensorboard at {self.url} serving {self.logdir}")


# What TensorBoard's dashboards show, read from the rendered page (the visible dashboard only: a dashboard
# opened earlier in the same document stays in the DOM, hidden).
_ACTIVE = "const dash = deepAll(document, arguments[0]).filter(visible)[0]; if (!dash) return null;"


def custom_scalar_charts(driver: Any) -> dict[str, Any] | None:
    """The Custom Scalars tab as drawn: ``{"sections": [...], "charts": {title: stats}}``, ``None`` before
    it is rendered. A chart's stats: ``lines`` (SVG line paths with data), ``segments`` (their line
    segments), ``symbols`` (drawn point markers), ``in_view`` (in the viewport now) and ``text`` (the
    card's text: title, axes, matched tags)."""
    return run_js(
        driver,
        _ACTIVE
        + """
        const sections = deepAll(dash, 'tf-category-paginated-view').filter(visible)
          .map(v => (v.category && v.category.name) || '');
        const charts = {};
        for (const card of deepAll(dash, 'tf-custom-scalar-multi-line-chart-card').filter(visible)) {
          const title = deepAll(card, 'tf-card-heading').map(h => deepText(h).trim()).join(' ');
          let lines = 0, segments = 0, symbols = 0;
          for (const p of deepAll(card, 'path.line')) {
            const d = p.getAttribute('d') || '';
            if (d) { lines += 1; segments += (d.match(/L/g) || []).length; }
          }
          for (const p of deepAll(card, 'path.symbol')) if (p.getAttribute('d')) symbols += 1;
          const r = card.getBoundingClientRect();
          const in_view = r.top < window.innerHeight && r.bottom > 0;
          charts[title] = {lines, segments, symbols, in_view, text: deepText(card)};
        }
        return {sections, charts};
        """,
        "tf-custom-scalar-dashboard",
    )


def histogram_cards(driver: Any) -> dict[str, int] | None:
    """The Histograms tab as drawn: tag -> number of histogram outlines (one per logged step) in its card."""
    return run_js(
        driver,
        _ACTIVE
        + """
        const cards = {};
        for (const card of deepAll(dash, 'tf-histogram-loader').filter(visible)) {
          const heading = deepAll(card, 'tf-card-heading').map(h => deepText(h).trim()).join(' ');
          const tag = heading.split(' ')[0];
          const drawn = deepAll(card, 'path.outline').filter(p => (p.getAttribute('d') || '').length > 0);
          cards[tag] = Math.max(cards[tag] || 0, drawn.length);
        }
        return cards;
        """,
        "tf-histogram-dashboard",
    )


def text_entries(driver: Any) -> list[dict[str, Any]] | None:
    """The Text tab as drawn: one ``{"text": ..., "em": [...]}`` per rendered Markdown entry."""
    return run_js(
        driver,
        _ACTIVE
        + """
        return deepAll(dash, 'tf-markdown-view').filter(visible).map(m => ({
          text: deepText(m).trim(),
          em: deepAll(m, 'em').map(e => e.textContent.trim()),
        }));
        """,
        "tf-text-dashboard",
    )


@contextlib.contextmanager
def tensorboard(logdir: Path, timeout: float = 60.0, wait: bool = True) -> Iterator[TensorBoardServer]:
    """Start TensorBoard on ``logdir``, wait (``wait``) until it serves the GradGuard layout and the
    histograms; always terminate it."""
    server = TensorBoardServer(logdir)
    try:
        server.start()
        if wait:
            server.wait_loaded(timeout)
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- a real run
FAULTY_RUN = "faulty/version_0"


def build_faulty_run(logdir: Path, steps: int = 30, bad_step: int = 7) -> tuple[Any, list[Any]]:
    """Train a small MLP for ``steps`` optimizer steps into ``logdir/faulty/version_0`` with TensorBoard.

    The batch of optimizer step ``bad_step`` carries a NaN: ``NaNSentinel(action="skip")`` reports
    ``nonfinite_loss`` (with its hint) and drops that update, and training goes on. Every scalar is
    logged on every step and histograms every 5 steps. Returns ``(trainer, gradguard callbacks)``.
    """
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch import nn

    from lightning_gradguard import (
        DeadReLUMonitor,
        GradientNormLogger,
        NaNSentinel,
        VanishingExplodingDetector,
    )

    class Faulty(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(8, 32)  # a functional ReLU after it: tag dead_relu/relu[hidden]
            self.net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(torch.relu(self.hidden(x)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.trainer.global_step == bad_step:
                x = x.clone()
                x[0, 2] = float("nan")
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 8, 8, generator=g)
    y = torch.randint(0, 4, (steps * 8,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with torch.random.fork_rng():  # a fixed init without touching the caller's global seed
        torch.manual_seed(0)
        model = Faulty()
    callbacks = [
        GradientNormLogger(log_every_n_steps=1, histogram_every_n_steps=5, clip_window=10),
        VanishingExplodingDetector(check_every_n_steps=1),
        DeadReLUMonitor(),
        NaNSentinel(action="skip", save_checkpoint=False, save_batch=False, find_origin=False),
    ]
    name, version = FAULTY_RUN.split("/")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(logdir), name=name, version=version, default_hp_metric=False),
        log_every_n_steps=1,
        gradient_clip_val=0.5,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(logdir),
    )
    trainer.fit(model, loader)
    return trainer, callbacks
