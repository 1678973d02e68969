"""What keeping the buffers costs per step: ``core.buffers.StepBuffers`` on a real BatchNorm network.

NaNSentinel and LossSpikeGuard keep, at the start of every optimizer step, a copy of the buffers the
step's forward writes (BatchNorm's running statistics, ``num_batches_tracked``), so that a dropped step
can put them back; LossSpikeGuard also reads each step's BatchNorm batch variance from them. This
benchmark trains the ResNet-18 layout of ``benchmarks/real_models.py`` (``transformers``' ResNet, 20
BatchNorm layers, 60 buffers, 0.70 M parameters, batch 32 of 32x32x3 digits, SGD momentum 0.9) with both
callbacks at their defaults, and measures, per optimizer step in the steady state (after step 10):

* the Python function calls (``sys.setprofile`` ``call`` events) and the aten ops (a
  ``TorchDispatchMode``) made inside ``StepBuffers.keep`` and ``StepBuffers.batch_variance_ratio``: counts
  that hold on any machine, whatever its load;
* the wall time inside them against the whole training step's (``on_train_batch_start`` to
  ``on_train_batch_end``).

``make bench-buffers``; ``--steps N`` for a shorter run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hooks import _Ops  # the aten-op counter of make bench-hooks
from real_models import SGD_RESNET, HFTask, resnet

from lightning_gradguard import LossSpikeGuard, NaNSentinel
from lightning_gradguard.core.buffers import StepBuffers

STEADY_FROM = 10
#: the files of the counting itself: this one, torch's op objects and its Python dispatch
_COUNTERS = (Path(__file__).name,)


class Meter:
    """Per step: calls and aten ops (``count``), or seconds, inside the wrapped methods (counting slows
    every call it sees, so a run counts or times, never both)."""

    def __init__(self, count: str | None) -> None:
        self.count = count  # "calls", "ops" or None (time)
        self.calls: dict[int, int] = {}
        self.ops: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.step = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def measured(*args: Any, **kwargs: Any) -> Any:
            calls = [0]

            def profile(frame: Any, event: str, arg: Any) -> None:
                # the counting's own frames are not ours
                if event == "call" and not frame.f_code.co_filename.endswith(_COUNTERS):
                    calls[0] += 1

            if self.count is None:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - start
                    self.seconds[self.step] = self.seconds.get(self.step, 0.0) + spent
            if self.count == "ops":  # the dispatch mode runs Python of its own: counted apart from calls
                mode = _Ops()
                try:
                    with mode:
                        return fn(*args, **kwargs)
                finally:
                    self.ops[self.step] = self.ops.get(self.step, 0) + mode.count
            sys.setprofile(profile)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
                self.calls[self.step] = self.calls.get(self.step, 0) + calls[0]

        return measured


class StepTimer(pl.Callback):
    def __init__(self, meter: Meter) -> None:
        self.meter, self.seconds = meter, {}  # type: ignore[var-annotated]
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.meter.step = int(trainer.global_step)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds[self.meter.step] = time.perf_counter() - self._start


def fit(steps: int, count: str | None) -> tuple[Meter, StepTimer, torch.nn.Module]:
    """One run with both callbacks at their defaults, the buffer methods measured."""
    pl.seed_everything(0, verbose=False)
    meter = Meter(count)
    originals = {name: getattr(StepBuffers, name) for name in ("keep", "batch_variance_ratio")}
    for name, fn in originals.items():
        setattr(StepBuffers, name, meter.wrap(fn))
    model, loader = resnet()
    timer = StepTimer(meter)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, NaNSentinel(), LossSpikeGuard()],
    )
    try:
        trainer.fit(HFTask(model, SGD_RESNET, total_steps=steps), loader)
    finally:
        for name, fn in originals.items():
            setattr(StepBuffers, name, fn)
    return meter, timer, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls, _, model = fit(args.steps, count="calls")
    ops, _, _ = fit(args.steps, count="ops")
    timed, timer, _ = fit(args.steps, count=None)
    steady = [s for s in sorted(timer.seconds) if s >= STEADY_FROM]
    entries = sum(b.numel() for b in model.buffers())
    count = len(list(model.buffers()))
    print(f"ResNet-18 layout: {count} buffers ({entries:,} entries), steps {steady[0]}-{steady[-1]}")
    for what, per in (("Python calls", calls.calls), ("aten ops", ops.ops)):
        values = [per.get(s, 0) for s in steady]
        median = statistics.median(values)
        print(f"  {what} per step in keep + batch_variance_ratio: median {median:g}, max {max(values)}")
    inside = statistics.median(timed.seconds.get(s, 0.0) for s in steady)
    whole = statistics.median(timer.seconds[s] for s in steady)
    share = inside / whole
    print(f"  time in them: median {inside * 1e3:.3f} ms per step; a step {whole * 1e3:.1f} ms: {share:.2%}")


if __name__ == "__main__":
    main()
