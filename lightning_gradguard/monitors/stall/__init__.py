"""StallDetector: a run that has quietly stopped learning, and the likely cause.

Its modules: the house table of docs/architecture.md.
"""
