"""Shared test helpers: a real Lightning logger that keeps what it is given, and small real modules."""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PL_DISABLE_FORK", "1")
# A monitor's own exception is raised in tests, not turned into a warning (see core.base.guarded).
os.environ.setdefault("GRADGUARD_STRICT", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent / "machine"))
import other_machine  # this machine rounding like another one, on request
from floor import FSDP2

other_machine.apply()
#: ``make unit`` runs the suite in pytest-xdist workers, one per core: one torch thread each (and in the
#: subprocesses they start: the examples, the DDP scripts, the command line), or the workers' thread pools
#: oversubscribe the cores. A thread count the caller chose (``OMP_NUM_THREADS``) is kept; an empty one is
#: no choice (torch then starts one thread per core).
_ONE_THREAD = (
    bool(os.environ.get("PYTEST_XDIST_WORKER")) and not os.environ.get("OMP_NUM_THREADS", "").strip()
)
if _ONE_THREAD:  # set before torch is imported: its pools start with one thread
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MKL_NUM_THREADS", "1")
#: whether torch in this process starts on one thread (then a forked child may run torch: run_example)
_STARTED_ON_ONE_THREAD = os.environ.get("OMP_NUM_THREADS", "").strip() == "1"
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*is smaller than the logging interval.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


#: the helpers of tests/testkit.py, imported on first use (``from conftest import make_trainer``)
_TESTKIT = (
    "MemoryLogger",
    "RecordingMLP",
    "make_trainer",
    "public_callbacks",
    "random_loader",
    "reference_total_norm",
)


def __getattr__(name: str) -> Any:
    if name in _TESTKIT:
        import testkit

        return getattr(testkit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the repository's root and the 2-process DDP scripts
ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


#: the strategies the sharded scenarios run under: FSDP2 where this torch has it (tests/floor.py)
SHARDED_KINDS = ("ddp", "fsdp1", "fsdp2") if FSDP2 else ("ddp", "fsdp1")

#: the DDP scenarios that run together, in one 2-process launch (tests/scripts/ddp_suite.py)
DDP_SUITE = (
    "ddp_grad_norm",
    "ddp_nan_one_rank",
    "ddp_buffers",
    "ddp_detectors",
    "ddp_activation_range",
    "ddp_noise_scale",
    "ddp_stall",
    "ddp_loss_spike",
    "ddp_lr_finder",
    "ddp_preflight",
    "ddp_all_callbacks",
    *(f"{script}/{kind}" for script in ("sharded_norms", "sharded_callbacks") for kind in SHARDED_KINDS),
)
_SUITE: dict[str, Any] = {}
#: the folder the suite's one launch writes into, shared by the xdist workers of one test session (made and
#: removed by the process that starts the session, see :func:`pytest_configure`)
_SUITE_DIR = "GRADGUARD_DDP_SUITE_DIR"


def _prepare_testing_process() -> None:
    """In a process that runs tests (an xdist worker, or the one process without xdist), not in the
    controller, which only hands tests out: torch on one thread in a worker, and every monitor's declared
    alert kinds loaded, so that under GRADGUARD_STRICT a monitor reporting a kind it did not declare fails
    the test whichever test file runs first (GradGuardCallback.report); Lightning's INFO lines quiet (its
    import sets its logger's level: this comes after it)."""
    import lightning.pytorch  # noqa: F401
    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    if _ONE_THREAD:
        torch.set_num_threads(1)
    assert importlib.import_module("lightning_gradguard.registry").RULES


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):  # a process that tests
        _prepare_testing_process()
    if not hasattr(config, "workerinput"):  # the session's own process, not an xdist worker
        root = tempfile.mkdtemp(prefix="gradguard_ddp_suite_")
        os.environ[_SUITE_DIR] = root  # the workers start after this and inherit it
        config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))


