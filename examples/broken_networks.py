"""The broken-network gallery: train each deliberately broken net and print what the detectors said.

Run it from the repository root::

    .venv/bin/python examples/broken_networks.py            # the broken gallery (a few seconds)
    .venv/bin/python examples/broken_networks.py --all      # plus the healthy controls
    .venv/bin/python examples/broken_networks.py --markdown # the results table of docs/detectors.md

Every case (``examples/zoo.py``) is a real Lightning run on scikit-learn's digits or small synthetic
sequences, with every training monitor of gradguard at its DEFAULT arguments (``zoo.monitors()``). For
each case it prints the alerts (kind, layer, step, message, hint), then a summary table: what was
expected, what was detected and at which step, whether the first alert named the cause, and any false
alert.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import textwrap
import warnings

import torch
from zoo import CASES, Result, detect


def quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_gradguard"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the alerts are printed below instead
    warnings.filterwarnings("ignore")


def show(result: Result) -> None:
    case = result.case
    label = "healthy control" if case.healthy else f"expected: {', '.join(case.expected)}"
    print(f"\n=== {case.name}: {case.description} ({label}) ===")
    if not result.serious:
        print("  no alert")
    if result.stopped:
        print(f"  the run was stopped by a monitor: {result.stopped}")
    for alert in result.serious:
        print(f"  [{alert.severity}] {alert.kind} at {alert.where} (step {alert.step})")
        print(textwrap.indent(textwrap.fill(alert.message, 100), "      "))
        print(textwrap.indent(textwrap.fill("hint: " + alert.hint, 100), "      "))


def cause_named(r: Result) -> str:
    """Whether the first expected alert says the case's cause words (``-`` where none are set)."""
    if not r.case.cause:
        return "-"
    first = next((a for a in r.serious if a.kind == r.case.expected[0]), None)
    return "yes" if first is not None and r.case.cause in f"{first.message} {first.hint}" else "no"


def table(results: list[Result]) -> str:
    rows = [
        "| case | what | expected | detected (first step) | onset | allowed delay | cause named "
        "| false alerts |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for r in results:
        expected = ", ".join(f"`{k}`" for k in r.case.expected) or "nothing (healthy)"
        detected = ", ".join(f"`{k}` ({s})" for k, s in r.detected.items()) or "-"
        if r.case.healthy:
            detected = "nothing" if not r.serious else detected
        false = ", ".join(f"`{a.kind}`@{a.where} ({a.step})" for a in r.false_alerts) or "none"
        delay = "-" if r.case.healthy else str(r.case.max_delay)
        cells = [f"`{r.case.name}`", r.case.description, expected, detected, str(r.case.onset), delay]
        rows.append("| " + " | ".join([*cells, cause_named(r), false]) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--all", action="store_true", help="also train the healthy controls")
    parser.add_argument("--markdown", action="store_true", help="print only the results table (all cases)")
    args = parser.parse_args()
    quiet()
    # one torch thread unless OMP_NUM_THREADS says otherwise: on a busy machine threads wait on each other
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    cases = [c for c in CASES if args.all or args.markdown or not c.healthy]
    results = []
    with tempfile.TemporaryDirectory(prefix="gradguard-zoo-") as tmp:
        for case in cases:
            results.append(detect(case, root_dir=tmp))
            if not args.markdown:
                show(results[-1])
    if not args.markdown:
        print("\n=== summary ===")
    print(table(results))
    if not args.markdown:
        print(f"\n{len(results)} cases trained in {sum(r.seconds for r in results):.1f} s")


if __name__ == "__main__":
    main()
