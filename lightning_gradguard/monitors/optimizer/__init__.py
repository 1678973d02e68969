"""OptimizerMonitor: what the optimizer did with the gradient, and what it keeps.

Its modules: the house table of docs/architecture.md.
"""
