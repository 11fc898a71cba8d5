"""Location index: leading-block counts, TTL, LRU capacity, vacuum, backend removal."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.block_lru import LOCATION_MOST_BYTES
from extproc.core.churn import ChurnMeter
from extproc.core.index import HEAD_KEY_BYTES, SLACK_BYTES, VACUUM_SLICE, LocalIndex

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def test_lookup_counts_leading_blocks_per_backend():
    index = LocalIndex(ttl_s=100, capacity_blocks=100)
    index.learn([1, 2, 3, 4], A, 0)
    index.learn([1, 2], B, 0)
    index.learn([9, 2, 3], C, 0)  # holds blocks 2 and 3 of another prefix, never block 1
    assert index.lookup([1, 2, 3, 4, 5], [A, B, C], 1) == {A: 4, B: 2, C: 0}


def test_lookup_stops_at_a_gap():
    index = LocalIndex(ttl_s=100, capacity_blocks=100)
    index.learn([1, 2], A, 0)
    index.learn([1, 2, 3, 4], A, 0)
    index.remove_backend(B)
    assert index.lookup([1, 2, 7, 8], [A], 0) == {A: 2}  # leaves A's chain at its third block


def test_expired_locations_do_not_count():
    index = LocalIndex(ttl_s=10, capacity_blocks=100)
    index.learn([1, 2, 3], A, 0)
    index.learn([1, 2], A, 5)  # block 3 was last seen at 0
    assert index.lookup([1, 2, 3], [A], 9) == {A: 3}
    assert index.lookup([1, 2, 3], [A], 12) == {A: 2}
    assert index.lookup([1, 2, 3], [A], 16) == {A: 0}


def test_vacuum_removes_expired_entries_on_its_deadline():
    index = LocalIndex(ttl_s=10, capacity_blocks=100)
    index.learn([1, 2, 3], A, 0)
    index.learn([7, 8], B, 5)
    assert index.vacuum(9) == 0
    assert index.vacuum(12) == 3
    assert index.entries_by_backend() == {A: 0, B: 2}
    index.lookup([7], [B], 16)  # a lookup past the next deadline vacuums on its way
    assert sum(index.entries_by_backend().values()) == 0


def test_after_a_quiet_spell_expired_entries_go_a_slice_at_a_time_and_never_match_meanwhile():
    """The first lookup after more than a TTL without traffic would find every location expired:
    it removes VACUUM_SLICE of them (a whole fleet's pictures at once held the loop for a second
    and more), each later lookup the next slice, and none of them matches in between."""
    index = LocalIndex(ttl_s=10, capacity_blocks=10 * VACUUM_SLICE)
    chain = list(range(1, 2 * VACUUM_SLICE + 1))
    index.learn(chain, A, 0)
    index.learn([chain[0] + 10**9], B, 0)
    assert index.lookup(chain, [A], 1) == {A: len(chain)}
    assert index.lookup(chain, [A, B], 30) == {A: 0, B: 0}
    assert sum(index.entries_by_backend().values()) == VACUUM_SLICE + 1
    assert index.lookup(chain, [A, B], 31) == {A: 0, B: 0}
    assert index.lookup(chain, [A, B], 32) == {A: 0, B: 0}
    assert index.entries_by_backend() == {A: 0, B: 0}
    index.learn(chain[:3], A, 33)  # done: vacuums wait for the next deadline again
    assert index.lookup(chain, [A], 34) == {A: 3}


def test_a_cache_emptied_after_a_moment_forgets_what_was_learned_until_then():
    """What was learned since may be the new content and stays; a picture learned wholly before
    (the usual case) goes in one step, its heads with it."""
    index = LocalIndex(ttl_s=100, capacity_blocks=100)
    index.learn([1, 2, 3], A, 1)
    index.learn([7, 8], A, 6)
    index.forget_before(A, 5)
    assert index.lookup([1, 2, 3], [A], 7) == {A: 0} and index.lookup([7, 8], [A], 7) == {A: 2}
    assert list(index.holders(1, 7)) == [] and list(index.holders(7, 7)) == [A]
    index.forget_before(A, 10)
    assert index.entries_by_backend() == {A: 0} and list(index.holders(7, 11)) == []
    index.learn([7, 8], A, 12)
    assert index.lookup([7, 8], [A], 13) == {A: 2} and list(index.holders(7, 13)) == [A]


def test_capacity_evicts_least_recently_used_and_keeps_prefix_heads():
    index = LocalIndex(ttl_s=100, capacity_blocks=5, learn_share=1.0)
    index.learn([1, 2, 3], A, 0)
    index.learn([10, 20, 30], A, 1)
    assert sum(index.entries_by_backend().values()) == 5
    # the older chain lost its tail first: its head is still usable
    assert index.lookup([1, 2, 3], [A], 2) == {A: 2}
    index.learn([1, 2], A, 3)  # touching moves them to the recent end
    index.learn([40], A, 4)
    assert index.lookup([10, 20, 30], [A], 5) == {A: 2}
    assert index.lookup([1, 2], [A], 5) == {A: 2}


def test_capacity_is_per_backend():
    index = LocalIndex(ttl_s=100, capacity_blocks=2, learn_share=1.0)
    index.learn([1, 2], A, 0)
    index.learn([3, 4], B, 0)
    assert index.entries_by_backend() == {A: 2, B: 2}


def test_remove_backend_drops_everything_at_once():
    index = LocalIndex(ttl_s=100, capacity_blocks=100)
    index.learn([1, 2], A, 0)
    index.learn([1, 2], B, 0)
    index.remove_backend(A)
    assert index.lookup([1, 2], [A, B], 1) == {A: 0, B: 2}
    assert sum(index.entries_by_backend().values()) == 2


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 20), max_size=6), st.sampled_from([A, B]), st.integers(0, 3)), max_size=40
    )
)
def test_lookup_matches_a_simple_model(ops):
    """Against a brute-force model of the same rules (TTL 5, capacity 6, LRU). Each generated list
    is a prompt's blocks; its chain names each prefix, as chain hashes do."""
    index = LocalIndex(ttl_s=5, capacity_blocks=6, learn_share=1.0)
    model: dict[str, dict[int, float]] = {A: {}, B: {}}
    names: dict[tuple[int, ...], int] = {}
    now = 0
    for prompt, backend, step in ops:
        now += step
        chain = [names.setdefault(tuple(prompt[: i + 1]), len(names) + 1) for i in range(len(prompt))]
        index.learn(chain, backend, now)
        blocks = model[backend]
        for block in reversed(chain):
            blocks.pop(block, None)
            blocks[block] = now
        while len(blocks) > 6:
            del blocks[next(iter(blocks))]
        probe = [*chain, names.setdefault((*prompt, 99), len(names) + 1)]
        expected = {}
        for name, held in model.items():
            count = 0
            for block in probe:
                if block not in held or held[block] < now - 5:
                    break
                count += 1
            expected[name] = count
        assert index.lookup(probe, [A, B], now) == expected


