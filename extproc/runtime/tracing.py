"""OpenTelemetry traces of routing decisions, exported over OTLP/gRPC; off unless the standard
`OTEL_*` environment names an endpoint.

One span per LLM request, `kvroute.route`, from its headers to the end of its response: the
candidates with their cost terms, the decision label, the chosen and second backend, the blocks
matched and the tokens predicted cached, then the response status and the backend that served it.
Time held by flow control is a child span of its own, `kvroute.queue`. The client's W3C
`traceparent` is continued, and the route span's is passed on to the backend (and the prefill leg
of a split request), so vLLM's own spans (`--otlp-traces-endpoint`) join the same trace. Sampling,
service name and exporter settings are the SDK's own variables (`OTEL_TRACES_SAMPLER`,
`OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_*`). No prompt text is ever put in a span.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from operator import attrgetter

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.core.decision import Decision
from extproc.runtime.tracing_wanted import TRACE_HEADERS

PROPAGATED = TRACE_HEADERS
MAX_ATTRIBUTE = 256  # characters of a client-chosen string kept in a span
# Candidates a route span lists: every one of 1,000 made a span of 82 KB, and a batch of 512
# past the 4 MiB a collector takes by default
MAX_SPAN_CANDIDATES = 16
_COST = attrgetter("cost")
_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    """Spans for the processor's requests. Every call is cheap and never raises into a request:
    the SDK's batch processor exports from a thread of its own, dropping spans when its queue is
    full rather than holding the event loop."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("kvroute")

    @classmethod
    def from_environment(cls) -> RequestTracer:
        """The SDK configured from `OTEL_*` (endpoint, headers, sampler, resource), exporting in batches."""
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "kvroute"}))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def start(self, headers: Mapping[str, str]) -> Span:
        """The route span of a request, continuing the client's trace if it sent one."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        return self._tracer.start_span("kvroute.route", context=parent)

    def queued(self, span: Span, start_ns: int, outcome: str, flow: str, priority: int) -> None:
        """Flow control held the request from `start_ns` until now; `outcome`: dispatched, or why not."""
        held = self._tracer.start_span("kvroute.queue", context=set_span_in_context(span), start_time=start_ns)
        held.set_attributes({"kvroute.queue.outcome": outcome, "kvroute.flow": flow, "kvroute.priority": priority})
        held.end()

    @staticmethod
    def decided(span: Span, decision: Decision, block_tokens: float, model: str | None) -> None:
        """The decision: why, where, what it predicted, and each candidate's cost by term (of
        the MAX_SPAN_CANDIDATES cheapest and the chosen one, in the pool's order)."""
        candidates = decision.candidates
        if len(candidates) > MAX_SPAN_CANDIDATES:
            listed = {id(c) for c in heapq.nsmallest(MAX_SPAN_CANDIDATES - 1, candidates, key=_COST)}
            candidates = [c for c in candidates if id(c) in listed or c.backend == decision.backend]
        attributes: dict[str, str | bool | int | float | list[str] | list[int] | list[float]] = {
            "kvroute.decision": decision.label.value,
            "kvroute.candidates.count": len(decision.candidates),
            "kvroute.blocks.matched": decision.matched_blocks,
            "kvroute.blocks.total": decision.total_blocks,
            "kvroute.cached_tokens.predicted": round(decision.matched_blocks * block_tokens),
            "kvroute.bootstrap": decision.bootstrap,
            "kvroute.candidates.backend": [c.backend for c in candidates],
            "kvroute.candidates.cost": [c.cost for c in candidates],
            "kvroute.candidates.prefill_cost": [c.prefill_cost for c in candidates],
            "kvroute.candidates.load_cost": [c.load_cost for c in candidates],
            "kvroute.candidates.adapter_cost": [c.adapter_cost for c in candidates],
            "kvroute.candidates.kv_room_cost": [c.kv_room_cost for c in candidates],
            "kvroute.candidates.matched_blocks": [c.matched for c in candidates],
            "kvroute.candidates.active": [c.active for c in candidates],
        }
        if decision.backend is not None:
            attributes["kvroute.backend"] = decision.backend
        if decision.second is not None:
            attributes["kvroute.second"] = decision.second
        if model is not None:  # (the client's string: a 4 MB one would stay in the export queue)
            attributes["gen_ai.request.model"] = model[:MAX_ATTRIBUTE]
        span.set_attributes(attributes)

    @staticmethod
    def context_headers(span: Span) -> dict[str, str]:
        """The route span's `traceparent` (and `tracestate`) for the requests kvroute sends on."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return carrier

    @staticmethod
    def responded(span: Span, status: int, served: str) -> None:
        span.set_attributes({"http.response.status_code": status, "kvroute.served": served})

    @staticmethod
    def reported(span: Span, cached_tokens: int) -> None:
        """The engine's own count of the prompt tokens it found cached (its response's usage)."""
        span.set_attribute("kvroute.cached_tokens.engine", cached_tokens)

    @staticmethod
    def end(span: Span) -> None:
        span.end()

    def shutdown(self) -> None:
        """Export what is queued, then stop (at most the SDK's export timeout)."""
        self._provider.shutdown()
