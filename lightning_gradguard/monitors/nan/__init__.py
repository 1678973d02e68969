"""NaNSentinel: fail fast at the first NaN/inf loss, gradient or parameter, with a forensic report.

Its modules: the house table of docs/architecture.md.
"""
