"""Where NaN forensics lived before 0.2 (``lightning_gradguard.hooks.forensics`` now).

Kept so that ``from lightning_gradguard.forensics import find_forward_origin`` still works.
"""

from lightning_gradguard.hooks.forensics import (
    BackwardOrigin,
    ForwardOrigin,
    find_backward_origin,
    find_forward_origin,
    replayed,
)

__all__ = ["BackwardOrigin", "ForwardOrigin", "find_backward_origin", "find_forward_origin", "replayed"]
