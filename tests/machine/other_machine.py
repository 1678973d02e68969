"""Make this machine round like another one, so a test that holds only on one CPU's rounding fails here.

A test must hold on any machine. What differs between machines is the order of float reductions (thread
count), the vector kernels (AVX-512, AVX2, none), the BLAS and convolution kernels, and what all of these
do to a trajectory over many steps. ``.ci/run`` runs the suite once under these perturbations:

- ``OMP_NUM_THREADS=2``: another reduction order (``make test``'s xdist workers run one thread each).
  ``ATEN_CPU_CAPABILITY=avx2`` or ``default``: other vector kernels (give inductor its own
  ``TORCHINDUCTOR_CACHE_DIR`` then: its cache is not keyed by that setting, and a kernel compiled for one
  capability and loaded under another computes garbage).
- ``GRADGUARD_TEST_PERTURB=kernels``: deterministic algorithms and no oneDNN: other float kernels.
- ``GRADGUARD_TEST_PERTURB=rounding``: every weight ``torch.nn.init`` draws is moved by about one part in
  a million (``GRADGUARD_TEST_ROUNDING_SCALE``), in a fixed pattern per tensor size that the global RNG
  never sees (``GRADGUARD_TEST_ROUNDING_SEED`` picks another): two models built alike are still alike,
  and weights a test sets itself are left alone. That is what a few steps of another CPU's rounding do
  to a trajectory: a test on a trained trajectory that fails under it asserts where chaos sends the run,
  not what the code does. Exact steps belong to constructed setups (injected faults, fixed gradients,
  scripted losses); on trained trajectories assert with measured margins.

``tests/conftest.py`` imports this module, and the ``sitecustomize`` beside it applies it in the
subprocesses the tests start (the DDP scripts, the examples) when their ``PYTHONPATH`` holds this folder
(:func:`subprocess_path`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

KINDS = ("kernels", "rounding")
PERTURB = {p for p in os.environ.get("GRADGUARD_TEST_PERTURB", "").split(",") if p}
SEED = int(os.environ.get("GRADGUARD_TEST_ROUNDING_SEED", "0"))
SCALE = float(os.environ.get("GRADGUARD_TEST_ROUNDING_SCALE", "1e-6"))
#: the weight-drawing functions of ``torch.nn.init`` that every built-in layer's ``reset_parameters`` calls
DRAWS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
)


def _rounded_elsewhere(draw: Callable[..., Any]) -> Callable[..., Any]:
    def drawn(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = draw(tensor, *args, **kwargs)
        if tensor.is_floating_point() and tensor.device.type == "cpu" and tensor.numel():
            pattern = torch.Generator().manual_seed(SEED * 1_000_003 + tensor.numel())
            with torch.no_grad():
                tensor.copy_(tensor.float() * (1 + SCALE * torch.randn(tensor.shape, generator=pattern)))
        return out

    drawn.__wrapped__ = draw  # type: ignore[attr-defined]
    return drawn


def apply() -> None:
    """Apply what ``GRADGUARD_TEST_PERTURB`` asks for (once per process)."""
    if PERTURB - set(KINDS):
        raise ValueError(f"GRADGUARD_TEST_PERTURB: {sorted(PERTURB - set(KINDS))} (allowed: {KINDS})")
    if "kernels" in PERTURB:
        torch.use_deterministic_algorithms(True)
        torch.backends.mkldnn.enabled = False
    if "rounding" in PERTURB and not hasattr(nn.init.uniform_, "__wrapped__"):
        for name in DRAWS:
            setattr(nn.init, name, _rounded_elsewhere(getattr(nn.init, name)))


def subprocess_path(pythonpath: str) -> str:
    """``PYTHONPATH`` for a subprocess of a test: under a perturbation, this folder first (its
    ``sitecustomize`` applies the same perturbation there)."""
    if not PERTURB:
        return pythonpath
    return os.pathsep.join([str(Path(__file__).resolve().parent), pythonpath])
