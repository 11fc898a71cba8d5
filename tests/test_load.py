"""Load reservations: idempotent release, detached counters, no leaks under random lifecycles."""

from __future__ import annotations

from extproc.core.load import PROGRESS_COMPACT_AT, LoadTracker


def test_release_is_idempotent():
    loads = LoadTracker()
    r = loads.reserve("A", 10)
    assert loads.snapshot() == {"A": (10, 1)}
    r.release_prefill()
    r.release_prefill()
    assert loads.snapshot() == {"A": (0, 1)}
    r.finish()
    r.finish()
    r.release_prefill()
    assert loads.snapshot() == {"A": (0, 0)}
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
