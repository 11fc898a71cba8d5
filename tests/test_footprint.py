"""Live conversations' context per backend (footprint.py), and the rule that places a new
conversation nothing caches where that context is smallest (rules.least_footprint)."""

from __future__ import annotations

import pytest
from test_router import FLEET, A, B, make_router, ok

from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.footprint import LiveFootprint
from extproc.core.request import PromptRequest, parse_request
from extproc.core.sessions import SessionTable


def test_a_conversation_counts_where_it_is_bound_and_fades_with_time():
    footprint = LiveFootprint(half_life_s=100.0)
    footprint.added((A, 0.0, 40), 0.0)
    footprint.added((B, 0.0, 10), 0.0)
    assert footprint.of([A, B], 0.0) == {A: 40.0, B: 10.0}
    assert footprint.of([A], 100.0) == {A: 20.0}
    footprint.removed((A, 0.0, 40))  # its next turn, on B: it left A
    footprint.added((B, 100.0, 44), 100.0)
    assert footprint.of([A, B], 100.0) == pytest.approx({A: 0.0, B: 5.0 + 44.0})
    footprint.remove_backend(B)
    assert footprint.of([B], 100.0) == {B: 0.0}


def test_the_sums_stay_exact_across_days_of_epoch_moves():
    """The weights are kept from an epoch that moves forward, so no float overflows however long
    the process runs, and a binding made before a move still leaves exactly."""
    footprint = LiveFootprint(half_life_s=1.0)
    footprint.added((A, 0.0, 8), 0.0)
    for second in range(1, 86_400 * 3, 3_600):
        footprint.added((B, float(second), 1), float(second))
        footprint.removed((B, float(second), 1))
    footprint.added((A, 86_400.0 * 3, 5), 86_400.0 * 3)
    assert footprint.of([A, B], 86_400.0 * 3) == pytest.approx({A: 5.0, B: 0.0})
    footprint.removed((A, 0.0, 8))  # long faded: takes nothing worth counting
    assert footprint.of([A], 86_400.0 * 3) == pytest.approx({A: 5.0})


def test_the_session_table_tells_it_of_every_binding_made_replaced_or_dropped():
    footprint = LiveFootprint(half_life_s=1e9)
    table = SessionTable(ttl_s=10.0, capacity=2, key=b"k" * 16, footprint=footprint)
    table.bind("one", A, 0.0, 10)
    table.bind("two", A, 1.0, 20)
    table.bind("one", B, 2.0, 12)  # moved: A loses its 10
    assert footprint.of([A, B], 2.0) == pytest.approx({A: 20.0, B: 12.0})
    table.bind("three", B, 3.0, 5)  # capacity 2: "two" (least recently used) goes
    assert footprint.of([A, B], 3.0) == pytest.approx({A: 0.0, B: 17.0})
    table.forget("three")
    assert footprint.of([B], 3.0) == pytest.approx({B: 12.0})
    table.bind("four", A, 20.0, 3)  # "one" expired (TTL 10 s)
    assert footprint.of([A, B], 20.0) == pytest.approx({A: 3.0, B: 0.0})
    table.remove_backend(A)
    assert footprint.of([A], 20.0) == pytest.approx({A: 0.0})


def new_conversation(index: int, session: bool = True) -> PromptRequest:
    """A conversation's first turn sharing nothing with any other (its own system prompt)."""
    body = {"model": "m", "messages": [{"role": "system", "content": f"agent {index} " * 800}]}
    body["messages"].append({"role": "user", "content": "go"})
    return parse_request(body, {"x-session-id": f"conversation-{index}"} if session else {})


@pytest.mark.parametrize("on", [True, False])
def test_a_new_conversation_goes_where_live_context_is_smallest_not_where_fewest_requests_run(on: bool):
    router = make_router(new_session_footprint=on)
    two = [FLEET[0], FLEET[1]]
    for index, backend in enumerate([A, A, B]):  # A holds two live conversations, B one
        exchange = router.begin(new_conversation(index), [Backend(backend)], float(index))
        router.response_started(exchange, ok(backend), float(index))
        exchange.end()
    running = router.begin(new_conversation(9, session=False), [FLEET[1]], 3.0)  # B busy with a request
    exchange = router.begin(new_conversation(3), two, 3.0)
    if on:
        assert (exchange.decision.backend, exchange.decision.label) == (B, Label.LEAST_CACHED)
    else:
        assert (exchange.decision.backend, exchange.decision.label) == (A, Label.LEAST_LOADED)
    running.end()
    exchange.end()


def test_a_cached_prefix_or_a_bound_conversation_is_not_moved_by_it():
    router = make_router(new_session_footprint=True)
    first = new_conversation(1)
    exchange = router.begin(first, [FLEET[0]], 0.0)
    router.response_started(exchange, ok(A), 0.0)
    exchange.end()
    again = router.begin(new_conversation(1), [FLEET[0], FLEET[1]], 1.0)  # its next turn: bound to A
    assert (again.decision.backend, again.decision.label) == (A, Label.SESSION_MATCH)
    again.end()
