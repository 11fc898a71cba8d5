"""Envoy ext_proc messages, read and built: pure protobuf helpers, no state and no routing.

Readers take what the processor needs out of a `ProcessingRequest` (headers, the gateway's subset
hint and served endpoint, attributes, whether the response ends); builders make the replies
(continue, the destination as a header and as `envoy.lb` metadata, body chunks handed back in
full-duplex mode, the picker protocol's 429 and 503). Replies without per-request content are
built once: copy one before changing it.
"""

from __future__ import annotations

import functools

from extproc.core.backends import parse_address
from extproc.core.objectives import ENGINE_PRIORITY_HEADER
from extproc.envoy.headers import (
    DESTINATION_HEADER,
    LB_NAMESPACE,
    PENDING_HEADER,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from extproc.envoy.proto import ext_proc_pb2 as pb

MAX_SUBSET = 4096  # endpoints read from one subset hint
DUPLEX = pb.ProcessingMode.FULL_DUPLEX_STREAMED
CHUNK_BYTES = 62_000  # body handed back to Envoy in chunks no larger than this (the reference picker's)
_OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# What only kvroute may tell the gateway and the engine: a client's own copies go from every
# request (a gateway routes on the destination; an engine schedules by the priority).
CLIENTS_NOT = (DESTINATION_HEADER, ENGINE_PRIORITY_HEADER)

# Request headers let through as they came, but for what only kvroute may set: a client's own
# destination, engine priority or pending mark. Every reply to request headers that does not
# route (a pass-through, a failure inside kvroute) is this one, never a bare continue.
STRIP_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[*CLIENTS_NOT, PENDING_HEADER]))
    )
)
# The body reply when routing failed inside kvroute: the request goes on unrouted (fail open), unmarked.
UNROUTED_BODY = pb.ProcessingResponse(
    request_body=pb.BodyResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=[PENDING_HEADER]), clear_route_cache=True
        )
    )
)
PASS_THROUGH = pb.ProcessingMode(request_body_mode=pb.ProcessingMode.NONE, response_header_mode=pb.ProcessingMode.SKIP)
CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
# The picker protocol's answer when the gateway's subset hint leaves no backend to choose.
NO_CANDIDATE = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=503),
        body=b"no backend in the gateway's subset",
        details="kvroute_no_subset_candidate",
    )
)
# A fleet that splits prefill from decode: a body kvroute could not read may carry transfer
# parameters it cannot strip (they name the address a decode server pulls from).
UNREAD_IN_SPLIT_FLEET = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=400),
        body=b"the request body is not JSON kvroute can read (this fleet passes on none it cannot check)",
        details="kvroute_unread_body",
    )
)
# A body whose client kv_transfer_params kvroute cannot strip (it parses, but cannot be written
# back: nesting orjson reads and will not write): never passed on, so refused.
UNSTRIPPED_TRANSFER_PARAMS = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=400),
        body=b"kv_transfer_params are not accepted from clients, and this body's cannot be removed",
        details="kvroute_client_transfer_params",
    )
)
# The empty reply to each kind of message: Envoy expects the reply to match what it sent.
CONTINUE = {
    "request_headers": STRIP_HEADERS,
    "request_body": CONTINUE_BODY,
    "response_headers": CONTINUE_RESPONSE_HEADERS,
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def header(key: str, value: str) -> pb.HeaderValueOption:
    """Envoy reads raw_value; a mutation that sets only `value` produces an empty header."""
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


# The headers reply to an LLM request whose body kvroute will decide on: marked pending (headers.py),
# with the route matched again, so the mark takes effect; a client's destination and priority removed.
PENDING_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[header(PENDING_HEADER, "1")], remove_headers=CLIENTS_NOT),
            clear_route_cache=True,
        )
    )
)


# The headers reply to an LLM request that will be decided at once: a client's destination and
# priority removed, nothing marked (the decision comes with the body's reply).
UNMARKED_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=CLIENTS_NOT))
    )
)


# Every candidate at max_backend_requests: the picker protocol's answer to shed load.
SHED = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=429),
        headers=pb.HeaderMutation(set_headers=[header("retry-after", "1")]),
        body=b"every backend is at its request limit",
        details="kvroute_shed",
    )
)


# A sheddable request no backend is predicted to serve within its TTFT objective.
SHED_SLO = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=429),
        headers=pb.HeaderMutation(set_headers=[header("retry-after", "1"), header("x-kvroute-decision", "shed_slo")]),
        body=b"no backend is predicted to give the first token within the request's TTFT objective",
        details="kvroute_shed_slo",
    )
)


def _queue_refusal(reason: str, text: bytes) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=pb.HttpStatus(code=429),
            headers=pb.HeaderMutation(
                set_headers=[
                    header("retry-after", "1"),
                    header("x-kvroute-decision", "shed"),
                    header("x-kvroute-queue", reason),
                ]
            ),
            body=text,
            details=f"kvroute_queue_{reason}",
        )
    )


# Flow control did not run a request: why, as a 429 the client may retry.
QUEUE_REFUSED: dict[str, pb.ProcessingResponse] = {
    "expired": _queue_refusal("expired", b"held past the queue's time limit while every backend was saturated"),
    "evicted": _queue_refusal("evicted", b"made room for a request of higher priority, or the router is stopping"),
    "band_full": _queue_refusal("band_full", b"every backend is saturated and this priority's queue is full"),
    "queue_full": _queue_refusal("queue_full", b"every backend is saturated and the queue is full"),
}


