"""GradientCheck: autograd's gradients against finite differences, in float64, before the run.

Its modules: the house table of docs/architecture.md.
"""
