"""The base of every gradguard callback: the alert bus (report, cooldown, action), state, layout.

:class:`GradGuardCallback` is what the monitors, the pre-flight checks and the LR finder stand on: it
records an :class:`~lightning_gradguard.alerts.Alert`, de-duplicates it within a cooldown, fans it out to
the sinks (Python logging, the JSON-lines file, TensorBoard's text tab, the loggers) and applies the
callback's ``action``. It also gives every callback a ``state_key``, its run state's lifecycle (``reset_run``,
``state_dict``, ``load_state_dict``, derived from the fields the callback declares:
:mod:`lightning_gradguard.core.runstate`), the cadence of its checks (:meth:`GradGuardCallback.due`), and
writes the "GradGuard" custom scalars layout. :func:`guarded` keeps a monitor's own failure from crashing
the run it watches.
"""

from __future__ import annotations

import functools
import operator
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradguard.alerts import (
    ACTIONS,
    Alert,
    Finding,
    GradGuardError,
    JsonlSink,
    LoggingSink,
    Rule,
    Severity,
    recorded_alerts,
    undeclared,
)
from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.buffers import restore_step_buffers
from lightning_gradguard.core.cadence import log_step, next_due
from lightning_gradguard.core.runstate import RunField, Stateful
from lightning_gradguard.core.skips import skip_update
from lightning_gradguard.core.state import info_once, raised_in_strict, strict_mode, trainer_state, warn_once
from lightning_gradguard.core.stats import global_step, step_cache
from lightning_gradguard.core.validate import check_choice, check_int
from lightning_gradguard.tags import ALERT_CHARTS, ALERT_TEXT, ALERTS, Chart, charts_of

#: the ``cooldown_steps`` default of every monitor (LossSpikeGuard's is 0: each spike is an intervention)
DEFAULT_COOLDOWN_STEPS = 1000

_Hook = TypeVar("_Hook", bound=Callable[..., Any])
_E = TypeVar("_E")


def guarded(hook: _Hook) -> _Hook:
    """A monitor's hook, or the work a hook hands to it, that must never crash the run it watches.

    An exception inside it (a model shape or a statistic our code did not expect) becomes one warning per
    callback and function, with the error, and training goes on; that work for that step is lost, nothing
    else. A hook that only tests its cadence on most steps guards the work it calls on the others, not itself:
    the guard's frame is then paid on working steps only. The errors a callback raises on purpose
    (:class:`GradGuardError`: a NaN, a failed pre-flight check, ``action="raise"``) pass through. Only for
    hooks without collectives, or whose collectives every rank reaches alike, so that a rank that skips one
    cannot leave the others waiting. With the environment variable ``GRADGUARD_STRICT=1`` the exception is
    raised (tests).
    """

    @functools.wraps(hook)
    def wrapper(self: Any, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, trainer, *args, **kwargs)
        except GradGuardError:
            raise
        except Exception as err:
            if strict_mode():
                raise
            name = type(self).__name__
            warn_once(
                trainer,
                f"internal:{name}:{hook.__name__}",
                f"{name}.{hook.__name__} failed ({type(err).__name__}: {err}); training goes on without it "
                "for this step. Please report this to lightning_gradguard with the model's layout.",
            )
            return None

    return wrapper  # type: ignore[return-value]


def _alerts_saved(_: Any, alerts: list[Alert]) -> list[dict[str, Any]]:
    return [a.to_dict() for a in alerts]


def _alerts_loaded(_: Any, saved: list[dict[str, Any]]) -> list[Alert]:
    return [Alert.from_dict(d) for d in saved]


