"""LossSpikeGuard: a loss or gradient-norm spike caught before the update, and the recovery.

Its modules: the house table of docs/architecture.md.
"""