def test_configure_and_per_backend_capacity_trim_oldest_first():
    index = LocalIndex(ttl_s=100, capacity_blocks=10)
    index.learn([1, 2, 3, 4], A, 0)
    index.learn([5, 6, 7, 8], B, 0)
    index.set_capacity(A, 2)
    assert index.lookup([1, 2, 3, 4], [A], 1) == {A: 2}
    index.configure(ttl_s=100, capacity_blocks=3, capacities={A: 2}, max_bytes=None)
    assert index.entries_by_backend() == {A: 2, B: 3}
    index.configure(ttl_s=1, capacity_blocks=3, capacities={A: 2}, max_bytes=None)
    assert index.lookup([5, 6, 7], [B], 5) == {B: 0}
    assert sum(index.entries_by_backend().values()) == 0  # the shorter TTL's vacuum ran on that lookup


def test_learn_reports_new_blocks_and_churn_decays():
    index = LocalIndex(ttl_s=1000, capacity_blocks=100)
    meter = ChurnMeter(half_life_s=10)
    meter.add(A, index.learn([1, 2, 3], A, 0), 0)
    meter.add(A, index.learn([1, 2, 3, 4], A, 0), 0)  # only block 4 is new
    assert meter.rate(A, 0) == 4
    assert meter.rate(A, 10) == pytest.approx(2)
    assert meter.rate(B, 10) == 0
    meter.remove_backend(A)
    assert meter.rate(A, 10) == 0


