"""Hooks on the user's model that exist only while they are needed, and what they find.

* ``capture``: :class:`ActivationCapture`, the activations of one sampled forward pass, as a context
  manager (a torch-function mode and global module hooks attached on entry, removed on exit).
* ``order``: :class:`ForwardOrder`, the order in which parameter-owning modules run (first batch only).
* ``modules``: forward hooks the pre-flight checks use (the last per-sample output, which modules ran),
  and ``Uncompiled``: while open, ``torch.compile``'d code runs eager (every hook of ours runs in one).
* ``forensics``: where a NaN/inf was born, by replaying a batch (forward hooks, then anomaly mode).
* ``nan_step`` / ``nan_report``: what NaNSentinel tracks during a step, and the report it files.
"""
