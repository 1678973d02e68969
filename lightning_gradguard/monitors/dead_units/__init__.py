"""DeadReLUMonitor: ReLU units that never fire and sigmoid/tanh units stuck in saturation, on sampled steps.

* ``callback``: :class:`DeadReLUMonitor` (cadence with follow-ups, logging, the alerts), on
  :class:`~lightning_gradguard.core.sampling.SamplingMonitor`;
* ``capture``: :class:`ActivationCapture`, every ReLU output and sigmoid/tanh input of one forward pass
  counted per unit on the device, and how its layers are named;
* ``counts``: a sampled step's counts, signature-checked and summed across ranks, in one transfer;
* ``windows``: the windows of sampled steps, the dead and saturated verdicts, and their wording.
"""
