"""Time to first token: the per-backend model, its evidence from the engine's events, and SLO admission."""

from __future__ import annotations

import math
import random

import pytest

from bench.workload import text
from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.engine import BlockStored
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.core.ttft import EVIDENCE, TTFTModel
from tests.test_router import ok

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
FLEET = [Backend(A), Backend(B)]


def test_the_fit_recovers_a_fixed_cost_and_a_rate_and_waits_for_evidence():
    model = TTFTModel()
    for i in range(EVIDENCE - 1):
        model.observe(A, 10 * i, 1, 0.05 + 0.002 * 10 * i, None)
    assert model.predict(A, 100, 1) is None  # not enough evidence yet: admission lets requests through
    model.observe(A, 70, 1, 0.05 + 0.002 * 70, None)
    assert model.predict(A, 100, 1) == pytest.approx(0.05 + 0.2)
    assert model.predict(B, 100, 1) is None  # another backend has its own evidence


def test_requests_sharing_the_engines_steps_are_a_cost_of_their_own():
    model = TTFTModel()
    for i in range(30):  # work and company vary apart: both are told
        work, company = 5 + i % 7, (i * 3) % 11
        model.observe(A, work, company, 0.1 + 0.02 * work + 0.05 * company, None)
    assert model.predict(A, 10, 0) == pytest.approx(0.3)
    assert model.predict(A, 10, 12) == pytest.approx(0.9)


def test_a_backend_that_slows_down_is_followed_within_a_few_dozen_requests():
    model = TTFTModel()
    for i in range(40):
        model.observe(A, 10 + i % 20, 0, 0.001 * (10 + i % 20), None)
    assert model.predict(A, 20, 0) == pytest.approx(0.02, rel=0.01)
    for i in range(60):  # now four times slower per block
        model.observe(A, 10 + i % 20, 0, 0.004 * (10 + i % 20), None)
    assert model.predict(A, 20, 0) == pytest.approx(0.08, rel=0.1)


def test_the_same_work_every_time_gives_a_rate_and_nonsense_is_ignored():
    model = TTFTModel()
    for _ in range(EVIDENCE):
        model.observe(A, 50, 2, 0.5, None)
    model.observe(A, 50, 2, -1.0, None)  # a clock step
    model.observe(A, 50, 2, math.inf, None)
    model.observe(A, -3, 2, 0.5, None)
    assert model.predict(A, 100, 2) == pytest.approx(1.0)
    assert model.observed == EVIDENCE


def test_predictions_made_are_scored_against_what_happened():
    model = TTFTModel()
    model.observe(A, 10, 0, 0.3, predicted=0.2)
    model.observe(A, 10, 0, 0.3, predicted=None)
    assert (model.observed, model.predicted) == (2, 1) and model.error_seconds == pytest.approx(0.1)


def prompt(i: int, objective_s: float | None = None, sheddable: bool = False) -> PromptRequest:
    content = f"{i} " + text(random.Random(i), 4000)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
    request = parse_request(body, {})
    request.ttft_objective_s, request.sheddable = objective_s, sheddable
    return request


