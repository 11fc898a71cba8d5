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

CAPACITY = 65536  # heads remembered; a miss costs only what kvroute did before homes: least loaded
GONE_MOST = 1024  # backends that left whose homes are dropped as they are met, before a pass drops them all


class PrefixHomes:
    """First block of a chain -> the backend its prompts go to when no cache shows it.

    A backend that leaves loses its homes as they are met (`get`), not in a pass over the table
    then: rebuilding 65,536 homes held the event loop some 20 ms per backend, a second for a
    rollout replacing fifty. A backend placed on again (back at the same address) first loses
    the homes it had, in one pass; so does the table when GONE_MOST backends have left, or when
    it is full (void homes go before live ones)."""

    __slots__ = ("_gone", "_homes")

    def __init__(self) -> None:
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._gone: set[str] = set()  # backends that left since the last pass

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
        if backend in self._gone:  # back: what it was home to before it left goes first
            self._drop(frozenset((backend,)))
        homes = self._homes
        homes[head] = backend
        homes.move_to_end(head)
        if len(homes) > CAPACITY and self._gone:  # void homes go before live ones
            self._drop(frozenset(self._gone))
        if len(homes) > CAPACITY:
            homes.popitem(last=False)

    def remove_backend(self, backend: str) -> None:
        """A backend left: its heads are placed again on merit."""
        self._gone.add(backend)
        if len(self._gone) > GONE_MOST:
            self._drop(frozenset(self._gone))

    def _drop(self, backends: frozenset[str]) -> None:
        """One pass: the homes of these backends go, and they are no longer gone."""
        homes = self._homes
        for head in [head for head, home in homes.items() if home in backends]:
            del homes[head]
        self._gone -= backends

    def __len__(self) -> int:
        return len(self._homes)
