"""ActivationRangeMonitor: every block's output range and the largest attention logit, on sampled steps.

Its modules: the house table of docs/architecture.md.
"""
