"""What every gradguard callback stands on; never imports a callback.

* ``validate``: argument checks that name the argument and what is allowed.
* ``state``: what the callbacks of one Trainer share; one-time messages; strict mode.
* ``cadence``: Lightning's logging axis and rule (when to measure and log).
* ``stats``: the statistics of one optimizer step, computed once on the device for every callback.
* ``grad_norms``: the gradient/weight norms a logging step or a detector check reads, in one transfer.
* ``activations``: activity counts of a sampled step summed across ranks and read in one transfer.
* ``transfer``: the one device -> host transfer of a step.
* ``collective``: verdicts reduced across ranks, so every rank acts alike.
* ``emit``: the one way out to the loggers (scalars, histograms, text, the custom-scalars layout).
* ``base``: :class:`GradGuardCallback`, the alert bus (report, cooldown, action), ``state_key``.
* ``batch``: finding tensors in batches, and preparing a batch exactly as Lightning's loop does.
* ``trial``: calling ``training_step`` outside Lightning's loop (quietly, seeded).
* ``snapshot``: an exact snapshot of everything trial steps can change, and its restore.
* ``preflight``: the base of the pre-flight checks (OverfitBatchSanity, GradientCheck): their findings,
  when a check runs, one verdict reduced across ranks.
"""
