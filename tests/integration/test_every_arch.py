"""The sweep of every architecture ``transformers`` ships (``benchmarks/every_arch.py``, ``make
bench-every-arch``): its catalogue is read from ``transformers``' own auto mappings, and a fast subset of
the runs whose mechanisms the sweep found runs here, each a real ``Trainer.fit`` of a shrunk model with
every training monitor and the pre-flight pair at their defaults: quiet, or the test fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "benchmarks"))

from every_arch import FAMILIES, catalogue, run_one

#: the subset: a run per mechanism the sweep found (about 10 s each)
FAST: dict[str, str] = {
    # a custom autograd.Function (GeLU) beside a softmax computed in float32: GradientCheck failed a dozen
    # upstream tensors when the float64 check let dtype=float32 through
    "causal_lm:bloom": "float32 parts under a custom Function",
    # an encoder-decoder run as a decoder: its cross-attention never runs (unused_parameter stopped it)
    "causal_lm:bart": "modules that never run, by design",
    # Adafactor's relative step keeps lr=None (five monitors and two checks failed on float(None))
    "causal_lm:gpt2+adafactor": "an optimizer that sets its own step",
    # torch's Muon on the matrices: every step rewrites a few percent of them by design (warmup_missing)
    "causal_lm:gpt2+muon": "an orthogonalized update",
    # the key biases (which softmax ignores: gradients of 1e-10) are AdamW's beside Muon's matrices: the eps
    # rule weighed them by their whole layers (adam_epsilon_dominates), not by the entries Adam holds
    "image:vit+muon": "a sliver of tiny gradients under Adam, in a layer split between optimizers",
    # a zero-initialized class token under a LayerNorm with eps=1e-12: finite differences at 1e-6 sat
    # outside their linear regime (gradient_mismatch on the class token until a second, smaller step)
    "image:beit": "finite differences outside their linear regime",
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_catalogue_is_every_model_class_of_the_families() -> None:
    """Every model type of every family's auto mapping (with a config class) runs once, in the first
    family that has it; nothing is picked by hand."""
    from transformers.models.auto import configuration_auto, modeling_auto

    archs = [a for a in catalogue() if a.recipe == "family"]
    shipped = {
        t
        for fam in FAMILIES.values()
        for t in getattr(modeling_auto, fam.mapping)
        if t in configuration_auto.CONFIG_MAPPING_NAMES
    }
    types = [a.model_type for a in archs]
    assert sorted(types) == sorted(shipped)  # each exactly once
    assert set(FAST) <= {a.name for a in catalogue()}
    assert len(shipped) > 200  # 316 model types in transformers 5.25


@pytest.mark.parametrize("name", list(FAST))
def test_a_swept_architecture_is_quiet_at_its_defaults(name: str) -> None:
    if name.endswith("+muon") and not hasattr(torch.optim, "Muon"):
        pytest.skip("needs torch.optim.Muon (torch >= 2.9)")
    arch = next(a for a in catalogue() if a.name == name)
    result = run_one(arch)  # the sweep's own steps: a shorter run is a schedule without its warm-up
    assert result.stage == "trained", f"{result.stage}: {result.reason}"
    assert result.ended == "completed", result.reason
    said = [
        f"{a['kind']}@{a.get('step')} ({a['source']}): {a['message'][:300]}"
        for a in result.preflight + result.alerts
    ]
    assert not said, f"{FAST[name]}: {said}"
