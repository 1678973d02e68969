"""The docs say what the code does: argument tables against signatures, alert kinds, functions and tags."""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, RecordingMLP, make_trainer, public_callbacks, random_loader
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_gradguard
from lightning_gradguard import (
    ALERT_KINDS,
    ActivationRangeMonitor,
    DeadReLUMonitor,
    GradGuardCallback,
    GradientCheck,
    GradientNormLogger,
    LossSpikeGuard,
    LRFinderPlus,
    NaNSentinel,
    OptimizerMonitor,
    OverfitBatchSanity,
    StallDetector,
    VanishingExplodingDetector,
    functional,
    gradient_check,
    lr_find,
    registry,
)

DOCS = ROOT / "docs"
ALL = public_callbacks()

# what is documented where: (object, page, the heading the table follows, arguments the table leaves out,
# arguments of the table the object does not take)
TABLES: list[tuple[Any, str, str, set[str], set[str]]] = [
    (GradientNormLogger, "tags.md", "## GradientNormLogger arguments", set(), set()),
    (NaNSentinel, "nan_sentinel.md", "## Arguments", set(), set()),
    (LossSpikeGuard, "loss_spike.md", "## Arguments", set(), set()),
    (OptimizerMonitor, "optimizer.md", "## Arguments", set(), set()),
    (VanishingExplodingDetector, "detectors.md", "## VanishingExplodingDetector", set(), set()),
    (DeadReLUMonitor, "detectors.md", "## DeadReLUMonitor", set(), set()),
    (ActivationRangeMonitor, "activations.md", "## Arguments", set(), set()),
    (StallDetector, "stall.md", "## Arguments", set(), set()),
    (LRFinderPlus, "lr_finder.md", "## Arguments", set(), set()),
    (
        lr_find,
        "lr_finder.md",
        "### `lr_find()` arguments",
        {"model", "train_dataloaders", "datamodule"},
        set(),
    ),
    (OverfitBatchSanity, "preflight.md", "## OverfitBatchSanity", set(), set()),
    (GradientCheck, "preflight.md", "## GradientCheck", set(), set()),
    (gradient_check, "preflight.md", "## GradientCheck", {"module", "batch", "loss_fn"}, {"action"}),
]


def _table_after(page: str, heading: str) -> list[list[str]]:
    """The rows of the first "| argument | default | ... |" table after ``heading`` on ``page``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    start = text.index(heading + "\n")
    match = re.search(r"^\| argument \| default \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text[start:], re.M)
    assert match, f"no argument table after {heading!r} in {page}"
    return [
        [cell.strip() for cell in row.strip().strip("|").split("|")] for row in match.group(1).splitlines()
    ]


def _literal(token: str) -> Any:
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError):
        return token


def _same(doc: Any, code: Any) -> bool:
    if isinstance(doc, (int, float)) and isinstance(code, (int, float)) and not isinstance(code, bool):
        return math.isclose(float(doc), float(code), rel_tol=1e-9)
    return bool(doc == code)


@pytest.mark.parametrize(
    ("obj", "page", "heading", "left_out", "extra"), TABLES, ids=lambda v: getattr(v, "__name__", None)
)
def test_every_argument_table_matches_the_signature(
    obj: Any, page: str, heading: str, left_out: set[str], extra: set[str]
) -> None:
    params = {
        name: p
        for name, p in inspect.signature(obj).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    documented: dict[str, str] = {}
    for row in _table_after(page, heading):
        names = re.findall(r"`([a-z_0-9]+)`", row[0])
        defaults = re.findall(r"`([^`]+)`", row[1]) or [row[1].split()[0]]
        assert names, f"{page}: a row without an argument name: {row}"
        for i, name in enumerate(names):
            documented[name] = defaults[min(i, len(defaults) - 1)]
    assert set(documented) - extra == set(params) - left_out, f"{page} {heading}"
    for name, shown in documented.items():
        if name in extra:
            continue
        default = params[name].default
        assert _same(_literal(shown), default), (
            f"{page}: `{name}` is documented as {shown}, the code has {default!r}"
        )


def test_every_alert_kind_is_in_the_alert_table() -> None:
    """The table of kinds is the one generated from the monitors' declarations (`registry`)."""
    from lightning_gradguard import registry

    text = (DOCS / "alerts.md").read_text(encoding="utf-8")
    assert registry.with_tables(text) == text, (
        f"docs/alerts.md's table of kinds is stale: run `{registry.REWRITE}`"
    )
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, re.M))
    assert set(ALERT_KINDS) <= rows


def _mentioned(name: str, text: str) -> bool:
    """``name`` appears as code: in backticks on one line (``x``, ``pkg.x``, ``x(...)``)."""
    return re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", text) is not None


def test_every_functional_name_is_documented() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    assert not [name for name in functional.__all__ if not _mentioned(name, text)]


def test_every_public_name_is_documented() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    public = [name for name in lightning_gradguard.__all__ if name != "__version__"]
    assert not [name for name in public if not _mentioned(name, text)]


def _documented_arguments(doc: str) -> list[str]:
    """The names a Google-style ``Args:`` section documents (``a, b:`` documents two)."""
    found = re.search(r"^([ \t]*)Args:[ \t]*$", doc, re.M)
    if found is None:
        return []
    names: list[str] = []
    for line in doc[found.end() :].splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent <= len(found.group(1)):
            break
        head, colon, _ = line.strip().partition(":")
        if colon and indent == len(found.group(1)) + 4:
            names += [n.split(" (")[0].strip().lstrip("*") for n in head.split(",")]
    return names


