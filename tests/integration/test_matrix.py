"""Every callback across the Trainer configurations users run (benchmarks/matrix.py, its fast rows).

Each row trains a small model in one Trainer configuration (precision, accumulation, clipping, manual
optimization, two optimizers, LBFGS, validation, limits, fast_dev_run, no logger) once without our
callbacks and once per column (each callback alone, and all of them together). Every cell must train to
its end; every callback that only watches must leave the run bit for bit as it was (the final weights
equal the unwatched run's). The slow rows (DDP, persistent workers, torch.compile, a GradScaler) run in
``python benchmarks/matrix.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("matrix_bench", ROOT / "benchmarks" / "matrix.py")
assert _spec is not None and _spec.loader is not None
matrix: Any = importlib.util.module_from_spec(_spec)
sys.modules["matrix_bench"] = matrix  # its dataclasses look their module up
_spec.loader.exec_module(matrix)

ROWS = [name for name, config in matrix.CONFIGS.items() if not config.slow]
COLUMNS = [c for c in matrix.COLUMNS if c != "none"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """Tiny models train faster on one thread (no pool to wake per kernel); put the count back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("row", ROWS)
def test_every_callback_trains_and_only_watches(row: str) -> None:
    reference = matrix.run_cell(row, "none")
    assert not isinstance(reference, str), reference
    verdicts = {column: matrix.compare(matrix.run_cell(row, column), reference) for column in COLUMNS}
    wrong = {
        column: got
        for column, got in verdicts.items()
        if got != "same" and not (matrix.expected(row, column) == "trained" and got == "differs")
    }
    assert not wrong


def test_the_matrix_covers_every_callback_and_the_configurations_users_run() -> None:
    from conftest import public_callbacks

    assert {c.__name__ for c in public_callbacks()} <= set(matrix.COLUMNS)
    assert len(ROWS) >= 12 and {"ddp_2", "persistent_workers", "compile_cnn"} <= set(matrix.CONFIGS)
