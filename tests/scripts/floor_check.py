"""What a user at our dependency floor runs, run there (``make test-floor``; the unit tests follow it).

In a scratch folder, with this interpreter (the floor venv's): the README's main job and every example
(``examples/*.py``; ``zoo.py`` is their shared zoo, not an example), each of which must exit 0 and print
no Python warning; then ``gradguard report`` on the quickstart's run; then a real TensorBoard on that run,
whose GradGuard dashboard (Custom Scalars: the layout and every chart's data) must load.

    python tests/scripts/floor_check.py SCRATCH_DIR
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from browser_support import TensorBoardServer  # noqa: E402

#: a Python warning as the warnings module prints it (``...py:12: UserWarning: ...``), or a library's
#: own notice that it disabled itself (transformers without a torch it supports)
WARNING = re.compile(r"\b\w*Warning: |^\[transformers\]", re.MULTILINE)
PACKAGES = ("torch", "lightning", "torchmetrics", "tensorboard", "numpy", "protobuf")


def run(args: list[str], cwd: Path, what: str) -> str:
    """Run ``args`` in ``cwd``; fail on a non-zero exit or a warning in its output."""
    started = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"FAILED {what} (exit {proc.returncode}):\n{out[-4000:]}")
    warned = [line for line in out.splitlines() if WARNING.search(line)]
    if warned:
        sys.exit(f"FAILED {what}: it printed warnings:\n" + "\n".join(warned[:20]))
    print(f"ok  {what} ({time.perf_counter() - started:.0f} s)", flush=True)
    return out


def dashboard(logdir: Path) -> int:
    """Load the GradGuard dashboard of ``logdir`` from a real TensorBoard: the number of charts served."""
    server = TensorBoardServer(logdir)
    server.start()
    try:
        server.wait_loaded()
        layout = server.get("/data/plugin/custom_scalars/layout")
        gradguard = next(c for c in layout["category"] if c["title"] == "GradGuard")
        run_name = next(iter(server.get("/data/plugin/scalars/tags")))
        served = 0
        for chart in gradguard["chart"]:
            for regex in chart["multiline"]["tag"]:
                body = server.get("/data/plugin/custom_scalars/scalars", run=run_name, tag=regex)
                assert body["regex_valid"], regex
            served += 1
        return served
    finally:
        server.stop()


def main(scratch: Path) -> None:
    print("floor:", ", ".join(f"{p} {version(p)}" for p in PACKAGES), flush=True)
    scratch.mkdir(parents=True, exist_ok=True)
    examples = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "zoo.py")
    for example in sorted(examples, key=lambda p: p.name != "quickstart.py"):  # the main job first
        run([sys.executable, str(example)], scratch, f"examples/{example.name}")
    gradguard = Path(sys.executable).with_name("gradguard")
    run([str(gradguard), "report", "runs/quickstart"], scratch, "gradguard report runs/quickstart")
    charts = dashboard(scratch / "runs" / "quickstart")
    print(f"ok  TensorBoard's GradGuard dashboard: {charts} charts served", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
