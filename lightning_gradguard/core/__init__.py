"""What every gradguard callback stands on (one module an idea used by two monitors or more).

Its modules: the house table of docs/architecture.md.
"""
