"""The ext_authz transport: Envoy asks for each request's route over plain HTTP/1.1, and tells how
each request ended through its access log, on the same port (ends.py;
docs/envoy.md#the-ext_authz-transport).

Why: an ext_proc stream costs grpc.aio 380-410 µs of CPU per request before kvroute decides
anything, an ext_authz HTTP call about 120 (docs/benchmarks.md, `bench floors`). The decision is
the same code as the ext_proc path's (`Processor.request_headers`, `Processor.decide_body`): flow
control, adapter placement, the core's lifecycle. What moves:

- The route comes back as the 200's destination header, which Envoy's `allowed_upstream_headers`
  puts on the upstream request before its router picks the host, with `EXCHANGE_HEADER` naming
  the exchange; a refusal (429, 503) is the answer's own status, which Envoy sends the client.
- Learning, and the release of what the request holds, come with its access-log entry, at the
  request's end instead of its response's start; the upstream that served and its status are
  the entry's. The decision headers go to the client with the decision, not the response.
- The body cannot be rewritten: a request that carries `kv_transfer_params` is refused with a
  400 (the ext_proc path strips them), and prefill/decode splitting needs the ext_proc path.
- An entry that never comes (Envoy restarted, the log connection broke) is swept once the engines'
  counts show nobody serves its request at two sweeps in a row (`_unreported`), at the latest
  after `max_stream_age_s`, like an ext_proc stream that never ended.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from extproc.core.objectives import ENGINE_PRIORITY_HEADER
from extproc.envoy import messages as msg
from extproc.envoy.calls import Call, CallProtocol, answer
from extproc.envoy.ends import BACKSTOP_FIELD, RECORD_LIMITS, EndsProtocol, Sniffer
from extproc.envoy.headers import DESTINATION_HEADER, EXCHANGE_HEADER, ROUTE_PREFIX
from extproc.envoy.processor import Phase, Processor, Stream
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.runtime.metrics import Metrics
from extproc.runtime.tracing_wanted import TRACE_HEADERS

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 30.0
# An exchange decided this long before its backend's latest engine sample, beyond the requests that
# sample counted running or waiting there, is not being served: its entry was lost (a log stream
# cut as a replica stopped: Envoy does not send an entry again).
UNREPORTED_S = 30.0
ENDED_LATE_KEPT = 4096  # exchanges the backstop ended whose own record may still come (Authz.ended)
FORWARDED_MAX_BYTES = 64 * 1024  # a request's record from a sibling: a few hundred bytes; past this it is not one
_UNSPLIT = (
    "Envoy asks over ext_authz, which cannot hand a prefill over: every request is served whole "
    "(`kvroute envoy-config --transport ext_proc`, the chart's envoy.transport: ext_proc)"
)


def _immediate(reply: pb.ProcessingResponse) -> bytes:
    """An ext_proc immediate response (429, 503) as the ext_authz answer Envoy passes on."""
    immediate = reply.immediate_response
    headers = [(option.header.key, msg.text(option.header)) for option in immediate.headers.set_headers]
    return answer(immediate.status.code or 503, headers, immediate.body)


_UNAUTHENTICATED = answer(401)
_NOT_FOUND = answer(404)
_HEALTHY = answer(200, body=b"ok")
_TRANSFER_PARAMS = answer(400, body=b"kv_transfer_params are not accepted from clients")


class Authz:
    """The check handler and the access-log servicer's target: open exchanges by id."""

    def __init__(
        self,
        processor: Processor,
        metrics: Metrics,
        token: str = "",
        clock: Callable[[], float] = time.monotonic,
        max_age_s: float = 3600.0,
        replica: str = "",
        forward: Callable[[str, bytes], bool] | None = None,
    ) -> None:
        """`replica` and `forward`, with siblings: exchange ids name the replica that decided them,
        and an entry for a sibling's is sent to it (`forward(replica, entry)`, False if it could
        not be), since Envoy's log stream reaches whichever replica it reached."""
        self._processor = processor
        self._metrics = metrics
        self._token = f"Bearer {token}".encode() if token else b""
        self._log_token = token
        self._logs: set[asyncio.BaseTransport] = set()  # Envoy's open access-log connections
        self._calls: set[CallProtocol] = set()  # and its open call connections
        self._clock = clock
        self._max_age_s = max_age_s
        self._ids = itertools.count(1)
        self._replica = replica
        # Exchange ids name their process: without replicas too, a log connection may reach another
        # process (a rolling update's new pod), whose own counter would give the same ids.
        self._id_prefix = f"{replica or os.urandom(4).hex()}."
        self._forward = forward
        self.forwarded = 0
        self._open: dict[str, tuple[Stream, float]] = {}  # exchange id -> its stream, when decided
        # exchanges the backstop's copy ended, so that their own record, should it still come
        # (the two loggers' connections race), is not counted unknown; the oldest go past the bound
        self._ended_late: OrderedDict[str, bool] = OrderedDict()
        self._suspects: set[str] = set()  # exchanges the last sweep found no engine serving
        self.unsplit = 0  # requests served whole in a fleet with prefill servers: see `warnings`
        self._refusals: dict[str, int] = {}  # why -> calls refused unread (a handful of reasons)

    def protocols(self) -> Callable[[], asyncio.Protocol]:
        """The port's protocol factory: ext_authz calls to `answer`, the access log's records to
        `ended`."""
        refused = self._metrics.errors.labels("unauthenticated_stream").inc

        def calls() -> asyncio.Protocol:
            return CallProtocol(self.admit, self.answer, self._malformed, self._calls)

        def ends() -> asyncio.Protocol:
            return EndsProtocol(self.ended, self._log_token, refused, self._logs)

        return lambda: Sniffer(calls, ends)

    def admit(self, method: str, target: str, headers: Mapping[str, str]) -> bytes | None:
        """A call's head, before its body is read: a route asked with the token, or the health
        check; anything else is answered now (and its connection closed)."""
        if target.startswith(ROUTE_PREFIX):
            if self._token and not hmac.compare_digest(headers.get("authorization", "").encode(), self._token):
                self._metrics.errors.labels("unauthenticated_stream").inc()
                return _UNAUTHENTICATED
            return None
        if target == "/health" and method == "GET" and headers.get("content-length", "0") == "0":
            return None
        self._malformed("neither the route nor the health check")  # (a health check with a body:
        return _NOT_FOUND  # nothing to buffer unasked)

    def _malformed(self, why: str) -> None:
        """A call refused unread: counted, and logged on the 1st, 2nd, 4th, 8th... of its kind
        (a caller sending them by the thousand must not flood the log)."""
        self._metrics.errors.labels("malformed_call").inc()
        count = self._refusals[why] = self._refusals.get(why, 0) + 1
        if count & (count - 1) == 0:
            log.warning("refused an ext_authz call: %s (%d so far)", why, count)

    async def answer(self, call: Call) -> bytes:
        """An admitted call: a route (under ROUTE_PREFIX), or the health check's."""
        return await self.check(call) if call.target.startswith(ROUTE_PREFIX) else _HEALTHY

    async def check(self, call: Call) -> bytes:
        """One request's route. Envoy sends its method, path (after ROUTE_PREFIX), the headers it
        forwards and its buffered body. Whatever the call ends in without an exchange id Envoy will
        report (Envoy left while the request was held, a failure inside kvroute), its request is
        released here: no record of its end will come."""
        stream = Stream()
        try:
            return await self._route(stream, call)
        except BaseException:
            self._processor.closed(stream)  # (again, where it was already: closing is idempotent)
            raise

    async def _route(self, stream: Stream, call: Call) -> bytes:
        headers = call.headers
        headers[":method"] = call.method
        headers[":path"] = call.target[len(ROUTE_PREFIX) :] or "/"
        body = call.body
        reply = self._processor.request_headers(stream, headers, end_of_stream=not body)
        if stream.phase is Phase.BODY:
            reply = await self._processor.decide_body(stream, body)
        if reply.HasField("immediate_response"):
            self._processor.closed(stream)
            return _immediate(reply)
        if (
            stream.exchange is not None
            and stream.exchange.request is not None
            and stream.exchange.request.transfer_params
        ):
            self._processor.closed(stream)  # the body cannot be rewritten here: never passed on
            self._metrics.errors.labels("client_transfer_params").inc()
            return _TRANSFER_PARAMS
        target = stream.destination
        routed = [(DESTINATION_HEADER, target)] if target is not None else []
        if ENGINE_PRIORITY_HEADER in stream.headers:  # (set by the decision when the policy tells engines)
            routed.append((ENGINE_PRIORITY_HEADER, stream.headers[ENGINE_PRIORITY_HEADER]))
        exchange = stream.exchange
        if exchange is None or exchange.decision.backend is None:  # passed through, or unrouted
            self._processor.closed(stream)
            return answer(200, routed)
        owner = self._processor.owner_of(stream)  # the policy that decided it
        if owner.splits():
            self._unsplit()
        key = f"{self._id_prefix}{next(self._ids):x}"
        router = owner.router
        router.sent(exchange, self._clock())
        routed.append((EXCHANGE_HEADER, key))
        if stream.span is not None:  # the route span's context, for the backend's own spans to join
            routed += [(name, stream.headers[name]) for name in TRACE_HEADERS if name in stream.headers]
        if router.settings.decision_headers and exchange.request is not None:  # (none when unread)
            backend = exchange.decision.backend
            routed += router.decision_headers(exchange, backend, exchange.predicted_blocks)
        self._open[key] = (stream, self._clock())  # last: from here its end comes in Envoy's log
        return answer(200, routed)

    def _unsplit(self) -> None:
        """A request a disaggregated fleet would have split, served whole: this transport cannot
        rewrite the body with the prefill's transfer parameters. Counted, and said once."""
        if not self.unsplit:
            log.warning("the fleet has prefill servers, but %s", _UNSPLIT)
        self.unsplit += 1
        self._metrics.disaggregation.labels("transport").inc()

    def warnings(self) -> list[str]:
        """For /readyz: a disaggregated fleet asked over this transport."""
        routes = self._processor.routes
        processors = (self._processor,) if routes is None else routes.processors
        split = any(processor.splits() for processor in processors)
        return [f"prefill/decode: {_UNSPLIT}"] if self.unsplit and split else []

    def ended(self, record: Mapping[str, Any]) -> None:
        """A request's access-log record (ends.RECORD): where it was served and with what status.
        The core learns from a 2xx and the exchange releases what it held."""
        key = record.get("x")
        key = key if isinstance(key, str) else ""  # (no exchange has that id)
        opened = self._open.pop(key, None)
        backstop = BACKSTOP_FIELD in record
        if opened is None:
            owner = key.partition(".")[0] if "." in key else ""
            forward = self._forward
            if owner not in ("", self._replica) and forward is not None and forward(owner, msgpack.packb(record)):
                self.forwarded += 1
            elif not (backstop or self._ended_late.pop(key, False)):
                self._metrics.errors.labels("unknown_exchange").inc()  # (else an expected copy)
            return
        if backstop:  # its own record was lost (Envoy dropped it while connecting) or is still coming
            self._metrics.errors.labels("late_end").inc()
            self._ended_late[key] = True
            if len(self._ended_late) > ENDED_LATE_KEPT:
                self._ended_late.popitem(last=False)
        stream = opened[0]
        upstream, status, details, flags = record.get("u"), record.get("c"), record.get("d"), record.get("f")
        try:
            self._processor.responded(
                stream,
                upstream if isinstance(upstream, str) and upstream != "-" else "",
                status if isinstance(status, int) else 0,
                details if isinstance(details, str) else "",
                isinstance(flags, str) and "UF" in flags.split(","),
            )
        finally:  # out of the open exchanges already: released here or never
            self._processor.closed(stream)

    def ended_elsewhere(self, data: bytes) -> None:
        """A record a sibling's log connection got for an exchange this replica decided."""
        try:  # (bounded as Envoy's own records are: it comes through the replica store)
            record = msgpack.unpackb(data, raw=False, **RECORD_LIMITS) if len(data) <= FORWARDED_MAX_BYTES else None
        except (msgpack.UnpackException, ValueError, TypeError):
            record = None
        if not isinstance(record, dict):
            self._metrics.errors.labels("unknown_exchange").inc()
            return
        self.ended(record)

    def sweep(self) -> int:
        """Close the exchanges whose entry never came within `max_age_s`, and those the engines
        cannot be serving (`_unreported`); how many."""
        cutoff = self._clock() - self._max_age_s
        stale = [key for key, (_, decided) in self._open.items() if decided < cutoff]
        for key in stale:
            self._close(key, "stream_age_limit")
        # Only what two sweeps in a row found unserved: a request the engine has just finished
        # while its entry is on the way would be found once, a lost one every time.
        found = self._unreported()
        unreported = [key for key in found if key in self._suspects]
        self._suspects = set(found) - set(unreported)
        for key in unreported:
            self._close(key, "unreported_end")
        return len(stale) + len(unreported)

    def _close(self, key: str, kind: str) -> None:
        stream, _ = self._open.pop(key)
        self._metrics.errors.labels(kind).inc()
        self._processor.closed(stream)

    def _unreported(self) -> list[str]:
        """Open exchanges no engine serves: per backend, the oldest of those decided UNREPORTED_S
        before its engine's latest sample, beyond the requests that sample counted running or
        waiting. Those counts are the whole fleet's (every replica's and other clients' requests),
        so only requests no engine holds are taken; one the engine finished while Envoy still
        streams its response to a slow client may be among them."""
        by_backend: dict[tuple[Processor, str], list[tuple[float, str]]] = {}
        for key, (stream, decided) in self._open.items():
            exchange = stream.exchange
            backend = exchange.decision.backend if exchange is not None else None
            if backend is not None:
                by_backend.setdefault((self._processor.owner_of(stream), backend), []).append((decided, key))
        lost = []
        for (owner, backend), opened in by_backend.items():
            load = owner.router.loads.known(backend)
            if load is None:  # it left (its load with it); the age limit still ends these
                continue
            old = sorted(item for item in opened if item[0] < load.engine_at - UNREPORTED_S)
            lost += [key for _, key in old[: max(0, len(old) - load.engine_requests)]]
        return lost

    async def sweep_forever(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.sweep()
            except Exception:  # one failed sweep must not end the sweeping: every lost end would stay
                log.exception("the sweep of open exchanges failed")
                self._metrics.errors.labels("internal").inc()

    def close_logs(self) -> None:
        """Stopping: Envoy's log connections close (it makes them again to a sibling), before the
        replica link stops forwarding what they bring."""
        for transport in list(self._logs):
            transport.close()
        self._logs.clear()

    async def close_calls(self, timeout_s: float) -> None:
        """Stopping, once no new connection comes: each call being decided is given `timeout_s`
        to be answered (flow control's drain answers those it held), then its connection closes."""
        calls = list(self._calls)
        if calls:
            await asyncio.gather(*(call.finish(timeout_s) for call in calls))

    def close_all(self) -> None:
        """Stopping: every open exchange releases what it holds."""
        while self._open:
            _, (stream, _) = self._open.popitem()
            self._processor.closed(stream)

    def state(self) -> dict[str, Any]:
        return {"open_exchanges": len(self._open), "forwarded_ends": self.forwarded}
