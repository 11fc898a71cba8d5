"""Location index: which backend holds which block of which prefix, and since when.

Behind the small `LocationIndex` interface so a precise or shared index can replace the
in-process one; cache turnover is measured outside the index (churn.py). The in-process index
keeps one LRU map per backend (block hash -> last seen): a backend's KV cache is finite and
evicts, so must our picture of it.
A lookup walks the chain on each candidate only until the first miss, so its cost depends on
the chain and the number of candidates, never on the index size.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

# The memory bound counts what the index's containers report (`sys.getsizeof`: each backend's LRU
# with its table, which does not shrink as entries go, and its nodes; the first-block map and its
# sets), kept up to date as they change, plus each location's objects: its key, a 64-bit int (36
# bytes, 40 as allocated), and at most a last-seen float of its own (24; a chain learned at once
# shares one).
LOCATION_BYTES = 64
# A pass that drops locations goes this far below the bound, so the next learnings need none;
# small, as the pass holds the event loop (some 2 us a location).
SLACK_BYTES = 256 * 1024
# The most an LRU takes per entry as it grows (its table and node; 75-116 bytes measured): one
# past twice that has lost most of its entries (shed, expired) and is copied into a right-sized
# table, or the memory it keeps would not be given back.
GROWN_ENTRY_BYTES = 116


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

    @property
    def shed(self) -> int:
        """Locations dropped so far to keep the process's index within its memory bound."""
        ...


