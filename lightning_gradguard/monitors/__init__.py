"""The monitors, one package each: its Callback, its step logic, its rules and its wording.

``nan`` (NaNSentinel), ``spike`` (LossSpikeGuard), ``gradients`` (GradientNormLogger), ``vanishing``
(VanishingExplodingDetector), ``dead_units`` (DeadReLUMonitor), ``activation_range``
(ActivationRangeMonitor), ``optimizer`` (OptimizerMonitor), ``stall`` (StallDetector), ``overfit``
(OverfitBatchSanity), ``gradcheck`` (GradientCheck, ``gradient_check``) and ``lr_finder`` (LRFinderPlus,
``lr_find``). A monitor imports ``core``, ``functional``, ``alerts`` and ``tags``, never another monitor;
users import the callbacks from ``lightning_gradguard``.
"""
