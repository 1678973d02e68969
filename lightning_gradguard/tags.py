"""What a tag is, and the tags every callback writes: the bottom of the tag registry.

A :class:`Family` is the first part of a tag (``grad_norm`` in ``grad_norm/net.0``) with the callback that
writes it and what kind of record it is; the emitters build their tags from it (:meth:`Family.tag`). A
:class:`Chart` is one chart of the custom-scalars layout. Each monitor declares its own families and charts
in ``monitors/<name>/tags.py`` (declarations only, no torch); its callback's
:meth:`~lightning_gradguard.core.base.GradGuardCallback.layout_charts` is :func:`charts_of` them, and
:mod:`lightning_gradguard.registry` gathers every declaration for ``gradguard report`` and the docs test.
Here: the alert counts every callback writes (:data:`ALERTS`, :data:`ALERT_TEXT`) and the shared regex parts.
Nothing here imports the rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

#: the tag part of the aggregates over all watched layers under a cap: ``grad_norm/across_layers/median``
ACROSS_LAYERS = "across_layers"
#: the text tag every alert is written to (TensorBoard's Text tab)
ALERT_TEXT = "gradguard/alerts"
#: a per-layer chart's regex tail: every tag of the family but the totals and the aggregates
PER_LAYER = rf"(?!total(_opt\d+)?$|{ACROSS_LAYERS}/).*"


@dataclass(frozen=True)
class Family:
    """A tag family: ``<name>/...`` tags written by ``owner`` as ``kind`` records."""

    name: str
    owner: str
    kind: Literal["scalar", "histogram", "image", "text"] = "scalar"

    @property
    def prefix(self) -> str:
        return f"{self.name}/"

    def tag(self, *parts: str) -> str:
        """``<name>/<part>/<part>...``."""
        return "/".join((self.name, *parts))


@dataclass(frozen=True)
class Chart:
    """One chart of the "GradGuard" layout: its title, the tag regexes it draws, who draws it and when.

    ``only`` names the callback setting the chart depends on (``"capped"``: ``max_layers`` is set;
    ``"saturation"``, ``"attention"``, ``"noise_scale"``: that option is on); ``None``: always.
    """

    title: str
    regexes: tuple[str, ...]
    owner: str
    only: str | None = None


#: the alert counts every callback writes (``alerts/<kind>``)
ALERTS = Family("alerts", "GradGuardCallback")
#: their chart
ALERT_CHARTS: tuple[Chart, ...] = (
    Chart("Alerts (cumulative count per kind)", (ALERTS.tag(".*"),), "GradGuardCallback"),
)


def charts_of(charts: Iterable[Chart], **settings: bool) -> dict[str, list[str]]:
    """``charts`` as title -> regexes, those whose ``only`` setting is on in ``settings``."""
    return {c.title: list(c.regexes) for c in charts if c.only is None or settings.get(c.only, False)}


def families_of(families: Iterable[Family], owner: str, kind: str = "scalar") -> tuple[Family, ...]:
    """The families of ``families`` that ``owner`` writes (of one ``kind``)."""
    return tuple(f for f in families if f.owner == owner and f.kind == kind)
