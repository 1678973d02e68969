"""docs/architecture.md's walkthroughs, done: a new rule is one declaration in one ``rules.py``, a new monitor
is its folder plus two lines of ``lightning_gradguard/__init__.py``.

* A rule with a threshold and a memory (the checks in a row it held, in the monitor's checkpointed state)
  added to StallDetector's declarations: judged on a real Trainer, its alert seen, its row in the table of
  kinds, its memory in the checkpoint.
* A tiny monitor written as a folder of its own (``callback.py``, ``rules.py``, ``tags.py``) on the
  monitors' path and registered in its ``_WHERE`` line: the registry gathers its kind, docs row and chart,
  the package root exports it, it runs on a real Trainer (its alert seen, its action taken, its chart in
  the layout), and its state comes back from a checkpoint.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import RecordingMLP, make_trainer, random_loader

import lightning_gradguard
import lightning_gradguard.monitors as monitors
from lightning_gradguard import StallDetector, registry
from lightning_gradguard.alerts import Finding, Rule, declare, kinds_table
from lightning_gradguard.monitors.stall import callback as stall_callback
from lightning_gradguard.monitors.stall import rules as stall_rules

#: the new rule's threshold: a constant of its rules.py (a field of StallThresholds if users should set it)
CEILING = 0.5


def _loss_above(e: stall_rules.Judged) -> Finding | None:
    """The check's loss stayed above :data:`CEILING` on ``patience`` checks in a row (the state's streak:
    its memory, saved with the detector)."""
    loss = e.check.loss
    if not e.state.streak(LOSS_ABOVE_CEILING, loss is not None and loss > CEILING):
        return None
    checks = e.state.checks_in_a_row(LOSS_ABOVE_CEILING)
    return Finding(
        LOSS_ABOVE_CEILING, f"loss {loss:.3g} above {CEILING:g} on {checks} checks", {"loss": loss}
    )


LOSS_ABOVE_CEILING: Rule[stall_rules.Judged] = Rule(
    kind="loss_above_ceiling",
    severity="warning",
    monitor="StallDetector",
    summary="the check loss stayed above its ceiling",
    when=f"the check loss above {CEILING:g} on `patience` checks in a row",
    where="loss",
    hint="Train longer.",
    cause=True,
    thresholds=("patience",),
    check=_loss_above,
)


def test_a_rule_added_to_the_declarations_is_judged_reported_and_remembered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The one edit: the declaration, in RULES at its place in the judging order (a cause: before the
    symptoms). The callback's name for RULES is the rules module's, patched with it here."""
    at = next(i for i, r in enumerate(stall_rules.RULES) if not r.cause)
    rules = (*stall_rules.RULES[:at], *declare(LOSS_ABOVE_CEILING), *stall_rules.RULES[at:])
    monkeypatch.setattr(stall_rules, "RULES", rules)
    monkeypatch.setattr(stall_callback, "RULES", rules)
    assert "| `loss_above_ceiling` | warning | `StallDetector` | the check loss above 0.5" in kinds_table(
        rules
    )

    detector = StallDetector(check_every_n_steps=2, patience=2)
    trainer = make_trainer([detector], max_steps=12)
    trainer.fit(RecordingMLP(lr=1e-4), random_loader(n=128))  # a loss near ln 4 = 1.39: above the ceiling
    (alert,) = [a for a in detector.alerts if a.kind == "loss_above_ceiling"]  # once per run
    assert (alert.where, alert.hint, alert.source) == ("loss", "Train longer.", "StallDetector")
    assert alert.data["loss"] > CEILING
    held = detector.state.checks_in_a_row(LOSS_ABOVE_CEILING)
    assert held >= 2

    trainer.save_checkpoint(tmp_path / "run.ckpt")
    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)["callbacks"][detector.state_key]
    resumed = StallDetector(check_every_n_steps=2, patience=2)
    resumed.load_state_dict(saved)
    assert resumed.state.checks_in_a_row(LOSS_ABOVE_CEILING) == held
    assert [a.kind for a in resumed.alerts].count("loss_above_ceiling") == 1