def test_local_index_fits_both_index_protocols():
    index = LocalIndex(ttl_s=1, capacity_blocks=1)
    assert all(callable(getattr(index, name)) for name in ("lookup", "learn", "remove_backend", "entries_by_backend"))


def test_one_response_teaches_at_most_half_the_capacity_from_the_head():
    index = LocalIndex(ttl_s=100, capacity_blocks=10)
    index.learn([1, 2, 3], B, 0)
    assert index.learn(list(range(100, 130)), A, 0) == 5  # a huge prompt: only its first 5 blocks
    assert index.lookup(list(range(100, 130)), [A], 1) == {A: 5}
    index.learn([1, 2, 3], A, 1)
    assert index.lookup([1, 2, 3], [A, B], 2) == {A: 3, B: 3}  # what others taught is still there


def apply(index: LocalIndex, op: str, chain: list[int], backend: str, now: float, step: int) -> None:
    """One operation of the property tests below."""
    if op == "learn":
        index.learn(chain, backend, now)
    elif op == "room":
        index.make_room(backend, chain[:1], 3 * step, 0.0)
    elif op == "forget_before":
        index.forget_before(backend, now - 1)
    elif op == "remove":
        index.remove_backend(backend)
    elif op == "vacuum":
        index.vacuum(now)
    else:
        index.set_capacity(backend, 1 + step)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["learn", "learn", "learn", "forget_before", "remove", "vacuum", "capacity"]),
            st.tuples(st.integers(0, 4), st.integers(1, 5)),
            st.sampled_from([A, B]),
            st.integers(0, 3),
        ),
        max_size=40,
    )
)
def test_the_holders_of_a_first_block_are_exactly_the_backends_whose_picture_has_it(ops):
    """Whatever evicts, expires, forgets or removes: `holders` of a chain's first block names
    exactly the backends where a lookup still finds it (expired but not yet vacuumed entries may
    stay named: a superset, which the lookup then decides). Chains as block hashes make them: a
    block's hash names its whole prefix, so a first block is never found further down a chain."""
    index = LocalIndex(ttl_s=5, capacity_blocks=6, learn_share=1.0)
    heads: set[int] = set()
    now = 0
    for op, (head, length), backend, step in ops:
        now += step
        chain = [head, *(100 * (head + 1) + i for i in range(1, length))]
        apply(index, op, chain, backend, now, step)
        if op == "learn":
            heads.add(chain[0])
        for head in heads:
            found = {b for b in (A, B) if index.lookup([head], [b], now)[b] == 1}
            named = set(index.holders(head, now))
            assert found <= named
            assert named == {b for b in (A, B) if index.lookup([head], [b], -1e9)[b] == 1}


def test_room_made_ahead_of_learning_evicts_the_least_recent():
    """A transport that learns at a request's end makes room for its blocks when it is sent, as
    the engine's prefill evicts then: the least recent go; a later learn fills the room."""
    index = LocalIndex(ttl_s=60, capacity_blocks=6, learn_share=1.0)
    index.learn([1, 2, 3], A, 0)
    index.learn([7, 8, 9], A, 1)
    room = index.make_room(A, [], 2, 0.0)
    assert index.lookup([1, 2, 3], [A], 2) == {A: 1}  # its tail went first, as vLLM frees tails first
    assert index.lookup([7, 8, 9], [A], 2) == {A: 3}
    room.give_back()  # its request ended: learned now
    index.learn([4, 5], A, 3)
    assert index.entries_by_backend()[A] == 6
    index.make_room(A, [1], 2, 0.0)  # the request uses block 1 there: it is the most recent now
    assert index.lookup([1], [A], 4) == {A: 1}
    assert index.lookup([7, 8, 9], [A], 4) == {A: 1}  # 9 and 8 went instead


