"""Sharded training (FSDP1, FSDP2): the norms we log are those of the whole tensors, as under DDP; the
other callbacks act as under DDP (DeadReLUMonitor, LossSpikeGuard's skip and rollback, LRFinderPlus) or
refuse with one clear warning (the pre-flight checks).

Real 2-process CPU runs (gloo) of ``tests/scripts/sharded_norms.py`` and ``sharded_callbacks.py``, one
per strategy, on the same model, data and seed: DDP, FSDP1 (Lightning's FSDPStrategy through a CPU
subclass, FULL_SHARD, every Linear wrapped) and FSDP2 (ModelParallelStrategy with ``fully_shard``:
DTensor parameters). A hang fails through the timeout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import SHARDED_KINDS, run_ddp_script
from floor import FSDP2_NEEDS, needs_torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_gradguard import GradientNormLogger, LossSpikeGuard, NaNSentinel

KINDS = SHARDED_KINDS  # FSDP2 where this torch has it (tests/floor.py)
#: the sharded ones, each compared with DDP
SHARDED = tuple(k for k in KINDS if k != "ddp")
NAN_AT, STEPS = 3, 6
REL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    out: dict[str, Path] = {}
    for kind in KINDS:  # the strategy is the folder's name
        (root / kind).mkdir()
        proc = run_ddp_script("sharded_norms.py", root / kind, timeout=150)
        assert proc.returncode == 0, f"{kind}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        out[kind] = root / kind
    return out


@needs_torch((2, 7), FSDP2_NEEDS)
def test_fsdp2_is_among_the_strategies_checked() -> None:
    assert "fsdp2" in SHARDED  # below torch 2.7 every test here compares DDP with FSDP1 only


def _read(folder: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((folder / f"{name}{r}.json").read_text()) for r in (0, 1)]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=REL, abs=1e-12)


def test_every_logged_norm_is_the_whole_tensors_under_fsdp1_and_fsdp2(runs: dict[str, Path]) -> None:
    ddp = _read(runs["ddp"], "rank")[0]
    logged = ddp["logged"]
    assert sorted(map(int, logged)) == list(range(STEPS))
    for step, total in ddp["reference"].items():  # DDP logs the true norm (torch's, on full gradients)
        assert logged[step]["2"]["grad_norm/total"] == pytest.approx(total, rel=REL)
    tags = set(logged["0"]["2"])
    assert {
        "grad_norm/net.4",
        "weight_norm/net.0",
        "update_ratio/total",
        "grad_clip/pre_clip_norm_p50",
    } <= tags
    for kind in SHARDED:
        for rank, seen in enumerate(_read(runs[kind], "rank")):  # every rank reads the same whole norms
            assert seen["steps"] == STEPS and seen["warnings"] == [], (kind, seen["warnings"])
            for step in logged:
                for norm in ("2", "inf"):
                    want, got = logged[step][norm], seen["logged"][step][norm]
                    assert got.keys() == want.keys(), (kind, step, set(got) ^ set(want))
                    bad = {t: (want[t], got[t]) for t in want if not _same(want[t], got[t])}
                    assert not bad, (kind, rank, step, norm, bad)
        assert list((runs[kind] / "tb" / "version_0").glob("events.out.tfevents.*"))  # histograms: no crash


def test_the_detector_and_the_spike_guard_judge_the_whole_norms(runs: dict[str, Path]) -> None:
    ddp = _read(runs["ddp"], "rank")[0]
    for kind in SHARDED:
        for seen in _read(runs[kind], "rank"):
            windows = seen["spike_windows"]
            assert len(windows["grad_norm"]) == STEPS
            for key in ("grad_norm", "loss"):
                assert windows[key] == pytest.approx(ddp["spike_windows"][key], rel=REL), (kind, key)
            check, want = seen["detector"], ddp["detector"]
            assert check["total"] == pytest.approx(want["total"], rel=REL)
            assert check["values"] == pytest.approx(want["values"], rel=REL)
            assert check["flow"] == pytest.approx(want["flow"], rel=REL)


def test_nan_sentinel_stops_every_rank_at_the_poisoned_step(runs: dict[str, Path]) -> None:
    want = _read(runs["ddp"], "nan")[0]
    for kind in KINDS:
        for seen in _read(runs[kind], "nan"):
            assert seen["alerts"] == [["nonfinite_loss", NAN_AT]], kind
            assert seen["global_step"] == NAN_AT + 1 and seen["finite"], kind  # stopped, update dropped
            steps = [s for s, _ in seen["history"]]
            assert steps == list(range(NAN_AT + 1)) and math.isnan(seen["history"][-1][1])
            for (_, a), (_, b) in zip(seen["history"][:-1], want["history"][:-1], strict=True):
                assert a == pytest.approx(b, rel=REL)  # the report's recent norms are whole ones too
        folder = runs[kind] / "nan" / "nan_report" / f"step_{NAN_AT}"
        report = json.loads((folder / "report.json").read_text())
        assert report["kind"] == "nonfinite_loss" and report["rank"] == 1
        # the ranks' pieces of each gradient added up: every entry of every tensor is NaN
        listed = report["nonfinite_parameters"]
        assert [t["name"] for t in listed][:2] == ["net.0.weight", "net.0.bias"]
        assert all(t["nonfinite"] == t["numel"] for t in listed) and listed[0]["numel"] == 7 * 13
        if kind == "ddp":
            assert report["origin"]["in_input"] is True
        else:  # no replay under sharding: it would wait on the other ranks' collectives
            assert "not replayed" in report["origin"]["description"]
        # FSDP1 on CPU: no last-good checkpoint (torch's sharded save crashed there); FSDP2 writes one
        assert (folder / "last_good.ckpt").exists() == (kind != "fsdp1"), kind


def test_fsdp1_flat_parameters_warn_once_and_keep_the_totals(runs: dict[str, Path]) -> None:
    ddp = _read(runs["ddp"], "rank")[0]["logged"]
    flat = _read(runs["fsdp1"], "flat")
    assert len(flat[0]["warnings"]) == 1 and "use_orig_params=True" in flat[0]["warnings"][0]
    assert flat[1]["warnings"] == []  # rank zero warns
    for seen in flat:
        for step, values in seen["logged"].items():
            for tag in ("grad_norm/total", "weight_norm/total", "grad_norm/net.0"):
                assert values["2"][tag] == pytest.approx(ddp[step]["2"][tag], rel=REL), (step, tag)


# ---------------------------------------------------------------- the other callbacks (sharded_callbacks.py)
SPIKES, SNAPSHOT_AT, CB_STEPS = (10, 11), 7, 14
STRATEGY_NAMES = {"fsdp1": "CPUFSDPStrategy", "fsdp2": "ModelParallelStrategy"}


@pytest.fixture(scope="module")
def callback_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """One 2-process run of ``sharded_callbacks.py`` per strategy; a crash is the tests' to report (the
    fits write their files in turn, so one that crashes late leaves the earlier ones readable)."""
    root = tmp_path_factory.mktemp("sharded_callbacks")
    out: dict[str, tuple[Path, Any]] = {}
    for kind in KINDS:
        (root / kind).mkdir()
        out[kind] = (root / kind, run_ddp_script("sharded_callbacks.py", root / kind, timeout=150))
    return out


def _fit(runs: dict[str, tuple[Path, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    folder, proc = runs[kind]
    if not (folder / f"{name}1.json").exists():
        pytest.fail(f"{kind}: no {name} result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return _read(folder, name)


def _close(got: dict[str, list[float]], want: dict[str, list[float]]) -> float:
    """The largest relative difference between two sets of whole weights (same names, same sizes)."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for a, b in zip(got[name], want[name], strict=True):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-6))
    return worst