class LocalIndex:
    """In-process index: per-backend LRU of block hash -> last seen, with TTL and capacity; and
    for each chain's first block, the backends holding it (so a large fleet's decision need not
    ask every backend: shortlist.py). Over all backends it stays within `max_bytes` (memory_bytes):
    a thousand backends' capacities can add up to more memory than the process has."""

    __slots__ = (
        "_backends",
        "_capacities",
        "_capacity",
        "_heads",
        "_learn_share",
        "_max_bytes",
        "_next_vacuum",
        "_set_bytes",
        "_shed",
        "_sizes",
        "_table_bytes",
        "_total",
        "_ttl",
    )

    def __init__(
        self, ttl_s: float, capacity_blocks: int, learn_share: float = 0.5, max_bytes: int | None = None
    ) -> None:
        """`learn_share`: the most of a backend's capacity one response may teach (from the head),
        so a single huge prompt cannot push everyone else's prefixes out of kvroute's picture.
        `max_bytes`: the bound over all backends (none: only each backend's capacity)."""
        self._ttl = ttl_s
        self._capacity = capacity_blocks
        self._learn_share = learn_share
        self._max_bytes = max_bytes
        self._capacities: dict[str, int] = {}
        self._backends: dict[str, OrderedDict[int, float]] = {}
        # first block of a learned chain -> the backend holding it, or the backends once several do
        # (one name, not a set: most heads live on one backend, and short prompts are all head)
        self._heads: dict[int, str | set[str]] = {}
        self._next_vacuum = float("inf")
        self._total = 0  # locations held over all backends
        self._shed = 0
        self._sizes: dict[str, int] = {}  # each backend's LRU's size as last measured
        self._table_bytes = 0  # their sum
        self._set_bytes = 0  # the first-block map's sets' sizes

    def configure(
        self, ttl_s: float, capacity_blocks: int, capacities: Mapping[str, int], *, max_bytes: int | None
    ) -> None:
        self._ttl = ttl_s
        self._capacity = capacity_blocks
        self._capacities = dict(capacities)
        self._max_bytes = max_bytes
        self._next_vacuum = float("-inf")  # the next lookup re-derives the vacuum deadline
        for backend, blocks in self._backends.items():
            self._trim(backend, blocks, self._capacities.get(backend, capacity_blocks))
        self._resized(list(self._backends))
        self._bound()

    @property
    def shed(self) -> int:
        return self._shed

    def memory_bytes(self) -> int:
        """The index's memory as its bound counts it: its containers' own measure, and the keys."""
        return self._table_bytes + sys.getsizeof(self._heads) + self._set_bytes + self._total * LOCATION_BYTES

    def _resized(self, backends: Iterable[str]) -> None:
        """Measure these backends' LRUs again after a change; one whose table has outgrown its
        entries is copied into a right-sized one first (the old table is given back)."""
        for name in backends:
            blocks = self._backends.get(name)
            if blocks is None:
                continue
            size = sys.getsizeof(blocks)
            if size > 2 * GROWN_ENTRY_BYTES * len(blocks) + 4096:
                blocks = self._backends[name] = OrderedDict(blocks)
                size = sys.getsizeof(blocks)
            self._table_bytes += size - self._sizes.get(name, 0)
            self._sizes[name] = size

    def _bound(self) -> None:
        """Past `max_bytes`, drop the coldest locations fleet-wide (the old ends of the backends'
        LRUs, by last seen) down to SLACK_BYTES below it."""
        bound = self._max_bytes
        if bound is None or self.memory_bytes() <= bound:
            return
        target = bound - min(SLACK_BYTES, bound // 10)
        fronts = [(next(iter(b.values())), i, name) for i, (name, b) in enumerate(self._backends.items()) if b]
        heapq.heapify(fronts)
        touched: set[str] = set()
        while fronts and self.memory_bytes() > target:
            # what the pops give back shows only once the touched LRUs are measured again (below)
            for _ in range(max(1, (self.memory_bytes() - target) // (4 * LOCATION_BYTES))):
                if not fronts:
                    break
                _, i, name = fronts[0]
                blocks = self._backends[name]
                self._lost(blocks.popitem(last=False)[0], name)
                self._shed += 1
                touched.add(name)
                if blocks:
                    heapq.heapreplace(fronts, (next(iter(blocks.values())), i, name))
                else:
                    heapq.heappop(fronts)
            self._resized(touched)

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacities[backend] = blocks
        if backend in self._backends:
            self._trim(backend, self._backends[backend], blocks)
            self._resized((backend,))

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
        self._resized((backend,))

    def _trim(self, backend: str, blocks: OrderedDict[int, float], capacity: int) -> None:
        for _ in range(len(blocks) - max(0, capacity)):
            self._lost(blocks.popitem(last=False)[0], backend)

    def _lost(self, block: int, backend: str) -> None:
        """The block left the backend's picture: if it heads a chain, the backend no longer holds it."""
        self._total -= 1
        holding = self._heads.get(block)
        if holding is None:
            return
        if isinstance(holding, str):
            if holding == backend:
                del self._heads[block]
            return
        self._set_bytes -= sys.getsizeof(holding)
        holding.discard(backend)
        if len(holding) == 1:  # back to one holder: its name
            self._heads[block] = next(iter(holding))
        else:
            self._set_bytes += sys.getsizeof(holding)

    def holders(self, block: int, now: float) -> Collection[str]:
        holding = self._heads.get(block)
        if holding is None:
            return ()
        return (holding,) if isinstance(holding, str) else holding

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
        self._total += added
        if chain:
            holding = self._heads.get(chain[0])
            if holding is None:
                self._heads[chain[0]] = backend
            elif isinstance(holding, str):
                if holding != backend:
                    holding = self._heads[chain[0]] = {holding, backend}
                    self._set_bytes += sys.getsizeof(holding)
            elif backend not in holding:
                self._set_bytes -= sys.getsizeof(holding)
                holding.add(backend)
                self._set_bytes += sys.getsizeof(holding)
        self._trim(backend, blocks, capacity)
        self._resized((backend,))
        self._bound()
        if self._next_vacuum == float("inf") and blocks:
            self._next_vacuum = now + self._ttl
        return added

    def remove_backend(self, backend: str) -> None:
        for block in list(self._backends.pop(backend, ())):
            self._lost(block, backend)
        self._table_bytes -= self._sizes.pop(backend, 0)

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
            self._resized((backend,))

    def vacuum(self, now: float) -> int:
        """Pop expired entries from the old end of each LRU; each entry is popped at most once."""
        cutoff = now - self._ttl
        removed = 0
        oldest = float("inf")
        touched = []
        for backend, blocks in self._backends.items():
            held = len(blocks)
            while blocks:
                block, seen = next(iter(blocks.items()))
                if seen >= cutoff:
                    oldest = min(oldest, seen)
                    break
                del blocks[block]
                self._lost(block, backend)
                removed += 1
            if len(blocks) < held:
                touched.append(backend)
        self._resized(touched)
        self._next_vacuum = oldest + self._ttl
        return removed

    def entries_by_backend(self) -> dict[str, int]:
        return {backend: len(blocks) for backend, blocks in self._backends.items()}
