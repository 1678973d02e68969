"""The learning-rate range test: ``LRFinderPlus`` and ``lr_find``.

Its modules: the house table of docs/architecture.md.
"""
