"""Alert kinds are declared where the monitors keep their rules, and everything central is built from them.

``ALERT_KINDS`` and docs/alerts.md's table come from the declarations (lightning_gradguard/registry.py);
every monitor's kinds are declared in its own folder; a monitor that reports a kind it did not declare
fails under ``GRADGUARD_STRICT=1``; StallDetector runs its rules from their declarations.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, RecordingMLP, make_trainer, public_callbacks, random_loader

import lightning_gradguard
from lightning_gradguard import registry
from lightning_gradguard.alerts import Rule, alert_kinds, declare, kinds_table, undeclared
from lightning_gradguard.core.base import GradGuardCallback
from lightning_gradguard.monitors.stall import rules as stall_rules
from lightning_gradguard.monitors.stall.check import StallCheck, StallThresholds
from lightning_gradguard.monitors.stall.state import StallState

#: the kinds of 0.1, which are never renamed
RELEASED = {
    "nonfinite_loss", "nonfinite_gradient", "nonfinite_parameter", "loss_scale_collapse",
    "clipping_always_active", "clipping_never_active", "exploding_gradient", "vanishing_gradient",
    "dead_relu", "saturated_activation", "overfit_failed", "unused_parameter", "parameter_not_updated",
    "update_below_precision", "initial_loss_mismatch", "batch_mixing", "labels_unstable",
    "gradient_not_shrinking", "overfit_unstable", "gradient_mismatch", "loss_spike", "early_divergence",
    "batch_statistics_outlier", "lr_finder_failed", "no_update", "clipped_updates", "lr_decayed",
    "updates_collapsed", "chance_level", "loss_plateau", "lr_jump", "warmup_never_ends", "warmup_missing",
    "sorted_labels", "weight_decay_collapse", "fp16_headroom_low", "attention_logit_growth",
    "attention_entropy_collapse", "adam_epsilon_dominates", "update_ratio_outlier", "adam_step_too_large",
    "parameters_not_in_optimizer", "update_ratio_high", "dropout_too_high",
}  # fmt: skip


def test_alert_kinds_is_built_from_the_declarations_and_keeps_every_released_kind() -> None:
    assert lightning_gradguard.ALERT_KINDS is registry.ALERT_KINDS
    assert set(registry.ALERT_KINDS) == RELEASED == {r.kind for r in registry.RULES}
    assert all(registry.ALERT_KINDS[r.kind] == r.summary for r in registry.RULES)


def test_every_monitor_declares_its_kinds_in_its_own_folder() -> None:
    monitors = {m.split(".")[2]: m for m in registry.DECLARED_IN}
    assert set(monitors) == {
        p.name for p in (ROOT / "lightning_gradguard/monitors").iterdir() if p.is_dir()
    } - {"__pycache__"}
    for module in registry.DECLARED_IN:
        owners = {r.monitor for r in sys.modules[module].RULES}
        assert len(owners) == 1, module  # one monitor per declaration module
    by_monitor = {r.monitor for r in registry.RULES}
    assert by_monitor == {c.__name__ for c in public_callbacks()}  # every callback of the package declares


def test_a_kind_two_monitors_declare_is_one_row_and_one_summary() -> None:
    shared = [r for r in registry.RULES if r.kind == "update_below_precision"]
    assert {r.monitor for r in shared} == {"OverfitBatchSanity", "StallDetector"}
    row = next(line for line in registry.alerts_table().splitlines() if "`update_below_precision`" in line)
    assert "`OverfitBatchSanity`, `StallDetector`" in row and all(r.when in row for r in shared)
    a = Rule(kind="x_y", severity="info", monitor="A", summary="one")
    with pytest.raises(ValueError, match="different summaries"):
        alert_kinds([a, dataclasses.replace(a, monitor="B", summary="two")])


def test_a_declaration_is_checked() -> None:
    with pytest.raises(ValueError, match="severity"):
        Rule(kind="x_y", severity="fatal", monitor="A", summary="one")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="snake_case"):
        Rule(kind="Bad Kind", severity="info", monitor="A", summary="one")
    with pytest.raises(ValueError, match="declared twice"):
        declare(*[Rule(kind="x_y", severity="info", monitor="A", summary="one")] * 2)
    table = kinds_table([Rule(kind="x_y", severity="warning", also=("error",), monitor="A", summary="s")])
    assert table.splitlines()[-1] == "| `x_y` | warning / error | `A` | s |"


def test_the_docs_table_of_kinds_is_the_generated_one() -> None:
    page = (ROOT / "docs/alerts.md").read_text(encoding="utf-8")
    assert registry.with_tables(page) == page, f"docs/alerts.md is stale: run `{registry.REWRITE}`"
    assert registry.with_tables(page.replace("| `dead_relu` |", "| `dead_neuron` |")) == page  # it rewrites


class _Liar(GradGuardCallback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.report(trainer, self.kind, "warning", None, "m", "h")


def test_a_monitor_reporting_a_kind_it_did_not_declare_fails_under_strict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRADGUARD_STRICT", "1")
    declare(Rule(kind="liar_finding", severity="warning", monitor="_Liar", summary="what the liar says"))
    assert undeclared("_Liar", "something_else") and not undeclared("_Liar", "liar_finding")
    assert not undeclared("LossCeiling", "loss_above_limit")  # a callback that declared nothing: any kind
    assert all(not undeclared(r.monitor, r.kind) for r in registry.RULES)
    for kind, fails in (("liar_finding", False), ("something_else", True)):
        liar = _Liar()
        liar.kind = kind  # type: ignore[attr-defined]
        trainer = make_trainer([liar], None, max_steps=1)
        if fails:
            with pytest.raises(ValueError, match="'something_else', a kind it did not declare"):
                trainer.fit(RecordingMLP(), random_loader(n=32))
        else:
            trainer.fit(RecordingMLP(), random_loader(n=32))
            assert [a.kind for a in liar.alerts] == ["liar_finding"]


def test_the_stall_rules_are_their_declarations() -> None:
    kinds = [r.kind for r in stall_rules.RULES]
    assert {k for k in registry.ALERT_KINDS if registry.RULES} >= set(kinds) and len(kinds) == len(set(kinds))
    assert set(kinds) - {"chance_level", "loss_plateau"} == stall_rules.CAUSES
    fields = {f.name for f in dataclasses.fields(StallThresholds)}
    used = {t for r in stall_rules.RULES for t in r.thresholds}
    assert used <= fields and fields - used <= {"improvement", "early_phase"} | used
    assert all(
        r.where and r.severity == "warning" and r.monitor == "StallDetector" for r in stall_rules.RULES
    )
    # every rule carries its check (lr_decayed's reads the schedule ahead; the no_update and collapse
    # checks name it too, from what they saw)
    assert [r.kind for r in stall_rules.RULES if r.check is None] == []


def test_a_rule_added_by_its_declaration_alone_is_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walkthrough of docs/architecture.md: one more declaration, and the detector judges it."""

    def lr_above_one(e: stall_rules.Judged) -> stall_rules.Finding | None:
        c = e.check
        return stall_rules.Finding(new, f"LR {c.lr}", {"lr": c.lr}) if c.lr > 1.0 else None

    new = Rule(
        kind="lr_above_one", severity="warning", monitor="StallDetector", summary="the LR is above 1",
        where="lr_scheduler", hint="Lower it.", cause=True, check=lr_above_one,
    )  # fmt: skip
    monkeypatch.setattr(stall_rules, "RULES", (*stall_rules.RULES, new))
    state = StallState(StallThresholds())
    found = stall_rules.observe(state, StallCheck(step=0, lr=2.0, lr_max=2.0, lr_configured=2.0))
    assert [(f.kind, f.where, f.hint) for f in found] == [("lr_above_one", "lr_scheduler", "Lower it.")]
    assert stall_rules.observe(state, StallCheck(step=1, lr=2.0, lr_max=2.0, lr_configured=2.0)) == []


def test_import_and_the_kinds_stay_lazy() -> None:
    """``import lightning_gradguard`` imports neither torch nor the registry (a fresh interpreter: this test's
    own process has both); ``ALERT_KINDS`` is the registry's, gathered on first use."""
    code = (
        "import sys, lightning_gradguard as g\n"
        "assert 'torch' not in sys.modules and 'lightning_gradguard.registry' not in sys.modules\n"
        "assert 'ALERT_KINDS' in dir(g)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    import lightning_gradguard
    from lightning_gradguard import registry

    assert lightning_gradguard.ALERT_KINDS is registry.ALERT_KINDS
    assert set(registry.ALERT_KINDS) == {r.kind for r in registry.RULES} and torch.__name__