def _launch(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a 2-process DDP script; a hang fails through ``timeout``.

    One retry, only for gloo's known abort at interpreter exit (SIGABRT with "terminate called without
    an active exception" after the run finished): that is a shutdown race in the C++ library, not in
    the code under test, and the scripts already destroy their process group to make it rare. The retry
    first removes what the first attempt wrote into the output folder (``args[1]``), so the tests read
    one run's files.
    """
    env = dict(os.environ, PYTHONPATH=other_machine.subprocess_path(str(ROOT)), OMP_NUM_THREADS="1")
    env.pop("PL_DISABLE_FORK", None)
    out = Path(args[1]) if len(args) > 1 else None
    before = set(out.iterdir()) if out is not None and out.is_dir() else set()
    for attempt in range(2):
        if attempt and out is not None and out.is_dir():
            # the retry starts clean: the first attempt's files would sit beside the second's (a
            # TensorBoardLogger of a fixed version adds a second event file to the same folder)
            for path in set(out.iterdir()) - before:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        proc = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        abort = "terminate called without an active exception"
        if proc.returncode != -6 or abort not in proc.stderr or attempt == 1:
            return proc
    return proc


def run_ddp_script(name: str, out: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The result of a 2-process DDP scenario ``tests/scripts/<name>``, its files copied into ``out``.

    The scenarios of :data:`DDP_SUITE` run once per test session, all in one launch (the first test to
    ask pays for it, in whichever xdist worker; the others read its files); any other script runs on its
    own. A script that reads
    its strategy from its folder's name (``sharded_norms.py`` in ``.../fsdp2``) is the scenario
    ``sharded_norms/fsdp2``.
    """
    stem = name.removesuffix(".py")
    if stem not in DDP_SUITE:  # a script whose strategy is its folder's name: one scenario per strategy
        stem = f"{stem}/{out.name}"
    if stem not in DDP_SUITE:
        return _launch([str(SCRIPTS / name), str(out)], timeout)
    if "proc" not in _SUITE:
        _SUITE["root"], _SUITE["proc"] = _suite_launch(timeout=600)
    proc = _SUITE["proc"]
    if isinstance(proc, subprocess.TimeoutExpired):
        raise proc
    folder = _SUITE["root"] / stem
    if folder.is_dir():
        shutil.copytree(folder, out, dirs_exist_ok=True)
    error = folder / "error.txt"
    if error.exists():  # this scenario raised: its own traceback
        return subprocess.CompletedProcess(proc.args, proc.returncode or 1, proc.stdout, error.read_text())
    later = [s for s in DDP_SUITE[DDP_SUITE.index(stem) + 1 :] if (_SUITE["root"] / s / "error.txt").exists()]
    if later and folder.is_dir():  # a later scenario raised: this one had finished
        return subprocess.CompletedProcess(proc.args, 0, proc.stdout, proc.stderr)
    return proc


def _suite_launch(timeout: float) -> tuple[Path, Any]:
    """The folder and the outcome (a ``CompletedProcess``, or ``TimeoutExpired`` for a hang) of the one
    launch of :data:`DDP_SUITE` in this test session. The first process to ask launches it under a file
    lock; any other xdist worker waits on that lock and reads the outcome the first one wrote."""
    from filelock import FileLock  # a dependency of torch

    shared = os.environ.get(_SUITE_DIR)
    if shared is None:  # outside a pytest session's configure (a helper called from elsewhere)
        shared = tempfile.mkdtemp(prefix="gradguard_ddp_suite_")
        atexit.register(shutil.rmtree, shared, ignore_errors=True)
    root = Path(shared)
    outcome = root / "launch.json"
    with FileLock(str(root / "launch.lock")):
        if not outcome.exists():
            try:
                proc = _launch([str(SCRIPTS / "ddp_suite.py"), str(root), *DDP_SUITE], timeout=timeout)
                done = {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout}
                done["stderr"] = proc.stderr
            except subprocess.TimeoutExpired as err:  # a hang: every scenario's test fails, none relaunches
                done = {"args": err.cmd, "timeout": err.timeout}
            outcome.write_text(json.dumps(done))
        done = json.loads(outcome.read_text())
    if "timeout" in done:
        return root, subprocess.TimeoutExpired(done["args"], done["timeout"])
    return root, subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"], done["stderr"])


def run_example(
    name: str, cwd: Path, timeout: float = 240, args: list[str] | None = None, fork: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` (with ``args``) in ``cwd`` as ``python examples/<name>`` would; it must exit
    cleanly.

    ``fork=True`` (the default) runs the script as ``__main__`` in a forked child of this test process,
    which has torch and Lightning imported already: the 10 s of imports a fresh interpreter pays (on this
    2-core machine) are paid once per worker instead of once per example. The child is a process of its
    own: its changes to global state (logging, seeds, warnings, the working directory) die with it, its
    output goes to its own files, and it gets what a fresh interpreter would (the root logger without
    pytest's handlers, ``sys.argv``, the script's folder first on ``sys.path``, only its own ``atexit``
    functions run at its end). ``fork=False`` starts a real interpreter (``make demo``'s way, kept for the
    quickstart), as does a test process whose torch runs more than one thread (``make unit-elsewhere``):
    OpenMP's thread team does not survive a fork, and the child's first parallel region hangs.
    """
    if not fork or not _fork_safe():
        env = dict(os.environ, PYTHONPATH=other_machine.subprocess_path(str(ROOT)), OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples" / name), *(args or [])],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = _run_forked(ROOT / "examples" / name, args or [], cwd, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _fork_safe() -> bool:
    """Whether this process may fork a child that runs torch: only when torch has never had a second thread,
    that is when the process started with ``OMP_NUM_THREADS=1`` (the xdist workers) and still runs one (an
    OpenMP team started before the fork leaves the child's runtime waiting for threads it lost: the child
    hangs; PyTorch's own forked DataLoader workers drop to one thread for the same reason)."""
    import torch

    return _STARTED_ON_ONE_THREAD and torch.get_num_threads() == 1


def _run_forked(script: Path, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``script`` run as ``__main__`` in a forked child (:func:`run_example`), stopped after ``timeout``."""
    import time

    out, err = cwd / ".example_stdout", cwd / ".example_stderr"
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        _example_child(script, args, cwd, out, err)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([str(script), *args], timeout)
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    stdout, stderr = (f.read_text(errors="replace") for f in (out, err))
    out.unlink(), err.unlink()
    return subprocess.CompletedProcess([str(script), *args], code, stdout, stderr)


def _example_child(script: Path, args: list[str], cwd: Path, out: Path, err: Path) -> None:
    """The forked child's life: a fresh interpreter's view, the script as ``__main__``, then ``_exit``."""
    import io
    import runpy
    import traceback

    code = 1
    try:
        atexit._clear()  # pytest's and the worker's exit functions are not the script's
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        sys.stdin = open(os.devnull)  # noqa: SIM115 (the process ends with os._exit)
        logging.getLogger().handlers.clear()  # pytest's capture handlers; a fresh process has none
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", []):  # a handler made under pytest's capture
                if type(handler) is logging.StreamHandler:
                    handler.setStream(sys.stderr)
        os.chdir(cwd)
        sys.argv = [str(script), *args]
        sys.path.insert(0, str(script.parent))
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # reported as the script's traceback, as python would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


@pytest.fixture
def memory_logger(tmp_path: Any) -> Any:
    from testkit import MemoryLogger

    return MemoryLogger(str(tmp_path))


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own folder: a Trainer without a logger writes to the working directory."""
    monkeypatch.chdir(tmp_path)
