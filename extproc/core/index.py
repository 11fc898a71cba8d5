"""Location index: which backend holds which block of which prefix, and since when.

Behind the small `LocationIndex` interface so a precise or shared index can replace the
in-process one; cache turnover is measured outside the index (churn.py). The in-process index
keeps one LRU map per backend (block hash -> last seen): a backend's KV cache is finite and
evicts, so must our picture of it.
A lookup walks the chain on each candidate only until the first miss, so its cost depends on
the chain and the number of candidates, never on the index size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol


class LocationIndex(Protocol):
    """What the router needs from an index of (block hash, backend) locations. Small on purpose:
    an in-process LRU, a precise index fed by engine events or a shared one can each stand here."""

    def lookup(self, chain: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """For each backend, how many leading blocks of the chain it holds (fresh entries only)."""
        ...

    def learn(self, chain: Sequence[int], backend: str, now: float) -> int:
        """Record that the backend now holds every block of the chain; return how many were new."""
        ...

    def holders(self, block: int, now: float) -> Collection[str]:
        """Backends that may hold this first block of a chain (a superset: lookup decides), without
        a pass over every backend where the index can avoid one."""
        ...

    def remove_backend(self, backend: str) -> None:
        """Forget everything about a backend at once."""
        ...

    def forget_before(self, backend: str, moment: float) -> None:
        """The backend's cache was emptied some time after `moment`: forget what was learned of it
        until then; what was learned since may already be its new content."""
        ...

    def entries_by_backend(self) -> dict[str, int]:
        """Locations held per backend (its size)."""
        ...


class LocalIndex:
    """In-process index: per-backend LRU of block hash -> last seen, with TTL and capacity; and
    for each chain's first block, the backends holding it (so a large fleet's decision need not
    ask every backend: shortlist.py)."""

    __slots__ = ("_backends", "_capacities", "_capacity", "_heads", "_learn_share", "_next_vacuum", "_ttl")

    def __init__(self, ttl_s: float, capacity_blocks: int, learn_share: float = 0.5) -> None:
        """`learn_share`: the most of a backend's capacity one response may teach (from the head),
        so a single huge prompt cannot push everyone else's prefixes out of kvroute's picture."""
        self._ttl = ttl_s
        self._capacity = capacity_blocks
        self._learn_share = learn_share
        self._capacities: dict[str, int] = {}
        self._backends: dict[str, OrderedDict[int, float]] = {}
        self._heads: dict[int, set[str]] = {}  # first block of a learned chain -> backends holding it
        self._next_vacuum = float("inf")

    def configure(self, ttl_s: float, capacity_blocks: int, capacities: Mapping[str, int]) -> None:
        self._ttl = ttl_s
        self._capacity = capacity_blocks
        self._capacities = dict(capacities)
        self._next_vacuum = float("-inf")  # the next lookup re-derives the vacuum deadline
        for backend, blocks in self._backends.items():
            self._trim(backend, blocks, self._capacities.get(backend, capacity_blocks))

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacities[backend] = blocks
        if backend in self._backends:
            self._trim(backend, self._backends[backend], blocks)

    def make_room(self, backend: str, held: Sequence[int], count: int) -> None:
        """A request is prefilling there that will be learned only later: the engine uses the
        prefix it holds (`held`, which becomes its most recent) and stores `count` new blocks,
        for which the least recent others go now."""
        blocks = self._backends.get(backend)
        if not blocks:
            return
        for block in reversed(held):
            if block in blocks:
                blocks.move_to_end(block)
        self._trim(backend, blocks, self._capacities.get(backend, self._capacity) - count)

    def _trim(self, backend: str, blocks: OrderedDict[int, float], capacity: int) -> None:
        for _ in range(len(blocks) - capacity):
            self._lost(blocks.popitem(last=False)[0], backend)

    def _lost(self, block: int, backend: str) -> None:
        """The block left the backend's picture: if it heads a chain, the backend no longer holds it."""
        holding = self._heads.get(block)
        if holding is not None:
            holding.discard(backend)
            if not holding:
                del self._heads[block]

    def holders(self, block: int, now: float) -> Collection[str]:
        return self._heads.get(block, ())

    def lookup(self, chain: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        if now >= self._next_vacuum:
            self.vacuum(now)
        cutoff = now - self._ttl
        matched: dict[str, int] = {}
        for backend in backends:
            blocks = self._backends.get(backend)
            count = 0
            if blocks:
                for block in chain:
                    seen = blocks.get(block)
                    if seen is None or seen < cutoff:
                        break
                    count += 1
            matched[backend] = count
        return matched

    def learn(self, chain: Sequence[int], backend: str, now: float) -> int:
        blocks = self._backends.get(backend)
        if blocks is None:
            blocks = self._backends[backend] = OrderedDict()
        capacity = self._capacities.get(backend, self._capacity)
        chain = chain[: max(1, int(capacity * self._learn_share))]
        # Tail first, so the head of the prefix is the most recently used and is evicted last,
        # as in vLLM, which frees a sequence's blocks from the tail.
        held = len(blocks)
        for block in reversed(chain):
            blocks[block] = now
            blocks.move_to_end(block)
        added = len(blocks) - held
        if chain:
            holding = self._heads.get(chain[0])
            if holding is None:
                holding = self._heads[chain[0]] = set()
            holding.add(backend)
        self._trim(backend, blocks, capacity)
        if self._next_vacuum == float("inf") and blocks:
            self._next_vacuum = now + self._ttl
        return added

    def remove_backend(self, backend: str) -> None:
        for block in list(self._backends.pop(backend, ())):
            self._lost(block, backend)

    def forget_before(self, backend: str, moment: float) -> None:
        blocks = self._backends.get(backend)
        if blocks:  # a full pass, not from the old end: a sibling replica's learning may arrive late
            kept: OrderedDict[int, float] = OrderedDict()
            for block, seen in blocks.items():
                if seen > moment:
                    kept[block] = seen
                else:
                    self._lost(block, backend)
            self._backends[backend] = kept

    def vacuum(self, now: float) -> int:
        """Pop expired entries from the old end of each LRU; each entry is popped at most once."""
        cutoff = now - self._ttl
        removed = 0
        oldest = float("inf")
        for backend, blocks in self._backends.items():
            while blocks:
                block, seen = next(iter(blocks.items()))
                if seen >= cutoff:
                    oldest = min(oldest, seen)
                    break
                del blocks[block]
                self._lost(block, backend)
                removed += 1
        self._next_vacuum = oldest + self._ttl
        return removed

    def entries_by_backend(self) -> dict[str, int]:
        return {backend: len(blocks) for backend, blocks in self._backends.items()}
