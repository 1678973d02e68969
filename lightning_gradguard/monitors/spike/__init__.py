"""LossSpikeGuard: a loss or gradient-norm spike caught before the update, and the recovery.

Modules:

* ``callback``: :class:`~lightning_gradguard.monitors.spike.callback.LossSpikeGuard`, its hooks, windows,
  counters, checkpoint state and ``spike/*`` scalars.
* ``step``: what an optimizer step gathers of its micro-batches, and its loss and gradient norm read in
  one transfer.
* ``rules``: the escalation ladder, when a rollback point is due, and the ``loss_spike`` alert's words.
* ``records``: ``spikes.json``, its records, and the batches a later run drops again.

The score itself is :mod:`lightning_gradguard.functional.spikes`.
"""
