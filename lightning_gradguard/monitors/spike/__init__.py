"""LossSpikeGuard: a loss or gradient-norm spike caught before the update, and the recovery; a loss that
climbs far above its start in the first steps, named.

Modules:

* ``callback``: :class:`~lightning_gradguard.monitors.spike.callback.LossSpikeGuard`, its hooks, windows,
  counters, checkpoint state and ``spike/*`` scalars.
* ``measure``: what an optimizer step gathers of its micro-batches, and its loss and gradient norm read in
  one transfer.
* ``rules``: what makes a step a spike (a gradient-norm spike needs the loss to confirm it), the
  escalation ladder, when a rollback point is due, and one declaration per alert kind with its check (the
  words of ``loss_spike``, ``batch_statistics_outlier`` and ``early_divergence``).
* ``early``: the early-divergence watch (the loss against the run's own start while the windows warm up).
* ``records``: ``spikes.json``, its records, and the batches a later run drops again.

The score itself, and the start an early loss is judged against, are
:mod:`lightning_gradguard.functional.spikes`.
"""
