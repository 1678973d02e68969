"""NaNSentinel: fail fast at the first NaN/inf loss, gradient or parameter, with a forensic report.

* :mod:`~lightning_gradguard.monitors.nan.callback`: the ``NaNSentinel`` callback (its hooks, the
  failure path in its order, the action, its checkpoint state);
* :mod:`~lightning_gradguard.monitors.nan.measure`: what it tracks during an optimizer step, the flags it
  reads in one collective and one host read, and the facts a report holds;
* :mod:`~lightning_gradguard.monitors.nan.rules`: the pure verdict the flags imply, and one declaration
  per alert kind with its check (the alert's words, from the report);
* :mod:`~lightning_gradguard.monitors.nan.report`: the forensic report of a finding, gathered, and its
  files (``report.json``, ``batch.pt``, ``last_good.ckpt``);
* :mod:`~lightning_gradguard.monitors.nan.forensics`: where a NaN/inf was born, found by replaying the
  batch on copies of the weights.
"""
