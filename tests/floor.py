"""What the tests know about the torch and Lightning releases they run on.

We claim a floor (pyproject.toml) and test it (``make test-floor``): a test that needs a newer release than
the floor, or torch 2.13's exact random draws, says so here and is skipped elsewhere with that reason,
never failed. The versions come from the installed packages' metadata: ``conftest`` reads them in the
pytest-xdist controller, which never imports torch. ``needs_torch_draws`` imports torch on first use.
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import version
from typing import Any

import pytest


def release(package: str) -> tuple[int, int]:
    """The installed ``package``'s (major, minor): ``2.3.1+cu121`` is (2, 3)."""
    major, minor = version(package).split("+", 1)[0].split(".")[:2]
    return int(major), int(minor)


TORCH = release("torch")
LIGHTNING = release("lightning")

#: FSDP2 on the CPU in our sharded tests: ``torch.distributed.fsdp.fully_shard`` is public from torch 2.6,
#: and its all-gather records an event on a CPU stream, a no-op from torch 2.7 on (pytorch#145935); torch
#: 2.6 raises "'Stream' object has no attribute 'record_event'"
FSDP2 = TORCH >= (2, 7)
FSDP2_NEEDS = "FSDP2 on the CPU (fully_shard's all-gather records an event on a CPU stream)"


def needs_torch(at_least: tuple[int, int], what: str) -> pytest.MarkDecorator:
    """Skip below torch ``at_least``, naming what the test needs (``what``) from that release."""
    wanted = ".".join(map(str, at_least))
    return pytest.mark.skipif(at_least > TORCH, reason=f"needs torch >= {wanted}: {what}")


def needs_argument(function: Any, argument: str) -> pytest.MarkDecorator:
    """Skip where ``function`` (of torch or Lightning) does not take ``argument`` yet."""
    return pytest.mark.skipif(
        not accepts(function, argument),
        reason=f"needs {function.__qualname__}({argument}=...): newer than this torch or Lightning",
    )


def accepts(function: Any, argument: str) -> bool:
    """Whether ``function`` takes a keyword ``argument`` in the installed release."""
    return argument in inspect.signature(function).parameters


#: what torch 2.13 draws after ``torch.manual_seed(0)`` in :func:`_draws` (a dropout mask as bits, a
#: ``randperm``, a ``randint``, then ``rand`` scaled): torch 2.3 to 2.6 draw other numbers
DRAWS_OF_TORCH_2_13 = (
    7248732334559846084,
    (9, 2, 1, 13, 5, 15, 10, 11, 6, 4, 8, 0, 3, 14, 12, 7),
    (2, 5, 0, 7, 5, 1, 7, 0),
    (77, 398),
)


@functools.cache
def _draws() -> tuple[Any, ...]:
    """A fingerprint of this torch's random draws (integers only: the rounding perturbation of
    ``make unit-elsewhere`` moves drawn weights, never these), without touching the global generator."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mask = torch.nn.functional.dropout(torch.ones(64), 0.5).ne(0).tolist()
        perm = tuple(torch.randperm(16).tolist())
        ints = tuple(torch.randint(0, 8, (8,)).tolist())
        after = tuple(torch.rand(2).mul(1000).long().tolist())
    return sum(1 << i for i, kept in enumerate(mask) if kept), perm, ints, after


def _needs_torch_draws() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        _draws() != DRAWS_OF_TORCH_2_13,
        reason="compares against torch 2.13's exact random draws (seeded init, dropout masks, shuffles); "
        "this torch draws other numbers",
    )


def __getattr__(name: str) -> Any:
    if name == "needs_torch_draws":  # built on first use: importing this module never imports torch
        return _needs_torch_draws()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
