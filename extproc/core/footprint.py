"""Each backend's live conversations' context: what a new conversation placed there must share
the cache with.

A conversation's context is the blocks of its last prompt where it is bound (sessions.py); it
counts fully when just used and half as much every `half_life_s` after, as its return grows less
likely. Kept as one sum per backend of blocks weighted 2^(since/half-life) from a common epoch, so
a binding made, replaced or dropped costs O(1) and its share is taken out exactly, with no scan of
the session table. sglang-router places a prompt nothing caches on the worker whose cached tree is
smallest; this is that idea on kvroute's session picture, which knows which contexts are
conversations' and how recently they were used.
"""

from __future__ import annotations

from collections.abc import Iterable

Binding = tuple[str, float, int]  # backend, when it was bound, blocks of its last prompt

REBASE_HALF_LIVES = 64.0  # weights stay far below float overflow: move the epoch past this


class LiveFootprint:
    """backend -> decayed blocks of the conversations bound there."""

    __slots__ = ("_epoch", "_sums", "half_life_s")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._epoch = 0.0
        self._sums: dict[str, float] = {}  # backend -> sum of blocks * 2^((since - epoch) / half-life)

    def _weight(self, since: float) -> float:
        return float(2.0 ** ((since - self._epoch) / self.half_life_s))

    def _fade(self, now: float) -> float:
        """What a weight from the epoch is worth at `now` (underflows to 0, never overflows)."""
        return float(2.0 ** ((self._epoch - now) / self.half_life_s))

    def added(self, binding: Binding, now: float) -> None:
        """A conversation was bound at `now`: its last prompt counts on its backend."""
        backend, since, blocks = binding
        if now - self._epoch > REBASE_HALF_LIVES * self.half_life_s:
            scale = self._fade(now)
            self._sums = {key: value * scale for key, value in self._sums.items()}
            self._epoch = now
        self._sums[backend] = self._sums.get(backend, 0.0) + blocks * self._weight(since)

    def removed(self, binding: Binding) -> None:
        """A binding was replaced, expired or dropped: its share leaves its backend."""
        backend, since, blocks = binding
        if backend in self._sums:
            self._sums[backend] = max(0.0, self._sums[backend] - blocks * self._weight(since))

    def of(self, backends: Iterable[str], now: float) -> dict[str, float]:
        """Each backend's decayed blocks as of `now`."""
        scale = self._fade(now)
        return {backend: self._sums.get(backend, 0.0) * scale for backend in backends}

    def remove_backend(self, backend: str) -> None:
        self._sums.pop(backend, None)

    def clear(self) -> None:
        self._sums.clear()