def _documented_callables() -> Any:
    """Every function, class and method defined in the package, with the signature its docs describe."""
    for info in pkgutil.walk_packages(lightning_gradguard.__path__, "lightning_gradguard."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield obj, obj
            elif inspect.isclass(obj):
                yield obj, obj.__init__
                yield from ((f, f) for f in vars(obj).values() if inspect.isfunction(f))


def test_every_documented_argument_is_in_the_signature() -> None:
    """The docs build (mkdocstrings, strict) fails on an ``Args:`` entry the signature lacks; so does this,
    in ``make test``, for every callable of the package (rendered or not)."""
    stray = []
    for documented, function in _documented_callables():
        parameters = set(inspect.signature(function).parameters)
        names = _documented_arguments(inspect.getdoc(documented) or "")
        stray += [(documented.__qualname__, n) for n in names if n not in parameters]
    assert not stray
    assert _documented_arguments(
        "Run.\n\nArgs:\n    a: one.\n        more.\n    b, c: two.\n\nReturns:\n    x: no."
    ) == [
        "a",
        "b",
        "c",
    ]


@pytest.mark.parametrize("page", registry.PAGES)
def test_every_generated_table_is_fresh(page: str) -> None:
    """The tables built from the declarations (kinds, layout, the callbacks' reference entries) are what
    the declarations give now."""
    text = (ROOT / page).read_text(encoding="utf-8")
    assert registry.with_tables(text) == text, f"{page} is stale: run `{registry.REWRITE}`"


def test_the_reference_lists_every_exported_callback() -> None:
    text = (DOCS / "reference" / "callbacks.md").read_text(encoding="utf-8")
    listed = re.findall(r"^::: lightning_gradguard\.(\w+)$", text, re.M)
    exported = [n for n in lightning_gradguard.__all__ if isinstance(getattr(lightning_gradguard, n), type)]
    assert set(listed) == {
        n for n in exported if issubclass(getattr(lightning_gradguard, n), GradGuardCallback)
    }


def test_the_layout_table_is_the_chart_registry() -> None:
    """docs/tags.md's layout table lists exactly the charts the monitors declare (gathered by
    ``lightning_gradguard.registry``), and every callback's layout is drawn from those."""
    text = (DOCS / "tags.md").read_text(encoding="utf-8")
    layout = text.split('## The "GradGuard" custom-scalars layout', 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| ([^|`]+?) \|", layout, re.M)) - {"chart"}
    declared = {c.title for c in registry.CHARTS}
    assert rows == declared
    assert registry.with_tables(text) == text, f"docs/tags.md is stale: run `{registry.REWRITE}`"
    drawn = {title for cls in ALL for title in cls().layout_charts()}
    assert drawn <= declared and len(drawn) > 30


def test_every_tag_family_a_run_writes_is_in_the_tag_reference(tmp_path: Path) -> None:
    """Every callback on one real run; every tag family in its event file must be on docs/tags.md."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    logger = TensorBoardLogger(str(tmp_path), name="docs", default_hp_metric=False)
    callbacks = [
        OverfitBatchSanity(),
        LRFinderPlus(num_training=40, max_lr=30.0, progress=False),
        GradientNormLogger(histogram_every_n_steps=4),
        VanishingExplodingDetector(),
        DeadReLUMonitor(),
        NaNSentinel(),
        OptimizerMonitor(),
        ActivationRangeMonitor(),
        StallDetector(check_every_n_steps=2),
    ]
    model = RecordingMLP()
    model.net[1] = torch.nn.ReLU()
    # labels a linear map of the inputs decides: the sweep's loss can fall, so it suggests (a curve of
    # random labels has a descent lost in its noise, and LRFinderPlus rightly suggests nothing)
    loader = random_loader(n=400)
    x, _ = loader.dataset.tensors
    labels = (x @ torch.randn(x.shape[1], 4, generator=torch.Generator().manual_seed(1))).argmax(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=32)
    make_trainer(callbacks, logger, gradient_clip_val=0.5, max_steps=24, log_every_n_steps=2).fit(model, data)
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    found = events.Tags()
    written = {*found["scalars"], *found["histograms"], *found["images"], *found["tensors"]}
    ours = {t for t in written if not t.startswith(("train_loss", "epoch"))}
    families = {t.split("/")[0] + "/" for t in ours if "/" in t}
    assert families <= {f.prefix for f in registry.FAMILIES} | {"gradguard/"}  # every family a run writes
    text = (DOCS / "tags.md").read_text(encoding="utf-8")
    assert not [f.prefix for f in registry.FAMILIES if f"`{f.prefix}" not in text]  # declared and here
    assert families >= {"grad_norm/", "grad_clip/", "grad_flow/", "dead_relu/", "lr_finder/", "preflight/"}
    assert families >= {"optimizer/", "activation/", "stall/"}
    undocumented = sorted(f for f in families if f"`{f}" not in text)
    assert not undocumented
    for tag in ("grad_clip/fraction_clipped", "lr_finder/suggested_lr", "preflight/overfit_loss"):
        assert tag in ours and f"`{tag}`" in text
