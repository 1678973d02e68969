"""The learning-rate range test: ``LRFinderPlus`` and ``lr_find``.

* ``callback``: ``LRFinderPlus`` (when a test runs, its alert, its state) and ``lr_find`` (one test before
  training, in a throwaway Trainer).
* ``rules``: the ``lr_finder_failed`` rule, declared with its check (no LR applied, in words, and what to
  change).
* ``engine``: the range test itself: which setups it supports, the sweep, the decision, applying the LR.
* ``divergence``: ``DivergenceMonitor``, the sweep's online smoothing and stop rule.
* ``schedule``: the run's LR schedule, read by stepping its schedulers ahead; compressed to a trial.
* ``search``: the search after the sweep: candidates in its bracket trained from the same start,
  successive halving, scored on held-out batches.
* ``result``: ``LRFinderResult``, the outcome of one test, and its figure.
* ``output``: where a result goes on rank 0: scalars, the summary line, CSV, figure, hyperparameters.

The stateless math (the LR schedule, the smoothing of the curve, whether its fall stands out of its
noise, the suggestions) is :mod:`lightning_gradguard.functional.lr_suggest`.
"""
