"""Prefix homes: the backend where each prompt head was first placed, kept after caches forget it.

A shared head (a system prompt, tool schemas) is cheapest when one backend holds it: each copy
takes room that, under cache pressure, would have kept some conversation's context. The location
index cannot keep a head in one place by itself: when every cache has turned over, it shows the
head nowhere, the next request that starts with it goes to the least loaded backend, and the head
ends up copied everywhere. Its home says where to send such a request instead, while that backend
is within the balance gates. Keyed by the first block of the chain, itself a keyed hash of the
prompt's head; bounded, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

from extproc.core.departures import Departures

CAPACITY = 65536  # heads remembered; a miss costs only what kvroute did before homes: least loaded


def _named(home: str) -> str:
    return home


class PrefixHomes:
    """First block of a chain -> the backend its prompts go to when no cache shows it. A backend
    that leaves loses its homes as they are met (departures.py)."""

    __slots__ = ("_gone", "_homes")

    def __init__(self) -> None:
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._gone: Departures[int, str] = Departures(_named)

    def get(self, head: int) -> str | None:
        home = self._homes.get(head)
        if home is None:
            return None
        if home in self._gone:
            del self._homes[head]
            return None
        self._homes.move_to_end(head)
        return home

    def place(self, head: int, backend: str) -> None:
        """The head's home is this backend from now on."""
        homes = self._homes
        self._gone.returning(homes, backend)
        homes[head] = backend
        homes.move_to_end(head)
        self._gone.full(homes, CAPACITY)
        if len(homes) > CAPACITY:
            homes.popitem(last=False)

    def remove_backend(self, backend: str) -> None:
        """A backend left: its heads are placed again on merit."""
        self._gone.left(self._homes, backend)

    def __len__(self) -> int:
        return len(self._homes)
