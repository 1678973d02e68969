r"""
DeadReLUMonitor
===============

Finds ReLU units that never fire (and, optionally, sigmoid/tanh units stuck in saturation) by looking at
activations on a few sampled training steps. Nothing is attached on the other steps, and nothing ever
runs during validation.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gradguard.core import emit as _emit
from lightning_gradguard.core.base import GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step, logging_interval
from lightning_gradguard.core.state import strict_mode, warn_once
from lightning_gradguard.core.validate import check_bool, check_float, check_int
from lightning_gradguard.functional.health import activity_counts, dead_units, saturation_counts, unit_dim
from lightning_gradguard.functional.stats import device_histograms

__all__ = ["DeadReLUMonitor"]

F = nn.functional

#: functions whose output is a ReLU output (``nn.ReLU`` calls ``F.relu``; ``nn.ReLU6`` calls ``F.hardtanh``)
_RELU_FUNCS: dict[Any, str] = {
    F.relu: "relu",
    F.relu_: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    torch.Tensor.relu: "relu",
    torch.Tensor.relu_: "relu",
    F.relu6: "relu6",
}
#: functions whose input decides saturation
_SATURATING_FUNCS: dict[Any, str] = {
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.Tensor.sigmoid: "sigmoid",
    torch.Tensor.sigmoid_: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    torch.Tensor.tanh: "tanh",
    torch.Tensor.tanh_: "tanh",
}
#: activation modules whose own name is the layer name (a functional call elsewhere is named "<module>:<fn>")
_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid, nn.Tanh)
#: modules whose outputs are channel-first (units along dimension 1)
_CHANNEL_FIRST = (_ConvNd, _BatchNorm, _InstanceNorm, nn.GroupNorm)

_DEAD_HINT = (
    "Lower the learning rate; initialise with He/Kaiming and zero (or small positive) biases; normalise the "
    "inputs; put BatchNorm/LayerNorm before the ReLU; or switch to LeakyReLU/GELU, whose units cannot die."
)
_SATURATION_HINT = (
    "Pre-activations are far outside the sensitive range: normalise the inputs, use Xavier initialization, "
    "add normalization before the activation, lower the learning rate, or use ReLU/GELU."
)


def _hardtanh_is_relu6(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    low = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
    return float(low) == 0.0


class _Capture(TorchFunctionMode):
    """Sees every torch function called while a sampled forward runs; records the activations we watch."""

    def __init__(self, monitor: DeadReLUMonitor) -> None:
        super().__init__()
        self.monitor = monitor

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        monitor = self.monitor
        if not monitor._capturing:
            return func(*args, **kwargs)
        try:
            relu = _RELU_FUNCS.get(func)
            sat = None if relu is not None else _SATURATING_FUNCS.get(func)
        except TypeError:  # an unhashable callable
            return func(*args, **kwargs)
        if relu is None and func is F.hardtanh and _hardtanh_is_relu6(args, kwargs):
            relu = "relu6"
        if sat is not None and monitor.check_saturation and args and isinstance(args[0], Tensor):
            monitor._safe_record(sat, args[0], saturation=True)
        out = func(*args, **kwargs)
        if relu is not None and isinstance(out, Tensor):
            monitor._safe_record(relu, out, saturation=False)
        return out


class DeadReLUMonitor(GradGuardCallback):
    r"""Alert when most units of a ReLU layer never fire.

    On sampled training steps (every step while ``global_step < window + patience - 1``, so a network
    that starts dead is caught at once; then every ``every_n_steps``, and when such a sample finds more
    than ``threshold`` of a layer's units silent on that step, the next ``window + patience - 1``
    steps as well, so a layer that dies mid-run is confirmed within ``every_n_steps + window +
    patience - 1`` steps; follow-ups never start new follow-ups) it watches each ReLU output during
    the forward pass: ``nn.ReLU``, ``nn.ReLU6``, in-place ReLUs, and ``F.relu`` / ``torch.relu`` /
    ``Tensor.relu`` called inside any ``forward``. Watching uses a ``TorchFunctionMode`` and global
    module hooks that exist only during the sampled forward pass and are removed right after; other
    steps and validation cost nothing. A functional call is named after the module whose ``forward``
    made it and the child whose output it got (``"encoder.block3:relu(fc1)"``; at the root
    ``"relu(hidden1)"``), a ReLU module by its own name; a name reached twice in one forward pass gets
    ``#2``, ``#3``. Calls outside every module's ``forward`` (loss code in ``training_step``, such as
    a hinge loss written with ``F.relu``) and outputs with fewer than 2 dimensions are not layers and are
    not watched (a one-time warning says so when the former were seen).

    A *unit* is a feature of a ``Linear`` output (last dimension) or a channel of a ``ConvNd`` output
    (dimension 1). One sample is one optimizer step (one batch in manual optimization): with
    ``accumulate_grad_batches`` every micro-batch of a sampled step is watched and they are pooled into
    one sample, so windows, ``patience``, follow-ups, rates and ``sampled_batches`` all count optimizer
    steps. Per sampled step each unit is *active* if it output a non-zero value for at least one sample
    of its batch (of any of its micro-batches); it is *dead* if it was inactive in every one of the last
    ``window`` sampled steps. All reductions happen on the device; one vector per sampled step comes to
    the host (all-reduced across ranks first, so every rank reaches the same verdict).

    Logged per layer: ``dead_relu/<layer>`` (dead fraction) and, to TensorBoard, a histogram
    ``activation_rate/<layer>`` of per-unit activation rates over the window. Alert ``dead_relu``
    (severity error) when a layer's dead fraction exceeds ``threshold`` on ``patience`` consecutive full
    windows. GELU, SiLU, LeakyReLU and friends are never watched: their units cannot die.

    With ``check_saturation`` it also watches ``sigmoid`` and ``tanh`` inputs: a unit is saturated when
    more than half of its inputs in the window lie where the float32 derivative is gone (tanh:
    ``|x| > 9.5``; sigmoid: ``x < -23`` or ``x > 17``); ``saturated/<layer>`` is the fraction of such units
    and alert ``saturated_activation`` (warning) fires above ``saturation_threshold``.

    Args:
        every_n_steps: sample one training step in this many (after the first ``window + patience - 1``).
        window: sampled steps a unit must stay silent in to count as dead.
        threshold: dead fraction of a layer above which it is reported (SageMaker and the classic
            debugging advice both use 0.5).
        patience: consecutive full-window checks above the threshold before the alert.
        check_saturation: also watch sigmoid/tanh saturation.
        saturation_threshold: saturated fraction of a layer above which it is reported.
        log_histograms: write the ``activation_rate/*`` histograms to TensorBoard.
        histogram_bins: buckets of those histograms.
        action: ``"warn"`` (default), ``"stop"`` or ``"raise"``, applied to ``dead_relu``.
        cooldown_steps: minimum steps between two alerts for the same layer.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradguard import DeadReLUMonitor

        monitor = DeadReLUMonitor()
        Trainer(callbacks=[monitor]).fit(model)
        print(monitor.dead_fractions)   # {"net.1": 0.03, "net.3": 0.97, ...}
    """

    state_key_args = ("every_n_steps", "action")

    def __init__(
        self,
        every_n_steps: int = 50,
        window: int = 4,
        threshold: float = 0.5,
        patience: int = 2,
        check_saturation: bool = True,
        saturation_threshold: float = 0.5,
        log_histograms: bool = True,
        histogram_bins: int = 20,
        action: Literal["warn", "stop", "raise"] = "warn",
        cooldown_steps: int = 1000,
    ) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self.every_n_steps: int = check_int("every_n_steps", every_n_steps, 1)
        self.window: int = check_int("window", window, 1)
        self.threshold: float = check_float("threshold", threshold, 0.0, 1.0)
        self.patience: int = check_int("patience", patience, 1)
        self.check_saturation = check_bool("check_saturation", check_saturation)
        self.saturation_threshold: float = check_float("saturation_threshold", saturation_threshold, 0.0, 1.0)
        self.log_histograms = check_bool("log_histograms", log_histograms)
        self.histogram_bins: int = check_int("histogram_bins", histogram_bins, 2)
        #: dead fraction per ReLU layer at the last full-window check
        self.dead_fractions: dict[str, float] = {}
        #: saturated fraction per sigmoid/tanh layer at the last full-window check
        self.saturated_fractions: dict[str, float] = {}
        #: how many optimizer steps were sampled (batches, in manual optimization); micro-batches pooled
        self.sampled_batches = 0
        self._windows: dict[str, deque[tuple[Tensor, float]]] = {}
        self._strikes: dict[str, int] = {}
        # capture state (only while a sampled forward runs)
        self._capturing = False
        self._mode: _Capture | None = None
        self._handles: list[RemovableHandle] = []
        self._names: dict[int, str] = {}
        # modules whose forward is running: [name, is an activation module, last child that finished]
        self._stack: list[list[Any]] = []
        self._channel_first = False
        self._calls: dict[str, int] = {}
        # the sampled step's records so far, pooled over its micro-batches: key -> (saturation, counts, n)
        self._step: dict[str, tuple[bool, Tensor, int]] = {}
        self._stepped = False  # on_before_optimizer_step fired during this batch
        self._step_sampled = False  # the current optimizer step is a sampled one (on every rank alike)
        self._record_error: Exception | None = None  # what stopped this step's capture, if anything
        self._sampled_at = (0, 0)
        #: sampled steps still to take right away because a layer looked dead on a sampled step
        self._follow_left = 0
        self._following = False
        self._outside_seen = False

    # ------------------------------------------------------------------ layout
    @override
    def layout_charts(self) -> dict[str, list[str]]:
        charts = {"Dead ReLU fraction per layer": ["dead_relu/.*"]}
        if self.check_saturation:
            charts["Saturated sigmoid/tanh units per layer"] = ["saturated/.*"]
        return charts

    def due(self, step: int) -> bool:
        """Whether logging step ``step`` (see :func:`~lightning_gradguard.core.cadence.log_step`) is sampled.

        Lightning's logging rule, ``(step + 1) % every_n_steps == 0``, so ``dead_relu/*`` points share the
        x of the loss and of the gradient histograms; every step at the start. Under
        ``accumulate_grad_batches`` all micro-batches of a due optimizer step are watched, as one sample.
        """
        return step < self.window + self.patience - 1 or (step + 1) % self.every_n_steps == 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.fresh_run(trainer):  # a new run is judged on its own sampled steps
            self._windows, self._strikes = {}, {}
            self.dead_fractions, self.saturated_fractions = {}, {}
            self.sampled_batches, self._follow_left, self._following = 0, 0, False
            self._step, self._stepped, self._step_sampled = {}, False, False

    # ------------------------------------------------------------------ attach / detach
    @override
    @guarded
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        at = log_step(trainer)
        if (self._step_sampled or self._following) and at != self._sampled_at[1]:
            # a step ended without on_before_optimizer_step (an ``optimizer_step`` override that skipped
            # ``optimizer.step``): close it now, still at the same point on every rank
            self._end_step(trainer)
        self._stepped = False
        regular = self.due(at)
        if self._mode is not None or not (regular or self._follow_left > 0):
            return
        # the micro-batches of one optimizer step share ``at``, so they are all sampled or none is
        self._following = not regular
        self._step_sampled = True
        self._names = {id(m): name for name, m in pl_module.named_modules()}
        self._sampled_at = (int(trainer.global_step), at)
        self._stack, self._calls = [], {}  # names (``#2``) restart with each forward pass
        self._channel_first = False
        self._handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._mode = _Capture(self)
        self._mode.__enter__()
        self._capturing = True

    def _detach(self, trainer: pl.Trainer) -> None:
        self._capturing = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        mode, self._mode = self._mode, None
        if mode is None:
            return
        current = (
            torch.overrides._get_current_function_mode()
            if hasattr(torch.overrides, "_get_current_function_mode")
            else mode
        )
        if current is mode:
            mode.__exit__(None, None, None)
        else:  # a mode entered after ours is still active: leave ours inert rather than pop theirs
            warn_once(
                trainer,
                "dead_relu_mode_order",
                "DeadReLUMonitor: another TorchFunctionMode is active above its capture mode; the capture "
                "mode is left inert on the stack.",
            )

    @override
    @guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._mode is not None:
            self._detach(trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._stepped = True  # fires only for the micro-batch that steps (more than once for LBFGS)

    @override
    @guarded
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._mode is not None:
            self._detach(trainer)
        # One sample per optimizer step: under accumulate_grad_batches the micro-batches before the one that
        # steps only add to the pooled counts. Without accumulation, and in manual optimization (where
        # Lightning refuses accumulate_grad_batches), every batch closes its step, as it always did.
        if self._stepped or not pl_module.automatic_optimization or trainer.accumulate_grad_batches <= 1:
            self._end_step(trainer)
        if self._outside_seen:
            self._outside_seen = False
            warn_once(
                trainer,
                "dead_relu_outside_modules",
                "DeadReLUMonitor: ReLU/sigmoid/tanh calls outside every module's forward (loss code in "
                "training_step, or a model called as self.forward(x) instead of self(x)) are not watched.",
            )

    def _end_step(self, trainer: pl.Trainer) -> None:
        """Close the sampled optimizer step: one flush (one collective under DDP), one follow-up used.

        Under DDP every rank of a sampled step flushes, also one that saw no activation (a branch its data
        did not take) or whose capture failed: the flush's collectives must meet on every rank, and its
        signature check then skips the step everywhere instead of leaving the others waiting.
        """
        self._stepped = False
        sampled, self._step_sampled = self._step_sampled, False
        records, self._step = self._step, {}
        if self._record_error is not None:
            err, self._record_error = self._record_error, None
            records = {}  # a partial capture is no sample
            warn_once(
                trainer,
                "dead_relu_record_error",
                f"DeadReLUMonitor could not measure an activation ({type(err).__name__}: {err}); the "
                "sampled steps where that happens are skipped.",
            )
        if records or (sampled and trainer.world_size > 1):
            self._flush(trainer, [(key, sat, counts, n) for key, (sat, counts, n) in records.items()])
        if self._following:
            self._following = False
            self._follow_left = max(self._follow_left - 1, 0)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mode is not None:  # on_train_batch_start returned -1: that batch never ended
            self._detach(trainer)
        if (self._step_sampled or self._following) and log_step(trainer) != self._sampled_at[1]:
            self._end_step(trainer)
        # what is left belongs to a step cut short with the epoch: Lightning drops its gradients too
        self._step, self._following, self._stepped, self._step_sampled = {}, False, False, False

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mode is not None:
            self._detach(trainer)
            self._step = {}

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._mode is not None:
            self._detach(trainer)
        self._step = {}

    # ------------------------------------------------------------------ during the sampled forward
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module), f"<{type(module).__name__}>")
        self._stack.append([name, isinstance(module, _ACTIVATION_MODULES), None])

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            done = self._stack.pop()[0]
            if self._stack:  # the caller's latest finished child: what a functional ReLU most likely eats
                self._stack[-1][2] = done
        if isinstance(module, _CHANNEL_FIRST):
            self._channel_first = True
        elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding, nn.RNNBase, nn.MultiheadAttention)):
            self._channel_first = False

    def _safe_record(self, fn: str, x: Tensor, saturation: bool) -> None:
        """:meth:`_record`, run inside the user's forward pass: a failure of ours must not break it.

        An activation we cannot measure (a tensor subclass, an exotic layout) stops the capture of this
        step; the step is then skipped with a one-time warning (see :meth:`_end_step`).
        """
        try:
            self._record(fn, x, saturation)
        except Exception as err:
            if strict_mode():
                raise
            self._capturing = False
            self._record_error = err

    def _record(self, fn: str, x: Tensor, saturation: bool) -> None:
        # Only layers are watched: a call outside every module's ``forward`` is loss or glue code in
        # ``training_step`` (a hinge loss ``F.relu(1 - y * f(x))`` outputs 0 exactly when it is satisfied),
        # and a tensor with fewer than 2 dimensions has no unit axis (one value per sample, or a scalar).
        if x.dim() < 2 or not x.is_floating_point():
            return
        if not self._stack:
            self._outside_seen = True
            return
        top, is_activation, producer = self._stack[-1]
        if is_activation:
            base = top
        else:  # a functional call: named by the calling module and the child whose output it got
            if producer and top and producer.startswith(top + "."):
                producer = producer[len(top) + 1 :]
            call = f"{fn}({producer})" if producer else fn
            base = f"{top}:{call}" if top else call
        n = self._calls[base] = self._calls.get(base, 0) + 1
        key = base if n == 1 else f"{base}#{n}"
        dim = unit_dim(x.dim(), self._channel_first and x.dim() >= 3)
        if saturation:
            counts, per_unit = saturation_counts(x, fn, dim)
        else:
            counts, per_unit = activity_counts(x, dim)
        # pooled over the step's micro-batches: a unit is active in the step if any sample of any of them
        # fired it, and its rate is over all their samples (a changed unit count starts the key afresh)
        prev = self._step.get(key)
        if prev is not None and prev[1].shape == counts.shape:
            counts, per_unit = prev[1] + counts, prev[2] + per_unit
        self._step[key] = (saturation, counts, per_unit)

    # ------------------------------------------------------------------ after the sampled step
    def _flush(self, trainer: pl.Trainer, records: list[tuple[str, bool, Tensor, int]]) -> None:
        device = records[0][2].device if records else trainer.strategy.root_device
        parts = [c.float().reshape(-1) for _, _, c, _ in records]
        parts.append(torch.tensor([float(n) for *_, n in records], device=device))
        packed = torch.cat(parts)
        if trainer.world_size > 1:
            sig = zlib.crc32("|".join(f"{k}:{s}:{c.numel()}" for k, s, c, _ in records).encode())
            check = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
            check = trainer.strategy.reduce(check, reduce_op="max")
            if int(check[0]) != -int(check[1]):
                warn_once(
                    trainer,
                    "dead_relu_ranks_differ",
                    "DeadReLUMonitor: ranks saw different activation layers on a sampled step; that step is "
                    "skipped on every rank.",
                )
                return
            if not records:  # no rank saw an activation on this sampled step
                return
            packed = trainer.strategy.reduce(packed, reduce_op="sum")
        host = packed.cpu()  # the one device -> host transfer of this sampled step
        self.sampled_batches += 1
        offset = 0
        per_step: dict[str, tuple[bool, Tensor]] = {}
        for key, saturation, counts, _ in records:
            per_step[key] = (saturation, host[offset : offset + counts.numel()])
            offset += counts.numel()
        ns = host[offset:].tolist()
        for (key, (_, counts)), n in zip(per_step.items(), ns, strict=True):
            win = self._windows.get(key)
            if win is None or (win and win[-1][0].numel() != counts.numel()):
                win = self._windows[key] = deque(maxlen=self.window)
            win.append((counts, n))
        self._check(trainer, per_step)

    def _check(self, trainer: pl.Trainer, per_step: dict[str, tuple[bool, Tensor]]) -> None:
        step, at = self._sampled_at
        metrics: dict[str, float] = {}
        histograms: list[tuple[str, Tensor]] = []
        alerts = []
        suspicious = False
        for key, (saturation, step_counts) in per_step.items():
            if not saturation:  # more than `threshold` of the units silent on this very step
                suspicious |= float((step_counts == 0).float().mean()) > self.threshold
            win = self._windows[key]
            counts = torch.stack([c for c, _ in win])
            total = sum(n for _, n in win)
            rate = counts.sum(0) / max(total, 1.0)
            full = len(win) >= self.window
            if saturation:
                frac = float((rate > 0.5).float().mean())
                metrics[f"saturated/{key}"] = frac
                if full:
                    self.saturated_fractions[key] = frac
                over = full and frac > self.saturation_threshold
                kind, limit = "saturated_activation", self.saturation_threshold
            else:
                dead = dead_units(counts)
                frac = float(dead.float().mean())
                metrics[f"dead_relu/{key}"] = frac
                histograms.append((f"activation_rate/{key}", rate))
                if full:
                    self.dead_fractions[key] = frac
                over = full and frac > self.threshold
                kind, limit = "dead_relu", self.threshold
            strike_key = f"{kind}@{key}"
            if not full:
                continue
            self._strikes[strike_key] = self._strikes.get(strike_key, 0) + 1 if over else 0
            if self._strikes[strike_key] < self.patience:
                continue
            units = counts.shape[1]
            data = {"fraction": frac, "threshold": limit, "units": float(units), "window": float(len(win))}
            if kind == "dead_relu":
                message = (
                    f"{frac:.0%} of the {units} units of {key} output 0 for every sample of the last "
                    f"{len(win)} sampled steps (threshold {limit:.0%})."
                )
                alert = self.report(trainer, kind, "error", key, message, _DEAD_HINT, data, step=step)
            else:
                message = (
                    f"{frac:.0%} of the {units} units of {key} spend most of the last {len(win)} sampled "
                    f"steps in the saturated zone, where the derivative is 0 (threshold {limit:.0%})."
                )
                alert = self.report(trainer, kind, "warning", key, message, _SATURATION_HINT, data, step=step)
            if alert is not None:
                alerts.append(alert)
        logging_on = logging_interval(trainer) > 0  # Trainer(log_every_n_steps=0): detection only
        if logging_on:
            _emit.log_scalars(trainer, metrics, at)
        if logging_on and self.log_histograms and histograms and _emit.tensorboard_writers(trainer):
            spec = device_histograms([r for _, r in histograms], bins=self.histogram_bins)
            for i, (tag, _) in enumerate(histograms):
                _emit.log_histogram_raw(trainer, tag, spec.stats[i], spec.edges[i], spec.counts[i], at)
        # A regular sample that looks dead is followed up at once: the next window + patience - 1 steps
        # are sampled too, so a layer that died mid-run is confirmed within a few steps, not
        # every_n_steps x (window + patience - 1). Follow-ups do not start new follow-ups.
        if suspicious and not self._following and step >= self.window + self.patience - 1:
            self._follow_left = self.window + self.patience - 1
        self.act(trainer, alerts)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            strikes=dict(self._strikes),
            windows={k: [(c.clone(), n) for c, n in w] for k, w in self._windows.items()},
            sampled_batches=self.sampled_batches,
            follow_left=self._follow_left,
        )
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._strikes = dict(state_dict.get("strikes", {}))
        self._windows = {
            k: deque([(torch.as_tensor(c), float(n)) for c, n in w], maxlen=self.window)
            for k, w in state_dict.get("windows", {}).items()
        }
        self.sampled_batches = int(state_dict.get("sampled_batches", 0))
        self._follow_left = int(state_dict.get("follow_left", 0))