# ---------------------------------------------------------------------------------------------- a new monitor
#: the new monitor's folder, file by file (what a developer writes under lightning_gradguard/monitors/)
TINY = {
    "__init__.py": '"""TinyCeiling: the loss against a ceiling (a walkthrough of docs/architecture.md)."""\n',
    "tags.py": """
        from lightning_gradguard.tags import Chart, Family

        TINY = Family("tiny_ceiling", "TinyCeiling")
        FAMILIES = (TINY,)
        CHARTS = (Chart("Tiny: the loss against its ceiling", (TINY.tag("loss"),), "TinyCeiling"),)
    """,
    "rules.py": """
        from dataclasses import dataclass

        from lightning_gradguard.alerts import Finding, Rule, declare
        from lightning_gradguard.core.runstate import Streaks


        @dataclass(frozen=True)
        class Seen:
            loss: float
            ceiling: float
            patience: int
            strikes: Streaks


        def _above(ev: Seen) -> Finding | None:
            if ev.strikes.update("loss", ev.loss > ev.ceiling) < ev.patience:
                return None
            return Finding(TINY_LOSS_ABOVE, f"loss {ev.loss:.3g} above {ev.ceiling:g}", {"loss": ev.loss})


        TINY_LOSS_ABOVE = Rule(
            kind="tiny_loss_above",
            severity="error",
            monitor="TinyCeiling",
            summary="the loss stayed above its ceiling",
            when="the loss above `ceiling` on `patience` checks in a row",
            hint="Lower the ceiling.",
            thresholds=("ceiling", "patience"),
            check=_above,
        )
        RULES = declare(TINY_LOSS_ABOVE)
    """,
    "callback.py": """
        from typing import Any

        from lightning_gradguard.core import emit
        from lightning_gradguard.core.base import GradGuardCallback
        from lightning_gradguard.core.runstate import RunField, Streaks
        from lightning_gradguard.monitors.tiny_ceiling.rules import RULES, Seen
        from lightning_gradguard.monitors.tiny_ceiling.tags import CHARTS, TINY


        class TinyCeiling(GradGuardCallback):
            \"\"\"Alert when the loss stays above ``ceiling`` on ``patience`` checks in a row.\"\"\"

            charts = CHARTS
            strikes: RunField[Streaks] = RunField(Streaks)

            def __init__(
                self,
                *,
                action: str = "warn",
                ceiling: float = 0.5,
                patience: int = 2,
                check_every_n_steps: int = 1,
            ) -> None:
                super().__init__(action=action)
                self.ceiling, self.patience = ceiling, patience
                self.check_every_n_steps, self.dense_steps = check_every_n_steps, 0

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
                step = int(trainer.global_step)
                if not self.due(step):
                    return
                loss = float(outputs["loss"])
                emit.log_scalars(trainer, {TINY.tag("loss"): loss}, step)
                self.run_rules(trainer, RULES, Seen(loss, self.ceiling, self.patience, self.strikes))
    """,
}


def _reload_registry() -> None:
    for cached in ("RULES", "ALERT_KINDS"):  # gathered on first use: gathered again
        registry.__dict__.pop(cached, None)
    importlib.reload(registry)


@pytest.fixture
def tiny_monitor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The folder written on the monitors' path, and its one line in ``_WHERE`` (its typed import, the
    other line, is for type checkers: ``test_an_export_is_registered_once_in_the_package_root``)."""
    folder = tmp_path / "tiny_ceiling"
    folder.mkdir()
    for name, text in TINY.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    monkeypatch.setattr(monitors, "__path__", [*monitors.__path__, str(tmp_path)])
    module = "lightning_gradguard.monitors.tiny_ceiling.callback"
    monkeypatch.setitem(lightning_gradguard._WHERE, "TinyCeiling", module)  # type: ignore[attr-defined]
    monkeypatch.setattr(lightning_gradguard, "__all__", sorted([*lightning_gradguard._WHERE, "__version__"]))  # type: ignore[attr-defined]
    _reload_registry()
    try:
        yield module
    finally:
        monkeypatch.undo()
        for name in [m for m in sys.modules if m.startswith("lightning_gradguard.monitors.tiny_ceiling")]:
            del sys.modules[name]
        lightning_gradguard.__dict__.pop("TinyCeiling", None)
        _reload_registry()


def test_a_new_monitor_is_its_folder_and_its_registration(tiny_monitor: str, tmp_path: Path) -> None:
    # gathered from the folder: its kind, its docs row, its chart and the layout table's row, its reference
    assert "tiny_ceiling" in registry.MONITORS
    assert registry.ALERT_KINDS["tiny_loss_above"] == "the loss stayed above its ceiling"
    assert "| `tiny_loss_above` | error | `TinyCeiling` |" in registry.alerts_table()
    assert (
        "| Tiny: the loss against its ceiling | `tiny_ceiling/loss` | `TinyCeiling` |"
        in registry.layout_table()
    )
    assert "::: lightning_gradguard.TinyCeiling" in registry.callbacks_reference()
    # exported by its _WHERE line
    tiny_class: Any = lightning_gradguard.TinyCeiling  # type: ignore[attr-defined]
    assert tiny_class.__module__ == tiny_monitor and "TinyCeiling" in lightning_gradguard.__all__

    # on a real Trainer: the alert (an error) stops the run, through the base's one action
    tiny = tiny_class(action="stop", ceiling=0.5, patience=2)
    trainer = make_trainer([tiny], max_steps=20)
    trainer.fit(RecordingMLP(lr=1e-4), random_loader(n=256))
    (alert,) = [a for a in tiny.alerts if a.kind == "tiny_loss_above"]  # the cooldown keeps it to one
    assert (alert.severity, alert.source, alert.hint) == ("error", "TinyCeiling", "Lower the ceiling.")
    assert alert.step == trainer.global_step == 2  # checked at steps 1 and 2: held twice, stopped at once
    assert tiny.layout_charts() == {"Tiny: the loss against its ceiling": ["tiny_ceiling/loss"]}
    assert tiny.strikes == {"loss": trainer.global_step}

    # its state, declared once, through a checkpoint
    trainer.save_checkpoint(tmp_path / "tiny.ckpt")
    saved = torch.load(tmp_path / "tiny.ckpt", weights_only=False)["callbacks"][tiny.state_key]
    resumed = tiny_class()
    resumed.load_state_dict(saved)
    assert resumed.strikes == tiny.strikes and [a.kind for a in resumed.alerts] == ["tiny_loss_above"]