def test_room_is_kept_for_every_prefill_in_flight_until_given_back_once():
    """Concurrent prefills store their blocks beside each other: the second request's room is
    taken beside the first's, not out of it, and the picture stays that much smaller until each
    is learned or ends; giving a room back twice (learned, then ended) frees it once."""
    index = LocalIndex(ttl_s=60, capacity_blocks=6, learn_share=1.0)
    index.learn([1, 2, 3, 4, 5, 6], A, 0)
    first = index.make_room(A, [], 2, 0.0)
    second = index.make_room(A, [], 2, 0.0)
    assert index.entries_by_backend()[A] == 2  # 6 - 2 - 2 (before: 4, the second found the first's room free)
    first.give_back()
    index.learn([11, 12], A, 1)  # the first was served: its blocks fill its room, not the second's
    assert index.entries_by_backend()[A] == 4
    first.give_back()
    index.learn([13, 14, 15], A, 2)  # a learn past the limit still leaves the second's room
    assert index.entries_by_backend()[A] == 4
    second.give_back()  # ended unserved
    index.learn([16, 17], A, 3)
    assert index.entries_by_backend()[A] == 6
    gone = index.make_room(B, [], 3, 0.0)  # nothing known there yet: the room is kept all the same
    index.learn(list(range(20, 30)), B, 4)
    assert index.entries_by_backend()[B] == 3
    index.remove_backend(B)
    gone.give_back()  # after the backend went: nothing to free, nothing negative left behind
    index.learn(list(range(20, 30)), B, 5)
    assert index.entries_by_backend()[B] == 6
    before = index.make_room(B, [], 2, 0.0)  # in flight as its picture is dropped (a cache reset) ...
    index.remove_backend(B)
    after = index.make_room(B, [], 3, 0.0)  # ... and one sent after it
    before.give_back()  # the first ends: the room the second takes is its own still
    index.learn(list(range(40, 50)), B, 6)
    assert index.entries_by_backend()[B] == 3
    after.give_back()


def test_a_prompt_longer_than_the_cache_makes_no_more_room_than_its_learning_keeps():
    index = LocalIndex(ttl_s=60, capacity_blocks=10, learn_share=0.5)
    index.learn(list(range(1, 6)), A, 0)
    index.learn(list(range(11, 16)), A, 1)
    room = index.make_room(A, [], 31, 0.0)
    assert index.entries_by_backend()[A] == 5  # half the picture stays while it prefills
    room.give_back()
    index.learn(list(range(100, 131)), A, 2)  # what its end teaches: the head, half the picture
    assert index.entries_by_backend()[A] == 10


def held(index: LocalIndex) -> int:
    """What the index's containers hold, measured afresh."""
    lrus = sum(blocks.nbytes() + sys.getsizeof(blocks) for blocks in index._backends.values())
    sets = sum(sys.getsizeof(h) for h in index._heads.values() if isinstance(h, set))
    held_heads = sys.getsizeof(index._held_heads) + sum(map(sys.getsizeof, index._held_heads.values()))
    return lrus + sys.getsizeof(index._heads) + sets + len(index._heads) * HEAD_KEY_BYTES + held_heads


def heads_by_backend(index: LocalIndex) -> dict[str, set[int]]:
    """The heads each backend holds, read off the first-block map."""
    out: dict[str, set[int]] = {}
    for head, holding in index._heads.items():
        for backend in (holding,) if isinstance(holding, str) else holding:
            out.setdefault(backend, set()).add(head)
    return out


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["learn", "learn", "learn", "room", "forget_before", "remove", "vacuum", "capacity"]),
            st.tuples(st.integers(0, 5), st.integers(1, 40)),
            st.sampled_from([A, B, C]),
            st.integers(0, 3),
        ),
        max_size=60,
    ),
    st.integers(8_000, 40_000),  # above three LRUs' fixed parts
)
def test_the_memory_count_covers_what_the_index_holds_through_every_change(ops, bound):
    """Whatever learns, makes room, forgets, removes, expires, trims or sheds: the index's count of
    its memory is never below a fresh measure of its containers, and stays within its bound."""
    index = LocalIndex(ttl_s=5, capacity_blocks=60, learn_share=1.0, max_bytes=bound)
    now = 0
    for op, (head, length), backend, step in ops:
        now += step
        apply(index, op, [head, *(100 * (head + 1) + i for i in range(1, length))], backend, now, step)
        assert held(index) <= index.memory_bytes()
        assert heads_by_backend(index) == {b: h for b, h in index._held_heads.items() if h}
        if op == "learn" and index.shed:
            assert index.memory_bytes() <= bound


