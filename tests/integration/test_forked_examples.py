"""The forked runner the example tests use (conftest ``run_example``): a process of its own per script."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from conftest import _run_forked


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def test_the_script_runs_as_main_in_its_folder_and_its_state_dies_with_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = _script(
        tmp_path,
        "import logging, os, sys\n"
        "os.environ['GRADGUARD_FORK_PROBE'] = '1'\n"
        "logging.getLogger('lightning_gradguard').setLevel(logging.CRITICAL)\n"
        "print(__name__, os.getcwd(), sys.argv[1:], sys.path[0], os.getpid(), sep='|')\n"
        "print('to stderr', file=sys.stderr)\n",
    )
    level = logging.getLogger("lightning_gradguard").level
    proc = _run_forked(script, ["--epochs", "2"], work, timeout=60)
    assert proc.returncode == 0, proc.stderr
    name, cwd, args, path0, pid = proc.stdout.strip().split("|")
    assert (name, cwd, path0) == ("__main__", str(work), str(tmp_path))
    assert args == "['--epochs', '2']" and int(pid) != os.getpid()
    assert proc.stderr == "to stderr\n"
    assert "GRADGUARD_FORK_PROBE" not in os.environ and os.getcwd() != str(work)
    assert logging.getLogger("lightning_gradguard").level == level


def test_a_failing_script_exits_with_its_code_and_its_traceback(tmp_path: Path) -> None:
    raised = _run_forked(_script(tmp_path, "raise ValueError('bad input')\n"), [], tmp_path, timeout=60)
    assert raised.returncode == 1 and "ValueError: bad input" in raised.stderr
    exited = _run_forked(_script(tmp_path, "import sys\nsys.exit(3)\n"), [], tmp_path, timeout=60)
    assert exited.returncode == 3


def test_a_hung_script_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _run_forked(_script(tmp_path, "import time\ntime.sleep(60)\n"), [], tmp_path, timeout=1)


def test_a_process_whose_torch_runs_two_threads_does_not_fork() -> None:
    """An OpenMP team started before a fork hangs the child's first parallel region (seen: make
    unit-elsewhere at two threads): there the examples start a fresh interpreter instead."""
    import torch
    from conftest import _fork_safe

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not _fork_safe()
    finally:
        torch.set_num_threads(threads)
