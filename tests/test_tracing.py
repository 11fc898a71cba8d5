"""OpenTelemetry traces of routing decisions: on only when OTEL_* names an endpoint; the route span
continues the client's trace, carries the decision and every candidate's cost by term, and its own
context goes on to the backend; time held by flow control is a span of its own. Here on the real
SDK with its in-memory exporter; tests/test_tracing_jaeger.py sends them to a real collector."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from test_processor import A, B, body, request_headers, response_headers, set_headers

from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.saturation import has_room
from extproc.core.settings import Settings
from extproc.envoy.headers import DESTINATION_HEADER
from extproc.envoy.processor import Processor, Stream
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool
from extproc.runtime.tracing import RequestTracer
from extproc.runtime.tracing_wanted import wanted
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, False),  # no endpoint named: off, as by default
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}, True),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.1",
            },
            True,
        ),
        # what the SDK would read as sampling every request: off, said in the log
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "traceidration"}, False),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "10%",
            },
            False,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "5",
            },
            False,
        ),
    ],
)
def test_tracing_is_off_unless_the_environment_names_an_otlp_endpoint(environ: dict[str, str], on: bool):
    assert wanted(environ) is on


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
    yield router, pool, RequestTracer(provider), exporter
    provider.shutdown()


def finished(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


def test_the_route_span_continues_the_clients_trace_and_carries_the_decision(traced):
    router, pool, tracer, exporter = traced
    processor = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0, tracer=tracer)
    stream = Stream()
    processor.handle(request_headers(traceparent=TRACEPARENT), stream)
    mutation = processor.handle(body(), stream).request_body.response.header_mutation
    sent = set_headers(mutation)
    backend = sent[DESTINATION_HEADER]
    processor.handle(response_headers("200", "via_upstream", backend), stream)
    assert exporter.get_finished_spans() == ()  # open until the response ends
    processor.closed(stream)

    span = finished(exporter, "kvroute.route")
    context = span.get_span_context()
    assert f"{context.trace_id:032x}" == TRACE_ID  # the client's trace, continued
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    # the backend's request carries the route span as its parent, so vLLM's spans join the trace
    assert sent["traceparent"] == f"00-{TRACE_ID}-{context.span_id:016x}-01"
    attributes = span.attributes or {}
    assert attributes["kvroute.decision"] == "least_loaded" and attributes["kvroute.backend"] == backend
    assert attributes["kvroute.blocks.total"] == 5 and attributes["kvroute.cached_tokens.predicted"] == 0
    assert attributes["gen_ai.request.model"] == "m"
    assert set(attributes["kvroute.candidates.backend"]) == {A, B}  # type: ignore[arg-type]
    terms = zip(
        attributes["kvroute.candidates.prefill_cost"],  # type: ignore[arg-type]
        attributes["kvroute.candidates.load_cost"],  # type: ignore[arg-type]
        attributes["kvroute.candidates.adapter_cost"],  # type: ignore[arg-type]
        attributes["kvroute.candidates.cost"],  # type: ignore[arg-type]
        strict=True,
    )
    for prefill, load, adapter, cost in terms:  # the terms add up to each candidate's cost
        assert prefill == 5 and prefill + load + adapter == pytest.approx(cost)
    assert attributes["http.response.status_code"] == 200 and attributes["kvroute.served"] == backend


def test_a_request_without_a_trace_starts_one_and_passes_it_on(traced):
    router, pool, tracer, exporter = traced
    processor = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0, tracer=tracer)
    stream = Stream()
    processor.handle(request_headers(), stream)
    sent = set_headers(processor.handle(body(), stream).request_body.response.header_mutation)
    processor.closed(stream)
    span = finished(exporter, "kvroute.route")
    assert span.parent is None
    assert sent["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
    assert stream.headers["traceparent"] == sent["traceparent"]  # what a prefill leg forwards


def test_a_traced_reply_is_a_copy_and_leaves_the_shared_routing_reply_alone(traced):
    """Routing replies are made once per destination and shared (messages.routing): a traced
    request's trace context goes on a copy, so the next request to that backend carries none."""
    router, _, tracer, _ = traced
    pool = BackendPool([Backend(A)], router.remove_backend, unhealthy_after=2)
    sent = []
    for processor in (
        Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0, tracer=tracer),
        Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0),
    ):
        stream = Stream()
        processor.handle(request_headers(traceparent=TRACEPARENT), stream)
        sent.append(set_headers(processor.handle(body(), stream).request_body.response.header_mutation))
        processor.closed(stream)
    assert sent[0][DESTINATION_HEADER] == sent[1][DESTINATION_HEADER] == A
    assert "traceparent" in sent[0] and "traceparent" not in sent[1]


def test_requests_not_for_a_model_and_untraced_processors_make_no_span(traced):
    router, pool, tracer, exporter = traced
    processor = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0, tracer=tracer)
    stream = Stream()
    processor.handle(request_headers(path="/health", method="GET"), stream)
    processor.closed(stream)
    untraced = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0)
    other = Stream()
    untraced.handle(request_headers(traceparent=TRACEPARENT), other)
    sent = set_headers(untraced.handle(body(), other).request_body.response.header_mutation)
    untraced.closed(other)
    assert exporter.get_finished_spans() == () and "traceparent" not in sent


