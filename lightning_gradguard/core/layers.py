"""How the monitors name a model's modules and layers, and the ``include`` / ``exclude`` / ``max_layers``
arguments every monitor takes, in one place.

:func:`user_name` is the one entry point for a module's or a parameter's name (the wrapper parts
``torch.compile``, FSDP and activation checkpointing insert left out; the root module, given ``root``, named
by its class): a monitor that hooks modules names them through it, never by its own rule.
:func:`parameter_layers` is each parameter's layer, labeled as :mod:`lightning_gradguard.core.stats` labels
the norms (:func:`~lightning_gradguard.functional.stats.layer_names`: a parameter on the root module or on
a container is its own layer), for a monitor that must key what it sees of a module by those labels.

A :class:`LayerSelection` is built from the three arguments (checked: ``TypeError`` / ``ValueError``
naming the argument). The monitors ask it which layers to watch (:meth:`LayerSelection.watches`: the
patterns), and, on the host before they log, which of the watched layers to show
(:meth:`LayerSelection.show`: the cap) and what to log for all of them together
(:meth:`LayerSelection.aggregates`: ``<family>/across_layers/{min,median,max}``, only with a cap).
The math is :mod:`lightning_gradguard.functional.layers`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_gradguard.core.validate import check_int
from lightning_gradguard.functional.layers import LayerPatterns, choose_layers, spread
from lightning_gradguard.functional.stats import clean_name, layer_names, module_label
from lightning_gradguard.tags import ACROSS_LAYERS


def user_name(name: str, root: object | None = None) -> str:
    """A module's or a parameter's qualified name as users read it: the wrapper parts left out
    (``net._orig_mod.0.weight`` -> ``net.0.weight``); with ``root`` (the model), the root module, whose
    qualified name is ``""``, named by its class (``"MyModel"``) instead of by nothing."""
    return clean_name(name) if root is None else module_label(name, root)


def parameter_layers(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its layer`` for the trainable parameters of ``module``, labeled as the step's
    norms are (``"encoder.blocks.0.attn"``; ``"cls_token"`` for a parameter on the root, ``"encoder.pos"``
    for one on a container module)."""
    named = [(user_name(n), p) for n, p in module.named_parameters() if p.requires_grad]
    labels = layer_names([n for n, _ in named])
    return {id(p): label for (_, p), label in zip(named, labels, strict=True)}


def check_patterns(name: str, value: Any) -> tuple[re.Pattern[str], ...]:
    """``value`` (``None``, a regular expression, or a list of them) as compiled patterns."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise TypeError(
            f"`{name}` must be a regular expression (str), a list of them, or None; got {value!r} "
            f"({type(value).__name__})"
        )
    patterns = []
    for item in items:
        try:
            patterns.append(re.compile(item))
        except re.error as err:
            raise ValueError(f"`{name}` holds {item!r}, not a valid regular expression: {err}") from err
    return tuple(patterns)


class LayerSelection:
    """Which layers a monitor watches and shows.

    Args:
        include: a regular expression (or a list of them) searched for in each layer name, as logged
            (``"encoder.layers.3.attn"``); only matching layers are watched. ``None``: every layer.
        exclude: layers whose name matches are not watched. Applied after ``include``.
        max_layers: show at most this many layers per chart (``None``: all): half of them spread evenly
            over the model and the same at every step, the rest the layers that stand out most at this
            step; ``<family>/across_layers/{min,median,max}`` then sum up all the watched layers.
    """

    def __init__(self, include: Any = None, exclude: Any = None, max_layers: Any = None) -> None:
        self.patterns = LayerPatterns(check_patterns("include", include), check_patterns("exclude", exclude))
        self.max_layers: int | None = check_int("max_layers", max_layers, 1, allow_none=True)
        #: the layers shown at the latest :meth:`show` (``None`` before the first)
        self.last_shown: frozenset[str] | None = None
        self._memo: dict[tuple[str, ...], tuple[str, ...]] = {}

    @property
    def capped(self) -> bool:
        """Whether ``max_layers`` caps the layers a chart shows (the capped charts are drawn)."""
        return self.max_layers is not None

    @property
    def filters(self) -> bool:
        """Whether the patterns leave any layer out."""
        return bool(self.patterns.include or self.patterns.exclude)

    def watches(self, name: str) -> bool:
        """Whether the layer ``name`` passes ``include`` and ``exclude``."""
        return self.patterns.keeps(name)

    def watched(self, labels: Sequence[str]) -> tuple[str, ...]:
        """The watched ones of ``labels``, in order (remembered per label list: the names rarely change)."""
        key = tuple(labels)
        if key not in self._memo:
            if len(self._memo) > 16:
                self._memo.clear()
            self._memo[key] = tuple(n for n in key if self.watches(n))
        return self._memo[key]

    def keep(self, values: Mapping[str, float]) -> dict[str, float]:
        """``values`` of the watched layers only."""
        return {n: v for n, v in values.items() if self.watches(n)}

    def show(self, labels: Sequence[str], scores: Sequence[float]) -> set[str]:
        """The watched layers to show this step: all of them, or ``max_layers`` chosen on ``scores`` (one
        per label, higher: more worth showing)."""
        by_name = dict(zip(labels, scores, strict=True))
        names = self.watched(labels)
        chosen = {names[i] for i in choose_layers([by_name[n] for n in names], self.max_layers)}
        self.last_shown = frozenset(chosen)
        return chosen

    def aggregates(self, family: str, values: Mapping[str, float]) -> dict[str, float]:
        """``<family>/across_layers/{min,median,max}`` over ``values`` (watched layers); with a cap only."""
        if self.max_layers is None:
            return {}
        return {f"{family}/{ACROSS_LAYERS}/{k}": v for k, v in spread(list(values.values())).items()}

    def histogram_layers(self, labels: Sequence[str]) -> frozenset[str] | None:
        """The layers that get histograms on this step (``None``: every layer): the watched ones, and with a
        cap the ones shown at the latest logging step (before any, the evenly spread ones)."""
        if not self.filters and self.max_layers is None:
            return None
        names = self.watched(labels)
        if self.max_layers is None:
            return frozenset(names)
        if self.last_shown is not None:
            return self.last_shown & frozenset(names)
        return frozenset(names[i] for i in choose_layers([0.0] * len(names), self.max_layers))


def cap_scalars(selection: LayerSelection, scalars: Mapping[str, float], family: str) -> dict[str, float]:
    """``scalars`` with the ``<family>/<layer>`` tags cut to the layers ``selection`` shows (chosen on the
    value itself: higher is worth more) and ``<family>/across_layers/*`` added; other tags as they are."""
    if selection.max_layers is None:
        return dict(scalars)
    head = f"{family}/"
    values = {t[len(head) :]: v for t, v in scalars.items() if t.startswith(head)}
    shown = selection.show(list(values), list(values.values()))
    out = {t: v for t, v in scalars.items() if not t.startswith(head) or t[len(head) :] in shown}
    out.update(selection.aggregates(family, values))
    return out
