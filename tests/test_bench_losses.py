"""bench/experiments/losses.py: where a router's reuse was lost, read from per-request records."""

from __future__ import annotations

from typing import Any

from bench.experiments.losses import against, summary, turns
from bench.workloads.trace import TraceRequest


def request(index: int, session: str, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index, float(index), len(ids) * 512, 8, ids, session)


def record(index: int, backend: str, cached: int, sent_at: float, decision: str = "session_match") -> dict[str, Any]:
    return {
        "index": index,
        "status": 200,
        "backend": backend,
        "sent_at": sent_at,
        "e2e_ms": 500.0,
        "prompt_tokens": 1024,
        "cached_tokens": cached,
        "decision": decision,
    }


REQUESTS = [
    request(0, "a", (1, 2)),
    request(1, "b", (7, 8)),
    request(2, "a", (1, 2)),  # returns to its backend, finds its prompt evicted
    request(3, "b", (7, 8)),  # moved to the other backend
    request(4, "a", (1, 2)),  # returns, finds it cached
]


def run(cached: tuple[int, ...]) -> list[Any]:
    backends = ("x", "y", "x", "x", "x")
    labels = ("least_loaded", "least_loaded", "session_match", "load_override", "session_match")
    return turns(REQUESTS, [record(i, backends[i], cached[i], float(i), labels[i]) for i in range(5)])


def test_returning_turns_that_found_their_context_evicted_are_told_apart_from_moves():
    figures = summary(run((0, 0, 0, 0, 1000)))
    assert figures["followups"] == 3
    assert figures["returning"] == 2  # requests 2 and 4; request 3 moved
    assert figures["returning_evicted"] == 1
    assert figures["returning_lost_tokens"] == 1024 + 24  # request 2 all of it, request 4 the rest
    assert figures["evicted_by_first_placement"] == {"least_loaded": 1}
    assert figures["evicted_by_backend"] == {"x": 1}
    assert figures["moved"] == 1
    assert figures["moved_lost_tokens"] == 1024


def test_live_sessions_per_backend_count_only_sessions_with_turns_to_come():
    requests = [request(0, "a", (1,)), request(1, "b", (2,)), request(2, "b", (2,)), request(3, "a", (1,))]
    records = [record(0, "x", 0, 0.0), record(1, "x", 0, 1.0), record(2, "y", 0, 2.0), record(3, "x", 0, 3.0)]
    live = summary(turns(requests, records))["by_backend"]
    # After each send: a on x; a and b on x; a on x (b's last turn); none.
    assert live["x"]["live_max"] == 2
    assert live["x"]["footprint_max_tokens"] == 2048
    assert live["y"]["live_max"] == 0
    assert live["imbalance"]["live_mean_abs_difference"] == 1.0


def test_side_by_side_counts_wins_and_losses_by_the_routers_label():
    ours, theirs = run((0, 0, 0, 0, 1000)), run((0, 0, 1000, 1000, 0))
    result = against(ours, theirs)
    assert result["worse_by_label"] == {"session_match": 1, "load_override": 1}
    assert result["better_by_label"] == {"session_match": 1}
