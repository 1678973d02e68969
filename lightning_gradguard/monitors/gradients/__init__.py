"""GradientNormLogger: gradient and weight norms, update ratios, histograms, clipping and the noise scale.

* ``callback``: :class:`GradientNormLogger` (what is logged when, the one transfer of a logging step);
* ``norms``: what a logging step measures from the shared step statistics (:class:`NormSample`, its host
  :class:`NormReading` and its scalars, the layers shown under a cap) and the pre-clip norm ring;
* ``clipping``: the verdict on the Trainer's ``gradient_clip_val``, in words;
* ``noise_scale``: the gradient noise scale from the micro-batches and ranks (tensor hooks on the
  parameters, device moving averages).
"""
