"""The spike score (functional.spikes), LossSpikeGuard's rules and alert wording (monitors.spike.rules) and
spikes.json (monitors.spike.records) against hand computations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lightning_gradguard.functional.spikes import SpikeScore, is_spike, spike_score
from lightning_gradguard.monitors.spike.records import (
    FORMAT,
    SpikeRecord,
    read_skip_batches,
    write_spikes,
)
from lightning_gradguard.monitors.spike.rules import (
    LOSS_SPIKE,
    SPIKE_HINTS,
    escalated_action,
    snapshot_due,
    spike_finding,
)


def _hand_score(value: float, window: list[float], log: bool) -> tuple[float, float]:
    """(z-score, level) by hand with NumPy: median and 1.4826 * MAD, a 1 % floor on the scale."""
    xs = np.log(window) if log else np.asarray(window, dtype=float)
    x = math.log(value) if log else value
    center = float(np.median(xs))
    mad = float(np.median(np.abs(xs - center)))
    floor = 0.01 if log else 0.01 * max(abs(center), 1e-12)
    scale = max(1.4826 * mad, floor)
    return (x - center) / scale, (math.exp(center) if log else center)


WINDOW = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.0, 1.15, 0.97]


def test_spike_score_log_space_matches_median_and_mad_of_logs() -> None:
    s = spike_score(3.0, WINDOW)
    z, level = _hand_score(3.0, WINDOW, log=True)
    assert s.log_space is True
    assert s.zscore == pytest.approx(z, rel=1e-12)
    assert s.level == pytest.approx(level, rel=1e-12) and s.level == pytest.approx(1.0)
    assert s.ratio == pytest.approx(3.0 / level, rel=1e-12)
    # log space is not linear space: the linear z-score of the same numbers differs
    assert s.zscore != pytest.approx(_hand_score(3.0, WINDOW, log=False)[0], rel=1e-3)
    # even window length: the median is the mean of the two middle values
    even = [1.0, 2.0, 4.0, 8.0]
    assert spike_score(16.0, even).level == pytest.approx(math.sqrt(2.0 * 4.0), rel=1e-12)


@pytest.mark.parametrize(
    ("value", "window"),
    [
        (0.5, [-1.0, -0.8, -1.2, -0.9, -1.1, -1.05, -0.95, -1.0]),  # a negative log-likelihood
        (2.0, [0.0, 0.1, 0.2, 0.15, 0.05, 0.1, 0.12, 0.08]),  # one value is 0
        (-0.5, WINDOW),  # the value itself is negative
    ],
)
def test_spike_score_linear_space_when_a_value_is_not_positive(value: float, window: list[float]) -> None:
    s = spike_score(value, window)
    z, level = _hand_score(value, window, log=False)
    assert s.log_space is False
    assert s.zscore == pytest.approx(z, rel=1e-12)
    assert s.level == pytest.approx(level, rel=1e-12)


def test_spike_score_constant_window_uses_the_floor_and_ignores_non_finite() -> None:
    s = spike_score(2.2, [2.0] * 8 + [math.nan, math.inf])
    assert s.log_space is True
    assert s.zscore == pytest.approx(math.log(1.1) / 0.01, rel=1e-12)  # MAD 0: the 1 % floor
    for value, window in [(1.0, []), (math.nan, WINDOW), (math.inf, WINDOW), (1.0, [math.nan])]:
        empty = spike_score(value, window)
        assert math.isnan(empty.zscore) and not is_spike(empty, 1.0, 1.0)


def _score(value: float, level: float, zscore: float, log_space: bool = True) -> SpikeScore:
    return SpikeScore(value=value, level=level, zscore=zscore, ratio=value / level, log_space=log_space)


def test_is_spike_needs_the_threshold_and_min_ratio() -> None:
    assert is_spike(_score(3.0, 1.0, 6.0), 6.0, 2.0)  # both reached (bounds inclusive)
    assert is_spike(_score(2.0, 1.0, 50.0), 6.0, 2.0)
    assert not is_spike(_score(1.9, 1.0, 50.0), 6.0, 2.0)  # a huge z-score in a quiet window, small rise
    assert not is_spike(_score(5.0, 1.0, 5.9), 6.0, 2.0)  # large rise, z-score below the threshold
    # from real windows: a quiet window makes a 30 % rise a z-score of ~26, still not 2x the median
    quiet = spike_score(1.3, [1.0] * 16)
    assert quiet.zscore > 20 and not is_spike(quiet, 6.0, 2.0) and is_spike(quiet, 6.0, 1.25)
    # linear space: the value must be at least level + (min_ratio - 1) * |level|
    assert is_spike(_score(0.0, -1.0, 9.0, log_space=False), 6.0, 2.0)  # -1 + 1 * 1 = 0
    assert not is_spike(_score(-0.01, -1.0, 9.0, log_space=False), 6.0, 2.0)
    assert is_spike(_score(3.0, 1.5, 9.0, log_space=False), 6.0, 2.0)
    assert not is_spike(_score(2.9, 1.5, 9.0, log_space=False), 6.0, 2.0)


def test_escalated_action_ladder() -> None:
    def ladder(action: str, can_roll_back: bool, patience: int = 3, n: int = 10) -> list[str]:
        return [escalated_action(action, k, patience, can_roll_back) for k in range(1, n + 1)]

    assert ladder("skip", True) == ["skip"] * 3 + ["rollback"] * 3 + ["raise"] * 4
    assert ladder("skip", False) == ["skip"] * 3 + ["raise"] * 7  # no snapshot: rollback passed over
    assert ladder("rollback", True) == ["rollback"] * 3 + ["raise"] * 7
    assert ladder("rollback", False) == ["skip"] * 3 + ["raise"] * 7  # a rollback without snapshot skips
    assert ladder("raise", True) == ["raise"] * 10
    assert ladder("skip", True, patience=1, n=4) == ["skip", "rollback", "raise", "raise"]
    assert ladder("skip", True, patience=2, n=6) == ["skip", "skip", "rollback", "rollback", "raise", "raise"]
    for can in (True, False):
        assert set(ladder("warn", can, n=50)) == {"warn"}  # warn never escalates


RECORDS = [
    SpikeRecord(step=12, epoch=0, batch_idx=[12], loss=3.5, loss_zscore=10.25, grad_norm=22.0,
                grad_norm_zscore=12.5, action="skip"),
    SpikeRecord(step=40, epoch=1, batch_idx=[36, 37, 38], loss=None, loss_zscore=None, grad_norm=8.0,
                grad_norm_zscore=7.0, action="rollback"),
    SpikeRecord(step=41, epoch=1, batch_idx=[39], loss=2.0, loss_zscore=math.nan, grad_norm=1.0,
                grad_norm_zscore=math.inf, action="replayed"),
]  # fmt: skip


def test_spikes_json_format_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "spikes.json"
    write_spikes(str(path), RECORDS)
    content = json.loads(path.read_text())  # strict JSON: no NaN / Infinity tokens
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"token {c}")) == content
    assert content["format"] == FORMAT == "lightning_gradguard.spikes/1"
    assert [SpikeRecord(**s) for s in content["spikes"][:2]] == RECORDS[:2]  # finite records: equal
    last = content["spikes"][2]
    assert last["loss_zscore"] is None and last["grad_norm_zscore"] is None  # non-finite -> null
    assert last["batch_idx"] == [39] and last["action"] == "replayed" and last["loss"] == 2.0
    assert read_skip_batches(str(path)) == {(0, 12), (1, 36), (1, 37), (1, 38), (1, 39)}
    write_spikes(str(path), [])  # the file is rewritten whole
    assert read_skip_batches(str(path)) == set()


@pytest.mark.parametrize(
    "text",
    [
        '{"spikes": []}',  # no format
        '{"format": "lightning_gradguard.spikes/2", "spikes": []}',  # another format
        "[1, 2]",  # not an object
        "not json at all",
        '{"format": "lightning_gradguard.spikes/1"}',  # no spikes
        '{"format": "lightning_gradguard.spikes/1", "spikes": [{"step": 3}]}',  # an entry without batches
    ],
)
def test_a_wrong_skip_batches_file_raises_value_error_naming_the_argument(text: str, tmp_path: Path) -> None:
    path = tmp_path / "spikes.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="skip_batches_path"):
        read_skip_batches(str(path))


def test_snapshot_due_at_warmup_end_then_every_n_and_after_a_held_rollback() -> None:
    due = [j for j in range(1, 400) if snapshot_due(j, 50, 100, streak=0, calm=0, probation=False)]
    assert due == [50, 100, 200, 300]
    assert not snapshot_due(100, 50, 100, streak=1, calm=0, probation=False)  # never mid-streak
    assert not snapshot_due(100, 50, 0, streak=0, calm=0, probation=False)  # snapshots off
    # after a rollback: only once `every` healthy steps followed it, whatever the judged count
    assert [c for c in range(0, 150, 10) if snapshot_due(137, 50, 100, 4, c, True)] == [
        100,
        110,
        120,
        130,
        140,
    ]


def test_spike_alert_says_the_numbers_the_streak_and_the_action() -> None:
    scores = {"loss": _score(3.0, 1.0, 9.0), "grad_norm": _score(40.0, 2.0, 12.5)}
    values = {"loss": 3.0, "grad_norm": 40.0}
    alert = spike_finding(step=7, action="rollback", values=values, scores=scores, streak=2)
    assert alert.rule is LOSS_SPIKE and alert.where is None
    assert alert.message == (
        "Spike at step 7: loss 3 is 3x the recent median 1 (robust z-score 9.0); "
        "grad norm 40 is 20x the recent median 2 (robust z-score 12.5); 2 spikes in a row. Action: rollback."
    )
    assert (alert.severity, alert.hint) == ("warning", SPIKE_HINTS["rollback"])
    assert alert.data == {"loss_zscore": 9.0, "grad_norm_zscore": 12.5, "streak": 2.0}
    first = spike_finding(step=3, action="raise", values=values, scores={"loss": scores["loss"]}, streak=1)
    assert first.severity == "error" and "in a row" not in first.message and first.message.endswith("raise.")
