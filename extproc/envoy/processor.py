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
import contextlib
import logging
import posixpath
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import grpc
import orjson

from extproc.core import handoff
from extproc.core.backends import Backend, Role
from extproc.core.decision import Label
from extproc.core.errors import InvalidRequest
from extproc.core.exchange import Exchange, Outcome, ResponseStart
from extproc.core.flow import Held, Refusal, State
from extproc.core.objectives import ENGINE_PRIORITY_HEADER, TTFT_HEADERS, classify, objective_priority
from extproc.core.placement import ADAPTER_WAIT_S
from extproc.core.request import PromptRequest, load_json
from extproc.core.router import Router
from extproc.core.usage import CachedTokens
from extproc.envoy import messages as msg
from extproc.envoy.headers import DESTINATION_HEADER, LLM_PATHS
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc
from extproc.runtime.metrics import Metrics
from extproc.runtime.placer import AdapterPlacer
from extproc.runtime.pool import BackendPool
from extproc.runtime.prefill import PrefillLegs
from extproc.runtime.waiting_room import WaitingRoom

if TYPE_CHECKING:  # the SDK is loaded only when tracing is on (service.py)
    from opentelemetry.trace import Span

    from extproc.envoy.dispatch import PolicyDispatch
    from extproc.runtime.tracing import RequestTracer

log = logging.getLogger(__name__)

_LLM_PATHS = frozenset(LLM_PATHS)
_SPELLED_OTHERWISE = re.compile(r"%|//|/\.")


def llm_path(path: str) -> bool:
    """One of the paths kvroute routes by prompt, also as the engine's server would read it when
    spelled otherwise (percent-escapes, repeated slashes, dot segments): kvroute's own Envoy
    normalizes paths first, but a gateway may not, and a request passed through unread would go
    past flow control with whatever it carries."""
    if path in _LLM_PATHS:
        return True
    if _SPELLED_OTHERWISE.search(path) is None:
        return False
    return posixpath.normpath("/" + urllib.parse.unquote(path).lstrip("/")) in _LLM_PATHS


# The 429 for a decision that refused the request, by its label.
_REFUSALS = {Label.SHED: msg.SHED, Label.SHED_SLO: msg.SHED_SLO}
HELD_BYTES = 64 * 1024 * 1024  # a full-duplex body beyond this is routed unread and passed on as it comes


class Phase(Enum):
    """Where one request's stream stands. Each stream decides once: request headers, then (for an
    LLM request) its body, then the decision; in full-duplex mode the body is held meanwhile."""

    HEADERS = "headers"  # nothing seen yet
    BODY = "body"  # an LLM request's headers seen: its body decides
    HOLDING = "holding"  # full duplex: the body's chunks (and the headers' reply) held until it ends
    PASSED = "passed"  # not an LLM request: passed through with a least-loaded destination, body unread
    DECIDED = "decided"  # routed, shed, refused (subset), or let through unrouted after a failure


# The phases each phase may move to (full duplex: the headers' reply waits in HOLDING).
NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.HEADERS: frozenset({Phase.BODY, Phase.PASSED, Phase.DECIDED}),
    Phase.BODY: frozenset({Phase.HOLDING, Phase.DECIDED}),
    Phase.HOLDING: frozenset({Phase.DECIDED}),
    Phase.PASSED: frozenset(),
    Phase.DECIDED: frozenset(),
}

# A body as routing reads it, or why it cannot be read.
Parsed = PromptRequest | InvalidRequest


class Unstrippable(Exception):
    """The client's kv_transfer_params cannot be removed from its body: answer 400."""


