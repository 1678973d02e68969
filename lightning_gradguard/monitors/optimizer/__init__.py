"""OptimizerMonitor: what the optimizer did with the gradient, and what it keeps.

* ``callback``: :class:`OptimizerMonitor` (cadence, tags, the skipped-update counters, the two rules);
* ``sample``: one measured step (the update's geometry on the step's shared update sample, Adam's moments
  or SGD's momentum at the same entries, the GradScaler's skips) read in one transfer;
* ``rules``: Adam's ``eps`` dominating a layer's step and an update ratio far from the others, in words.
"""
