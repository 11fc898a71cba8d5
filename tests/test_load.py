"""Load reservations: idempotent release, detached counters, no leaks under random lifecycles."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.core.load import NO_LOAD, PROGRESS_COMPACT_AT, LoadTracker, LoadVector, PeerLoads


def test_release_is_idempotent():
    loads = LoadTracker()
    r = loads.reserve("A", 10, chain=list(range(12)))
    assert loads.published() == {"A": (10, 1, 12)}  # (reserved, in flight, the whole prompt's blocks)
    r.release_prefill()
    r.release_prefill()
    assert loads.published() == {"A": (0, 1, 12)}
    r.finish()
    r.finish()
    r.release_prefill()
    assert loads.published() == {"A": (0, 0, 0)}
    assert r.finished


def test_finish_without_response_releases_prefill_too():
    loads = LoadTracker()
    loads.reserve("A", 7).finish()
    assert loads.snapshot() == {"A": (0, 0)}


def test_late_release_after_removal_does_not_touch_a_readded_backend():
    loads = LoadTracker()
    old = loads.reserve("A", 5)
    loads.remove_backend("A")
    new = loads.reserve("A", 3)
    old.finish()
    assert loads.snapshot() == {"A": (3, 1)}
    new.finish()
    assert loads.snapshot() == {"A": (0, 0)}


def test_engine_progress_drains_the_oldest_waiting_prefill_first():
    loads = LoadTracker()
    load = loads.get("A")
    first, second = loads.reserve("A", 5), loads.reserve("A", 4)
    load.await_progress(first)
    load.await_progress(second)
    done: list = []
    load.progress(3.5, done)
    assert (first.pending, second.pending) == (2, 4) and loads.snapshot() == {"A": (6, 2)} and done == []
    load.progress(2.5, done)  # the half block left over completes one more
    assert (first.pending, second.pending) == (0, 3)
    assert done == [first]  # its prefill was stored: the one completed is reported, once
    second.finish()
    assert loads.snapshot() == {"A": (0, 1)} and list(load.awaiting) == [second]
    load.progress(1, done)  # the ended one is dropped, not credited
    assert not load.awaiting and loads.snapshot() == {"A": (0, 1)} and done == [first]


def test_progress_beyond_what_waits_is_not_kept_for_later_requests():
    loads = LoadTracker()
    load = loads.get("A")
    load.progress(50, [])  # decode blocks, or another client's requests
    late = loads.reserve("A", 4)
    load.await_progress(late)
    assert late.pending == 4 and loads.snapshot() == {"A": (4, 1)}
    load.release_awaiting()
    assert late.pending == 0 and not load.awaiting and loads.snapshot() == {"A": (0, 1)}


def test_ended_requests_waiting_behind_a_live_one_are_compacted():
    loads = LoadTracker()
    load = loads.get("A")
    live = loads.reserve("A", 1)
    load.await_progress(live)
    for _ in range(5000):
        ended = loads.reserve("A", 2)
        load.await_progress(ended)
        ended.finish()
    assert len(load.awaiting) <= PROGRESS_COMPACT_AT + 3 and loads.snapshot() == {"A": (1, 1)}


R1, R2 = "replica-1", "replica-2"
PEER_BACKENDS = ["a", "b", "c"]
_entry = st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 40))
_ops = st.lists(
    st.tuples(
        st.sampled_from(["update", "merge", "wait"]),
        st.sampled_from([R1, R2]),
        st.dictionaries(st.sampled_from(PEER_BACKENDS), _entry, max_size=3),
    ),
    max_size=30,
)


@given(_ops)
def test_the_changes_handed_over_add_up_to_the_peers_sums(ops):
    """Whole vectors, deltas and replicas going quiet, in any order: the backends `changes` hands
    over, applied as they come, always give what summing every held vector gives."""
    peers = PeerLoads(max_age_s=1.0)
    held: dict[str, dict[str, LoadVector]] = {}
    seen: dict[str, float] = {}
    applied: dict[str, LoadVector] = {}
    now = 0.0
    for op, replica, vector in ops:
        if op == "wait":
            now += 0.6
        elif op == "update":
            peers.update(replica, vector, now)
            held[replica], seen[replica] = dict(vector), now
        elif peers.merge(replica, vector, now):
            held[replica].update(vector)
            seen[replica] = now
        else:
            assert replica not in held  # a delta before any whole vector is ignored
        for gone in [r for r, at in seen.items() if now - at > 1.0]:
            del held[gone], seen[gone]
        applied.update(peers.changes(now))
        expected = {b: NO_LOAD for b in PEER_BACKENDS}
        for vector in held.values():
            for backend, counts in vector.items():
                expected[backend] = tuple(e + c for e, c in zip(expected[backend], counts, strict=True))
        assert {b: applied.get(b, NO_LOAD) for b in PEER_BACKENDS} == expected
        totals = peers.totals(now)
        assert all(totals[b] == expected[b] for b in totals)
