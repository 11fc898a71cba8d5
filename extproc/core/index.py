"""Location index: which backend holds which block of which prefix, and since when.

Behind the small `LocationIndex` interface so a precise or shared index can replace the
in-process one; cache turnover is measured outside the index (churn.py). The in-process index
keeps one LRU per backend (block hash -> last seen; block_lru.py, some 50 bytes a location): a
backend's KV cache is finite and evicts, so must our picture of it.
A lookup bisects the chain on each candidate, so its cost depends on the chain's length and the
number of candidates, never on the index size.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

from extproc.core.block_lru import LOCATION_MOST_BYTES, LRU_FIXED_BYTES, BlockLRU

# The memory bound counts each location at the most it can take in a backend's BlockLRU
# (LOCATION_MOST_BYTES: three slots of 24 bytes, as a table emptier than a third is rebuilt
# smaller), each LRU's fixed part, the first-block map and its sets as `sys.getsizeof` reports
# them, and the one object a location may have: a chain head's key there (a 60-bit int). A
# BlockLRU's actual use is lower (about 50 bytes a location), so the bound is kept.
HEAD_KEY_BYTES = 32
# A pass that drops locations goes this far below the bound, so the next learnings need none;
# small, as the pass holds the event loop (some 4-7 us a location with the heap of the backends'
# old ends: 256 KiB, about 3,600 locations, held it 14-22 ms at 200 backends: results/stalls-34).
SLACK_BYTES = 32 * 1024
# Expired locations one lookup removes at most (about 1 us each): after a quiet spell longer than
# the TTL, the first lookup found every location expired and removed them all at once (1.3 s for
# 8 pictures of 100,000 blocks); the next lookups carry on. Expired ones never match meanwhile.
VACUUM_SLICE = 2048


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
    a thousand backends' capacities can add up to more memory than the process has. Block hashes
    are 60-bit chain hashes (chain.HASH_MASK)."""

    __slots__ = (
        "_backends",
        "_capacities",
        "_capacity",
        "_heads",
        "_held_bytes",
        "_held_heads",
        "_learn_share",
        "_max_bytes",
        "_next_vacuum",
        "_room",
        "_set_bytes",
        "_shed",
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
        self._backends: dict[str, BlockLRU] = {}
        # first block of a learned chain -> the backend holding it, or the backends once several do
        # (one name, not a set: most heads live on one backend, and short prompts are all head)
        self._heads: dict[int, str | set[str]] = {}
        # backend -> the heads it holds (the other side of `_heads`), so a picture that goes drops its
        # heads without a look at each of its blocks: a rollout of 50 pictures of 25,000 blocks held
        # the loop about 100 ms that way (results/stalls-34)
        self._held_heads: dict[str, set[int]] = {}
        self._held_bytes = 0  # their sets' sizes
        self._next_vacuum = float("inf")
        self._shed = 0
        self._total = 0  # locations held over all backends
        self._set_bytes = 0  # the first-block map's sets' sizes
        # backend -> blocks its in-flight prefills are storing that are not learned yet (make_room):
        # the engine holds them beside the picture's, so the picture keeps that much less
        self._room: dict[str, Taken] = {}

    def configure(
        self, ttl_s: float, capacity_blocks: int, capacities: Mapping[str, int], *, max_bytes: int | None
    ) -> None:
        self._ttl = ttl_s
        self._capacity = capacity_blocks
        self._capacities = dict(capacities)
        self._max_bytes = max_bytes
        self._next_vacuum = float("-inf")  # the next lookup re-derives the vacuum deadline
        for backend, blocks in self._backends.items():
            self._trim(backend, blocks)
        self._bound()

    @property
    def shed(self) -> int:
        return self._shed

    def memory_bytes(self) -> int:
        """The index's memory as its bound counts it: at least what it takes."""
        lrus = self._total * LOCATION_MOST_BYTES + len(self._backends) * LRU_FIXED_BYTES
        heads = sys.getsizeof(self._heads) + self._set_bytes + len(self._heads) * HEAD_KEY_BYTES
        return lrus + heads + sys.getsizeof(self._held_heads) + self._held_bytes

    def _limit(self, backend: str) -> int:
        return self._capacities.get(backend, self._capacity)

    def _bound(self) -> None:
        """Past `max_bytes`, drop the coldest locations fleet-wide (the old ends of the backends'
        LRUs, by last seen) down to SLACK_BYTES below it."""
        bound = self._max_bytes
        if bound is None or self.memory_bytes() <= bound:
            return
        target = bound - min(SLACK_BYTES, bound // 10)
        fronts = [(b.oldest_seen(), i, name) for i, (name, b) in enumerate(self._backends.items()) if b]
        heapq.heapify(fronts)
        while fronts and self.memory_bytes() > target:
            for _ in range(-(-(self.memory_bytes() - target) // LOCATION_MOST_BYTES)):  # each gives that back, or more
                _, i, name = fronts[0]
                blocks = self._backends[name]
                self._lost(blocks.pop_oldest(), name)
                self._shed += 1
                if blocks:
                    heapq.heapreplace(fronts, (blocks.oldest_seen(), i, name))
                else:
                    heapq.heappop(fronts)
                    if not fronts:
                        break

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacities[backend] = blocks
        lru = self._backends.get(backend)
        if lru is not None:
            self._trim(backend, lru)

    def make_room(self, backend: str, held: Sequence[int], count: int, now: float) -> Room:
        """A request is prefilling there that will be learned only later: the engine uses the
        prefix it holds (`held`, which becomes its most recent, seen `now`: a prefix in use must
        not age out of the picture while its request runs) and stores `count` new blocks,
        for which the least recent others go now. Those blocks stay taken beside every other
        in-flight prefill's until the returned room is given back (learned, or ended): without
        that, concurrent prefills evicted for one request's blocks at a time. At most what its
        learning will keep (`learn_share` of the backend's picture, as `learn`), so one prompt
        longer than the cache does not empty the picture for as long as it runs."""
        count = min(count, max(1, int(self._limit(backend) * self._learn_share)))
        taken = self._room.get(backend)
        if taken is None:
            taken = self._room[backend] = Taken()
        taken.blocks += count
        blocks = self._backends.get(backend)
        if blocks:
            blocks.use(reversed(held), now, add=False)
            self._trim(backend, blocks)
        return Room(self, backend, taken, count)

    def free_room(self, backend: str, taken: Taken, count: int) -> None:
        """Room given back to the count it was taken from: once the backend's picture was dropped
        (a reset, a departure) that count is no longer its, and the new one is not touched."""
        taken.blocks -= count
        if taken.blocks <= 0 and self._room.get(backend) is taken:
            del self._room[backend]

    def _taken(self, backend: str) -> int:
        taken = self._room.get(backend)
        return 0 if taken is None else taken.blocks

    def _trim(self, backend: str, blocks: BlockLRU) -> None:
        blocks.limit = limit = self._limit(backend)
        for _ in range(len(blocks) - max(0, limit - self._taken(backend))):
            self._lost(blocks.pop_oldest(), backend)

    def _lost(self, block: int, backend: str) -> None:
        """The block left the backend's picture: if it heads a chain, the backend no longer holds it."""
        self._total -= 1
        if block in self._heads:
            self._unhead(block, backend)

    def _unhead(self, block: int, backend: str) -> None:
        """The backend no longer holds the chain this block heads."""
        held = self._held_heads.get(backend)
        if held is not None and block in held:
            before = sys.getsizeof(held)
            held.discard(block)
            self._held_bytes += sys.getsizeof(held) - before
        holding = self._heads[block]
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
            matched[backend] = blocks.held_chain(chain, cutoff) if blocks else 0
        return matched

    def learn(self, chain: Sequence[int], backend: str, now: float) -> int:
        capacity = self._limit(backend)
        blocks = self._backends.get(backend)
        if blocks is None:
            blocks = self._backends[backend] = BlockLRU(capacity)
        chain = chain[: max(1, int(capacity * self._learn_share))]
        # Tail first, so the head of the prefix is the most recently used and is evicted last,
        # as in vLLM, which frees a sequence's blocks from the tail.
        added = blocks.use(reversed(chain), now)
        self._total += added
        if chain:
            head = chain[0]
            holding = self._heads.get(head)
            if holding is None:
                self._heads[head] = backend
            elif isinstance(holding, str):
                if holding != backend:
                    holding = self._heads[head] = {holding, backend}
                    self._set_bytes += sys.getsizeof(holding)
            elif backend not in holding:
                self._set_bytes -= sys.getsizeof(holding)
                holding.add(backend)
                self._set_bytes += sys.getsizeof(holding)
            held = self._held_heads.get(backend)
            if held is None:
                held = self._held_heads[backend] = set()
                self._held_bytes += sys.getsizeof(held)
            if head not in held:
                before = sys.getsizeof(held)
                held.add(head)
                self._held_bytes += sys.getsizeof(held) - before
        self._trim(backend, blocks)
        self._bound()
        if self._next_vacuum == float("inf") and blocks:
            self._next_vacuum = now + self._ttl
        return added

    def forget_capacity(self, backend: str) -> None:
        """The size a backend reported no longer holds (it left long ago): the default again."""
        self._capacities.pop(backend, None)

    def remove_backend(self, backend: str) -> None:
        self._room.pop(backend, None)
        blocks = self._backends.pop(backend, None)
        if blocks:
            self._dropped(backend, blocks)

    def _dropped(self, backend: str, blocks: BlockLRU) -> None:
        """Every block of this picture of the backend left it."""
        self._total -= len(blocks)
        held = self._held_heads.pop(backend, None)
        if held is not None:
            self._held_bytes -= sys.getsizeof(held)
            for block in held:  # only the chains' heads name backends
                self._unhead(block, backend)

    def forget_before(self, backend: str, moment: float) -> None:
        blocks = self._backends.get(backend)
        if blocks and blocks.newest_seen() <= moment:  # all of it predates the clear, as usual
            self._backends[backend] = BlockLRU(blocks.limit)
            self._dropped(backend, blocks)
        elif blocks:  # a full pass, not from the old end: a sibling replica's learning may arrive late
            for block in blocks.seen_until(moment):
                blocks.remove(block)
                self._lost(block, backend)

    def vacuum(self, now: float) -> int:
        """Pop expired entries from the old end of each LRU, at most VACUUM_SLICE of them: with more
        left, the next lookup goes on. Each entry is popped at most once."""
        cutoff = now - self._ttl
        removed = 0
        oldest = float("inf")
        for backend, blocks in self._backends.items():
            while blocks:
                seen = blocks.oldest_seen()
                if seen >= cutoff:
                    oldest = min(oldest, seen)
                    break
                if removed == VACUUM_SLICE:
                    self._next_vacuum = now
                    return removed
                self._lost(blocks.pop_oldest(), backend)
                removed += 1
        self._next_vacuum = oldest + self._ttl
        return removed

    def entries_by_backend(self) -> dict[str, int]:
        return {backend: len(blocks) for backend, blocks in self._backends.items()}


class Taken:
    """Blocks a backend's in-flight prefills take in its picture, until the picture is dropped."""

    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks = 0


class Room:
    """The blocks one in-flight prefill takes in a backend's picture (LocalIndex.make_room), given
    back once: when its request is learned, or ends unlearned."""

    __slots__ = ("_index", "_taken", "backend", "blocks")

    def __init__(self, index: LocalIndex, backend: str, taken: Taken, blocks: int) -> None:
        self._index = index
        self._taken = taken
        self.backend = backend
        self.blocks = blocks

    def give_back(self) -> None:
        if self.blocks:
            self._index.free_room(self.backend, self._taken, self.blocks)
            self.blocks = 0
