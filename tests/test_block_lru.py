"""BlockLRU answers as an OrderedDict of block -> last seen would, through any sequence of changes,
and its bisecting lookup as a walk would on chains of prefix hashes."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.block_lru import LOCATION_MOST_BYTES, LRU_FIXED_BYTES, BlockLRU
from extproc.core.chain import HASH_MASK

# few distinct homes' worth of keys, so probes collide, run on and shift back; and the largest keys
KEYS = st.one_of(st.integers(0, 40), st.integers(HASH_MASK - 40, HASH_MASK), st.integers(0, HASH_MASK))
OPS = st.lists(
    st.tuples(
        st.sampled_from(["use", "use", "use", "move", "pop", "pop", "remove", "forget"]),
        st.lists(KEYS, max_size=30),
        st.integers(0, 3),
    ),
    max_size=80,
)


class Model:
    """The reference: what the index kept before BlockLRU (an OrderedDict, oldest first)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, float] = OrderedDict()

    def use(self, blocks: list[int], now: float) -> int:
        added = 0
        for block in blocks:
            added += block not in self.blocks
            self.blocks[block] = max(now, self.blocks.get(block, now))  # older news keeps the later time
            self.blocks.move_to_end(block)
        return added

    def held_prefix(self, chain: list[int], cutoff: float) -> int:
        held = 0
        for block in chain:
            seen = self.blocks.get(block)
            if seen is None or seen < cutoff:
                break
            held += 1
        return held


@settings(max_examples=300)
@given(OPS, st.integers(1, 200))
def test_block_lru_answers_as_an_ordered_dict(ops, limit):
    lru, model = BlockLRU(limit), Model()
    now = 0.0
    for op, blocks, step in ops:
        now += step
        if op == "use":
            assert lru.use(blocks, now) == model.use(blocks, now)
        elif op == "move":
            lru.move_to_end(blocks)
            for block in blocks:
                if block in model.blocks:
                    model.blocks.move_to_end(block)
        elif op == "pop":
            for _ in range(min(step * 5, len(model.blocks))):
                assert lru.oldest_seen() == next(iter(model.blocks.values()))
                assert lru.pop_oldest() == model.blocks.popitem(last=False)[0]
        elif op == "remove":
            for block in blocks:
                assert lru.remove(block) == (model.blocks.pop(block, None) is not None)
        else:
            gone = sorted(b for b, seen in model.blocks.items() if seen <= now - 2)
            assert sorted(lru.seen_until(now - 2)) == gone
        assert len(lru) == len(model.blocks)
        assert sorted(lru.keys()) == sorted(model.blocks)
        for cutoff in (0.0, now - 2):
            for block in (*blocks, *model.blocks):  # one block is a chain of one
                assert lru.held_chain([block], cutoff) == model.held_prefix([block], cutoff)
        assert lru.nbytes() + sys.getsizeof(lru) <= LOCATION_MOST_BYTES * len(lru) + LRU_FIXED_BYTES
        assert lru.newest_seen() >= max(model.blocks.values(), default=float("-inf"))  # a bound on what it holds
    order = [lru.pop_oldest() for _ in range(len(lru))]
    assert order == list(model.blocks)


def test_a_table_emptied_gives_its_memory_back_and_one_at_its_limit_stops_growing():
    lru = BlockLRU(limit=3000)
    for start in range(0, 3000, 30):
        lru.use(range(start * 7919, start * 7919 + 30), float(start))
    full = lru.nbytes()
    assert full <= 40 * 3000  # about 20 bytes a slot, two thirds filled, and the log
    for _ in range(2990):
        lru.pop_oldest()
    assert lru.nbytes() < full / 50


def test_a_table_at_its_limit_takes_a_learnings_new_blocks_past_it_without_a_rebuild_each(monkeypatch):
    """The index adds a response's blocks, then trims back to the limit. A table as large as its
    limit needs takes them without growing; one learning far past it grows once (and shrinks once
    trimmed), never once per block: each rebuild is a pass over the whole table."""
    rebuilds = []
    rebuild = BlockLRU._rebuild
    monkeypatch.setattr(BlockLRU, "_rebuild", lambda lru, homes: (rebuilds.append(homes), rebuild(lru, homes)))
    lru = BlockLRU(limit=3000)
    lru.use(range(3000), 0.0)
    rebuilds.clear()
    for start, learned in ((10_000, 200), (20_000, 400), (30_000, 200)):
        lru.use(range(start, start + learned), 1.0)
        for _ in range(learned):
            lru.pop_oldest()
    assert rebuilds == []
    lru.use(range(40_000, 41_500), 2.0)  # half the limit at once: the most the index lets one response teach
    assert len(rebuilds) == 1
    for _ in range(1500):
        lru.pop_oldest()
    assert len(rebuilds) == 2 and len(lru) == 3000
    assert lru.nbytes() + sys.getsizeof(lru) <= LOCATION_MOST_BYTES * len(lru) + LRU_FIXED_BYTES
    assert [lru.pop_oldest() for _ in range(3)] == [2300, 2301, 2302]  # the order kept through it all


CHAINS = st.lists(
    st.tuples(
        st.sampled_from(["use", "use", "use", "move", "pop", "forget"]),
        st.tuples(st.integers(0, 5), st.integers(1, 12)),  # which conversation, how far into it
        st.integers(-2, 3),  # time step: a sibling's news may be older
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(CHAINS, st.integers(1, 40))
def test_bisecting_a_chain_of_prefix_hashes_finds_what_a_walk_finds(ops, limit):
    """Six conversations of twelve blocks, some sharing their first blocks; each block's key names
    its whole prefix, as chain hashes do. Whatever is learned (from the head, sometimes with older
    times), moved ahead of a prefill, evicted or forgotten, bisection counts what a walk counts."""
    rng = random.Random(0)
    names: dict[tuple[int, ...], int] = {}
    chains = []
    for conversation in range(6):
        path = (conversation % 3, *(conversation * 100 + i for i in range(11)))  # three shared heads
        chains.append([names.setdefault(path[: i + 1], rng.getrandbits(60)) for i in range(12)])
    lru, model = BlockLRU(limit), Model()
    now = 10.0
    for op, (which, length), step in ops:
        now += step
        prefix = chains[which][:length]
        if op == "use":
            lru.use(reversed(prefix), now)
            model.use(list(reversed(prefix)), now)
        elif op == "move":
            lru.move_to_end(reversed(prefix))
            for block in reversed(prefix):
                if block in model.blocks:
                    model.blocks.move_to_end(block)
        elif op == "pop":
            for _ in range(min(length, len(model.blocks))):
                assert lru.pop_oldest() == model.blocks.popitem(last=False)[0]
        else:
            for block in lru.seen_until(now - 3):
                lru.remove(block)
                del model.blocks[block]
        while len(model.blocks) > limit:  # its owner trims it to its limit, oldest first
            assert lru.pop_oldest() == model.blocks.popitem(last=False)[0]
        for chain in chains:
            for cutoff in (0.0, now - 2, now):
                assert lru.held_chain(chain, cutoff) == model.held_prefix(chain, cutoff)