def test_dead_relu_monitor_counts_the_same_dead_units_as_ddp(callback_runs: Any) -> None:
    ddp = _fit(callback_runs, "ddp", "guard")[0]
    # the independent part: the first layer has 6 of 13 units with a bias of -50, which never fire
    assert ddp["dead"][str(CB_STEPS - 1)]["net.1"] == pytest.approx(6 / 13)
    assert ddp["sampled"] == CB_STEPS
    for kind in SHARDED:
        for rank, seen in enumerate(_fit(callback_runs, kind, "guard")):
            assert seen["sampled"] == CB_STEPS and seen["warnings"] == [], (kind, rank, seen["warnings"])
            for step, fractions in ddp["dead"].items():  # every check, every layer, from step 1 on
                assert seen["dead"][step] == pytest.approx(fractions, rel=REL), (kind, rank, step)


def test_loss_spike_guard_skips_and_rolls_back_on_every_rank_under_fsdp(callback_runs: Any) -> None:
    ddp = _fit(callback_runs, "ddp", "guard")[0]
    for kind in KINDS:
        for rank, seen in enumerate(_fit(callback_runs, kind, "guard")):
            # rank 1's loss spiked; both ranks judged it and acted at the same steps
            assert seen["records"] == [[SPIKES[0], "skip"], [SPIKES[1], "rollback"]], (kind, rank)
            assert seen["snapshots"] == [SNAPSHOT_AT] and seen["rollbacks"] == 1, (kind, rank)
            w = seen["weights"]  # the whole (gathered) weights at the end of every step
            assert w[str(SPIKES[0])] == w[str(SPIKES[0] - 1)], (kind, rank)  # skipped: no update at all
            assert w[str(SPIKES[1])] == w[str(SNAPSHOT_AT)], (kind, rank)  # rolled back to the point
            assert w[str(SPIKES[1])] != w[str(SPIKES[1] - 1)]
            for step, want in ddp["weights"].items():  # and the whole run is DDP's
                assert _close(w[step], want) <= REL, (kind, rank, step)


