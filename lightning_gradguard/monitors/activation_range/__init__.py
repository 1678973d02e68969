"""ActivationRangeMonitor: every block's output range and the largest attention logit, on sampled steps.

* ``callback``: :class:`ActivationRangeMonitor` (when to sample, what to log, the alerts), on
  :class:`~lightning_gradguard.core.sampling.SamplingMonitor`;
* ``capture``: the sampled forward pass (which modules are blocks, the hooks and the ``TorchFunctionMode``
  that keep output moments and attention logits on the device) and its one transfer, pooled across ranks;
* ``rules``: fp16 headroom running out and attention logits growing, in words.
"""
