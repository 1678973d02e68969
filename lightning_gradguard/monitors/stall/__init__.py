"""StallDetector: a run that has quietly stopped learning, and the likely cause.

* ``callback``: :class:`StallDetector` (when to check, the LR history, logging, the alerts);
* ``probe``: what one check measures on the device (update ratios from the step's shared update sample,
  the clip ratio, the losses and the labels) and reads in one transfer;
* ``check``: one check's numbers, the rules' thresholds, label entropy and batch purity, and the wording;
* ``rules``: the stall rules on host numbers, with what they remember between checks.
"""
