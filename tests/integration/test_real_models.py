"""Real Hugging Face architectures: a fast subset of ``benchmarks/real_models.py`` (which holds the
catalogue; ``make bench-real`` runs all of it). Each entry is a real ``Trainer.fit`` of a small, randomly
initialised ``transformers`` model with its family's recipe and every training monitor at its DEFAULT
arguments: it must not crash, it must learn, and a healthy run must raise no warning.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import ROOT

transformers = pytest.importorskip("transformers")
if not transformers.is_torch_available():  # transformers 5 turns its models off below torch 2.6
    pytest.skip(
        f"transformers {transformers.__version__} offers no models with torch {torch.__version__}",
        allow_module_level=True,
    )
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_models import BY_NAME, run_entry  # noqa: E402

#: the subset, with its (shortened) optimizer steps: a few seconds each on a laptop core
FAST: dict[str, int] = {
    "gpt2": 80,  # decoder LM, AdamW + warm-up/cosine + clip 1
    "bert": 80,  # post-LN encoder on padded, variable-length sequences with attention masks
    "vit": 110,  # vision transformer on digits at 32x32x3 (past the 100-step window of the clipping rule)
    "resnet": 60,  # BasicBlock + BatchNorm, SGD momentum 0.9
    "mobilenet_v2": 50,  # depthwise convolutions + ReLU6 + BatchNorm, AdamW + clip 1
}

#: healthy entries of FAST that raise a warning today, and why (empty: every one of them is quiet)
KNOWN_FALSE_ALARMS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as the benchmark runs: these models are too small for a second one to pay."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_subset_is_in_the_catalogue() -> None:
    assert set(FAST) <= set(BY_NAME)
    assert set(KNOWN_FALSE_ALARMS) <= set(FAST)
    assert all(BY_NAME[name].kind == "healthy" for name in FAST)


@pytest.mark.parametrize("name", list(FAST))
def test_real_model_healthy_run(name: str) -> None:
    out = run_entry(BY_NAME[name], steps=FAST[name])
    run = out.training
    assert run.ended != "crashed", run.error
    said = [f"{a['kind']}@{a['step']} ({a['source']}): {a['message']}" for a in run.alerts]
    if run.ended == "completed":
        first, last = out.mean_loss("first"), out.mean_loss("last")
        assert out.learned, f"a healthy run must learn: loss {first:.3f} -> {last:.3f}"
    if said or run.ended == "stopped":
        if name in KNOWN_FALSE_ALARMS:
            pytest.xfail(f"known false alarm ({KNOWN_FALSE_ALARMS[name]}): {said} {run.error}")
        pytest.fail(f"warnings on a healthy run: {said} {run.error}")
