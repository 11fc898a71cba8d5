"""Saturation (extproc/core/saturation.py): when a backend should take nothing more."""

from __future__ import annotations

from extproc.core.load import ENGINE_SAMPLE_MAX_AGE_S, LoadTracker
from extproc.core.saturation import has_room, saturated
from extproc.core.settings import Settings

SETTINGS = Settings(hash_key=bytes(16), saturation_waiting=2, saturation_kv_usage=0.8)


def test_requests_sent_since_the_engine_last_reported_count_as_waiting_at_once():
    loads = LoadTracker()
    load = loads.get("a")
    load.report(running=4, waiting=0, kv_usage=0.1, now=10)
    reservations = [loads.reserve("a", 1) for _ in range(5)]  # four run, one more waits
    assert load.waiting(10.1) == 1 and not saturated(load, SETTINGS, 10.1)
    reservations.append(loads.reserve("a", 1))
    assert saturated(load, SETTINGS, 10.1)
    reservations[0].finish()
    assert not saturated(load, SETTINGS, 10.1)


def test_the_engines_own_waiting_queue_and_kv_usage_saturate():
    loads = LoadTracker()
    load = loads.get("a")
    load.report(running=3, waiting=2, kv_usage=0.1, now=10)  # someone else's requests wait there
    assert saturated(load, SETTINGS, 10)
    load.report(running=3, waiting=0, kv_usage=0.85, now=11)
    assert saturated(load, SETTINGS, 11)


def test_a_stale_sample_says_nothing_and_only_the_request_limit_holds():
    loads = LoadTracker()
    load = loads.get("a")
    load.report(running=3, waiting=9, kv_usage=0.99, now=10)
    later = 10 + ENGINE_SAMPLE_MAX_AGE_S + 1
    assert load.waiting(later) is None and not saturated(load, SETTINGS, later)
    limited = Settings(hash_key=bytes(16), max_backend_requests=1)
    held = loads.reserve("a", 1)
    assert saturated(load, limited, later)
    held.finish()
    assert not saturated(load, limited, later)


def test_room_while_any_candidate_has_it():
    loads = LoadTracker()
    loads.get("a").report(running=1, waiting=5, kv_usage=0.1, now=10)
    loads.get("b").report(running=1, waiting=0, kv_usage=0.1, now=10)
    assert has_room(loads, ["a", "b"], SETTINGS, 10)
    assert not has_room(loads, ["a"], SETTINGS, 10)
    assert not has_room(loads, [], SETTINGS, 10)


def test_a_prefill_backlog_saturates_when_set_and_drains_as_the_engine_stores_it():
    loads = LoadTracker()
    load = loads.get("a")
    gated = Settings(hash_key=bytes(16), saturation_prefill_tokens=1000)
    first = loads.reserve("a", 4)  # 4 blocks of 128 tokens still to prefill: 512
    assert not saturated(load, gated, 0, block_tokens=128)
    second = loads.reserve("a", 4)
    assert saturated(load, gated, 0, block_tokens=128)  # 1,024 tokens queued
    assert not saturated(load, SETTINGS, 0, block_tokens=128)  # off by default
    load.peer_reserved = 0
    first.drain(4)  # the engine stored its blocks: decoding does not count
    assert not saturated(load, gated, 0, block_tokens=128)
    load.peer_reserved = 4  # another replica's backlog here counts the same
    assert saturated(load, gated, 0, block_tokens=128)
    second.finish()
