"""GradientNormLogger: gradient and weight norms, update ratios, histograms, clipping and the noise scale.

* ``callback``: :class:`GradientNormLogger` (what is logged when, the one transfer of a logging step);
* ``measure``: what a logging step measures from the shared step statistics (:class:`NormSample`, its host
  :class:`NormReading` and its scalars, the layers shown under a cap) and the pre-clip norm ring;
* ``rules``: one declaration per rule with its check: the verdict on the Trainer's ``gradient_clip_val``
  (clips every step, or never) and the update-ratio rule (the learning rate, or the weight decay, named);
* ``ratio``: how long the total update/weight ratio has stayed above its ceiling, and what the optimizer
  runs with;
* ``noise_scale``: the gradient noise scale from the micro-batches and ranks (tensor hooks on the
  parameters, device moving averages).
"""