def queue_refused(reason: str) -> pb.ProcessingResponse:
    """The 429 for a request flow control refused, expired or evicted (`Refusal`, `State` values)."""
    return QUEUE_REFUSED.get(reason, QUEUE_REFUSED["queue_full"])


def text(value: pb.HeaderValue) -> str:
    """A header's value as Envoy carries it (raw_value; `value` stays empty)."""
    return value.raw_value.decode("latin-1")


def headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key: text(h) for h in message.headers.headers}


def served(message: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as a gateway reports it in `envoy.lb` dynamic metadata."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    value = None if namespace is None else namespace.fields.get(SERVED_KEY)
    return value.string_value if value is not None and value.string_value else None


def subset(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints a gateway allows for this request (`envoy.lb.subset_hint`), or None: no hint.
    A list of `ip:port` strings, or one comma-separated string; bounded."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    value = None if hint is None else hint.fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values[:MAX_SUBSET]]
    else:  # (split no further than it is read: a 48 MiB hint held the loop 0.9 s)
        items = value.string_value.split(",", MAX_SUBSET)[:MAX_SUBSET]
    return frozenset(filter(None, map(_address, items)))


def _address(item: str) -> str | None:
    """A hinted endpoint as the pool spells its backends (`[fd00::1]:8000` for `[FD00:0::1]:8000`),
    or None if it is no ip:port."""
    try:
        return parse_address(item)
    except ValueError:
        return None


def attribute(message: pb.ProcessingRequest, name: str) -> str | None:
    for struct in message.attributes.values():
        value = struct.fields.get(name)
        if value is not None:
            return str(value.string_value)
    return None


def response_ended(message: pb.ProcessingRequest) -> bool:
    """Whether this message ends the response (its headers without a body, its last body chunk,
    or its trailers): nothing more will come on the stream. The processor then ends the stream
    itself; left to an Envoy without the graceful-close runtime key (bootstrap.GRACEFUL_CLOSE; gateways'
    Envoys by default), it ends with a reset, and grpcio's aio server keeps about 120 bytes of C
    memory for every reset stream (grpc/grpc#43360; `kvroute-dev bench cancelled-streams`)."""
    kind = message.WhichOneof("request")
    if kind == "response_headers":
        return bool(message.response_headers.end_of_stream)
    if kind == "response_body":
        return bool(message.response_body.end_of_stream)
    return bool(kind == "response_trailers")


def destination(target: str, priority: str | None = None) -> pb.HeaderMutation:
    """The destination header, and the engine priority if one is given (else a client's removed),
    overwriting whatever a client sent; the request is no longer pending."""
    if priority is None:
        return pb.HeaderMutation(
            set_headers=[header(DESTINATION_HEADER, target)], remove_headers=[PENDING_HEADER, ENGINE_PRIORITY_HEADER]
        )
    return pb.HeaderMutation(
        set_headers=[header(DESTINATION_HEADER, target), header(ENGINE_PRIORITY_HEADER, priority)],
        remove_headers=[PENDING_HEADER],
    )


# No destination: none set, a client's removed (with its engine priority), the request no longer pending.
NO_DESTINATION = pb.HeaderMutation(remove_headers=[*CLIENTS_NOT, PENDING_HEADER])


def unrouted(priority: str | None) -> pb.HeaderMutation:
    """No destination (Envoy picks the backend), with the engine priority if one is given."""
    if priority is None:
        return NO_DESTINATION
    return pb.HeaderMutation(
        set_headers=[header(ENGINE_PRIORITY_HEADER, priority)], remove_headers=[DESTINATION_HEADER, PENDING_HEADER]
    )


@functools.lru_cache(maxsize=4096)
def routing(kind: str, target: str | None, priority: str | None = None) -> pb.ProcessingResponse:
    """The reply that routes a request_headers or request_body message to `target` (None: to no
    backend, the decision left to Envoy) with the engine `priority` (None: none), as header
    mutations and as metadata; a body's reply matches the route again (the pending mark goes).
    Made once per target (a backend or a fallback pair) and priority, so shared: copy one before
    changing it."""
    reply = pb.ProcessingResponse()
    response = getattr(reply, kind).response
    response.header_mutation.CopyFrom(unrouted(priority) if target is None else destination(target, priority))
    if kind == "request_body":
        response.clear_route_cache = True
    return with_destination(reply, target)


def copied(reply: pb.ProcessingResponse) -> pb.ProcessingResponse:
    """A reply of one's own, to change (replies may be shared)."""
    copy = pb.ProcessingResponse()
    copy.CopyFrom(reply)
    return copy


def with_destination(response: pb.ProcessingResponse, target: str | None) -> pb.ProcessingResponse:
    """The destination also as `envoy.lb` dynamic metadata, same key and value as the header."""
    if target:
        lb = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value
        lb.fields[DESTINATION_HEADER].string_value = target
    return response


def cleared(reply: pb.ProcessingResponse) -> pb.ProcessingResponse:
    """A copy of a request-headers reply that makes Envoy match the route again with the new
    header (replies may be shared constants)."""
    copy = copied(reply)
    copy.request_headers.response.clear_route_cache = True
    return copy


def streamed(kind: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """A body chunk handed back to Envoy unchanged (full-duplex mode)."""
    body = pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    reply = pb.ProcessingResponse()
    getattr(reply, kind).response.body_mutation.streamed_response.CopyFrom(body)
    return reply


def chunks(kind: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """A held body handed back in CHUNK_BYTES pieces; the last carries the end of stream."""
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [streamed(kind, piece, end_of_stream and i == len(pieces) - 1) for i, piece in enumerate(pieces)]
