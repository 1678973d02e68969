"""OverfitBatchSanity: before the run, prove in seconds that the model can learn one batch.

Its modules: the house table of docs/architecture.md.
"""
