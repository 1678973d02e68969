"""Dead and saturated units over a window of sampled steps: the verdict of the dead-ReLU monitor, and its
declared alert kinds (:data:`RULES`).

Pure functions and a small store on per-unit counts, no Trainer:

* :class:`UnitCounts`: one layer's per-unit counts (active values of a ReLU output, or saturated inputs of a
  sigmoid/tanh, as from :func:`~lightning_gradguard.functional.health.activity_counts` /
  :func:`~lightning_gradguard.functional.health.saturation_counts`) and how many values each unit had; one
  forward pass, or pooled by :func:`pool` over the micro-batches of an optimizer step;
* :func:`window_summary`: a window of sampled steps -> the layer's fraction of dead (or saturated) units
  and its per-unit rates; :func:`silent_fraction`: the share of units silent on one step;
* :class:`UnitWindows`: the windows of many layers and their strikes (consecutive full windows over the
  limit), updated once per sampled step into a :class:`StepVerdict` (one :class:`LayerCheck` per layer, the
  scalars and histograms to log, the findings); it is what a checkpoint stores;
* the two rules, one declaration each (kind, docs row, hint and check): a layer whose check fired is put
  into words (a :class:`~lightning_gradguard.alerts.Finding`) by its rule's check, run from :data:`RULES`
  on a :class:`Sampled` (:func:`dead_finding`, :func:`saturated_finding` word one layer).

Example::

    from lightning_gradguard.monitors.dead_units.rules import window_summary

    summary = window_summary([counts_step1, counts_step2], [64.0, 64.0], saturation=False)
    summary.fraction, summary.rates   # dead fraction; per-unit activation rate over the window
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.core.runstate import RunField, Stateful, Streaks
from lightning_gradguard.functional.health import dead_units
from lightning_gradguard.monitors.dead_units.tags import ACTIVATION_RATE, DEAD_RELU, SATURATED


@dataclass
class UnitCounts:
    """One watched layer in one forward pass (or pooled over several).

    ``counts[u]``: how many of unit ``u``'s values were active (a ReLU output) or saturated (a sigmoid/tanh
    input, ``saturation=True``); ``samples``: how many values each unit had.
    """

    saturation: bool
    counts: Tensor
    samples: float


def pool(into: dict[str, UnitCounts], records: Mapping[str, UnitCounts]) -> None:
    """Add one forward pass's ``records`` to ``into`` (the micro-batches of one optimizer step so far).

    A unit is active in the pool if any sample of any pass fired it, and its rate is over all their samples;
    a layer whose unit count changed starts afresh.
    """
    for key, record in records.items():
        prev = into.get(key)
        if prev is not None and prev.counts.shape == record.counts.shape:
            counts, samples = prev.counts + record.counts, prev.samples + record.samples
            record = UnitCounts(saturation=record.saturation, counts=counts, samples=samples)
        into[key] = record


@dataclass(frozen=True)
class WindowSummary:
    """A layer over a window of sampled steps.

    ``fraction``: for a ReLU, the fraction of units inactive in every step of the window (dead); for a
    sigmoid/tanh, the fraction of units whose inputs lay in the saturated zone more than half of the time.
    ``rates``: per unit, active (or saturated) values over all values of the window. ``units``: the layer's
    width; ``steps``: sampled steps in the window.
    """

    fraction: float
    rates: Tensor
    units: int
    steps: int


def window_summary(counts: Sequence[Tensor], samples: Sequence[float], saturation: bool) -> WindowSummary:
    """Summarise a window: one per-unit count vector and one values-per-unit number per sampled step."""
    stacked = torch.stack(list(counts))
    rates = stacked.sum(0) / max(sum(samples), 1.0)
    if saturation:
        fraction = float((rates > 0.5).float().mean())
    else:
        fraction = float(dead_units(stacked).float().mean())
    return WindowSummary(fraction=fraction, rates=rates, units=stacked.shape[1], steps=len(stacked))


def silent_fraction(step_counts: Tensor) -> float:
    """Fraction of units with no active value on one step (a hint that the layer may be dying)."""
    return float((step_counts == 0).float().mean())


@dataclass(frozen=True)
class LayerCheck:
    """One layer after one sampled step: its window, its limit, and whether it is reported.

    ``silent``: the fraction of its units silent on this very step (ReLU layers; 0 for sigmoid/tanh).
    ``full``: the window holds ``window`` steps (only then is a fraction a verdict). ``fires``: over the
    limit on ``patience`` consecutive full windows.
    """

    key: str
    saturation: bool
    summary: WindowSummary
    limit: float
    silent: float
    full: bool
    fires: bool


@dataclass(frozen=True)
class StepVerdict:
    """Every watched layer after one sampled step.

    ``scalars``: ``dead_relu/<layer>`` / ``saturated/<layer>``, the fraction over the window so far;
    ``rates``: ``activation_rate/<layer>``, the per-unit activation rates of the ReLU layers;
    ``dead_fractions`` / ``saturated_fractions``: the fractions of the layers whose window is full;
    ``suspicious``: a ReLU layer had more than ``threshold`` of its units silent on this very step. The
    layers whose check fired are put into words by the rules (:data:`RULES`, on a :class:`Sampled`).
    """

    checks: list[LayerCheck]
    scalars: dict[str, float]
    rates: dict[str, Tensor]
    dead_fractions: dict[str, float]
    saturated_fractions: dict[str, float]
    suspicious: bool


@dataclass(frozen=True)
class Sampled:
    """What the rules read after a sampled step: every layer's check (:class:`StepVerdict`) and whether the
    run is learning (its loss fell to half its start and holds there: dead units then cost it nothing)."""

    verdict: StepVerdict
    learning: bool = False


_Window = deque[tuple[Tensor, float]]


def _windows_saved(_: Any, windows: dict[str, _Window]) -> dict[str, list[dict[str, Any]]]:
    return {k: [{"counts": c.clone(), "samples": n} for c, n in w] for k, w in windows.items()}


def _windows_loaded(owner: UnitWindows, saved: Mapping[str, Any]) -> dict[str, _Window]:
    return {
        k: deque([(torch.as_tensor(s["counts"]), float(s["samples"])) for s in w], maxlen=owner.size)
        for k, w in saved.items()
    }


class UnitWindows(Stateful):
    """Per layer, its last ``size`` sampled steps (``(per-unit counts, values per unit)``, oldest first), and
    per finding (``"<kind>@<layer>"``) how many full windows in a row were over the limit.

    A layer whose width changed (a resized model) starts a fresh window.
    """

    strikes: RunField[Streaks] = RunField(Streaks)
    windows: RunField[dict[str, _Window]] = RunField(dict, save=_windows_saved, load=_windows_loaded)

    def __init__(self, size: int) -> None:
        self.size = size
        self.reset_run()

    def __getitem__(self, key: str) -> deque[tuple[Tensor, float]]:
        return self.windows[key]

    def add(self, key: str, counts: Tensor, samples: float) -> None:
        """Append one sampled step of layer ``key``."""
        win = self.windows.get(key)
        if win is None or (win and win[-1][0].numel() != counts.numel()):
            win = self.windows[key] = deque(maxlen=self.size)
        win.append((counts, samples))

    def update(
        self, records: Mapping[str, UnitCounts], threshold: float, saturation_threshold: float, patience: int
    ) -> StepVerdict:
        """Add one sampled step (host counts of every layer) and check each layer, in ``records``' order.

        A layer is reported when its fraction is above ``threshold`` (ReLU) or ``saturation_threshold``
        (sigmoid/tanh) on ``patience`` consecutive full windows.
        """
        for key, record in records.items():
            self.add(key, record.counts, record.samples)
        checks = []
        for key, record in records.items():
            win = self.windows[key]
            summary = window_summary([c for c, _ in win], [n for _, n in win], record.saturation)
            limit = saturation_threshold if record.saturation else threshold
            full = len(win) >= self.size
            rule = SATURATED_RULE if record.saturation else DEAD_RELU_RULE
            strike = f"{rule.kind}@{key}"
            if full:
                self.strikes.update(strike, summary.fraction > limit)
            silent = 0.0 if record.saturation else silent_fraction(record.counts)
            fires = full and self.strikes[strike] >= patience
            checks.append(
                LayerCheck(
                    key=key,
                    saturation=record.saturation,
                    summary=summary,
                    limit=limit,
                    silent=silent,
                    full=full,
                    fires=fires,
                )
            )
        relu = [c for c in checks if not c.saturation]
        return StepVerdict(
            checks=checks,
            scalars={
                (SATURATED if c.saturation else DEAD_RELU).tag(c.key): c.summary.fraction for c in checks
            },
            rates={ACTIVATION_RATE.tag(c.key): c.summary.rates for c in relu},
            dead_fractions={c.key: c.summary.fraction for c in relu if c.full},
            saturated_fractions={c.key: c.summary.fraction for c in checks if c.saturation and c.full},
            suspicious=any(c.silent > threshold for c in relu),
        )


def _data(check: LayerCheck) -> dict[str, float]:
    s = check.summary
    return {
        "fraction": s.fraction,
        "threshold": check.limit,
        "units": float(s.units),
        "window": float(s.steps),
    }


# ------------------------------------------------------------------ dead_relu
def _dead(ev: Sampled) -> list[Finding]:
    """Each ReLU layer whose check fired, unless the run is learning (units dead from the start are named
    by the first full windows, before it can be)."""
    if ev.learning:
        return []
    return [dead_finding(c) for c in ev.verdict.checks if c.fires and not c.saturation]


def dead_finding(check: LayerCheck) -> Finding:
    """A ReLU layer whose check fired: most of its units gave 0 for every sample of the window."""
    s, key, limit = check.summary, check.key, check.limit
    message = (
        f"{s.fraction:.0%} of the {s.units} units of {key} output 0 for every sample of the last "
        f"{s.steps} sampled steps (threshold {limit:.0%})."
    )
    return Finding(DEAD_RELU_RULE, message, _data(check), where=key)


DEAD_RELU_RULE: Rule[Sampled] = Rule(
    kind="dead_relu",
    severity="error",
    monitor="DeadReLUMonitor",
    summary="most units of a ReLU layer output 0 for every sample over a window of sampled batches",
    when=(
        "more than `threshold` (0.5) of a ReLU layer's units gave 0 for every sample of the last "
        "`window_samples` (4) sampled optimizer steps, on `patience` (2) consecutive full-window checks, "
        "while the run is not learning (the median of its last three sampled losses above half its "
        "start): units that stopped firing in a run that learns cost it nothing it needed. Units "
        "dead from the start (the first verdict, step 4) are always named."
    ),
    hint=(
        "Lower the learning rate; initialise with He/Kaiming and zero (or small positive) biases; normalise "
        "the inputs; put BatchNorm/LayerNorm before the ReLU; or switch to LeakyReLU/GELU, whose units "
        "cannot die."
    ),
    check=_dead,
)


# ------------------------------------------------------------------ saturated_activation
def _saturated(ev: Sampled) -> list[Finding]:
    """Each sigmoid/tanh layer whose check fired."""
    return [saturated_finding(c) for c in ev.verdict.checks if c.fires and c.saturation]


def saturated_finding(check: LayerCheck) -> Finding:
    """A sigmoid/tanh layer whose check fired: most of its units sat in the saturated zone."""
    s, key, limit = check.summary, check.key, check.limit
    message = (
        f"{s.fraction:.0%} of the {s.units} units of {key} spend most of the last {s.steps} sampled "
        f"steps in the saturated zone, where the derivative is 0 (threshold {limit:.0%})."
    )
    return Finding(SATURATED_RULE, message, _data(check), where=key)


SATURATED_RULE: Rule[Sampled] = Rule(
    kind="saturated_activation",
    severity="warning",
    monitor="DeadReLUMonitor",
    summary="most units of a sigmoid/tanh layer sit where the derivative is numerically 0",
    when=(
        "more than `saturation_threshold` (0.5) of the units of a sigmoid/tanh layer sit in the "
        "flat zone (with `check_saturation=True`, the default)."
    ),
    hint=(
        "Pre-activations are far outside the sensitive range: normalise the inputs, use Xavier "
        "initialization, add normalization before the activation, lower the learning rate, or use ReLU/GELU."
    ),
    check=_saturated,
)

#: every kind this monitor reports, in the order they are judged
RULES: tuple[Rule[Sampled], ...] = declare(DEAD_RELU_RULE, SATURATED_RULE)
