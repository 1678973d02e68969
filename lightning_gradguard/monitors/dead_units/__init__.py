"""DeadReLUMonitor: ReLU units that never fire and sigmoid/tanh units stuck in saturation, on sampled steps.

Its modules: the house table of docs/architecture.md.
"""
