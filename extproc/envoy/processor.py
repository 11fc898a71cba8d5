"""The Envoy external processor: one gRPC stream per HTTP request.

request headers -> (LLM path?) -> buffered body -> routing core decision -> destination header;
response headers -> learn (2xx from the upstream) and release the prefill reservation, add the
decision headers; stream end (completion, error, client abort, Envoy timeout) -> release the
rest, exactly once, from the gRPC done callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from extproc.core.decision import Decision
from extproc.core.errors import InvalidRequest
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

log = logging.getLogger(__name__)

LLM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Replies without per-request content are built once.
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_STRIP_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[DESTINATION_HEADER]))
    )
)
_PASS_THROUGH = pb.ProcessingMode(request_body_mode=pb.ProcessingMode.NONE, response_header_mode=pb.ProcessingMode.SKIP)
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_OTHER_REPLIES = {
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def _header(key: str, value: str) -> pb.HeaderValueOption:
    """Envoy reads raw_value; a mutation that sets only `value` produces an empty header."""
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key: h.raw_value.decode("latin-1") for h in message.headers.headers}


def _attribute(message: pb.ProcessingRequest, name: str) -> str | None:
    for struct in message.attributes.values():
        value = struct.fields.get(name)
        if value is not None:
            return value.string_value
    return None


class Exchange:
    """One HTTP request's routing state across its stream."""

    __slots__ = ("decision", "headers", "request", "routed")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.request: PromptRequest | None = None
        self.decision: Decision | None = None
        self.routed = False

    def close(self, _context: Any = None) -> None:
        """The stream ended, however it ended: release whatever the request still holds."""
        if self.decision is not None and self.decision.reservation is not None:
            self.decision.reservation.finish()


class Processor(pb_grpc.ExternalProcessorServicer):
    """Serves envoy.service.ext_proc.v3.ExternalProcessor/Process."""

    def __init__(
        self, router: Router, pool: BackendPool, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._clock = clock

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange()
        context.add_done_callback(exchange.close)
        async for message in request_iterator:
            yield self.handle(message, exchange)

    def handle(self, message: pb.ProcessingRequest, exchange: Exchange) -> pb.ProcessingResponse:
        """One reply per message; a failure here never stops the request, it only skips routing."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._on_request_headers(message.request_headers, exchange)
            if kind == "request_body":
                return self._on_request_body(message.request_body, exchange)
            if kind == "response_headers":
                return self._on_response_headers(message, exchange)
        except Exception:
            log.exception("ext_proc failed on %s; the request continues unrouted", kind)
            self._metrics.errors.labels("internal").inc()
        return _OTHER_REPLIES.get(kind, _CONTINUE_BODY if kind == "request_body" else _CONTINUE_HEADERS)

    def _on_request_headers(self, message: pb.HttpHeaders, exchange: Exchange) -> pb.ProcessingResponse:
        headers = exchange.headers = _headers(message)
        spoofed = DESTINATION_HEADER in headers
        if spoofed:
            self._metrics.errors.labels("client_destination_header").inc()
        path = headers.get(":path", "").partition("?")[0]
        if headers.get(":method") != "POST" or path not in LLM_PATHS:
            response = pb.ProcessingResponse()
            response.CopyFrom(_STRIP_HEADERS if spoofed else _CONTINUE_HEADERS)
            response.mode_override.CopyFrom(_PASS_THROUGH)
            return response
        if message.end_of_stream:
            self._metrics.errors.labels("empty_body").inc()
            response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=self._route(exchange, b"")))
            return response
        return _STRIP_HEADERS if spoofed else _CONTINUE_HEADERS

    def _on_request_body(self, message: pb.HttpBody, exchange: Exchange) -> pb.ProcessingResponse:
        if exchange.routed or not exchange.headers:
            return _CONTINUE_BODY
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=self._route(exchange, message.body)))

    def _route(self, exchange: Exchange, body: bytes) -> pb.CommonResponse:
        """Body -> decision -> destination header. Unreadable bodies go least loaded (fail-open)."""
        exchange.routed = True
        started = time.perf_counter()
        now = self._clock()
        backends = self._pool.backends
        try:
            exchange.request = parse_request(body, exchange.headers, self._router.settings.session_headers)
            decision = self._router.query(exchange.request, backends, now)
        except InvalidRequest as exc:
            log.info("unroutable body (%s), request %s routed least loaded", exc, exchange.headers.get("x-request-id"))
            self._metrics.errors.labels("invalid_request").inc()
            decision = self._router.fallback(backends, now)
        exchange.decision = decision
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        self._metrics.decisions.labels(decision.label.value).inc()
        mutation = pb.HeaderMutation(remove_headers=[DESTINATION_HEADER])
        if decision.backend is not None:
            target = decision.backend if decision.second is None else f"{decision.backend},{decision.second}"
            del mutation.remove_headers[:]
            mutation.set_headers.append(_header(DESTINATION_HEADER, target))
        return pb.CommonResponse(header_mutation=mutation)

    def _on_response_headers(self, message: pb.ProcessingRequest, exchange: Exchange) -> pb.ProcessingResponse:
        decision = exchange.decision
        if decision is None:
            return _CONTINUE_RESPONSE_HEADERS
        if decision.reservation is not None:
            decision.reservation.release_prefill()
        status = _headers(message.response_headers).get(":status", "")
        details = _attribute(message, "response.code_details") or ""
        upstream = _attribute(message, "upstream.address") or ""
        served = upstream if self._pool.is_known(upstream) else None
        if served and status.startswith("2") and details == "via_upstream" and exchange.request is not None:
            self._router.notify(exchange.request, served, self._clock())
            self._metrics.learned.inc()
        elif served and "connection_failure" in details:
            self._pool.mark_refused(served)
        if served and served != decision.backend:
            self._metrics.rerouted.inc()
        backend = served or decision.backend or ""
        matched = next((c.matched for c in decision.candidates if c.backend == backend), 0)
        mutation = pb.HeaderMutation(
            set_headers=[
                _header("x-kvroute-decision", decision.label.value),
                _header("x-kvroute-backend", backend),
                _header("x-kvroute-prefix", f"{matched}/{decision.total_blocks}"),
            ]
        )
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )
