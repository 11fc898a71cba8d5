"""The Envoy external processor: one gRPC stream per HTTP request.

A translator between Envoy's protobuf messages and the core's request lifecycle:
request headers -> (LLM path? else the least loaded backend, body unread) -> whole body ->
Router.begin -> destination header, and the
same in `envoy.lb` dynamic metadata (the endpoint-picker protocol: gateways read either);
response headers (the served endpoint from `envoy.lb` metadata or the `upstream.address`
attribute) -> Router.response_started (the core decides what to learn and which headers
to add); stream end -> Exchange.end, exactly once, from the gRPC done callback.

The body arrives buffered (kvroute's own Envoy: one message, answered with the header) or, as
endpoint-picker gateways configure it, FULL_DUPLEX_STREAMED: then the processor holds the
request-headers reply until the body's end, answers it with the destination and a cleared route
cache, and hands the body back to Envoy in chunks (and every response body chunk unchanged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.errors import InvalidRequest
from extproc.core.exchange import Exchange, ResponseStart
from extproc.core.request import PromptRequest
from extproc.core.router import Router
from extproc.envoy.headers import DESTINATION_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

log = logging.getLogger(__name__)

# Bodies above this are parsed and hashed in a worker thread, so the event loop never stalls for
# more than a few milliseconds: about 2 ms of parsing and hashing at 256 KiB; tokenizing (precise
# mode) costs about 1 us per token, so there the limit is 16 KiB.
OFFLOAD_BYTES = 256 * 1024
OFFLOAD_BYTES_PRECISE = 16 * 1024
LLM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
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
# The picker protocol's answer when the gateway's subset hint leaves no backend to choose.
_NO_CANDIDATE = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=503),
        body=b"no backend in the gateway's subset",
        details="kvroute_no_subset_candidate",
    )
)
MAX_SUBSET = 4096  # endpoints read from one subset hint
DUPLEX = pb.ProcessingMode.FULL_DUPLEX_STREAMED
CHUNK_BYTES = 62_000  # body handed back to Envoy in chunks no larger than this (the reference picker's)
HELD_BYTES = 64 * 1024 * 1024  # a full-duplex body beyond this is routed unread and passed on as it comes
# The empty reply to each kind of message: Envoy expects the reply to match what it sent.
_CONTINUE = {
    "request_headers": _CONTINUE_HEADERS,
    "request_body": _CONTINUE_BODY,
    "response_headers": _CONTINUE_RESPONSE_HEADERS,
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def _header(key: str, value: str) -> pb.HeaderValueOption:
    """Envoy reads raw_value; a mutation that sets only `value` produces an empty header."""
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


# Every candidate at max_backend_requests: the picker protocol's answer to shed load.
_SHED = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=429),
        headers=pb.HeaderMutation(set_headers=[_header("retry-after", "1")]),
        body=b"every backend is at its request limit",
        details="kvroute_shed",
    )
)


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key: h.raw_value.decode("latin-1") for h in message.headers.headers}


def _served(message: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as a gateway reports it in `envoy.lb` dynamic metadata."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    value = None if namespace is None else namespace.fields.get(SERVED_KEY)
    return value.string_value if value is not None and value.string_value else None


def _subset(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints a gateway allows for this request (`envoy.lb.subset_hint`), or None: no hint.
    A list of `ip:port` strings, or one comma-separated string; bounded."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    value = None if hint is None else hint.fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values[:MAX_SUBSET]]
    else:
        items = value.string_value.split(",")[:MAX_SUBSET]
    return frozenset(item.strip() for item in items if item.strip())


def _destination(target: str) -> pb.HeaderMutation:
    """The destination header, overwriting whatever a client sent."""
    return pb.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, target)])


def _with_destination(response: pb.ProcessingResponse, target: str | None) -> pb.ProcessingResponse:
    """The destination also as `envoy.lb` dynamic metadata, same key and value as the header."""
    if target:
        lb = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value
        lb.fields[DESTINATION_HEADER].string_value = target
    return response


def _response_ended(message: pb.ProcessingRequest) -> bool:
    """Whether this message ends the response (its headers without a body, its last body chunk,
    or its trailers): nothing more will come on the stream. The processor then ends the stream
    itself; left to an Envoy without the graceful-close runtime key (bootstrap.RUNTIME; gateways'
    Envoys by default), it ends with a reset, and grpcio's aio server keeps about 120 bytes of C
    memory for every reset stream (grpc/grpc#43360; `kvroute-dev bench cancelled-streams`)."""
    kind = message.WhichOneof("request")
    if kind == "response_headers":
        return bool(message.response_headers.end_of_stream)
    if kind == "response_body":
        return bool(message.response_body.end_of_stream)
    return bool(kind == "response_trailers")


def _streamed(kind: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """A body chunk handed back to Envoy unchanged (full-duplex mode)."""
    body = pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    reply = pb.ProcessingResponse()
    getattr(reply, kind).response.body_mutation.streamed_response.CopyFrom(body)
    return reply


def _chunks(kind: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """A held body handed back in CHUNK_BYTES pieces; the last carries the end of stream."""
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [_streamed(kind, piece, end_of_stream and i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def _attribute(message: pb.ProcessingRequest, name: str) -> str | None:
    for struct in message.attributes.values():
        value = struct.fields.get(name)
        if value is not None:
            return value.string_value
    return None


class Stream:
    """One HTTP request's state across its gRPC stream: its headers, then the core's exchange."""

    __slots__ = (
        "duplex",
        "exchange",
        "headers",
        "held",
        "held_bytes",
        "prepared",
        "response_duplex",
        "routed",
        "subset",
    )

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.exchange: Exchange | None = None
        self.subset: frozenset[str] | None = None  # the gateway's subset hint, if it sent one
        self.prepared: PromptRequest | InvalidRequest | None = None  # a large body, parsed off the loop
        self.routed = False
        self.duplex = False  # request body FULL_DUPLEX_STREAMED: kvroute hands the body back
        self.response_duplex = False  # the same for the response body
        self.held: list[bytes] | None = None  # full duplex: body chunks held until the decision
        self.held_bytes = 0

    def close(self, _context: Any = None) -> None:
        """The stream ended, however it ended (completion, error, client abort, Envoy timeout)."""
        if self.exchange is not None:
            self.exchange.end()


class Processor(pb_grpc.ExternalProcessorServicer):
    """Serves envoy.service.ext_proc.v3.ExternalProcessor/Process."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        max_stream_age_s: float = 3600.0,
        fallback: bool = False,
    ) -> None:
        """`fallback`: name the second choice after a comma (kvroute's own override_host Envoy
        retries it); off, as by default, for gateways whose ORIGINAL_DST cluster takes the
        destination as one address."""
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._max_stream_age_s = max_stream_age_s
        self._fallback = fallback

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = Stream()
        context.add_done_callback(stream.close)  # type: ignore[arg-type]  # the stub wants its own private class
        try:
            async with asyncio.timeout(self._max_stream_age_s):
                async for reply in self._replies(request_iterator, stream):
                    yield reply
        except TimeoutError:  # a stream never closed must not hold its reservation forever
            self._metrics.errors.labels("stream_age_limit").inc()
            stream.close()

    async def _replies(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], stream: Stream
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if message.HasField("protocol_config"):  # the stream's first message says how bodies come
                stream.duplex = message.protocol_config.request_body_mode == DUPLEX
                stream.response_duplex = message.protocol_config.response_body_mode == DUPLEX
            if stream.duplex:
                for reply in await self._duplex(message, stream):
                    yield reply
                if stream.response_duplex and _response_ended(message):
                    return  # end the stream first: see _response_ended
                continue
            if not stream.routed and stream.headers and message.WhichOneof("request") == "request_body":
                await self._prepare_large(message.request_body.body, stream)  # (a copy: read once)
            yield self.handle(message, stream)

    async def _prepare_large(self, body: bytes, stream: Stream) -> None:
        """Parsing and hashing a large body takes milliseconds to seconds: do it off the event
        loop, so health answers and other requests do not wait behind it; `_route` takes it up."""
        if len(body) > (OFFLOAD_BYTES_PRECISE if self._router.precise else OFFLOAD_BYTES):
            stream.prepared = await asyncio.to_thread(self._prepare, body, stream.headers)

    async def _duplex(self, message: pb.ProcessingRequest, stream: Stream) -> list[pb.ProcessingResponse]:
        """Full-duplex replies: none while the body is held, the held headers reply and the body
        once it has ended, each later chunk handed back as it comes. Failures fail open: the
        body is handed back unrouted."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                stream.subset = _subset(message)
                reply = self._on_request_headers(message.request_headers, stream)
                if reply.HasField("mode_override"):  # not an LLM request: pass it through as it comes
                    reply.ClearField("mode_override")  # (a fresh reply; body modes cannot change in full duplex)
                    reply.request_headers.response.clear_route_cache = True
                    stream.routed = True
                    return [reply]
                if stream.routed:  # routed from its headers alone (no body), or a repeated message
                    return [reply if reply.HasField("immediate_response") else self._cleared(reply)]
                stream.held = []  # an LLM request: the reply waits for the body
                return []
            if kind == "request_body":
                return await self._duplex_body(message.request_body, stream)
            if kind == "request_trailers" and stream.held is not None:  # the body ended with trailers
                return [*await self._release(stream, end_of_stream=False), _CONTINUE[kind]]
            if kind == "response_body" and stream.response_duplex:
                return [_streamed(kind, message.response_body.body, message.response_body.end_of_stream)]
            return [self.handle(message, stream)]
        except Exception:
            log.exception("ext_proc failed on %s in full-duplex mode; the request continues unrouted", kind)
            self._metrics.errors.labels("internal").inc()
            return self._unrouted(message, stream, kind)

    async def _duplex_body(self, message: pb.HttpBody, stream: Stream) -> list[pb.ProcessingResponse]:
        if stream.held is None:  # not held (passed through, or already routed): hand it straight back
            return [_streamed("request_body", message.body, message.end_of_stream)]
        stream.held.append(message.body)
        stream.held_bytes += len(message.body)
        if stream.held_bytes > HELD_BYTES:  # too big to read: route unread, then pass the rest on
            self._metrics.errors.labels("body_too_large").inc()
            return await self._release(stream, end_of_stream=message.end_of_stream, read=False)
        if not message.end_of_stream:
            return []
        return await self._release(stream, end_of_stream=True)

    async def _release(self, stream: Stream, end_of_stream: bool, read: bool = True) -> list[pb.ProcessingResponse]:
        """Decide on the held body, then send the held headers reply and the body back."""
        body = b"".join(stream.held or ())
        if read:
            await self._prepare_large(body, stream)
        decided = self._routed(stream, body if read else None, "request_headers")
        stream.held, stream.held_bytes = None, 0  # only now: a failure above hands the held body back
        if decided.HasField("immediate_response"):
            return [decided]
        return [self._cleared(decided), *_chunks("request_body", body, end_of_stream)]

    @staticmethod
    def _cleared(reply: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """A copy of a request-headers reply that makes Envoy match the route again with the new
        header (replies may be shared constants)."""
        cleared = pb.ProcessingResponse()
        cleared.CopyFrom(reply)
        cleared.request_headers.response.clear_route_cache = True
        return cleared

    def _unrouted(self, message: pb.ProcessingRequest, stream: Stream, kind: str) -> list[pb.ProcessingResponse]:
        """After a failure in full duplex: release whatever is held, unrouted, so the request goes on."""
        stream.routed = True
        if stream.held is not None:
            body = b"".join(stream.held)
            stream.held = None
            end = kind == "request_body" and message.request_body.end_of_stream
            trailers = [_CONTINUE[kind]] if kind == "request_trailers" else []  # Envoy waits for it
            return [_CONTINUE_HEADERS, *_chunks("request_body", body, end), *trailers]
        if kind == "request_body" or (kind == "response_body" and stream.response_duplex):
            part = getattr(message, kind)
            return [_streamed(kind, part.body, part.end_of_stream)]
        return [_CONTINUE[kind]]

    def handle(self, message: pb.ProcessingRequest, stream: Stream) -> pb.ProcessingResponse:
        """One reply per message, of the message's own kind; a failure here never stops the
        request, it only skips routing."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                stream.subset = _subset(message)
                return self._on_request_headers(message.request_headers, stream)
            if kind == "request_body":
                return self._on_request_body(message.request_body, stream)
            if kind == "response_headers":
                return self._on_response_headers(message, stream)
        except Exception:
            log.exception("ext_proc failed on %s; the request continues unrouted", kind)
            self._metrics.errors.labels("internal").inc()
        return _CONTINUE[kind]

    def _on_request_headers(self, message: pb.HttpHeaders, stream: Stream) -> pb.ProcessingResponse:
        if stream.routed:  # one stream decides once: a repeated message changes nothing
            self._metrics.errors.labels("repeated_message").inc()
            return _CONTINUE_HEADERS
        headers = stream.headers = _headers(message)
        spoofed = DESTINATION_HEADER in headers
        if spoofed:
            self._metrics.errors.labels("client_destination_header").inc()
        path = headers.get(":path", "").partition("?")[0]
        if headers.get(":method") != "POST" or path not in LLM_PATHS:
            return self._passed_through(stream, spoofed)
        if message.end_of_stream:
            self._metrics.errors.labels("empty_body").inc()
            return self._routed(stream, None, "request_headers")
        return _STRIP_HEADERS if spoofed else _CONTINUE_HEADERS

    def _passed_through(self, stream: Stream, spoofed: bool) -> pb.ProcessingResponse:
        """Another path or method: its body is not read and nothing is learned from it, but it
        still gets a destination (the least loaded backend): gateways whose cluster connects only
        where the picker says would otherwise have nowhere to send it."""
        target = self._router.least_loaded(self._candidates(stream), self._clock())
        response = pb.ProcessingResponse()
        if target is None:
            response.CopyFrom(_STRIP_HEADERS if spoofed else _CONTINUE_HEADERS)
        else:
            response.request_headers.response.header_mutation.CopyFrom(_destination(target))
            _with_destination(response, target)
        response.mode_override.CopyFrom(_PASS_THROUGH)
        return response

    def _candidates(self, stream: Stream) -> list[Backend]:
        """The pool's backends, within the gateway's subset hint if it sent one."""
        if stream.subset is None:
            return self._pool.backends
        return [b for b in self._pool.backends if b.address in stream.subset]

    def _on_request_body(self, message: pb.HttpBody, stream: Stream) -> pb.ProcessingResponse:
        if stream.routed or not stream.headers:
            return _CONTINUE_BODY
        body = message.body if stream.prepared is None else b""  # already parsed off the loop: no second copy
        return self._routed(stream, body, "request_body")

    def _routed(self, stream: Stream, body: bytes | None, kind: str) -> pb.ProcessingResponse:
        """The routing reply to a request_headers or request_body message: the destination as a
        header mutation and as metadata, or a 503 when the gateway's subset leaves no backend."""
        backends = self._candidates(stream)
        if stream.subset is not None and not backends:
            stream.routed = True
            self._metrics.errors.labels("no_subset_candidate").inc()
            return _NO_CANDIDATE
        common, target = self._route(stream, body, backends)
        if stream.exchange is not None and stream.exchange.decision.label is Label.SHED:
            return _SHED
        reply = pb.ProcessingResponse()
        getattr(reply, kind).response.CopyFrom(common)
        return _with_destination(reply, target)

    def _route(
        self, stream: Stream, body: bytes | None, backends: list[Backend]
    ) -> tuple[pb.CommonResponse, str | None]:
        """Body -> exchange among `backends` -> destination header (and the destination, for the
        metadata). A missing or unreadable body goes least loaded (fail-open), counted once under
        its own kind."""
        stream.routed = True
        started = time.perf_counter()
        exchange = None
        if body is not None:
            try:
                prepared = stream.prepared if stream.prepared is not None else self._prepare(body, stream.headers)
                stream.prepared = None
                if isinstance(prepared, InvalidRequest):
                    raise prepared
                if prepared.truncated:
                    self._metrics.errors.labels("prompt_budget").inc()
                exchange = self._router.begin(prepared, backends, self._clock())
            except InvalidRequest as exc:
                request_id = stream.headers.get("x-request-id")
                log.info("unroutable body (%s), request %s routed least loaded", exc, request_id)
                self._metrics.errors.labels("invalid_request").inc()
        if exchange is None:
            exchange = self._router.begin_unreadable(backends, self._clock())
        stream.exchange = exchange
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        decision = exchange.decision
        if decision.backend is None:
            return pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[DESTINATION_HEADER])), None
        second = decision.second if self._fallback else None
        target = decision.backend if second is None else f"{decision.backend},{second}"
        return pb.CommonResponse(header_mutation=_destination(target)), target

    def _prepare(self, body: bytes, headers: dict[str, str]) -> PromptRequest | InvalidRequest:
        """Parse, tokenize (precise mode) and hash a body; may run in a worker thread (the router's
        parse and chain touch no shared state but the tokenizer's own locked cache)."""
        try:
            request = self._router.parse(body, headers)
        except InvalidRequest as exc:
            return exc
        self._router.chain_of(request)
        return request

    def _on_response_headers(self, message: pb.ProcessingRequest, stream: Stream) -> pb.ProcessingResponse:
        """Translate Envoy's view of the response start for the core, and its answer back."""
        if stream.exchange is None:
            return _CONTINUE_RESPONSE_HEADERS
        status = _headers(message.response_headers).get(":status", "")
        details = _attribute(message, "response.code_details") or ""
        upstream = _served(message) or _attribute(message, "upstream.address") or ""
        known = self._pool.canonical(upstream)
        start = ResponseStart(
            upstream=known or upstream,
            known=known is not None,
            status=int(status) if status.isdigit() else 0,
            from_upstream=details == "via_upstream",
            connect_failed="connection_failure" in details,
        )
        outcome = self._router.response_started(stream.exchange, start, self._clock())
        if outcome.refused:
            self._pool.mark_suspect(outcome.served)
        decision = stream.exchange.decision
        log.debug(
            "request %s: %s on %s, %d/%d blocks held, status %s",
            stream.headers.get("x-request-id"),
            decision.label.value,
            outcome.served,
            decision.matched_blocks,
            decision.total_blocks,
            status,
        )
        if not outcome.headers:
            return _CONTINUE_RESPONSE_HEADERS
        mutation = pb.HeaderMutation(set_headers=[_header(key, value) for key, value in outcome.headers])
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )
