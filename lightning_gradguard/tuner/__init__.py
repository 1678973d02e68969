"""The learning-rate range test: the engine (``engine``), its result (``result``), its output (``output``),
and the faces over it: the :class:`LRFinderPlus` callback and :func:`lr_find` (``lr_finder``)."""

from lightning_gradguard.tuner.lr_finder import LRFinderPlus, lr_find
from lightning_gradguard.tuner.result import LRFinderResult

__all__ = ["LRFinderPlus", "LRFinderResult", "lr_find"]
