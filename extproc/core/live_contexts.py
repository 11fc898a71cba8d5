"""The contexts of the conversations live now: what the caches must hold for their next turns.

A conversation is live while its last turn was served within the window; its context is that
turn's prompt, in blocks of the current chains. On agent traffic (long prompts that grow turn by
turn, few shared prefixes) the engines' LRU caches cycle through every live context once they do
not all fit, and each returning turn then finds its own evicted (docs/benchmarks.md, "Real
coding-agent sessions"). `conversation_hold_share` uses the sum to hold a new conversation's first
turn while the live contexts fill the caches (rules in `Router.crowded_by`).

The sum is kept as turns come and go out of the window, at O(1) amortized a turn: each served turn
is queued with its time; the queue's front is dropped once older than the window, and counts only
while it is still its conversation's latest turn.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class LiveContexts:
    """digest(session) -> (its last turn's time, that prompt's blocks), and their sum over the window."""

    __slots__ = ("_capacity", "_latest", "_queue", "_window_s", "blocks_live")

    def __init__(self, window_s: float, capacity: int) -> None:
        self._window_s = window_s
        self._capacity = capacity  # conversations kept at most (the session table's capacity)
        self._latest: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self._queue: deque[tuple[float, bytes]] = deque()  # every served turn in the window, oldest first
        self.blocks_live = 0  # the sum of `_latest`'s blocks

    def __len__(self) -> int:
        return len(self._latest)

    def configure(self, window_s: float, capacity: int) -> None:
        self._window_s = window_s
        self._capacity = capacity
        self._trim()

    def served(self, session: bytes, blocks: int, now: float) -> None:
        """A conversation's turn was served with a prompt of `blocks`: its context now."""
        held = self._latest.pop(session, None)
        if held is not None:
            self.blocks_live -= held[1]
        self._latest[session] = (now, blocks)
        self.blocks_live += blocks
        self._queue.append((now, session))
        self._trim()
        self.blocks(now)

    def blocks(self, now: float) -> int:
        """The live contexts' blocks: those of conversations served within the window."""
        cutoff = now - self._window_s
        queue = self._queue
        while queue and queue[0][0] < cutoff:
            self._leave(*queue.popleft())
        return self.blocks_live

    def clear(self) -> None:
        self._latest.clear()
        self._queue.clear()
        self.blocks_live = 0

    def _leave(self, when: float, session: bytes) -> None:
        """A turn leaves the queue: its conversation is no longer live, unless a later turn of it
        is queued behind."""
        held = self._latest.get(session)
        if held is not None and held[0] == when:
            del self._latest[session]
            self.blocks_live -= held[1]

    def _trim(self) -> None:
        """Past capacity, the conversations served longest ago go. A queue grown past twice the
        conversations it speaks for (many turns within one window) is rebuilt from their latest
        turns (in the order they were served), so it is bounded at an amortized O(1) a turn."""
        latest = self._latest
        while len(latest) > self._capacity:
            _, (_, blocks) = latest.popitem(last=False)
            self.blocks_live -= blocks
        if len(self._queue) > 2 * len(latest) + 16:
            self._queue = deque((when, session) for session, (when, _) in latest.items())
