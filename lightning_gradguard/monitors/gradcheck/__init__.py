"""GradientCheck: autograd's gradients against finite differences, in float64, before the run.

* ``callback``: :class:`GradientCheck` (the check on the first batch of ``fit``) and ``gradient_check``
  (the same check on any module and batch), on
  :class:`~lightning_gradguard.core.preflight.PreflightCheck`;
* ``engine``: the check of an ``nn.Module`` on a float64 copy, and its results (``GradientCheckResult``,
  ``ParameterCheck``);
* ``graph``: the float64 copy, and which module made which part of the autograd graph
  (``find_custom_functions``);
* ``rules``: the ``gradient_mismatch`` rule, declared with its hint and its check (one finding per
  failing parameter);
* ``findings``: what a result says in words: a failing parameter, the known patterns, the passed line.

The math is :mod:`lightning_gradguard.functional.gradcheck`; what the check shares with
:class:`~lightning_gradguard.OverfitBatchSanity` is :mod:`lightning_gradguard.core.preflight`.
"""
