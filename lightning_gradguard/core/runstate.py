"""Run state, declared once: what a monitor remembers during a run, its fresh value, its checkpoint key.

A class that keeps run state (a callback, or a state object a callback holds) derives from :class:`Stateful`
and declares each field once, as a class attribute::

    class Detector(GradGuardCallback):
        history: RunField[dict[int, list[float]]] = RunField(dict, load=_history)  # saved as "history"
        strikes: RunField[Streaks] = RunField(Streaks)                             # saved as "strikes"
        _windows: RunField[Windows] = RunField(from_settings=lambda d: Windows(d.window_samples))
        last_check: RunField[dict[str, Any]] = RunField(dict, key=None)            # reset, not saved

and :class:`Stateful` derives ``reset_run`` (every field of the run back to its fresh value),
``state_dict`` (a plain dict of picklable values, one entry per saved field, under its key) and
``load_state_dict`` (each saved field read back, an older key too; a field the checkpoint lacks starts
fresh). What follows from the state (a threshold computed from it, a flag) is recomputed in
:meth:`Stateful.state_changed`, called after both.

A :class:`RunField` is a non-data descriptor: the first read makes the fresh value and stores it on the
instance, and every later read is a plain attribute lookup; a hook pays nothing for it.
:class:`Streaks` is the one counter of consecutive hits per key (a rule that must hold on ``patience``
checks in a row).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, overload

T = TypeVar("T")

#: ``key``'s default: the attribute's name without its leading underscores
_NAME = "<name>"
#: what a field's ``save`` returns to leave its key out of the state dict (a result not there yet)
LEFT_OUT: Any = object()


class RunField(Generic[T]):
    """One field of run state, declared on the class that holds it.

    Args:
        fresh: makes its value at the start of a run (``dict``, ``list``, ``int``, a class).
        from_settings: instead of ``fresh``, makes it from the instance (its settings: a window's size).
        key: its key in the state dict (default: the attribute's name without leading underscores); a
            dotted key nests (``"counters.rollbacks"``); ``""`` is inline (``save`` gives a dict whose keys
            join the state dict's, ``load`` reads the whole state dict); ``None``: not checkpointed (reset
            with the run only).
        per_run: ``False`` for a field kept across the runs of one instance (``alerts``): ``reset_run`` and a
            checkpoint without its key leave it as it is.
        old_keys: keys an older checkpoint saved it under, tried after ``key``.
        save: ``save(owner, value)``: the picklable form (default: plain containers, a state object's
            ``state_dict``, a tensor detached and copied); :data:`LEFT_OUT` leaves the key out.
        load: ``load(owner, saved)``: the value from its saved form (default: by the fresh value's type: a
            ``deque`` keeps its ``maxlen``, a set, a state object's ``load_state_dict``, an int, ...).
        if_missing: ``if_missing(owner)``: what a checkpoint without the key is read as (default: the field
            starts fresh).
    """

    def __init__(
        self,
        fresh: Callable[[], T] | None = None,
        *,
        from_settings: Callable[[Any], T] | None = None,
        key: str | None = _NAME,
        per_run: bool = True,
        old_keys: tuple[str, ...] = (),
        save: Callable[[Any, T], Any] | None = None,
        load: Callable[[Any, Any], T] | None = None,
        if_missing: Callable[[Any], Any] | None = None,
    ) -> None:
        if (fresh is None) == (from_settings is None):
            raise TypeError("a RunField takes one of fresh= and from_settings=")
        self._fresh, self._from_settings = fresh, from_settings
        self.key, self.per_run, self.old_keys = key, per_run, old_keys
        self._save, self._load, self._if_missing = save, load, if_missing
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if self.key == _NAME:
            self.key = name.lstrip("_")

    @overload
    def __get__(self, obj: None, owner: type) -> RunField[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> RunField[T] | T:
        if obj is None:
            return self
        value = self.fresh_value(obj)  # the first read: from then on, the instance's own attribute
        vars(obj)[self.name] = value
        return value

    if TYPE_CHECKING:  # assigned like any attribute; at run time a non-data descriptor, free to read

        def __set__(self, obj: object, value: T) -> None: ...

    @property
    def custom_load(self) -> bool:
        """Whether the field reads its saved form with its own ``load``."""
        return self._load is not None

    def fresh_value(self, owner: Any) -> T:
        """The field's value at the start of a run."""
        if self._from_settings is not None:
            return self._from_settings(owner)
        assert self._fresh is not None
        return self._fresh()

    def saved(self, owner: Any, value: T) -> Any:
        """``value`` as the checkpoint holds it."""
        return self._save(owner, value) if self._save is not None else plain(value)

    def loaded(self, owner: Any, saved: Any) -> T:
        """The value a checkpoint's ``saved`` form stands for."""
        if self._load is not None:
            return self._load(owner, saved)
        return _like(self.fresh_value(owner), saved)

    def read(self, owner: Any, state: Mapping[str, Any]) -> tuple[bool, Any]:
        """``(found, saved)``: the saved form under ``key`` or an old key (or ``if_missing``'s)."""
        for key in (self.key, *self.old_keys):
            found, saved = _lookup(state, key) if key is not None else (False, None)
            if found:
                return True, saved
        if self._if_missing is not None:
            return True, self._if_missing(owner)
        return False, None


def nothing() -> None:
    """The fresh value ``None`` (a field that holds nothing until the run sets it)."""
    return None


class Stateful:
    """A holder of declared run state (:class:`RunField`): ``reset_run``, ``state_dict`` and
    ``load_state_dict`` follow from the declarations (of the class and its bases, bases first)."""

    #: the declared fields, gathered once per class
    run_fields: ClassVar[tuple[RunField[Any], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields: dict[str, RunField[Any]] = {}
        for klass in reversed(cls.__mro__):
            fields.update({n: v for n, v in vars(klass).items() if isinstance(v, RunField)})
        cls.run_fields = tuple(fields.values())

    def reset_run(self) -> None:
        """Forget the run: every field of the run back to its fresh value; a ``per_run=False`` field stays,
        and when it holds a state object, that object forgets its own fields of the run."""
        for f in self.run_fields:
            if f.per_run:
                vars(self)[f.name] = f.fresh_value(self)
            elif isinstance(held := vars(self).get(f.name), Stateful):
                held.reset_run()
        self.state_changed()

    def state_dict(self) -> dict[str, Any]:
        """The saved fields, under their keys: a plain dict of picklable values."""
        out: dict[str, Any] = {}
        for f in self.run_fields:
            if f.key is not None and (saved := f.saved(self, getattr(self, f.name))) is not LEFT_OUT:
                _place(out, f.key, saved)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The run as the checkpoint holds it: each saved field read back; a field of the run the checkpoint
        does not hold (not saved, or an older checkpoint's) starts fresh, so nothing of an earlier run of
        this instance leaks into the loaded one; ``per_run=False`` fields it lacks are kept."""
        for f in self.run_fields:
            saved: Any = None
            found, saved = f.read(self, state_dict) if f.key is not None else (False, None)
            held = vars(self).get(f.name)
            if found and isinstance(held, Stateful) and not f.custom_load:
                held.load_state_dict(saved)  # a state object loads in place: it keeps its settings
            elif found:
                vars(self)[f.name] = f.loaded(self, saved)
            elif f.per_run:
                vars(self)[f.name] = f.fresh_value(self)
        self.state_changed()

    def state_changed(self) -> None:
        """Recompute what follows from the fields (after ``reset_run`` and ``load_state_dict``); a subclass
        that derives something from its state extends it."""


class Streaks(Mapping[str, int]):
    """Consecutive hits per key: a hit adds one, a miss starts the key over at 0 (a rule that must hold on
    ``patience`` checks in a row). A read-only mapping ``key -> count``, equal to a dict of the same counts;
    saved as that plain dict.
    """

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        self._counts: dict[str, int] = {k: int(v) for k, v in (counts or {}).items()}

    def update(self, key: str, held: bool) -> int:
        """One more check of ``key``: a hit if ``held``, else a miss. Returns its count."""
        n = self._counts.get(key, 0) + 1 if held else 0
        self._counts[key] = n
        return n

    def hit(self, key: str) -> int:
        """``key`` held once more: its count."""
        return self.update(key, True)

    def miss(self, key: str) -> None:
        """``key`` did not hold: it starts over (kept, at 0)."""
        self._counts[key] = 0

    def advance(self, found: Iterable[str]) -> dict[str, int]:
        """One check over every key at once: each key ``found`` one more, every other key dropped.
        Returns the counts of the keys found."""
        self._counts = {k: self._counts.get(k, 0) + 1 for k in found}
        return dict(self._counts)

    def reached(self, patience: int) -> dict[str, int]:
        """The keys held ``patience`` times in a row or more, with their counts."""
        return {k: n for k, n in self._counts.items() if n >= patience}

    def __getitem__(self, key: str) -> int:
        return self._counts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"Streaks({self._counts!r})"


def restored(obj: T, saved: Any) -> T:
    """``obj`` (a fresh state object) after ``obj.load_state_dict(saved)``: a custom ``load`` of a
    container of state objects reads each with it."""
    obj.load_state_dict(saved)  # type: ignore[attr-defined]
    return obj


def plain(value: Any) -> Any:
    """``value`` in a checkpoint's plain form: a state object's ``state_dict()``, containers as dicts and
    lists (a set sorted), a tensor detached and copied, anything else as it is."""
    if isinstance(value, Streaks):
        return dict(value)
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple, deque)):
        return [plain(v) for v in value]
    if callable(getattr(value, "detach", None)):
        return value.detach().clone()
    return value


def _like(fresh: Any, saved: Any) -> Any:
    """``saved`` read back as a value of ``fresh``'s kind."""
    if isinstance(fresh, Streaks):
        return Streaks(saved)
    if callable(getattr(fresh, "load_state_dict", None)):
        fresh.load_state_dict(saved)
        return fresh
    if isinstance(fresh, deque):
        return deque(saved, maxlen=fresh.maxlen)
    if isinstance(fresh, (bool, int, float, str, set, list, dict)):
        return type(fresh)(saved)
    return saved


def _lookup(state: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    if key == "":  # inline: the whole state dict
        return True, state
    node: Any = state
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _place(out: dict[str, Any], key: str, value: Any) -> None:
    if key == "":  # inline: its keys join the state dict's
        out.update(value)
        return
    *parents, last = key.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
