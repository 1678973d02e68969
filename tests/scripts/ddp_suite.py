"""Every 2-process DDP scenario of the test suite in one launch: ``python ddp_suite.py OUTDIR NAME ...``.

Each NAME is a script of this folder (``ddp_grad_norm``, ``ddp_stall``, ...) whose ``main(folder)`` runs its
fits and writes what every rank saw into ``OUTDIR/NAME``; ``SCRIPT/KIND`` (``sharded_norms/fsdp2``) runs a
script that reads its strategy from its folder's name in ``OUTDIR/SCRIPT/KIND``. Launching the two processes,
importing torch and Lightning and forming the gloo group once instead of once per scenario saves most of the
suite's DDP time; the scenarios share the process group, as the fits inside one script always did. Lightning
relaunches this script with the same arguments for rank 1, so both ranks run the same scenarios in the same
order. A scenario that raises stops the launch (its traceback is in ``OUTDIR/NAME/error.txt``): the later ones
then leave no result, which their tests report.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def run(out: Path, names: list[str]) -> None:
    for name in names:
        script = name.split("/", 1)[0]
        spec = importlib.util.spec_from_file_location(script, HERE / f"{script}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            module.main(folder, *([list(module.FITS)] if hasattr(module, "FITS") else []))
            (folder / "seconds.txt").write_text(f"{time.perf_counter() - start:.2f}\n")
        except BaseException:
            (folder / "error.txt").write_text(traceback.format_exc())
            raise


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
    # leave no gloo threads behind at interpreter exit (they can abort the process: "terminate called")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