def test_past_its_bound_the_index_drops_the_coldest_locations_fleet_wide():
    index = LocalIndex(ttl_s=1000, capacity_blocks=100, learn_share=1.0)
    for t in range(30):  # ten chains of ten blocks on each of three backends, A's oldest
        index.learn([1000 * t + i for i in range(10)], (A, B, C)[t // 10], float(t))
    full = index.memory_bytes()
    index.configure(1000, 100, {}, max_bytes=full * 2 // 3)  # room for about two backends' worth
    entries = index.entries_by_backend()
    assert index.memory_bytes() <= full * 2 // 3 and index.shed == 300 - sum(entries.values())
    assert entries[C] == 100 and entries[A] < entries[B]  # the newest kept whole, the oldest went first
    assert index.lookup([0, 1], [A], 40.0) == {A: 0}  # A's first chain went
    assert index.holders(0, 40.0) == ()  # and its head with it: no candidate points at it
    assert index.lookup([29000, 29001], [C], 40.0) == {C: 2}


def test_a_pass_goes_below_the_bound_so_the_next_learnings_need_none():
    index = LocalIndex(ttl_s=1000, capacity_blocks=10**6, learn_share=1.0, max_bytes=2**20)
    round_ = 0
    while not index.shed:
        index.learn([round_ * 100 + i for i in range(50)], (A, B)[round_ % 2], float(round_))
        round_ += 1
    shed = index.shed
    assert index.memory_bytes() <= 2**20 - min(SLACK_BYTES, 2**20 // 10)
    index.learn([10**9 + i for i in range(5)], C, float(round_))  # within the slack: nothing dropped
    assert index.shed == shed


def test_a_smaller_bound_configured_live_takes_effect_at_once():
    index = LocalIndex(ttl_s=1000, capacity_blocks=100, learn_share=1.0)
    for t in range(10):
        index.learn([100 * t + i for i in range(10)], (A, B)[t % 2], float(t))
    assert index.shed == 0
    index.configure(1000, 100, {}, max_bytes=index.memory_bytes() // 2)
    assert index.shed >= 40


def _fill(index: LocalIndex, backends: list[str], chain: int, rounds: int, heads: int | None, start: int) -> None:
    rng = random.Random(7)
    for round_ in range(start, start + rounds):
        for name in backends:
            first = rng.randrange(heads) if heads else rng.getrandbits(60)  # heads: drawn from a pool
            index.learn([first, *(rng.getrandbits(60) for _ in range(chain - 1))], name, float(round_))


@pytest.mark.parametrize(
    ("backends", "chain", "phases", "heads"),
    [
        (64, 16, 1, None),  # long chains spread evenly
        (8, 16, 1, None),
        (64, 1, 1, None),  # one-block prompts: every location heads a chain
        (64, 1, 1, 1000),  # short prompts repeated over many backends: heads held by several
        (1, 16, 3, None),  # traffic moving from backend to backend: emptied LRUs give their tables back
    ],
)
def test_the_memory_bound_holds_in_bytes(backends: int, chain: int, phases: int, heads: int | None):
    """Filled far past a 512 KiB bound, the index's memory by tracemalloc stays within it (its count
    is its containers' own measure), for long chains and one-block prompts, heads shared by
    several backends, and traffic that moves on and leaves LRUs emptied behind it."""
    bound = 2**19
    rounds = 2 * bound // (LOCATION_MOST_BYTES * chain * backends)  # twice the bound's worth of locations
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = LocalIndex(ttl_s=1e9, capacity_blocks=10**6, learn_share=1.0, max_bytes=bound)
        for phase in range(phases):
            _fill(index, [f"10.1.{phase}.{i}:8000" for i in range(backends)], chain, rounds, heads, phase * rounds)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.shed > 0
    assert 0.5 * bound < used <= bound, used
