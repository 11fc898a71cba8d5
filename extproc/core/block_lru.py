"""One backend's cached blocks, least recently used first, without an object per block.

A dict of int keys costs some 85 bytes a block (the key's int object and its table entry), an
OrderedDict 140: at a thousand backends' caches that is gigabytes per replica. Here a block is 24
bytes of four parallel arrays (key, last seen, the previous and next block in the order) in a table
filled a third to two thirds, at the price of probing in Python (some 0.1-0.3 us a block against
the dict's 0.03-0.1).

The table is open addressing with linear probing that does not wrap: a block's home slot is its key
modulo `homes`, and probes run on into spare slots past the last home, the last of which stays
free. A removal shifts the entries after it back (no tombstones), relinking their neighbours. The
order is a doubly linked list through the slots, so using a block again moves it in O(1) and
nothing needs compacting; only growing or shrinking the table rebuilds it (a Python pass, about
0.5 us a block, when it crosses two thirds or a third filled). A table as large as `limit` blocks
need takes a learning's new blocks beyond the limit (its owner trims back to it right after) up to
OVER_NUM/OVER_DEN filled before it grows, and then to 5/2 of its blocks: growing it just enough
for one more block rebuilt it once per block past the limit, a whole-table pass each. Keys must be
below EMPTY (chain hashes are 60 bits).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence

EMPTY = 1 << 63  # a free slot; no block key is this large
NIL = 0xFFFFFFFF  # no slot: the list's ends
MIN_HOMES = 8
SPARE = 32  # slots past the last home a probe may run into; the last stays free
# Homes per block: a table grows to 5/2 of its blocks when it would fill two thirds of its homes,
# and is rebuilt at twice them when emptier than a third: each block takes at most three homes.
GROW_NUM, GROW_DEN = 5, 2
FILL_NUM, FILL_DEN = 2, 3
OVER_NUM, OVER_DEN = 17, 20  # how full a table at its limit's size may get while over the limit
SHRINK_BELOW = 3
# The most a block costs: three slots of 8 + 8 + 4 + 4 bytes; and a table's fixed part (the object,
# four arrays' headers, MIN_HOMES and SPARE slots, spares added by probes that ran to the end), as
# the memory bound counts them.
LOCATION_MOST_BYTES = 72
LRU_FIXED_BYTES = 2048


class BlockLRU:
    """Block key -> last seen, in least-recently-used order. Not thread-safe: one event loop."""

    __slots__ = ("_first", "_homes", "_keys", "_last", "_next", "_prev", "_seen", "count", "limit")

    def __init__(self, limit: int) -> None:
        """`limit`: the most blocks it will hold (its owner trims to it), so it never grows its
        table beyond what that many need."""
        self.limit = limit
        self.count = 0
        self._first = self._last = NIL
        self._allocate(MIN_HOMES, MIN_HOMES + SPARE)

    def _allocate(self, homes: int, slots: int) -> None:
        self._homes = homes
        self._keys = array("Q", (EMPTY,)) * slots
        self._seen = array("d", bytes(8 * slots))
        self._prev = array("I", (NIL,)) * slots
        self._next = array("I", (NIL,)) * slots

    def __len__(self) -> int:
        return self.count

    def nbytes(self) -> int:
        """Memory its arrays hold, as allocated."""
        return sum(map(sys.getsizeof, (self._keys, self._seen, self._prev, self._next)))

    def held_chain(self, chain: Sequence[int], cutoff: float) -> int:
        """How many leading blocks of the chain it holds, last seen at or after `cutoff`; by
        bisection, not a walk, as the chain's blocks are prefix hashes: a block held names its whole
        prefix, which is then held too and seen at least as late (each learning uses a chain from
        its head, the head last, and never moves a last-seen time back), so "held and seen since
        `cutoff`" holds for the chain's first blocks and for none after them."""
        fresh = self._fresh
        if not chain or not fresh(chain[0], cutoff):
            return 0
        low, high = 0, len(chain)  # fresh at low; high is past the end, or not fresh
        if fresh(chain[high - 1], cutoff):
            return high
        high -= 1
        while high - low > 1:
            middle = (low + high) // 2
            if fresh(chain[middle], cutoff):
                low = middle
            else:
                high = middle
        return high

    def _fresh(self, block: int, cutoff: float) -> bool:
        slot = self._find(block)
        return slot >= 0 and self._seen[slot] >= cutoff

    def _find(self, block: int) -> int:
        keys = self._keys
        slot = block % self._homes
        key = keys[slot]
        while key != block:
            if key == EMPTY:
                return -1
            slot += 1
            key = keys[slot]
        return slot

    def use(self, blocks: Iterable[int], now: float, *, add: bool = True) -> int:
        """Mark each block seen at `now` (a later time it has stays) and most recent, in this
        order, so the last is the most recent; one it does not hold is added, or with `add` false
        skipped. Returns how many were added."""
        keys, seen, prev, after, homes = self._keys, self._seen, self._prev, self._next, self._homes
        first, last = self._first, self._last
        added = 0
        for block in blocks:
            slot = block % homes
            key = keys[slot]
            while key != block and key != EMPTY:
                slot += 1
                key = keys[slot]
            if key == block:  # held already: out of its place in the order
                if seen[slot] < now:
                    seen[slot] = now
                if slot == last:
                    continue
                before, behind = prev[slot], after[slot]
                if before == NIL:
                    first = behind
                else:
                    after[before] = behind
                prev[behind] = before
            elif add:
                if (self.count + 1) * FILL_DEN > homes * FILL_NUM and self._must_grow(homes):
                    self._first, self._last = first, last
                    self._rebuild(self._grown(self.count + 1))
                    keys, seen, prev, after, homes = self._keys, self._seen, self._prev, self._next, self._homes
                    first, last = self._first, self._last
                    slot = self._free(block)
                if slot == len(keys) - 1:  # the last slot stays free, so probes end
                    self._spare()
                keys[slot] = block
                seen[slot] = now
                self.count += 1
                added += 1
            else:
                continue
            prev[slot] = last
            after[slot] = NIL
            if last == NIL:
                first = slot
            else:
                after[last] = slot
            last = slot
        self._first, self._last = first, last
        return added

    def _unlink(self, slot: int) -> None:
        before, after = self._prev[slot], self._next[slot]
        if before == NIL:
            self._first = after
        else:
            self._next[before] = after
        if after == NIL:
            self._last = before
        else:
            self._prev[after] = before

    def _free(self, block: int) -> int:
        """The slot a new block takes (the table has room: just rebuilt, or being rebuilt)."""
        keys = self._keys
        slot = block % self._homes
        while keys[slot] != EMPTY:
            slot += 1
        return slot

    def _spare(self) -> None:
        """More free slots past the last home (a probe ran to the end)."""
        self._keys.extend(array("Q", (EMPTY,)) * SPARE)
        self._seen.extend(array("d", bytes(8 * SPARE)))
        self._prev.extend(array("I", (NIL,)) * SPARE)
        self._next.extend(array("I", (NIL,)) * SPARE)

    def move_to_end(self, blocks: Iterable[int]) -> None:
        """Make those of the blocks it holds the most recent, in this order; last seen unchanged."""
        self.use(blocks, float("-inf"), add=False)

    def newest_seen(self) -> float:
        """No block it holds was last seen later than this (an upper bound, read in one C pass:
        freed slots keep the time they had)."""
        return max(self._seen, default=float("-inf"))

    def oldest_seen(self) -> float:
        """When the least recent block was last seen; the table is not empty."""
        return self._seen[self._first]

    def pop_oldest(self) -> int:
        """Remove the least recent block; returns its key. The table is not empty."""
        slot = self._first
        key = self._keys[slot]
        self._remove(slot)
        return key

    def remove(self, block: int) -> bool:
        slot = self._find(block)
        if slot < 0:
            return False
        self._remove(slot)
        return True

    def keys(self) -> list[int]:
        """Every block it holds, in no order."""
        return [key for key in self._keys if key != EMPTY]

    def seen_until(self, moment: float) -> list[int]:
        """The blocks last seen at or before `moment`."""
        keys, seen = self._keys, self._seen
        return [keys[slot] for slot in range(len(keys)) if keys[slot] != EMPTY and seen[slot] <= moment]

    def _ordered(self) -> Iterator[int]:
        """Its slots, least recent first."""
        after = self._next
        slot = self._first
        while slot != NIL:
            yield slot
            slot = after[slot]

    def _remove(self, hole: int) -> None:
        """Free a slot, shifting back the entries after it that probing would no longer reach."""
        keys, seen, prev, after, homes = self._keys, self._seen, self._prev, self._next, self._homes
        self._unlink(hole)
        self.count -= 1
        slot = hole + 1
        key = keys[slot]
        while key != EMPTY:
            if key % homes <= hole:
                keys[hole] = key
                seen[hole] = seen[slot]
                before = prev[hole] = prev[slot]
                behind = after[hole] = after[slot]
                if before == NIL:
                    self._first = hole
                else:
                    after[before] = hole
                if behind == NIL:
                    self._last = hole
                else:
                    prev[behind] = hole
                hole = slot
            slot += 1
            key = keys[slot]
        keys[hole] = EMPTY
        if homes > MIN_HOMES and self.count * SHRINK_BELOW < homes:
            self._rebuild(max(MIN_HOMES, 2 * self.count))

    def _most(self) -> int:
        """Homes that `limit` blocks fill to two thirds: the table's size once it holds its limit."""
        return self.limit * FILL_DEN // FILL_NUM + 1

    def _must_grow(self, homes: int) -> bool:
        """One more block (past two thirds filled) needs a larger table: below its limit's size,
        or over the limit beyond OVER_NUM/OVER_DEN filled."""
        return homes < self._most() or (self.count + 1) * OVER_DEN > homes * OVER_NUM

    def _grown(self, blocks: int) -> int:
        """Homes for so many blocks as it grows: 5/2 of them, but no more than `limit` blocks fill
        to two thirds (nor fewer than these fill to two thirds); past the limit, 5/2 of them."""
        grown, fitted, most = blocks * GROW_NUM // GROW_DEN, blocks * FILL_DEN // FILL_NUM + 1, self._most()
        return max(MIN_HOMES, grown if fitted > most else max(min(grown, most), fitted))

    def _rebuild(self, homes: int) -> None:
        """Rehash into `homes` homes, keeping the order."""
        old_keys, old_seen = self._keys, self._seen
        order = list(self._ordered())
        self._allocate(homes, homes + SPARE)
        keys, seen, prev, after = self._keys, self._seen, self._prev, self._next
        last = NIL
        for old in order:
            block = old_keys[old]
            slot = self._free(block)
            if slot == len(keys) - 1:
                self._spare()
            keys[slot] = block
            seen[slot] = old_seen[old]
            prev[slot] = last
            if last == NIL:
                self._first = slot
            else:
                after[last] = slot
            last = slot
        self._last = last