def test_time_held_by_flow_control_is_a_span_of_its_own_under_the_route_span(traced):
    """Every backend at its limit: the request is held until its queue TTL passes, then refused."""
    router, pool, tracer, exporter = traced
    settings = Settings(hash_key=b"k" * 16, max_backend_requests=1, queue_ttl_s=0.05)
    router.settings = settings
    taken = [router.loads.reserve(backend, 1) for backend in (A, B)]  # noqa: F841  # held while it runs

    async def held() -> None:
        room = WaitingRoom(
            lambda: settings,
            lambda backends: has_room(router.loads, [b.address for b in backends], settings, time.monotonic(), 128),
            WaitingRoomMetrics(CollectorRegistry()),
            time.monotonic,
        )
        processor = Processor(
            router, pool, Metrics(router, pool), clock=time.monotonic, waiting_room=room, tracer=tracer
        )
        running = asyncio.create_task(room.run())
        stream = Stream()

        async def messages():
            yield request_headers(traceparent=TRACEPARENT, **{"x-gateway-inference-fairness-id": "team-a"})
            yield body()

        try:
            replies = [r async for r in processor._replies(messages(), stream)]
        finally:
            running.cancel()
        assert replies[-1].immediate_response.status.code == 429
        processor.closed(stream)

    asyncio.run(held())
    queue, route = finished(exporter, "kvroute.queue"), finished(exporter, "kvroute.route")
    assert queue.parent is not None and queue.parent.span_id == route.get_span_context().span_id
    assert queue.attributes == {"kvroute.queue.outcome": "expired", "kvroute.flow": "team-a", "kvroute.priority": 0}
    assert queue.end_time is not None and queue.start_time is not None
    assert queue.end_time - queue.start_time >= 0.04e9
    assert "kvroute.decision" not in (route.attributes or {})  # refused before any decision


def test_over_ext_authz_the_route_spans_context_goes_to_the_backend_and_a_models_name_is_cut(traced):
    """kvroute's default transport answers Envoy with the headers the upstream request gets: the
    route span's `traceparent` is one of them (Envoy lets it through, bootstrap
    AUTHZ_UPSTREAM_HEADERS), so vLLM's spans join kvroute's trace there too. A client's model name
    goes into the span cut to MAX_ATTRIBUTE characters."""
    import orjson
    from test_authz import TOKEN, Clock
    from test_authz import check as authz_check

    from extproc.envoy.authz import Authz
    from extproc.envoy.bootstrap import AUTHZ_UPSTREAM_HEADERS
    from extproc.runtime.tracing import MAX_ATTRIBUTE

    router, pool, tracer, exporter = traced
    metrics = Metrics(router, pool)
    clock = Clock()
    processor = Processor(router, pool, metrics, clock=clock, tracer=tracer)
    authz = Authz(processor, metrics, TOKEN, clock, max_age_s=60.0)
    model = "m" * 10_000
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    status, headers, _ = authz_check(authz, body, {"traceparent": TRACEPARENT})
    assert status == 200 and "traceparent" in AUTHZ_UPSTREAM_HEADERS
    assert headers["traceparent"].split("-")[1] == TRACE_ID and headers["traceparent"] != TRACEPARENT
    authz.close_all()
    span = finished(exporter, "kvroute.route")
    assert span.attributes is not None and span.attributes["gen_ai.request.model"] == model[:MAX_ATTRIBUTE]


def test_a_large_fleets_route_span_lists_the_cheapest_candidates_and_the_chosen_one():
    """Every one of 1,000 candidates made a route span of 82 KB, and a batch of 512 spans past the
    4 MiB a collector takes by default: the span lists the 15 cheapest and the chosen one."""
    from extproc.core.decision import CandidateCost, Decision, Label
    from extproc.runtime.tracing import MAX_SPAN_CANDIDATES

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider)
    costs = [
        CandidateCost(f"10.0.{i // 250}.{i % 250}:8000", 0, 5, 0, 0, 0.0, 0.0, cost=float(1_000 - i))
        for i in range(1_000)
    ]
    chosen = costs[3].backend  # (by a rule other than the cheapest: a session's backend)
    decision = Decision(Label.SESSION_MATCH, chosen, costs[-1].backend, 0, 5, False, costs)
    span = tracer.start({})
    tracer.decided(span, decision, 16.0, "m")
    span.end()
    attributes = finished(exporter, "kvroute.route").attributes or {}
    listed = list(attributes["kvroute.candidates.backend"])  # type: ignore[arg-type]
    assert len(listed) == MAX_SPAN_CANDIDATES and attributes["kvroute.candidates.count"] == 1_000
    assert listed == [chosen] + [c.backend for c in costs[-15:]]  # the cheapest 15 and the chosen, in pool order
    assert len(attributes["kvroute.candidates.cost"]) == MAX_SPAN_CANDIDATES  # type: ignore[arg-type]
    provider.shutdown()
