"""Hooks that exist only on a sampled step: the scope a sampling monitor measures in.

:class:`ScopedHooks` holds what a scope attaches to the user's model (global module hooks, a
``TorchFunctionMode``, the eager stance for a compiled model) and lets all of it go on :meth:`close`;
:class:`NextCall` makes the scope exactly the next call of a method (the LightningModule's
``training_step``); :class:`SamplingMonitor` is the lifecycle of a sampled step (arm the scope on a
sampled step, close it after each ``training_step`` call, end the sample once per optimizer step, at the
epoch's end or on an exception). DeadReLUMonitor and ActivationRangeMonitor are built on both.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gradguard.core.base import DEFAULT_COOLDOWN_STEPS, GradGuardCallback, guarded
from lightning_gradguard.core.cadence import log_step
from lightning_gradguard.core.compile import Uncompiled
from lightning_gradguard.core.progress import LossProgress
from lightning_gradguard.core.runstate import RunField


class ScopedHooks(AbstractContextManager[Any]):
    """What a capture scope holds and lets go: global module hooks, a ``TorchFunctionMode``, the eager
    stance for a compiled model (:class:`~lightning_gradguard.core.compile.Uncompiled`) and a pending
    :class:`NextCall`. Subclasses open them in ``__enter__``; :meth:`close` (also ``__exit__``) removes
    them all, idempotently.

    Attributes:
        capturing: the scope is open and measuring.
        left_inert: another ``TorchFunctionMode`` entered after ours was still active when a scope ended:
            ours was left on the stack, inert, rather than popping theirs.
    """

    def __init__(self, model: nn.Module) -> None:
        self.capturing = False
        self.left_inert = False
        self._next_call: NextCall | None = None
        self._mode: Any = None  # the subclass's TorchFunctionMode while a scope is open (with ``live``)
        self._handles: list[RemovableHandle] = []
        self._eager = Uncompiled(model)
        self._open = False  # a subclass's ``__enter__`` opens the scope

    @property
    def active(self) -> bool:
        """A scope is open, or waiting for the call :meth:`around_next_call` named."""
        return self._open or self._next_call is not None

    def around_next_call(self, owner: Any, name: str) -> None:
        """Open a scope around the next call of ``owner.<name>`` only (:class:`NextCall`)."""
        self._next_call = NextCall(owner, name, self)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End the current scope now (idempotent): the mode, the hooks and a pending next call go."""
        self._release()

    def _release(self) -> bool:
        """Remove everything; ``False`` when the mode had to be left inert (see ``left_inert``)."""
        self.capturing = False
        self._open = False
        if self._next_call is not None:
            self._next_call.remove()
            self._next_call = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._eager.close()
        mode, self._mode = self._mode, None
        if mode is None:
            return True
        mode.live = False
        current = getattr(torch.overrides, "_get_current_function_mode", lambda: mode)()
        if current is mode:
            mode.__exit__(None, None, None)
            return True
        self.left_inert = True  # a mode entered after ours is still active: leave ours, not pop theirs
        return False


class NextCall:
    """The next call of ``owner.<name>`` runs inside ``scope``; later calls are plain again.

    An instance attribute shadows the method and removes itself before the call it wraps (as Lightning's
    forward redirection does), so exactly one call is wrapped, whoever makes it (Lightning's loop, or the
    DDP wrapper's forward redirection). :meth:`remove` takes it away if that call never came. The wrapper
    keeps the method's signature (``functools.wraps``), which Lightning inspects for ``batch_idx``.
    """

    def __init__(self, owner: Any, name: str, scope: AbstractContextManager[Any]) -> None:
        self.owner, self.name = owner, name
        own = vars(owner)
        self._shadowed = (name in own, own.get(name))
        original = getattr(owner, name)

        @functools.wraps(original)
        def once(*args: Any, **kwargs: Any) -> Any:
            if self._wrapper is None:  # a reference someone kept past its one call: a plain call now
                return original(*args, **kwargs)
            self.remove()
            with scope:
                return original(*args, **kwargs)

        # Lightning unwraps one ``__wrapped__`` level to read the signature: let it land where it would
        # without us (a compiled or decorated ``training_step`` has ``(*args, **kwargs)`` one level up)
        once.__wrapped__ = getattr(original, "__wrapped__", original)
        self._wrapper: Any = once
        setattr(owner, name, once)

    def remove(self) -> None:
        """Put the method back (idempotent)."""
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is None or vars(self.owner).get(self.name) is not wrapper:
            return
        had, previous = self._shadowed
        if had:
            setattr(self.owner, self.name, previous)
        else:
            delattr(self.owner, self.name)