class GradGuardCallback(Stateful, Callback):
    """Base class: keeps ``alerts``, de-duplicates them within a cooldown and fans them out to the sinks.

    Run state is declared once per field (:class:`~lightning_gradguard.core.runstate.RunField`):
    :meth:`reset_run`, :meth:`state_dict` and :meth:`load_state_dict` follow from the declarations. The
    cadence of a detection rule is read by :meth:`due` from the attributes the class names in
    ``cadence_every`` and ``cadence_dense``.

    Args:
        action: what a finding does (the same in every callback): ``"warn"`` reports it, ``"stop"`` sets
            ``trainer.should_stop`` (Lightning stops at the end of the current step, after its
            validation), ``"raise"`` raises a :class:`~lightning_gradguard.GradGuardError` from the hook
            on every rank. A finding is an alert of a severity in ``acted_severities`` (``error`` and
            ``critical``; StallDetector's warnings too). Never part of the ``state_key``.
        cooldown_steps: the same alert kind at the same place is not reported again within this many
            optimizer steps.
    """

    error_type: type[GradGuardError] = GradGuardError
    allowed_actions: tuple[str, ...] = ACTIONS
    #: the severities ``action`` applies to
    acted_severities: frozenset[str] = frozenset({"error", "critical"})
    #: the ``__init__`` arguments that tell two instances of the callback apart in a checkpoint (never
    #: ``action``: a run resumed with another action keeps its state)
    state_key_args: tuple[str, ...] = ()
    #: constructor arguments renamed, old keyword -> new one: the old keyword is still accepted for one
    #: release, with a ``DeprecationWarning`` naming the new one (the signature, and so LightningCLI, shows
    #: the new name only)
    renamed_args: ClassVar[dict[str, str]] = {}
    #: the cause a dropped update is counted under (``core.skips``), for the callbacks that drop updates
    skip_cause: ClassVar[str] = ""
    #: the attributes :meth:`due` reads: the period of the checks and the dense start
    cadence_every: ClassVar[str] = "check_every_n_steps"
    cadence_dense: ClassVar[str] = "dense_steps"
    #: the charts this callback draws in the "GradGuard" layout (its ``tags.py``'s ``CHARTS``): the base's
    #: :meth:`layout_charts` gives them
    charts: ClassVar[tuple[Chart, ...]] = ()
    #: a chart's ``only`` setting -> the attribute (a dotted path) that turns it on (``"layers.capped"``)
    chart_switches: ClassVar[dict[str, str]] = {}

    #: the findings of every run of this instance (kept across runs; the checkpoint's on a resume)
    alerts: RunField[list[Alert]] = RunField(list, per_run=False, save=_alerts_saved, load=_alerts_loaded)
    #: the cooldowns: "<kind>@<where>" -> the step it was last reported at (an earlier run's cooldowns do
    #: not silence this one's alerts)
    _last_reported: RunField[dict[str, int]] = RunField(dict, key="last_reported")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.renamed_args and "__init__" in vars(cls):
            cls.__init__ = _accepting_renamed(cls.__init__, cls.renamed_args)  # type: ignore[method-assign]

    def __init__(self, *, action: str = "warn", cooldown_steps: int = DEFAULT_COOLDOWN_STEPS) -> None:
        self.action: str = check_choice("action", action, self.allowed_actions)
        self.cooldown_steps: int = check_int("cooldown_steps", cooldown_steps, 0)
        self._step_cache: dict[Any, Any] = {}  # the Trainer's cached step statistics (core.stats)

    @property
    @override
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: its class and identifying arguments.

        Like Lightning's ``ModelCheckpoint`` and ``EarlyStopping``: two instances with different settings
        (two ``GradientNormLogger`` with other cadences, two ``LRFinderPlus`` with other milestones) are
        saved side by side and each resumes its own state. The identifying arguments are listed in
        ``state_key_args``; changing one of them between a run and its resume starts that callback's state
        afresh.
        """
        return self._generate_state_key(**{name: getattr(self, name) for name in self.state_key_args})

    # ------------------------------------------------------------------ layout
    def layout_charts(self) -> dict[str, list[str]]:
        """Chart title -> tag regexes this callback contributes to the "GradGuard" custom-scalars section:
        its declared :attr:`charts`, those whose ``only`` setting is on (:attr:`chart_switches`)."""
        on = {only: bool(operator.attrgetter(path)(self)) for only, path in self.chart_switches.items()}
        return charts_of(self.charts, **on)

    def fresh_run(self, trainer: pl.Trainer) -> bool:
        """Whether this fit starts a new run: no ``ckpt_path`` and the Trainer at step 0.

        The same callback instances may serve several fits (a notebook, a hyperparameter loop, a retry
        after a failure). What belongs to one run (cooldowns, windows, histories) is reset at the start
        of a new one. A fit that resumes from a checkpoint keeps what ``load_state_dict`` restored, and a
        second ``fit()`` on the same Trainer, which continues its run at the step the first one reached,
        keeps what the first measured, as Lightning's own callbacks (``EarlyStopping``, ``ModelCheckpoint``)
        keep their state.
        """
        return getattr(trainer, "ckpt_path", None) is None and global_step(trainer) == 0

    def due(self, step: int) -> bool:
        """Whether logging step ``step`` (:func:`~lightning_gradguard.core.cadence.log_step`) is checked:
        every step below the dense start (the attribute ``cadence_dense`` names), then Lightning's logging
        rule on the period ``cadence_every`` names, plus step 0
        (:func:`~lightning_gradguard.core.cadence.check_due`, written out: one call on a hook's hot path)."""
        every, dense = getattr(self, self.cadence_every), getattr(self, self.cadence_dense)
        return step < dense or (every > 0 and (step == 0 or (step + 1) % every == 0))

    def next_due(self, step: int) -> int:
        """The first step from ``step`` on that :meth:`due` accepts
        (:func:`~lightning_gradguard.core.cadence.next_due`): a hook that runs every step tests one
        comparison between checks."""
        return next_due(step, getattr(self, self.cadence_every), getattr(self, self.cadence_dense))

    @staticmethod
    def _layout(trainer: pl.Trainer) -> dict[str, list[str]]:
        charts: dict[str, list[str]] = {}
        for cb in gradguard_callbacks(trainer):
            charts.update(cb.layout_charts())
        charts.update(charts_of(ALERT_CHARTS))  # the alert counts every callback writes
        return charts

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_cache = step_cache(trainer)
        if self.fresh_run(trainer):
            self.reset_run()
        _emit.write_layout(trainer, self._layout(trainer))
        frozen = frozen_summary(pl_module)
        if frozen is not None:  # once per Trainer, whichever gradguard callback starts first
            info_once(trainer, "frozen_parameters", frozen)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """The last step's shared statistics hold its gradients: drop them, so ``zero_grad(set_to_none)``
        frees the gradients before the next backward allocates new ones (else the peak holds both)."""
        self._step_cache.clear()  # the Trainer's cache, taken at fit start: no lookup on every step

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rewrite the layout without the charts that stayed empty (no sigmoid in the model, no alert)."""
        state = trainer_state(trainer)
        if state.layout_pruned or not _emit.tensorboard_writers(trainer):
            return
        state.layout_pruned = True
        charts = self._layout(trainer)
        kept = {
            title: regexes
            for title, regexes in charts.items()
            if any(re.match(r, tag) for r in regexes for tag in state.logged_tags)
        }
        if kept and kept != charts:
            _emit.write_layout(trainer, kept, replace=True)

    # ------------------------------------------------------------------ alerts
    def report(
        self,
        trainer: pl.Trainer,
        kind: str,
        severity: Severity,
        where: str | None,
        message: str,
        hint: str,
        data: dict[str, float] | None = None,
        step: int | None = None,
        cooldown_key: str | None = None,
    ) -> Alert | None:
        """Record and emit an alert, unless the same kind at the same place was reported within the cooldown.

        ``step`` is the ``global_step`` the finding was measured at (default: the current one).
        ``cooldown_key`` names what counts as "the same finding" (default ``"<kind>@<where>"``; a check
        whose ``where`` moves between layers passes its own). Returns the alert, or ``None`` when it was
        suppressed by the cooldown.
        """
        if strict_mode() and undeclared(type(self).__name__, kind):  # a monitor's bug: its rules say not
            raise ValueError(f"{type(self).__name__} reported {kind!r}, a kind it did not declare")
        step = int(trainer.global_step) if step is None else int(step)
        key = cooldown_key if cooldown_key is not None else f"{kind}@{where}"
        if not self.would_report(key, step):
            return None
        self._last_reported[key] = step
        alert = Alert(
            kind=kind,
            severity=severity,
            step=step,
            where=where,
            message=message,
            hint=hint,
            source=type(self).__name__,
            data=dict(data or {}),
        )
        self.alerts.append(alert)
        if trainer.is_global_zero:
            _fan_out(trainer, alert)
        return alert

    def report_finding(
        self,
        trainer: pl.Trainer,
        finding: Finding,
        *,
        step: int | None = None,
        cooldown_key: str | None = None,
    ) -> Alert | None:
        """:meth:`report` a check's :class:`~lightning_gradguard.alerts.Finding`: its rule's kind, and the
        severity, place and hint the finding carries (the rule's unless the check stated its own)."""
        f = finding
        return self.report(
            trainer, f.kind, f.level, f.where, f.message, f.hint, f.data, step=step, cooldown_key=cooldown_key
        )

    def run_rules(
        self,
        trainer: pl.Trainer,
        rules: Iterable[Rule[_E]],
        evidence: _E,
        *,
        step: int | None = None,
        cooldown: Callable[[Finding], str | None] | None = None,
        admit: Callable[[Finding], bool] | None = None,
        then: Callable[[list[Alert]], None] | None = None,
    ) -> list[Alert]:
        """Run ``rules`` on ``evidence`` in their declared order, report each finding, then act once.

        The one way a monitor judges: each rule's check (:class:`~lightning_gradguard.alerts.Check`) reads
        the monitor's evidence; each finding goes through :meth:`report_finding` at ``step`` (default: the
        current one) under the cooldown key ``cooldown(finding)`` gives (default ``"<kind>@<where>"``);
        ``admit`` may pass over a finding before it is reported (a kind said once per run). The alerts
        reported are then acted on once: :meth:`act`, or ``then`` for a monitor whose action depends on
        more than the alerts (an escalated action, an update to drop). Call it on every rank, on check steps
        only: a quiet step pays nothing.
        """
        alerts: list[Alert] = []
        for rule in rules:
            for f in rule.findings(evidence):
                if admit is not None and not admit(f):
                    continue
                key = None if cooldown is None else cooldown(f)
                alert = self.report_finding(trainer, f, step=step, cooldown_key=key)
                if alert is not None:
                    alerts.append(alert)
        if then is None:
            self.act(trainer, alerts)
        else:
            then(alerts)
        return alerts

    def would_report(self, key: str, step: int) -> bool:
        """Whether a finding under ``key`` at ``step`` is outside the cooldown (nothing is recorded)."""
        last = self._last_reported.get(key)
        return last is None or step - last >= self.cooldown_steps

    def act(self, trainer: pl.Trainer, alerts: list[Alert]) -> None:
        """Apply ``action`` to the alerts of a severity in ``acted_severities`` (call it on every rank)."""
        serious = [a for a in alerts if a.severity in self.acted_severities]
        if serious:
            self.apply_action(trainer, self.action, alerts=serious)

    def apply_action(
        self,
        trainer: pl.Trainer,
        action: str,
        *,
        alerts: list[Alert] | None = None,
        optimizer: Any = None,
        poisoned: bool = False,
        error: GradGuardError | None = None,
    ) -> None:
        """What ``action`` does, the same in every callback (call it on every rank, with the same decision).

        ``warn``: nothing more. ``skip``: this step's update of ``optimizer`` is dropped (its buffers put
        back, counted under :attr:`skip_cause`: ``core.skips``). ``rollback``: dropped, then
        :meth:`roll_back`. ``stop``: ``trainer.should_stop``; a ``poisoned`` update (one a NaN would write
        into the weights) is dropped first. ``raise``: the buffers this step's forward wrote are put back
        (the update never applies), then ``error`` (by default :attr:`error_type` over ``alerts``) is raised.
        """
        if action == "warn":
            return
        if action == "raise":
            if optimizer is not None:
                restore_step_buffers(trainer)
            found = alerts or []
            raise error if error is not None else self.error_type("; ".join(a.format() for a in found), found)
        if action == "stop":
            trainer.should_stop = True
        if optimizer is not None and (action in ("skip", "rollback") or (action == "stop" and poisoned)):
            if not self.skip_cause:
                raise TypeError(f"{type(self).__name__} drops updates: it needs a skip_cause")
            skip_update(trainer, optimizer, self.skip_cause)
        if action == "rollback":
            self.roll_back(trainer, optimizer)

    def roll_back(self, trainer: pl.Trainer, optimizer: Any) -> None:
        """``action="rollback"``: bring back the last rollback point (the callbacks that allow it say how)."""
        raise NotImplementedError(f"{type(self).__name__} has no rollback point")


def _accepting_renamed(init: Callable[..., None], renamed: dict[str, str]) -> Callable[..., None]:
    """``init`` that also takes each old keyword of ``renamed``, warning that it is deprecated."""

    @functools.wraps(init)  # inspect.signature follows __wrapped__: the new names only
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for old, new in renamed.items():
            if old not in kwargs:
                continue
            if new in kwargs:
                raise TypeError(f"{type(self).__name__}() got both {old!r} and its new name {new!r}")
            warnings.warn(
                f"{type(self).__name__}({old}=...) is deprecated: use {new}=... (the old name goes in the "
                "next release)",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    return wrapper


def frozen_summary(module: Any, shown: int = 4) -> str | None:
    """One line on the parameters that will not train (``requires_grad=False``): their share and the
    largest modules that are frozen whole; ``None`` when every parameter trains.

    Said at fit start, because a fine-tune frozen by mistake still passes a pre-flight (the head alone
    memorises one batch) and shows only later, as a loss stuck near chance.
    """
    sizes: dict[str, list[int]] = {}  # module -> [frozen, all] parameter counts, over its subtree
    frozen = total = 0
    for name, p in module.named_parameters():
        n = p.numel()
        total += n
        frozen += n * (not p.requires_grad)
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            counts = sizes.setdefault(".".join(parts[:depth]), [0, 0])
            counts[0] += n * (not p.requires_grad)
            counts[1] += n
    if not frozen:
        return None
    whole = [m for m, (f, a) in sizes.items() if m and f == a]  # frozen whole, under no frozen-whole parent
    tops = [m for m in whole if not any(m.startswith(f"{o}.") for o in whole)]
    tops.sort(key=lambda m: -sizes[m][1])
    named = ", ".join(f"{m} ({sizes[m][1]:,})" for m in tops[:shown])
    more = f" and {len(tops) - shown} more" if len(tops) > shown else ""
    where = f": {named}{more}" if tops else " (parts of modules)"
    return (
        f"gradguard: {frozen / total:.1%} of the model's parameters ({frozen:,} of {total:,}) are frozen "
        f"(requires_grad=False){where}; they will not train. If that is not what you meant (a fine-tune "
        "that should update the backbone), set requires_grad=True before fit."
    )


def gradguard_callbacks(trainer: pl.Trainer) -> list[GradGuardCallback]:
    """The gradguard callbacks on ``trainer``, in its order."""
    return [cb for cb in trainer.callbacks if isinstance(cb, GradGuardCallback)]  # type: ignore[attr-defined]


def _fan_out(trainer: pl.Trainer, alert: Alert) -> None:
    """Send an alert to every sink (rank zero): Python logging, the JSON-lines file, TensorBoard's text tab
    and the ``alerts/<kind>`` count of every logger.

    A sink that fails (a full disk, a logger's network error) loses that copy of the alert, never the
    alert itself nor the action after it: under DDP the other ranks act on it.
    """
    state = trainer_state(trainer)
    state.alert_counts[alert.kind] = state.alert_counts.get(alert.kind, 0) + 1
    at = log_step(trainer)
    count = {ALERTS.tag(alert.kind): float(state.alert_counts[alert.kind])}
    sinks: tuple[tuple[str, Callable[[], None]], ...] = (
        ("Python logging", lambda: LoggingSink()(alert)),
        (_emit.alerts_path(trainer), lambda: _write_line(trainer, alert)),
        ("TensorBoard's text tab", lambda: _emit.log_text(trainer, ALERT_TEXT, alert.markdown(), at)),
        ("the loggers", lambda: _emit.log_scalars(trainer, count, at)),
    )
    for name, sink in sinks:
        try:
            sink()
        except Exception as err:
            if raised_in_strict(err):  # a full disk loses this copy, in the tests too
                raise
            message = f"lightning_gradguard could not write an alert to {name} ({type(err).__name__}: {err})."
            warn_once(trainer, f"alert_sink:{name}", message)


def _write_line(trainer: pl.Trainer, alert: Alert) -> None:
    """Append ``alert`` to the run's alerts file, unless a resumed fit replays a step whose alert the file
    already holds (the file then reads as the run's would, had it never been killed)."""
    path = _emit.alerts_path(trainer)
    if getattr(trainer, "ckpt_path", None) is not None:
        state = trainer_state(trainer)
        if state.alerts_on_file is None:
            state.alerts_on_file = recorded_alerts(path)
        key = alert.key()
        if state.alerts_on_file[key] > 0:
            state.alerts_on_file[key] -= 1
            return
    JsonlSink(path)(alert)
