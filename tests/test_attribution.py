"""Prefix reuse attribution: available (the best candidate's cached prefix), routed (the serving
backend's), delivered (the engines' own prefix-cache counters), through the router's lifecycle and
out as Prometheus counters and /debug/state."""

from __future__ import annotations

from prometheus_client import generate_latest
from test_router import FLEET, A, B, chat, make_router, ok, serve

from extproc.core.engine import EngineSample
from extproc.core.exchange import ResponseStart
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool


def sample(hits: float) -> EngineSample:
    return EngineSample(0, 0, 0.0, 100.0, 131072, 128, cache_queries=hits * 2, cache_hits=hits)


def test_a_request_sent_where_its_prefix_is_routes_all_that_was_available():
    router = make_router()
    first = serve(router, chat([], session="s"), 0.0)
    again = serve(router, chat([], session="t"), 1.0)  # the same prompt, another conversation
    assert again.backend == first.backend and again.matched_blocks > 0
    reuse = router.attribution
    tokens = router.block_tokens()
    assert reuse.available == reuse.routed[first.backend] == again.matched_blocks * tokens
    assert reuse.prompt == (first.total_blocks + again.total_blocks) * tokens
    assert router.state().reuse["routing_efficiency"] == 1.0


def test_a_request_served_away_from_its_prefix_counts_what_routing_gave_up():
    router = make_router()
    first = serve(router, chat([], session="s"), 0.0)
    elsewhere = next(b for b in FLEET if b.address != first.backend)
    exchange = router.begin(chat([], session="t"), [elsewhere, *[b for b in FLEET if b is not elsewhere]], 1.0)
    best = max(c.matched for c in exchange.decision.candidates)
    router.response_started(exchange, ok(elsewhere.address), 1.0)  # Envoy retried it there
    exchange.end()
    reuse = router.attribution
    assert reuse.available == best * router.block_tokens() > 0
    assert reuse.routed.get(elsewhere.address, 0) == 0  # nothing of it was cached where it ran
    assert router.state().reuse["routing_efficiency"] == 0.0


def test_errors_teach_no_reuse_and_delivered_follows_the_engines_counters_through_a_restart():
    router = make_router()
    exchange = router.begin(chat([]), FLEET, 0.0)
    assert exchange.decision.backend is not None
    router.response_started(exchange, ResponseStart(exchange.decision.backend, True, 503, True), 0.0)
    exchange.end()
    assert router.attribution.prompt == 0 and router.state().reuse["routing_efficiency"] is None
    for hits in (1000.0, 1600.0, 200.0, 500.0):  # the third sample after a restart: counting starts over
        router.engine_sample(A, sample(hits), 0.0)
    router.engine_sample(B, sample(50.0), 0.0)  # a first sample is a baseline, not reuse
    assert router.attribution.delivered == {A: 600.0 + 300.0}


def test_the_sums_are_counters_with_one_series_per_backend():
    router = make_router()
    decision = serve(router, chat([], session="s"), 0.0)
    serve(router, chat([], session="t"), 1.0)
    router.engine_sample(A, sample(100.0), 0.0)
    router.engine_sample(A, sample(300.0), 1.0)
    page = generate_latest(Metrics(router, BackendPool(FLEET, router.remove_backend, 2)).registry).decode()
    routed = router.attribution.routed[decision.backend]  # type: ignore[index]
    assert f'kvroute_reuse_routed_tokens_total{{backend="{decision.backend}"}} {routed}' in page
    assert f'kvroute_reuse_delivered_tokens_total{{backend="{A}"}} 200.0' in page
    assert f"kvroute_reuse_available_tokens_total {router.attribution.available}" in page
    assert f"kvroute_prompt_tokens_total {router.attribution.prompt}" in page


def test_the_engines_own_count_per_response_is_set_beside_the_picture_once():
    router = make_router()
    serve(router, chat([], session="s"), 0.0)
    exchange = router.begin(chat([], session="t"), FLEET, 1.0)
    backend = exchange.decision.backend
    assert backend is not None
    router.engine_reported(exchange, 99)  # before the response started: nothing is known of it yet
    assert router.attribution.reported == {}
    router.response_started(exchange, ok(backend), 1.0)
    predicted = exchange.decision.matched_blocks * router.block_tokens()
    router.engine_reported(exchange, 1000)
    router.engine_reported(exchange, 1000)  # once
    exchange.end()
    assert router.attribution.reported == {backend: 1000.0}
    assert router.attribution.reported_routed == {backend: predicted}
    assert router.state().reuse["reported_accuracy"] == round(1000 / predicted, 4)
    page = generate_latest(Metrics(router, BackendPool(FLEET, router.remove_backend, 2)).registry).decode()
    assert f'kvroute_reuse_reported_tokens_total{{backend="{backend}"}} 1000.0' in page
