"""OverfitBatchSanity: before the run, prove in seconds that the model can learn one batch.

* ``callback``: :class:`OverfitBatchSanity` (its arguments, the first batch drawn, cut and put back, the
  words of its verdict), on :class:`~lightning_gradguard.core.preflight.PreflightCheck`;
* ``rules``: one declaration per rule (its kind, words, hint and check, the check right above it);
* ``check``: the check on one batch: the trial, the rules' checks, the fallback, the verdict;
* ``trial``: the training loop on one batch, and what ``training_step`` draws at random;
* ``findings``: ``OverfitResult``, and what the rules about the parameters and the data read (the
  parameters that never moved and why, the batch mixing);
* ``diagnosis``: the loss curve (the classes and the chance level, a loss summed over the batch, the
  shape of a curve that missed its target);
* ``modules``: the forward hooks the check puts on the model, and the modules only other steps use.

What it shares with :class:`~lightning_gradguard.GradientCheck` (``PreflightFinding``, when a check
runs, one verdict reduced across ranks) is :mod:`lightning_gradguard.core.preflight`.
"""
