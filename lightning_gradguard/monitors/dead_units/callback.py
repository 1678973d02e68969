r"""
DeadReLUMonitor
===============

Finds ReLU units that never fire (and sigmoid/tanh units stuck in saturation) on a few sampled training
steps; nothing is attached on the other steps or during validation.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS
from lightning_gradguard.core.cadence import log_step, logging_interval
from lightning_gradguard.core.layers import LayerSelection, cap_scalars
from lightning_gradguard.core.runstate import RunField
from lightning_gradguard.core.sampling import SamplingMonitor, ScopedHooks
from lightning_gradguard.core.state import warn_once
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.stats import device_histograms
from lightning_gradguard.monitors.dead_units.counts import sum_counts
from lightning_gradguard.monitors.dead_units.measure import ActivationCapture
from lightning_gradguard.monitors.dead_units.rules import RULES, Sampled, UnitCounts, UnitWindows
from lightning_gradguard.monitors.dead_units.tags import CHARTS, DEAD_RELU, SATURATED


class DeadReLUMonitor(SamplingMonitor):
    r"""Alert when most units of a ReLU layer never fire.

    On sampled training steps it watches each ReLU output of the forward pass (``nn.ReLU``, ``nn.ReLU6``,
    in-place ReLUs, ``F.relu`` / ``torch.relu`` / ``Tensor.relu`` inside any ``forward``), through a
    ``TorchFunctionMode`` and global module hooks that exist only during the sampled ``training_step``
    (:class:`~lightning_gradguard.monitors.dead_units.measure.ActivationCapture`, which also names the layers:
    ``"encoder.block3:relu(fc1)"``, ``"net.act#2"``). Sampled: every step while ``global_step <
    window_samples + patience - 1``, then every ``sample_every_n_steps``; a sample that finds more than
    ``threshold`` of a layer silent is followed up on the next ``window_samples + patience - 1`` steps
    (follow-ups start none). Calls
    outside every module's ``forward`` (loss code) and outputs of fewer than 2 dimensions are not layers.

    A *unit* is a feature of a ``Linear`` output (last dimension) or a channel of a ``ConvNd`` output
    (dimension 1). One sample is one optimizer step (its micro-batches pooled; one batch in manual
    optimization). A unit is *active* on a step if it output a non-zero value for some sample of the
    step, *dead* if inactive in each of the last ``window_samples`` sampled steps. Reductions stay on the
    device;
    one vector per sampled step comes to the host (all-reduced first: every rank reaches one verdict).

    Logged per layer: ``dead_relu/<layer>`` (dead fraction) and, to TensorBoard, a histogram
    ``activation_rate/<layer>`` of per-unit activation rates over the window. Alert ``dead_relu``
    (severity error) when a layer's dead fraction exceeds ``threshold`` on ``patience`` consecutive full
    windows. GELU, SiLU, LeakyReLU and friends are never watched: their units cannot die.

    With ``check_saturation`` it also watches ``sigmoid`` and ``tanh`` inputs: a unit is saturated when
    more than half of its inputs in the window lie where the float32 derivative is gone (tanh:
    ``|x| > 9.5``; sigmoid: ``x < -23`` or ``x > 17``); ``saturated/<layer>`` is the fraction of such units
    and alert ``saturated_activation`` (warning) fires above ``saturation_threshold``.

    Args:
        action: what a ``dead_relu`` finding does: ``"warn"`` (default) reports it, ``"stop"`` ends the run
            (``trainer.should_stop``), ``"raise"`` raises :class:`~lightning_gradguard.GradGuardError`
            on every rank. Saturation findings are reported only.
        sample_every_n_steps: sample one training step in this many (after the first
            ``window_samples + patience - 1``).
        window_samples: sampled steps a unit must stay silent in to count as dead (was ``window``).
        threshold: dead fraction of a layer above which it is reported (SageMaker's and the classic 0.5).
        patience: consecutive full-window checks above the threshold before the alert.
        check_saturation: also watch sigmoid/tanh saturation.
        saturation_threshold: saturated fraction of a layer above which it is reported.
        log_histograms: write the ``activation_rate/*`` histograms to TensorBoard.
        histogram_bins: buckets of those histograms.
        include: the activation layers watched (regular expressions on the names above; ``None``: all):
            see :class:`~lightning_gradguard.core.layers.LayerSelection`.
        exclude: activation layers whose name matches are not watched.
        max_layers: a cap on the curves per chart, the most dead layers first (``None``: no cap).
        cooldown_steps: minimum steps between two alerts for the same layer.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import DeadReLUMonitor

        Trainer(callbacks=[monitor := DeadReLUMonitor()]).fit(model)
        print(monitor.dead_fractions)   # {"net.1": 0.03, "net.3": 0.97, ...}
    """

    charts = CHARTS
    chart_switches = {"saturation": "check_saturation"}

    allowed_actions = ("warn", "stop", "raise")
    #: 0.x name: ``window`` was a count of sampled steps here and of optimizer steps in LossSpikeGuard
    renamed_args = {"window": "window_samples"}
    state_key_args = ("sample_every_n_steps",)
    #: sampled on Lightning's logging rule every ``sample_every_n_steps``, and on every step below ``_dense``
    #: (so ``dead_relu/*`` points share the x of the loss and of the gradient histograms); under
    #: ``accumulate_grad_batches`` all micro-batches of a due optimizer step are watched, as one sample
    cadence_every, cadence_dense = "sample_every_n_steps", "_dense"

    #: dead fraction per ReLU layer / saturated fraction per sigmoid/tanh layer, at the last check
    dead_fractions: RunField[dict[str, float]] = RunField(dict, key=None)
    saturated_fractions: RunField[dict[str, float]] = RunField(dict, key=None)
    #: how many optimizer steps were sampled (batches, in manual optimization); micro-batches pooled
    sampled_batches: RunField[int] = RunField(int)
    #: the windows of sampled steps, and the strikes of each finding (a new run: its own sampled steps)
    _windows: RunField[UnitWindows] = RunField(from_settings=lambda m: UnitWindows(m.window_samples))
    #: sampled steps still to take at once: a layer looked dead on a sample
    _follow_left: RunField[int] = RunField(int)

    def __init__(
        self,
        *,
        action: Literal["warn", "stop", "raise"] = "warn",
        sample_every_n_steps: int = 50,
        window_samples: int = 4,
        threshold: float = 0.5,
        patience: int = 2,
        check_saturation: bool = True,
        saturation_threshold: float = 0.5,
        log_histograms: bool = True,
        histogram_bins: int = 20,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
        max_layers: int | None = None,
        cooldown_steps: int = DEFAULT_COOLDOWN_STEPS,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.sample_every_n_steps: int = check_int("sample_every_n_steps", sample_every_n_steps, 1)
        self.window_samples: int = check_int("window_samples", window_samples, 1)
        self.threshold: float = check_float("threshold", threshold, 0.0, 1.0)
        self.patience: int = check_int("patience", patience, 1)
        self.check_saturation = check_bool("check_saturation", check_saturation)
        self.saturation_threshold: float = check_float("saturation_threshold", saturation_threshold, 0.0, 1.0)
        self.log_histograms = check_bool("log_histograms", log_histograms)
        self.histogram_bins: int = check_int("histogram_bins", histogram_bins, 2)
        self.layers = LayerSelection(include, exclude, max_layers)
        self._dense = self.window_samples + self.patience - 1  # every step is sampled below this one
        self._following = False  # the open sample is a follow-up

    @override
    def sample_due(self, trainer: pl.Trainer, at: int) -> bool:
        return self._follow_left > 0 or self.due(at)

    @override
    def new_capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ActivationCapture:
        self._following = not self.due(log_step(trainer))
        say = lambda key, text: warn_once(trainer, f"dead_relu_{key}", f"DeadReLUMonitor: {text}")  # noqa: E731
        watch = self.layers.watches if self.layers.filters else None
        return ActivationCapture(pl_module, self.check_saturation, warn=say, watch=watch)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._following = False

    # ------------------------------------------------------------------ after the sampled step
    @override
    def end_sample(self, trainer: pl.Trainer, capture: ScopedHooks, sampled_at: tuple[int, int]) -> None:
        """Close the sampled optimizer step: one flush (one collective under DDP), one follow-up used.

        Under DDP every rank of a sampled step flushes, also one that saw no activation (a branch its data
        did not take) or whose capture failed: the flush's collectives must meet on every rank, and its
        signature check then skips the step everywhere instead of leaving the others waiting.
        """
        assert isinstance(capture, ActivationCapture)
        if capture.error is not None:
            warn_once(
                trainer,
                "dead_relu_record_error",
                f"DeadReLUMonitor could not measure an activation ({type(capture.error).__name__}: "
                f"{capture.error}); the sampled steps where that happens are skipped.",
            )
        records = capture.records if capture.error is None else {}  # a partial capture is no sample
        loss = self.progress.take(trainer)
        if records or trainer.world_size > 1:
            self._flush(trainer, records, sampled_at, loss)
        if self._following:
            self._following = False
            self._follow_left = max(self._follow_left - 1, 0)

    def _flush(
        self,
        trainer: pl.Trainer,
        records: dict[str, UnitCounts],
        sampled_at: tuple[int, int],
        loss: Tensor | None,
    ) -> None:
        summed = sum_counts(trainer, records, loss)
        if not summed.agreed:
            warn_once(
                trainer,
                "dead_relu_ranks_differ",
                "DeadReLUMonitor: ranks saw different activation layers on a sampled step; that step is "
                "skipped on every rank.",
            )
        if not summed.records:
            return
        self.sampled_batches += 1
        self.progress.note(summed.loss)
        limits = (self.threshold, self.saturation_threshold, self.patience)
        verdict = self._windows.update(summed.records, *limits)
        self.dead_fractions.update(verdict.dead_fractions)
        self.saturated_fractions.update(verdict.saturated_fractions)
        step, at = sampled_at
        # units that stopped firing in a run whose loss fell to half its start and holds there cost it
        # nothing it needed (a RegNet's 4-unit squeeze-excitation gate): dead units harm a run that does
        # not learn, and one that learned and then diverges. Units dead from the start (the first full
        # windows' verdict) are the initialization's fault, whatever the loss does.
        learning = self.sampled_batches > self.window_samples + self.patience - 1 and self.progress.learning()
        logging_on = logging_interval(trainer) > 0  # Trainer(log_every_n_steps=0): detection only
        scalars = cap_scalars(self.layers, verdict.scalars, DEAD_RELU.name)
        shown = self.layers.last_shown  # histograms for the dead_relu curves shown
        rates = {t: r for t, r in verdict.rates.items() if shown is None or t.split("/", 1)[1] in shown}
        if logging_on:
            _emit.log_scalars(trainer, cap_scalars(self.layers, scalars, SATURATED.name), at)
        if logging_on and self.log_histograms and rates and _emit.tensorboard_writers(trainer):
            spec = device_histograms(list(rates.values()), bins=self.histogram_bins)
            for i, tag in enumerate(rates):
                _emit.log_histogram_raw(trainer, tag, spec.stats[i], spec.edges[i], spec.counts[i], at)
        # A regular sample that looks dead (more than `threshold` of a layer's units silent on this very
        # step) is followed up at once: the next window_samples + patience - 1 steps are sampled too, so a
        # layer that died mid-run is confirmed within a few steps, not every_n_steps x (window_samples +
        # patience - 1).
        # Follow-ups do not start new follow-ups.
        if verdict.suspicious and not self._following and step >= self.window_samples + self.patience - 1:
            self._follow_left = self.window_samples + self.patience - 1
        self.run_rules(trainer, RULES, Sampled(verdict=verdict, learning=learning), step=step)
