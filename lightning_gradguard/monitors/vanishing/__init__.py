"""VanishingExplodingDetector: exploding and vanishing gradients, judged from per-layer norms.

* ``callback``: :class:`VanishingExplodingDetector` (when to check, the strikes, the gradient-flow chart);
* ``norms``: the per-layer gradient norms of a check, from the shared step statistics, in one transfer;
* ``order``: the forward order of the layers (first and last), from one watched forward pass;
* ``rules``: the exploding and vanishing rules on one check's numbers, and their wording.
"""