class Stream:
    """One HTTP request's state across its gRPC stream: its phase, its headers, the core's exchange."""

    __slots__ = (
        "destination",
        "dispatched",
        "exchange",
        "headers",
        "held",
        "held_bytes",
        "owner",
        "phase",
        "request_duplex",
        "response_duplex",
        "span",
        "subset",
        "usage",
    )

    def __init__(self) -> None:
        self.phase = Phase.HEADERS
        self.headers: dict[str, str] = {}
        self.exchange: Exchange | None = None
        self.destination: str | None = None  # where its reply sent it (a backend, or a fallback pair)
        self.subset: frozenset[str] | None = None  # the gateway's subset hint, if it sent one
        # How bodies come, from the stream's first message: FULL_DUPLEX_STREAMED, kvroute hands
        # them back to Envoy (the request's after its decision, the response's as they come).
        self.request_duplex = False
        self.response_duplex = False
        self.held: list[bytes] | None = None  # HOLDING: the body's chunks so far (kept until handed back)
        self.held_bytes = 0
        self.dispatched: Held | None = None  # held by flow control, its turn came, its backend not yet reserved
        self.span: Span | None = None  # its route span, with tracing on
        self.usage: CachedTokens | None = None  # the engine's count of its cached tokens, read from the response body
        self.owner: Processor | None = None  # several policies: the one its model chose (none: the one it came to)

    def advance(self, phase: Phase) -> None:
        """Move to `phase`; raises RuntimeError on a move the protocol's order does not allow."""
        if phase not in NEXT[self.phase]:
            raise RuntimeError(f"ext_proc stream cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

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
        waiting_room: WaitingRoom | None = None,
        priorities: Callable[[], Mapping[str, int]] = dict,
        prefill_legs: PrefillLegs | None = None,
        placer: AdapterPlacer | None = None,
        tracer: RequestTracer | None = None,
        routes: PolicyDispatch | None = None,
    ) -> None:
        """`fallback`: name the second choice after a comma (kvroute's own override_host Envoy
        retries it); off, as by default, for gateways whose ORIGINAL_DST cluster takes the
        destination as one address. `waiting_room`: flow control (none: every request is
        decided at once); `priorities`: each defined objective's priority; `prefill_legs`: runs
        the prefill leg of requests split in a disaggregated fleet (none: never split); `placer`:
        loads a placed LoRA adapter a request names when no server has it (none: never);
        `tracer`: a span per LLM request (none: tracing off); `routes`: the process serves several
        policies, and a request's body hands it to the processor of its model's (this one
        takes every stream first)."""
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._max_stream_age_s = max_stream_age_s
        self._fallback = fallback
        self._room = waiting_room
        self._priorities = priorities
        self._legs = prefill_legs
        self._placer = placer
        self._tracer = tracer
        self.routes = routes

    @property
    def router(self) -> Router:
        return self._router

    @property
    def pool(self) -> BackendPool:
        return self._pool

    def _runs_connectors(self) -> bool:
        """Whether some engine here may act on transfer parameters: a fleet with prefill or decode
        servers, or one that splits between `both` servers (`pd_flexible`: each runs a connector)."""
        return self._router.settings.pd_flexible or any(b.role is not Role.BOTH for b in self._pool.backends)

    def splits(self) -> bool:
        """The policy's fleet has prefill servers (the routing core's memo: once per backend set)."""
        return self._router.pipeline.memo.disaggregated(self._pool.backends)

    def owner_of(self, stream: Stream) -> Processor:
        """The processor whose policy decides the stream: its model's, once its body was read."""
        return stream.owner or self

    def may_hold(self, stream: Stream) -> bool:
        """Whether this policy's flow control would hold a request arriving now."""
        return self._room is not None and self._room.may_hold(self._candidates(stream))

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = Stream()
        context.add_done_callback(lambda _: self.closed(stream))  # type: ignore[arg-type]  # the stub wants its own private class
        try:
            async with asyncio.timeout(self._max_stream_age_s):
                async for reply in self._replies(request_iterator, stream):
                    yield reply
        except TimeoutError:  # a stream never closed must not hold its reservation forever
            self._metrics.errors.labels("stream_age_limit").inc()
            self.closed(stream)

    def closed(self, stream: Stream) -> None:
        """The stream ended, however it ended: release what it holds, and give its room to the
        next held request."""
        owner = stream.owner
        if owner is not None and owner is not self:
            owner.closed(stream)
            return
        stream.close()
        self._dispatched(stream)
        if self._room is not None:
            self._room.pump()
        if stream.span is not None and self._tracer is not None:
            self._tracer.end(stream.span)
            stream.span = None

    async def _replies(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], stream: Stream
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if message.WhichOneof("request") is None:  # no phase named: nothing to answer (Envoy
                self._metrics.errors.labels("malformed_message").inc()  # sends none such; a reply of
                continue  # some kind would be one it did not ask for, and indexing by none ended the stream)
            owner = stream.owner or self  # several policies: the one the body chose, from then on
            if message.HasField("protocol_config"):  # the stream's first message says how bodies come
                stream.request_duplex = message.protocol_config.request_body_mode == msg.DUPLEX
                stream.response_duplex = message.protocol_config.response_body_mode == msg.DUPLEX
            if stream.request_duplex:
                for reply in await owner._duplex(message, stream):
                    yield reply
                if stream.response_duplex and msg.response_ended(message):
                    return  # end the stream first: see messages.response_ended
                continue
            body = None
            if stream.phase is Phase.BODY and message.WhichOneof("request") == "request_body":
                body = message.request_body.body  # (a copy: read once)
                reply = await owner.decide_body(stream, body)
            else:
                reply = owner.handle(message, stream)
            if body is not None and not reply.HasField("immediate_response"):  # this body decided it
                try:
                    handed = await self.owner_of(stream)._handed_over(stream, body)
                except Unstrippable:
                    yield msg.UNSTRIPPED_TRANSFER_PARAMS  # (the stream's end releases its decision)
                    continue
                if handed is not None:
                    reply = msg.copied(reply)
                    response = reply.request_body.response
                    response.body_mutation.body = handed
                    response.header_mutation.set_headers.append(msg.header("content-length", str(len(handed))))
            yield reply

    async def decide_body(self, stream: Stream, body: bytes, parsed: Parsed | None = None) -> pb.ProcessingResponse:
        """A buffered LLM request's body decides (both transports: ext_authz.py too): read off the
        loop when large (`parsed`: already read), its policy's processor chosen by its model,
        adapter placement, flow control's turn, the decision. The reply as the ext_proc protocol
        sends it; a failure never stops the request, it only skips routing. Placement comes
        before the turn: a request waiting for its adapter to load must not hold the turn, which
        stops every other dispatch until it reserves its backend."""
        if parsed is None:
            owner, parsed = await self._owned(stream, body)
            if owner is not self:
                return await owner.decide_body(stream, body, parsed)
        parsed = await self._placed(body, stream, parsed)
        parsed, refused = await self._wait_turn(body, stream, parsed, len(body))
        if refused is not None:
            return refused
        try:
            reply = self._on_request_body(body, stream, parsed)
        except Exception:
            log.exception("ext_proc failed on request_body; the request continues unrouted")
            self._metrics.errors.labels("internal").inc()
            reply = msg.UNROUTED_BODY
        self._dispatched(stream)
        return reply

    async def _owned(self, stream: Stream, body: bytes) -> tuple[Processor, Parsed | None]:
        """The processor that decides the body, and the body as read if it was. One policy: this
        one, the body read here only if large. Several: the body is read now, for its model,
        and by the processor of the policy serving that model (its settings, its tokenizer)."""
        routes = self.routes
        if routes is None:
            return self, await self._read_large(body, stream)
        routes.refresh()  # here, on the loop: the pools' views are not read from worker threads
        if len(body) > routes.slow_read_bytes():
            parsed = await asyncio.to_thread(self._read_routed, routes, body, stream)
        else:
            parsed = self._read_routed(routes, body, stream)
        return self.owner_of(stream), parsed

    def _read_routed(self, routes: PolicyDispatch, body: bytes, stream: Stream) -> Parsed:
        """Several policies: the JSON decoded once, its model choosing the stream's owner, which
        reads the rest. A body without a model (or not JSON) goes to the policy for unlisted
        models, which reads it for its error. May run in a worker thread: the choice reads only
        the map `routes.refresh` made on the loop."""
        loaded: Any = body
        with contextlib.suppress(InvalidRequest):  # else read again by its owner, for its error
            loaded = load_json(body)
        model = loaded.get("model") if isinstance(loaded, dict) else None
        owner = routes.owner(model if isinstance(model, str) else "")
        stream.owner = owner
        return owner._read(loaded, stream.headers)

    def _unread(self, stream: Stream) -> Processor:
        """The processor deciding a request whose model is not read (no body, a body too large
        to hold): with several policies, the one unlisted models go to. On the event loop."""
        if self.routes is None or stream.owner is not None:
            return self.owner_of(stream)
        stream.owner = self.routes.serving("")
        return stream.owner

    async def _read_large(self, body: bytes, stream: Stream) -> Parsed | None:
        """Parsing and hashing a large body takes milliseconds to seconds: do it off the event
        loop, so health answers and other requests do not wait behind it. None: a small body,
        read where it is decided."""
        if len(body) > self._router.slow_read_bytes:
            return await asyncio.to_thread(self._read, body, stream.headers)
        return None

    async def _duplex(self, message: pb.ProcessingRequest, stream: Stream) -> list[pb.ProcessingResponse]:
        """Full-duplex replies: none while the body is held, the held headers reply and the body
        once it has ended, each later chunk handed back as it comes. Failures fail open: the
        body is handed back unrouted."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                stream.subset = msg.subset(message)
                reply = self._on_request_headers(message.request_headers, stream)
                if reply.HasField("mode_override"):  # not an LLM request: pass it through as it comes
                    reply.ClearField("mode_override")  # (a fresh reply; body modes cannot change in full duplex)
                    reply.request_headers.response.clear_route_cache = True
                    return [reply]
                if stream.phase is Phase.HOLDING:  # repeated while the body is held: the held reply answers
                    return []
                if stream.phase is not Phase.BODY:  # decided from its headers alone (no body), or repeated
                    return [reply if reply.HasField("immediate_response") else msg.cleared(reply)]
                stream.advance(Phase.HOLDING)  # an LLM request: the reply waits for the body
                stream.held = []
                return []
            if kind == "request_body":
                return await self._duplex_body(message.request_body, stream)
            if kind == "request_trailers" and stream.phase is Phase.HOLDING:  # the body ended with trailers
                return [*await self._release(stream, end_of_stream=False), msg.CONTINUE[kind]]
            if kind == "response_body" and stream.response_duplex:
                self._read_usage(stream, message.response_body.body)
                return [msg.streamed(kind, message.response_body.body, message.response_body.end_of_stream)]
            return [self.handle(message, stream)]
        except Exception:
            log.exception("ext_proc failed on %s in full-duplex mode; the request continues unrouted", kind)
            owner = self.owner_of(stream)  # several policies: the one that holds its turn, if any
            owner._metrics.errors.labels("internal").inc()
            return owner._fail_open(message, stream, kind)

    def _read_usage(self, stream: Stream, chunk: bytes) -> None:
        """The engine's count of the request's cached tokens, if this chunk completes it: the
        per-request reuse account, and the route span."""
        if stream.exchange is None or stream.exchange.routed is None:
            return
        if stream.usage is None:
            stream.usage = CachedTokens()
        cached = stream.usage.feed(chunk)
        if cached is None:
            return
        self._router.engine_reported(stream.exchange, cached)
        if stream.span is not None and self._tracer is not None:
            self._tracer.reported(stream.span, cached)

    async def _duplex_body(self, message: pb.HttpBody, stream: Stream) -> list[pb.ProcessingResponse]:
        if stream.phase is not Phase.HOLDING or stream.held is None:  # passed through, or decided: hand it back
            return [msg.streamed("request_body", message.body, message.end_of_stream)]
        stream.held.append(message.body)
        stream.held_bytes += len(message.body)
        if stream.held_bytes > HELD_BYTES:  # too big to read: route unread, then pass the rest on
            self._metrics.errors.labels("body_too_large").inc()
            return await self._release(stream, end_of_stream=message.end_of_stream, read=False)
        if not message.end_of_stream:
            return []
        return await self._release(stream, end_of_stream=True)

    async def _release(self, stream: Stream, end_of_stream: bool, read: bool = True) -> list[pb.ProcessingResponse]:
        """Decide on the held body (by its policy's processor), then send the held headers reply
        and the body back."""
        body = b"".join(stream.held or ())
        stream.held = [body]  # one copy while it may wait (a failure still hands it back)
        owner, parsed = await self._owned(stream, body) if read else (self._unread(stream), None)
        return await owner._release_read(stream, body, end_of_stream, read, parsed)

    async def _release_read(
        self, stream: Stream, body: bytes, end_of_stream: bool, read: bool, parsed: Parsed | None
    ) -> list[pb.ProcessingResponse]:
        parsed = await self._placed(body if read else None, stream, parsed)  # (before the turn: decide_body)
        parsed, refused = await self._wait_turn(body if read else None, stream, parsed, stream.held_bytes)
        if refused is not None:
            stream.held, stream.held_bytes = None, 0
            return [refused]
        decided = self._routing_reply(stream, body if read else None, "request_headers", parsed)
        self._dispatched(stream)
        if decided.HasField("immediate_response"):
            stream.held, stream.held_bytes = None, 0
            return [decided]
        reply = msg.cleared(decided)
        try:
            handed = await self._handed_over(stream, body) if read else None
        except Unstrippable:
            stream.held, stream.held_bytes = None, 0
            return [msg.UNSTRIPPED_TRANSFER_PARAMS]
        if handed is not None:
            body = handed
            reply.request_headers.response.header_mutation.set_headers.append(
                msg.header("content-length", str(len(body)))
            )
        stream.held, stream.held_bytes = None, 0  # only now: a failure above hands the held body back
        return [reply, *msg.chunks("request_body", body, end_of_stream)]

    async def _placed(self, body: bytes | None, stream: Stream, parsed: Parsed | None) -> Parsed | None:
        """A request for a LoRA adapter the policy places, which no server has: wait until one
        loaded it (at most `ADAPTER_WAIT_S`); then, or on failure, it is decided as it stands.
        Returns the body as read (read here only while placement is on)."""
        placer = self._placer
        if placer is None or not placer.enabled or body is None:
            return parsed
        if parsed is None:
            parsed = self._read(body, stream.headers)
        if isinstance(parsed, PromptRequest):
            try:
                await placer.ensure(parsed.model, ADAPTER_WAIT_S)
            except Exception:  # placement must never cost a request
                log.exception("adapter placement failed for a request; it is decided as it stands")
                self._metrics.errors.labels("internal").inc()
        return parsed

    async def _wait_turn(
        self, body: bytes | None, stream: Stream, parsed: Parsed | None, size: int
    ) -> tuple[Parsed | None, pb.ProcessingResponse | None]:
        """Flow control: while every candidate is saturated, hold the request until its turn
        (the decision is made then, on the state then). Returns the body as read, so it is read
        once, and the 429 to answer if it was refused, expired or evicted instead. Whether it
        may go at once is judged over the pool (the gateway's subset); once held, over the
        backends serving its model."""
        room = self._room
        backends = self._candidates(stream)
        if room is None or room.goes_now(backends):
            return parsed, None
        try:
            settings = self._router.settings
            if parsed is None and body is not None:
                parsed = self._read(body, stream.headers)
            now = self._clock()
            candidates = backends
            if isinstance(parsed, PromptRequest):
                cost = self._router.cost_tokens(parsed, backends, now)
                serving = set(self._router.pipeline.candidates(parsed, backends))
                if not serving:  # its model is served nowhere: no room will come for it, so it is
                    return parsed, None  # decided at once (and the engine says what it says)
                if len(serving) < len(backends):  # else the pool's own tuple: its room is weighed once a turn
                    candidates = [b for b in backends if b.address in serving]
            else:
                cost = settings.default_output_tokens
            request_class = classify(stream.headers, self._priorities(), settings.tenant_header)
        except Exception:  # flow control must never cost a request: it goes on as without it
            log.exception("flow control could not weigh a request; it is decided at once")
            self._metrics.errors.labels("internal").inc()
            return parsed, None
        if not request_class.known:
            self._metrics.errors.labels("unknown_objective").inc()
        waited_from = time.time_ns()
        held = await room.wait(request_class, cost, size, candidates)
        outcome = held.value if isinstance(held, Refusal) else held.state.value
        if stream.span is not None and self._tracer is not None:
            self._tracer.queued(stream.span, waited_from, outcome, request_class.flow, request_class.priority)
        if isinstance(held, Held) and held.state is State.DISPATCHED:
            stream.dispatched = held
            return parsed, None
        stream.advance(Phase.DECIDED)
        return parsed, msg.queue_refused(outcome)

    async def _handed_over(self, stream: Stream, body: bytes) -> bytes | None:
        """The body the decided request goes on with, if not its own: with its prefill leg run on a
        prefill backend and that leg's kv_transfer_params (a split request), or without the
        client's own kv_transfer_params (never passed on: they name an address a decode server
        would pull from). None: the body as it came. A leg that fails leaves the request whole,
        counted; so does a failure here (in buffered mode it would otherwise end the stream, and
        Envoy would send the request on unrouted)."""
        exchange = stream.exchange
        request = exchange.request if exchange is not None else None
        if exchange is None or request is None:
            return None
        if exchange.decision.backend is None:  # Envoy picks a server: the client's parameters go still
            return self._stripped(body) if request.transfer_params else None
        try:
            return await self._split(stream, exchange, request, body)
        except Exception:
            log.exception("the prefill hand-off failed; the request is served whole")
            self._metrics.errors.labels("internal").inc()
            self._router.prefill_again(exchange)
            return self._stripped(body) if request.transfer_params else None

    def _stripped(self, body: bytes) -> bytes:
        """The body without the client's kv_transfer_params; Unstrippable where it cannot be
        rewritten (the client's parameters would stay in it: refused)."""
        try:
            return handoff.strip(orjson.loads(body))
        except Exception:
            self._metrics.errors.labels("client_transfer_params").inc()
            raise Unstrippable from None

    async def _split(self, stream: Stream, exchange: Exchange, request: PromptRequest, body: bytes) -> bytes | None:
        leg = None
        if self._legs is not None:
            leg = self._router.prefill_leg(exchange, self._candidates(stream), self._clock())
        if leg is None and not request.transfer_params:
            return None
        parsed = orjson.loads(body)
        if leg is None or leg.decision.backend is None:
            self._metrics.disaggregation.labels("stripped").inc()
            return handoff.strip(parsed)
        backend = leg.decision.backend
        assert self._legs is not None  # (a leg is only made with them)
        try:
            path = stream.headers.get(":path", "/v1/chat/completions")
            timeout_s = self._router.settings.pd_prefill_timeout_s
            status, parameters, failure = await self._legs.run(backend, path, parsed, stream.headers, timeout_s)
            start = ResponseStart(backend, True, status, from_upstream=status != 0, connect_failed=status == 0)
            self._router.response_started(leg, start, self._clock())
        finally:
            leg.end()
        if parameters is None:
            self._router.prefill_again(exchange)  # the decode backend computes the prompt after all
            log.info("prefill leg on %s gave no transfer (%s): served whole", backend, failure)
            self._metrics.disaggregation.labels(failure.value if failure is not None else "parameters").inc()
            return handoff.strip(parsed) if request.transfer_params else None
        self._metrics.disaggregation.labels("split").inc()
        return handoff.decode_body(parsed, parameters)

    def _dispatched(self, stream: Stream) -> None:
        """A request held by flow control has reserved its backend (or failed to): the next
        one's turn."""
        held = stream.dispatched
        if held is not None and self._room is not None:
            stream.dispatched = None
            if stream.exchange is not None:
                stream.exchange.queued = True  # its decision header says so
            self._room.started(held)

    def _fail_open(self, message: pb.ProcessingRequest, stream: Stream, kind: str) -> list[pb.ProcessingResponse]:
        """After a failure in full duplex: release whatever is held, unrouted, so the request goes on."""
        stream.phase = Phase.DECIDED  # from any phase: the request goes on, never decided again
        self._dispatched(stream)  # a held request's turn ends here too
        if stream.held is not None:
            body = b"".join(stream.held)
            stream.held = None
            end = kind == "request_body" and message.request_body.end_of_stream
            trailers = [msg.CONTINUE[kind]] if kind == "request_trailers" else []  # Envoy waits for it
            return [msg.STRIP_HEADERS, *msg.chunks("request_body", body, end), *trailers]
        if kind == "request_body" or (kind == "response_body" and stream.response_duplex):
            part = getattr(message, kind)
            return [msg.streamed(kind, part.body, part.end_of_stream)]
        return [msg.CONTINUE[kind]]

    def handle(
        self, message: pb.ProcessingRequest, stream: Stream, parsed: Parsed | None = None
    ) -> pb.ProcessingResponse:
        """One reply per message, of the message's own kind; a failure here never stops the
        request, it only skips routing. `parsed`: the body, already read off the event loop."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                stream.subset = msg.subset(message)
                return self._on_request_headers(message.request_headers, stream)
            if kind == "request_body":
                return self._on_request_body(message.request_body.body, stream, parsed)
            if kind == "response_headers":
                return self._on_response_headers(message, stream)
        except Exception:
            log.exception("ext_proc failed on %s; the request continues unrouted", kind)
            self._metrics.errors.labels("internal").inc()
            if kind == "request_body":
                return msg.UNROUTED_BODY
        return msg.CONTINUE[kind]

    def _on_request_headers(self, message: pb.HttpHeaders, stream: Stream) -> pb.ProcessingResponse:
        if stream.phase is not Phase.HEADERS:  # one stream decides once: a repeated message changes nothing
            self._metrics.errors.labels("repeated_message").inc()
            return msg.STRIP_HEADERS
        return self.request_headers(stream, msg.headers(message), message.end_of_stream)

    def request_headers(self, stream: Stream, headers: dict[str, str], end_of_stream: bool) -> pb.ProcessingResponse:
        """A request's headers (both transports): an LLM request waits for its body (phase BODY);
        another path or method is passed through to the least loaded backend (PASSED); an LLM
        request without a body is decided now."""
        stream.headers = headers
        if DESTINATION_HEADER in headers:
            self._metrics.errors.labels("client_destination_header").inc()
        path = headers.get(":path", "").partition("?")[0]
        if headers.get(":method") != "POST" or not llm_path(path):
            return self._passed_through(stream)
        if end_of_stream:
            owner = self._unread(stream)
            owner._metrics.errors.labels("empty_body").inc()
            return owner._routing_reply(stream, None, "request_headers")
        stream.advance(Phase.BODY)
        if self._tracer is not None:
            stream.span = self._tracer.start(headers)
        if not (self.may_hold(stream) if self.routes is None else self.routes.may_hold(stream)):
            return msg.UNMARKED_HEADERS
        return msg.PENDING_HEADERS

    def _passed_through(self, stream: Stream) -> pb.ProcessingResponse:
        """Another path or method: its body is not read and nothing is learned from it, but it
        still gets a destination (the least loaded backend): gateways whose cluster connects only
        where the picker says would otherwise have nowhere to send it."""
        stream.advance(Phase.PASSED)
        target = stream.destination = self._router.least_loaded(self._candidates(stream), self._clock())
        response = msg.copied(msg.STRIP_HEADERS if target is None else msg.routing("request_headers", target))
        response.mode_override.CopyFrom(msg.PASS_THROUGH)
        return response

    def _candidates(self, stream: Stream) -> Sequence[Backend]:
        """The pool's backends, within the gateway's subset hint if it sent one."""
        if stream.subset is None:
            return self._pool.backends
        return [b for b in self._pool.backends if b.address in stream.subset]

    def _on_request_body(self, body: bytes, stream: Stream, parsed: Parsed | None) -> pb.ProcessingResponse:
        if stream.phase is not Phase.BODY:  # passed through, decided, or no headers before it
            return msg.CONTINUE_BODY
        if self.routes is not None and stream.owner is None:  # several policies: its model's decides
            self.routes.refresh()
            parsed = self._read_routed(self.routes, body, stream)
            owner = self.owner_of(stream)
            if owner is not self:
                return owner._on_request_body(body, stream, parsed)
        return self._routing_reply(stream, body, "request_body", parsed)

    def _routing_reply(
        self, stream: Stream, body: bytes | None, kind: str, parsed: Parsed | None = None
    ) -> pb.ProcessingResponse:
        """The reply to the request_headers or request_body message that decides: the destination
        as a header mutation and as metadata, a 429 when shed, a 503 when the gateway's subset
        leaves no backend, or a 400 for a body that cannot be checked for transfer parameters."""
        stream.advance(Phase.DECIDED)
        backends = self._candidates(stream)
        if stream.subset is not None and not backends:
            self._metrics.errors.labels("no_subset_candidate").inc()
            return msg.NO_CANDIDATE
        target = self._decide(stream, body, backends, parsed)
        exchange = stream.exchange
        if exchange is not None and exchange.decision.label in _REFUSALS:
            return _REFUSALS[exchange.decision.label]
        if exchange is not None and self._refuses_unread(stream, exchange, body):
            return msg.UNREAD_IN_SPLIT_FLEET
        stream.destination = target
        reply = msg.routing(kind, target, self._engine_priority(stream))
        if target is not None and exchange is not None and stream.span is not None and self._tracer is not None:
            reply = msg.copied(reply)
            self._traced(stream, stream.span, self._tracer, exchange, getattr(reply, kind).response.header_mutation)
        return reply

    def _engine_priority(self, stream: Stream) -> str | None:
        """The request's priority as its engine reads it (vLLM serves lower first), if the policy
        tells engines; kept on the stream's headers for a prefill leg, a client's own never."""
        if not self._router.settings.engine_priority:
            stream.headers.pop(ENGINE_PRIORITY_HEADER, None)
            return None
        value = stream.headers[ENGINE_PRIORITY_HEADER] = str(-objective_priority(stream.headers, self._priorities()))
        return value

    def _refuses_unread(self, stream: Stream, exchange: Exchange, body: bytes | None) -> bool:
        """A body kvroute could not read (or would not: too large), in a fleet that splits prefill
        from decode, is refused rather than passed on: it may carry transfer parameters kvroute
        cannot strip. Elsewhere such a body goes least loaded, and the engine answers it."""
        unread = exchange.request is None and (body is not None or stream.held_bytes > 0)  # (not an empty body)
        if not unread or not self._runs_connectors():
            return False
        exchange.end()
        self._metrics.errors.labels("unread_in_split_fleet").inc()
        return True

    def _decide(
        self, stream: Stream, body: bytes | None, backends: Sequence[Backend], parsed: Parsed | None
    ) -> str | None:
        """Body (or what was read of it) -> exchange among `backends` -> destination (None: no
        backend). A missing or unreadable body goes least loaded (fail-open), counted once under
        its own kind."""
        started = time.perf_counter()
        exchange = None
        if body is not None:
            read = parsed if parsed is not None else self._read(body, stream.headers)
            if isinstance(read, InvalidRequest):
                log.info(
                    "unroutable body (%s), request %s routed least loaded", read, stream.headers.get("x-request-id")
                )
                self._metrics.errors.labels("invalid_request").inc()
            else:
                if read.truncated:
                    self._metrics.errors.labels("prompt_budget").inc()
                self._ttft_objective(stream, read)
                exchange = self._router.begin(read, backends, self._clock())
        if exchange is None:
            exchange = self._router.begin_unreadable(backends, self._clock())
        stream.exchange = exchange
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        decision = exchange.decision
        if decision.backend is None:
            return None
        second = decision.second if self._fallback else None
        return decision.backend if second is None else f"{decision.backend},{second}"

    def _traced(
        self, stream: Stream, span: Span, tracer: RequestTracer, exchange: Exchange, mutation: pb.HeaderMutation
    ) -> None:
        """The decision on the request's span, and the span's trace context passed on: to the
        backend (a header Envoy sets) and to a prefill leg (which forwards the stream's headers)."""
        request = exchange.request
        tracer.decided(span, exchange.decision, self._router.block_tokens(), None if request is None else request.model)
        for name, value in tracer.context_headers(span).items():
            stream.headers[name] = value
            mutation.set_headers.append(msg.header(name, value))

    def _ttft_objective(self, stream: Stream, request: PromptRequest) -> None:
        """The request's TTFT objective, less what it waited held, and whether it may be refused
        (its objective's priority is below 0): SLO admission reads them (rules.ttft_objective)."""
        headers = stream.headers
        if not any(name in headers for name in TTFT_HEADERS):
            return
        request_class = classify(headers, self._priorities(), self._router.settings.tenant_header)
        if request_class.ttft_s is None:
            return
        held = stream.dispatched
        request.ttft_objective_s = request_class.ttft_s - (0.0 if held is None else self._clock() - held.arrived)
        request.sheddable = request_class.priority < 0

    def _read(self, body: bytes | Mapping[str, Any], headers: dict[str, str]) -> Parsed:
        """Parse, tokenize (precise mode) and hash a body, or say why it cannot be routed by it; may
        run in a worker thread (the router's parse and chain touch no shared state but the
        tokenizer's own locked cache). `body` may be its JSON, already decoded."""
        try:
            request = self._router.parse(body, headers)
        except InvalidRequest as exc:
            return exc
        self._router.chain_of(request)
        return request

    def responded(self, stream: Stream, upstream: str, status: int, details: str, connect_failed: bool) -> Outcome:
        """The gateway's view of a decided request's response (both transports: its start here,
        its end in ext_authz's access log) for the core: a refused connection makes the backend
        suspect, and the route span is told."""
        owner = stream.owner
        if owner is not None and owner is not self:
            return owner.responded(stream, upstream, status, details, connect_failed)
        assert stream.exchange is not None  # (only decided requests get here)
        known = self._pool.canonical(upstream) if upstream else None
        start = ResponseStart(
            upstream=known or upstream,
            known=known is not None,
            status=status,
            from_upstream=details == "via_upstream",
            connect_failed=connect_failed,
        )
        outcome = self._router.response_started(stream.exchange, start, self._clock())
        if outcome.refused:
            self._pool.mark_suspect(outcome.served)
        if stream.span is not None and self._tracer is not None:
            self._tracer.responded(stream.span, start.status, outcome.served)
        return outcome

    def _on_response_headers(self, message: pb.ProcessingRequest, stream: Stream) -> pb.ProcessingResponse:
        """Translate Envoy's view of the response start for the core, and its answer back."""
        if stream.exchange is None:
            return msg.CONTINUE_RESPONSE_HEADERS
        status = msg.headers(message.response_headers).get(":status", "")
        details = msg.attribute(message, "response.code_details") or ""
        upstream = msg.served(message) or msg.attribute(message, "upstream.address") or ""
        code = int(status) if status.isdigit() else 0
        outcome = self.responded(stream, upstream, code, details, "connection_failure" in details)
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
            return msg.CONTINUE_RESPONSE_HEADERS
        mutation = pb.HeaderMutation(set_headers=[msg.header(key, value) for key, value in outcome.headers])
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )
