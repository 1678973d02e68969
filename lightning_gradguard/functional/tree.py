"""Finding the tensors in nested lists, tuples and dicts: batches, module inputs and module outputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside nested lists, tuples and dicts, in order."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
