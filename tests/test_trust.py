"""Trust in the approximate picture, learned from the engines' own prefix-cache counters: a
backend whose engine keeps finding less than kvroute predicted stops pulling requests by prefix."""

from __future__ import annotations

import pytest

from extproc.core.engine import EngineSample
from extproc.core.trust import AGREEMENT, EVIDENCE, MIN_TOKENS, PredictionTrust
from tests.test_router import FLEET, chat, make_router, ok

A = FLEET[0].address


def sample(queries: float, hits: float, start: float = 1.0) -> EngineSample:
    return EngineSample(0, 0, 0.0, start, None, None, None, queries, hits)


def windows(trust: PredictionTrust, predicted: float, found: float, count: int = EVIDENCE) -> None:
    """`count` windows in which kvroute predicted `predicted` tokens cached and the engine found `found`."""
    queries, hits = trust._counters.get(A, (0.0, 0.0))
    for _ in range(count):
        trust.routed(A, predicted)
        queries, hits = queries + MIN_TOKENS, hits + found
        trust.engine(A, queries, hits)


def test_trust_is_what_the_engine_found_over_what_kvroute_predicted():
    trust = PredictionTrust()
    trust.engine(A, 0, 0)  # the first sample only sets the counters' origin
    trust.engine(A, MIN_TOKENS / 2, 0)  # too few tokens looked up for a window: none closes
    assert not trust._sums
    windows(trust, 20_000, 10_000, EVIDENCE - 1)
    assert trust.of(A) == 1.0  # not enough evidence yet
    windows(trust, 20_000, 10_000, 1)
    assert trust.of(A) == pytest.approx(0.5, abs=0.02)
    assert trust.apply({A: 10, "other": 10}) == {A: 5, "other": 10}


def test_near_agreement_or_more_hits_than_predicted_keep_full_trust():
    """Windows do not line up exactly; other clients' hits only add to the engine's count."""
    for found in (AGREEMENT * 20_000 + 100, 20_000, 40_000):
        trust = PredictionTrust()
        trust.engine(A, 0, 0)
        windows(trust, 20_000, found, 2 * EVIDENCE)
        assert trust.of(A) == 1.0 and not trust.values
    trust = PredictionTrust()
    trust.engine(A, 0, 0)
    windows(trust, 1_000, 0, 2 * EVIDENCE)  # predicting almost nothing of what was looked up: no ratio
    assert trust.of(A) == 1.0


def test_counters_that_go_back_are_a_new_origin_not_a_window():
    trust = PredictionTrust()
    trust.engine(A, 0, 0)
    windows(trust, 20_000, 0)
    assert trust.of(A) == 0.0
    trust.engine(A, 10, 0)  # a new engine process: counting from 10 again
    assert trust.of(A) == 0.0
    trust.forget(A)  # what the router does when the engine restarted or its cache was cleared
    assert trust.of(A) == 1.0


def test_a_restarted_engine_is_trusted_again():
    router = make_router()
    router.engine_sample(A, sample(0, 0, start=1.0), 0)
    for window in range(1, EVIDENCE + 1):
        router.trust.routed(A, 20_000)
        router.engine_sample(A, sample(window * MIN_TOKENS, 0, start=1.0), window)
    assert router.trust.of(A) == 0.0
    router.engine_sample(A, sample(0, 0, start=2.0), 9)  # a new process start time: reset
    assert router.trust.of(A) == 1.0


def test_a_contradicted_picture_stops_pulling_by_prefix_and_stops_being_predicted():
    """The second session shares the first one's long system prompt, cached on its backend by
    kvroute's picture. While the engine confirms it, the second follows the first; once the
    engine's counters say it finds nothing there, the prefix no longer pulls and the prediction
    header no longer claims it."""

    def second_session(router, now):
        exchange = router.begin(chat([], "s2", "another question"), FLEET, now)
        headers = dict(router.response_started(exchange, ok(exchange.decision.backend), now).headers)
        exchange.end()
        return exchange.decision, headers

    trusting = make_router(decision_headers=True)
    first = trusting.begin(chat([], "s1", "first question"), FLEET, 0)
    trusting.response_started(first, ok(first.decision.backend), 0)
    first.end()
    decision, headers = second_session(trusting, 1)
    assert decision.backend == first.decision.backend and int(headers["x-kvroute-cached-tokens"]) > 0

    doubting = make_router(decision_headers=True)
    held = first.decision.backend
    doubting.engine_sample(held, sample(0, 0), 0)
    first = doubting.begin(chat([], "s1", "first question"), FLEET, 0)
    doubting.response_started(first, ok(held), 0)
    first.end()
    for window in range(1, EVIDENCE + 1):  # kvroute keeps predicting hits there; the engine finds none
        for turn in range(3):  # requests that share the system prompt, never answered (nothing learned)
            doubting.begin(chat([], f"p{window}-{turn}", "a prompt sharing the system prompt"), FLEET, 1).end()
        doubting.engine_sample(held, sample(window * MIN_TOKENS, 0), 1)
    assert doubting.trust.of(held) == 0.0 and doubting.state().prediction_trust == {held: 0.0}
    decision, headers = second_session(doubting, 2)
    assert doubting.index.entries_by_backend()[held] > 0  # the picture still holds the prefix there
    assert next(c for c in decision.candidates if c.backend == held).matched == 0  # but it is not weighed
    assert decision.matched_blocks == 0 and headers["x-kvroute-cached-tokens"] == "0"
    assert decision.backend != held and decision.label.value == "least_loaded"


def test_operators_can_turn_the_correction_off():
    for enabled in (True, False):
        router = make_router(prediction_trust=enabled)
        first = router.begin(chat([], "s1", "first question"), FLEET, 0)
        held = first.decision.backend
        router.response_started(first, ok(held), 0)
        first.end()
        router.trust.values[held] = 0.0
        decision = router.query(chat([], "s2", "another question"), FLEET, 1)
        assert (decision.backend == held) is not enabled
