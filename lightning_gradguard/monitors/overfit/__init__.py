"""OverfitBatchSanity: before the run, prove in seconds that the model can learn one batch.

* ``callback``: :class:`OverfitBatchSanity` (its arguments, the first batch drawn, cut and put back, the
  words of its verdict), on :class:`~lightning_gradguard.core.preflight.PreflightCheck`;
* ``check``: the check on one batch: the trial, the findings, the fallback, the verdict;
* ``trial``: the training loop on one batch, and what ``training_step`` draws at random;
* ``findings``: ``OverfitResult``, and the findings about the parameters and the data;
* ``diagnosis``: the findings about the loss curve (initial loss, chance level, why a batch was not
  learned);
* ``modules``: the forward hooks the check puts on the model, and the modules only other steps use.

What it shares with :class:`~lightning_gradguard.GradientCheck` (``Finding``, when a check runs, one
verdict reduced across ranks) is :mod:`lightning_gradguard.core.preflight`.
"""
