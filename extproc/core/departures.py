"""Backends that left, for a table whose entries each name a backend (prefix homes): a departed
backend's entries answer nothing and are dropped as they are met, not in a pass over the table
when it leaves (65,536 homes took 5-20 ms a backend, a rollout replacing fifty about a second).

A backend that comes back at the same address first loses its old entries, in one pass; so does
the table once GONE_MOST backends have left, or once it is full (void entries go before live ones).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

GONE_MOST = 1024  # backends that left whose entries go as they are met, before a pass drops them all

K = TypeVar("K")
V = TypeVar("V")


class Departures(Generic[K, V]):
    """The backends that left since the last pass over a table, and that pass."""

    __slots__ = ("_backend_of", "_gone")

    def __init__(self, backend_of: Callable[[V], str]) -> None:
        self._backend_of = backend_of  # the backend an entry names
        self._gone: set[str] = set()

    def __contains__(self, backend: str) -> bool:
        return backend in self._gone

    def left(self, table: OrderedDict[K, V], backend: str) -> None:
        """The backend left: its entries in `table` answer nothing from now on."""
        self._gone.add(backend)
        if len(self._gone) > GONE_MOST:
            self._drop(table, frozenset(self._gone))

    def returning(self, table: OrderedDict[K, V], backend: str) -> None:
        """An entry naming `backend` is about to be made: if it had left, its old entries go first."""
        if backend in self._gone:
            self._drop(table, frozenset((backend,)))

    def full(self, table: OrderedDict[K, V], capacity: int) -> None:
        """The table is past `capacity`: void entries go before any live one is pushed out."""
        if len(table) > capacity and self._gone:
            self._drop(table, frozenset(self._gone))

    def clear(self) -> None:
        self._gone.clear()

    def _drop(self, table: OrderedDict[K, V], backends: frozenset[str]) -> None:
        """One pass: the entries naming these backends go, and they are no longer gone."""
        backend_of = self._backend_of
        for key in [key for key, value in table.items() if backend_of(value) in backends]:
            del table[key]
        self._gone -= backends


class RecentlyLeft:
    """The last `most` backends that left, oldest first: a table keyed by backend keeps what it
    knows of one that may come back (a health flap, a restart) for this long, and no longer, so a
    rollout that replaces thousands over time leaves nothing behind."""

    __slots__ = ("_left", "_most")

    def __init__(self, most: int = GONE_MOST) -> None:
        self._most = most
        self._left: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, backend: str) -> bool:
        return backend in self._left

    def left(self, backend: str) -> str | None:
        """The backend left; returns the one past the bound (whose entries go now), if any."""
        self._left[backend] = None
        self._left.move_to_end(backend)
        if len(self._left) > self._most:
            return self._left.popitem(last=False)[0]
        return None

    def back(self, backend: str) -> None:
        """It is in the pool again."""
        self._left.pop(backend, None)