class SamplingMonitor(GradGuardCallback):
    """A monitor that measures the forward pass of sampled training steps only (DeadReLUMonitor,
    ActivationRangeMonitor): the one lifecycle of a sampled step, written once.

    On a sampled step (:meth:`sample_due`) a scope (:meth:`new_capture`, a :class:`ScopedHooks`) is armed
    around the next ``training_step`` call of every micro-batch (from Lightning's loop, or through the DDP
    wrapper's forward); validation never runs inside it. The scope closes when the call returns (before
    the backward of manual optimization), and the sample ends once per optimizer step: at the end of the
    batch that stepped (every batch without accumulation and in manual optimization), at the start of
    the next step when one ended without ``on_before_optimizer_step`` (an ``optimizer_step`` override that
    skipped ``optimizer.step``), or at the epoch's end; :meth:`end_sample` then reads and judges what the
    scope measured, at the same point on every rank. An exception drops the scope. Every hook is
    :func:`~lightning_gradguard.core.base.guarded`.
    """

    #: the sampled steps' losses (the monitor reads them in its transfer): is the run learning?
    progress: RunField[LossProgress] = RunField(LossProgress)

    def __init__(self, action: str = "warn", cooldown_steps: int = DEFAULT_COOLDOWN_STEPS) -> None:
        super().__init__(action=action, cooldown_steps=cooldown_steps)
        self._forget_sample()

    # ------------------------------------------------------------------ what a monitor defines
    def sample_due(self, trainer: pl.Trainer, at: int) -> bool:
        """Whether the optimizer step at log step ``at`` is sampled (the same answer on every rank)."""
        raise NotImplementedError

    def new_capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ScopedHooks:
        """The scope of a newly sampled step (called once per sampled optimizer step)."""
        raise NotImplementedError

    def end_sample(self, trainer: pl.Trainer, capture: ScopedHooks, sampled_at: tuple[int, int]) -> None:
        """Read and judge what ``capture`` measured on the step sampled at ``(global_step, log step)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the lifecycle
    def _forget_sample(self) -> None:
        self._capture: ScopedHooks | None = None
        self._sampled_at: tuple[int, int] | None = None  # (global_step, log step) of the open sample
        self._stepped = False  # on_before_optimizer_step fired during this batch

    @guarded
    def _end_step(self, trainer: pl.Trainer) -> None:
        capture, sampled_at = self._capture, self._sampled_at
        self._forget_sample()
        if capture is not None and sampled_at is not None:
            capture.close()
            self.end_sample(trainer, capture, sampled_at)

    @guarded
    def _close_scope(self, trainer: pl.Trainer) -> None:
        if self._capture is not None:
            self._capture.close()

    @guarded
    def _arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, at: int) -> None:
        """Open the sample (once per optimizer step: its micro-batches share ``at``) and put the scope
        around this batch's ``training_step`` call."""
        if self._capture is None:
            self._capture = self.new_capture(trainer, pl_module)
            self._sampled_at = (int(trainer.global_step), at)
            self.progress.clear()  # the sample's losses start here (end_sample takes them)
        if not self._capture.active:
            self._capture.around_next_call(pl_module, "training_step")

    # The hooks test the cadence themselves and hand the work to the guarded methods above: a step that is
    # not sampled costs each hook one frame.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._forget_sample()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        at = log_step(trainer)
        if self._sampled_at is not None and at != self._sampled_at[1]:
            self._end_step(trainer)  # a step that ended without on_before_optimizer_step
        self._stepped = False
        if self._sampled_at is not None or self.sample_due(trainer, at):
            self._arm(trainer, pl_module, at)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._capture is not None:  # manual optimization: backward and later forwards run in training_step
            self._close_scope(trainer)
        if self._sampled_at is not None:
            self.progress.add(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._stepped = True  # fires only for the micro-batch that steps (more than once for LBFGS)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._sampled_at is None and self._capture is None:
            return
        self._close_scope(trainer)  # this batch's pass is over (and a training_step call that never came)
        steps_now = (
            self._stepped or not pl_module.automatic_optimization or trainer.accumulate_grad_batches <= 1
        )
        if self._sampled_at is not None and steps_now:
            self._end_step(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_scope(trainer)  # on_train_batch_start returned -1: that batch never ran
        if self._sampled_at is not None:  # a step cut short with the epoch
            self._end_step(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close_scope(trainer)
        self._forget_sample()
