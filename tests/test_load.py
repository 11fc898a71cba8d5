"""Load reservations: idempotent release, detached counters, no leaks under random lifecycles."""

from __future__ import annotations

from extproc.core.load import LoadTracker


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
