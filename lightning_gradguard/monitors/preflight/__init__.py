"""The pre-flight checks: OverfitBatchSanity and GradientCheck, run once at the start of ``fit``.

* ``verdict``: what both checks share: ``Finding``, the base ``PreflightCheck`` (when a check
  runs, one verdict reduced across ranks);
* ``overfit``: the ``OverfitBatchSanity`` callback and the words of its verdict;
* ``overfit_check``: the check on one batch: the trial, the findings, the fallback, the verdict;
* ``overfit_trial``: the training loop on one batch, and what ``training_step`` draws at random;
* ``findings``: ``OverfitResult``, and the findings about the parameters and the data;
* ``diagnosis``: the findings about the loss curve (initial loss, chance level, why a batch was not
  learned);
* ``modules``: the forward hooks the overfit check puts on the model;
* ``gradient_check``: ``gradient_check`` and the ``GradientCheck`` callback;
* ``gradcheck_module``: the gradient-check engine on a float64 copy, and its results;
* ``gradcheck_graph``: the float64 copy, and which module made which part of the autograd graph;
* ``gradcheck_report``: the gradient check's findings and lines, in words.

The math of the gradient check is in :mod:`lightning_gradguard.functional.gradcheck`.
"""