def test_lr_finder_plus_sweeps_the_ddp_curve_under_fsdp(callback_runs: Any) -> None:
    ddp = _fit(callback_runs, "ddp", "lr")[0]
    assert ddp["suggestion"] is not None and len(ddp["lrs"]) >= 10
    for kind in SHARDED:
        for rank, seen in enumerate(_fit(callback_runs, kind, "lr")):
            assert seen["alerts"] == [] and seen["warnings"] == [], (kind, rank, seen["warnings"])
            assert seen["stop_reason"] == ddp["stop_reason"] and seen["lrs"] == ddp["lrs"], (kind, rank)
            assert seen["losses"] == pytest.approx(ddp["losses"], rel=REL), (kind, rank)
            assert seen["suggestion"] == pytest.approx(ddp["suggestion"], rel=REL)
            assert seen["lr_now"] == pytest.approx(seen["suggestion"], rel=1e-12)  # applied on every rank
            # the sweep was undone (restored into the live pieces), then the run trained as DDP's did
            assert seen["steps"] == CB_STEPS and _close(seen["weights"], ddp["weights"]) <= REL, kind


def test_preflight_checks_refuse_under_fsdp_with_one_clear_warning(callback_runs: Any) -> None:
    ddp = _fit(callback_runs, "ddp", "preflight")
    assert all(seen["overfit"] is True and seen["gradcheck"] is True for seen in ddp)  # they do run there
    for kind in SHARDED:
        assert callback_runs[kind][1].returncode == 0, callback_runs[kind][1].stderr[-3000:]
        zero, one = _fit(callback_runs, kind, "preflight")
        assert one["warnings"] == [], one["warnings"]  # rank zero warns
        assert len(zero["warnings"]) == 2, zero["warnings"]
        for check, message in zip(("OverfitBatchSanity", "GradientCheck"), zero["warnings"], strict=True):
            assert message.startswith(f"{check} does not run under {STRATEGY_NAMES[kind]}"), message
            assert "skipped" in message and "devices=1" in message
        for seen in (zero, one):
            assert seen["overfit"] is None and seen["gradcheck"] is None and seen["alerts"] == []
            # untouched: the run trains exactly as DDP's did after its checks restored everything
            assert seen["steps"] == CB_STEPS and _close(seen["weights"], ddp[0]["weights"]) <= REL, kind


def test_shares_of_pieces_add_up_to_the_whole_norms() -> None:
    """Pure math: each rank's shares (pieces' p-th powers over their copies; maxima for inf) combine
    into the norms of the whole tensors, per tensor, per group and in total."""
    from lightning_gradguard.core.sharding import PendingNorms
    from lightning_gradguard.functional.stats import group_shares, norm_shares, total_share

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in (7, 1, 12, 5)]
    index, world = torch.tensor([0, 0, 1, 1]), 3
    copies = torch.tensor([1.0, 3.0, 1.0, 1.0])  # tensor 1 is replicated on every rank
    for p in (2.0, math.inf):
        ranks = []
        for r in range(world):
            pieces = [t if c > 1 else t.tensor_split(world)[r] for t, c in zip(tensors, copies, strict=True)]
            norms = torch.stack([torch.linalg.vector_norm(x, ord=p) for x in pieces])
            shares = norm_shares(norms, copies, p)
            ranks.append((shares, group_shares(shares, index, 2, p), total_share(shares, p)))
        combine = (
            (lambda xs: torch.stack(xs).amax(0)) if math.isinf(p) else (lambda xs: torch.stack(xs).sum(0))
        )
        per, groups, total = (combine([r[i] for r in ranks]) for i in range(3))
        finish = PendingNorms(per, p, sharded=True).finish
        whole = [torch.linalg.vector_norm(t, ord=p) for t in tensors]
        torch.testing.assert_close(finish(per), torch.stack(whole))
        torch.testing.assert_close(
            finish(groups),
            torch.stack(
                [torch.linalg.vector_norm(torch.cat(tensors[a:b]), ord=p) for a, b in ((0, 2), (2, 4))]
            ),
        )
        torch.testing.assert_close(finish(total), torch.linalg.vector_norm(torch.cat(tensors), ord=p))


class DeepSpeedStrategy(SingleDeviceStrategy):
    """Stands in for Lightning's (what we look at is the strategy's class name)."""


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_deepspeed_gets_one_clear_message_and_no_gradient_numbers(tmp_path: Path, memory_logger: Any) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=8)
    norms, spike, sentinel = GradientNormLogger(log_every_n_steps=1), LossSpikeGuard(), NaNSentinel()
    trainer = pl.Trainer(
        strategy=DeepSpeedStrategy(device=torch.device("cpu")),
        max_epochs=1,
        logger=memory_logger,
        callbacks=[norms, spike, sentinel],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.warns(UserWarning, match="off under DeepSpeed") as caught:
        trainer.fit(_Tiny(), loader)
    assert sum("DeepSpeed" in str(w.message) for w in caught) == 1
    tags = {k for _, metrics in memory_logger.calls for k in metrics}
    assert not any(t.startswith(("grad_norm/", "weight_norm/", "update_ratio/")) for t in tags), tags
    # the loss alone is judged of the step's numbers (beside the batch's inputs, which need no gradient)
    assert set(spike.windows) - {"inputs"} == {"loss"} and len(spike.windows["loss"]) == 4
    assert sentinel.alerts == []