def stored(router: Router, blocks: int) -> BlockStored:
    """An engine event storing about `blocks` of the router's blocks."""
    tokens = math.ceil(blocks * router.block_tokens() / 16) * 16
    return BlockStored(tuple(range(tokens // 16)), None, (1,) * tokens, 16, ())


def teach(router: Router, backend: str, seconds_per_block: float, count: int = EVIDENCE) -> None:
    """`count` streamed requests on `backend` whose prefill the engine's events show stored, one at
    a time, after `seconds_per_block` per block of their work."""
    now = 0.0
    router.engine_events(backend, [stored(router, 1)], now=now)  # the engine reports progress: followed
    for i in range(count):
        exchange = router.begin(prompt(1000 * (backend == B) + i), [Backend(backend)], now)
        reservation = exchange.reservation
        assert reservation is not None and reservation.pending > 0
        router.response_started(exchange, ok(backend), now)
        now += seconds_per_block * reservation.work
        router.engine_events(backend, [stored(router, reservation.pending)], now=now)
        assert reservation.pending == 0
        exchange.end()


def test_the_engines_events_teach_the_model_and_responses_report_its_prediction():
    router = Router(Settings(hash_key=b"test-key-16bytes", decision_headers=True))
    teach(router, A, 0.01)
    assert router.ttft.observed == EVIDENCE
    exchange = router.begin(prompt(99), [Backend(A)], 100.0)
    reservation = exchange.reservation
    assert reservation is not None and reservation.predicted_s == pytest.approx(0.01 * reservation.work, rel=1e-6)
    outcome = router.response_started(exchange, ok(A), 100.0)
    assert ("x-kvroute-ttft-ms", str(round(reservation.predicted_s * 1000))) in outcome.headers
    exchange.end()


def slow_and_fast() -> Router:
    """A router whose A takes ten times as long per block of prefill as B."""
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    teach(router, A, 0.05)
    teach(router, B, 0.005)
    return router


def test_a_request_goes_only_where_its_first_token_is_predicted_in_time():
    router = slow_and_fast()
    work = router.begin(prompt(7), FLEET, 200.0).reservation
    assert work is not None
    blocks = work.blocks
    work.finish()
    # Held blocks ahead on B make it the dearer by load, but only B is predicted in time.
    ahead = router.loads.reserve(B, 2 * blocks)
    objective = 0.005 * 4 * blocks
    decision = router.begin(prompt(8, objective), FLEET, 200.0).decision
    assert decision.backend == B
    ahead.finish()


def test_a_sheddable_request_no_backend_can_serve_in_time_is_refused():
    router = slow_and_fast()
    exchange = router.begin(prompt(9, objective_s=0.001, sheddable=True), FLEET, 300.0)
    assert exchange.decision.label is Label.SHED_SLO and exchange.decision.backend is None
    assert exchange.reservation is None and router.stats.decisions[Label.SHED_SLO] == 1


def test_any_other_request_goes_where_its_first_token_is_predicted_soonest():
    router = slow_and_fast()
    decision = router.begin(prompt(10, objective_s=0.001), FLEET, 300.0).decision
    assert decision.backend == B and decision.label is not Label.SHED_SLO


def test_without_evidence_a_request_with_an_objective_is_routed_as_any_other():
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    decision = router.begin(prompt(11, objective_s=0.001, sheddable=True), FLEET, 0.0).decision
    assert decision.backend is not None


def test_slo_admission_off_routes_requests_with_objectives_as_any_other():
    router = slow_and_fast()
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", slo_admission=False))
    decision = router.begin(prompt(12, objective_s=0.001, sheddable=True), FLEET, 300.0).decision
    assert decision.backend is not None and decision.label is not Label.SHED_SLO


def test_predictions_are_scaled_to_the_engines_own_time_to_first_token():
    model = TTFTModel()
    model.engine(A, 0.0, 0)
    for _ in range(EVIDENCE):
        model.observe(A, 10, 0, 0.5, None)  # kvroute sees each prefill stored after 0.5 s
    assert model.predict(A, 10, 0) == pytest.approx(0.5)
    model.engine(A, 2 * EVIDENCE * 1.0, 2 * EVIDENCE)  # the engine counted 1.0 s for each first token
    assert model.scale(A) == pytest.approx(2.0)
    assert model.predict(A, 10, 0) == pytest.approx(1.0)
    model.engine(A, 0.0, 0)  # a restart: the counters start again, the scale is kept until a window closes
    assert model.scale(A) == pytest.approx(2.0)
    for _ in range(3):
        model.observe(A, 10, 0, 0.5, None)
    model.engine(A, 100.0, 3)  # too few of either: no window yet
    assert model.scale(A) == pytest.approx(2.0)
