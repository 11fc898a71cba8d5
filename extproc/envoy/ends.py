"""Each request's end, as Envoy's Fluentd access logger sends it, on the ext_authz port itself.

Why not Envoy's gRPC access-log service: grpc.aio hands every message from its poller thread to
the event loop. Moving the records here cut the ext_proc's CPU per request by 80-110 µs at 16
concurrent, about a fifth (docs/benchmarks.md, "Request ends over Envoy's Fluentd logger"). The
Fluentd logger (`envoy.access_loggers.fluentd`) writes each entry, as it is logged, to one plain
TCP connection per Envoy worker (through a relay inside Envoy: bootstrap._ENDS_RELAY says why):
MessagePack in the Forward protocol's forward mode, `[tag, [[time, record], ...]]`, the record a
map whose fields the bootstrap names (`RECORD`). Read here from the socket as it comes, it costs
a few microseconds. A second, backstop logger sends every record again, batched, over its own
connection (`BACKSTOP_FIELD`).

The connection comes to the ext_authz port (one port, one Service, one TLS setup for both): its
first byte tells them apart, `0x92` (a two-element MessagePack array) for the log, an HTTP
method's letter for ext_authz calls, which go on to calls.py's protocol. With a token, the log
proves itself as the calls do: the first record of a connection must carry it (field `k`), else
the connection is closed, counted, and nothing it sent is applied.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

log = logging.getLogger(__name__)

FORWARD_MODE = 0x92  # msgpack fixarray of two: [tag, entries]
# The backstop logger's buffer (bootstrap._access_log): Envoy counts an entry's 8-byte time and its
# record's 25 bytes or more, so a full buffer is at most about 1,000 entries and 32 KiB, within
# what one message may declare (4,096 entries) and before a connection's token is proven (64 KiB).
BACKSTOP_BUFFER_BYTES = 32 * 1024
# A message is one entry of a few hundred bytes, or the backstop's batch of up to its buffer's size
# and one entry more; a stream with more than this of one message still coming is closed. Its bytes
# are only framed (skipped over, building nothing) until the message is whole, then decoded at
# once: MessagePack decoded can take 70 times its bytes, so an unfinished message must not be.
MAX_MESSAGE_BYTES = 2 * BACKSTOP_BUFFER_BYTES
READ_BYTES = 1 << 20  # what the framer buffers at most: one socket read (asyncio's are up to 256 KiB)
# A record's fields are short strings: what one whole message may declare.
RECORD_LIMITS = {"max_str_len": 4096, "max_bin_len": 0, "max_ext_len": 0, "max_map_len": 64, "max_array_len": 4096}
PROOF_BYTES = 64 * 1024  # a stream must prove the token within this many bytes ...
PROOF_TIMEOUT_S = 10.0  # ... and this long after its first byte, or it is closed

# The record Envoy sends for each request's end: field -> Envoy's substitution format. Short keys:
# every entry carries them.
RECORD = {
    "x": "%REQ(X-KVROUTE-EXCHANGE)%",  # the exchange the ext_authz answer named
    "u": "%UPSTREAM_REMOTE_ADDRESS%",  # who served it ("-": nobody)
    "c": "%RESPONSE_CODE%",  # its status (0: none)
    "d": "%RESPONSE_CODE_DETAILS%",  # why ("via_upstream", "upstream_reset_before_response_started{...}", ...)
    "f": "%RESPONSE_FLAGS%",  # Envoy's short flags ("UF": the upstream connection failed)
}
TOKEN_FIELD = "k"
# Set on the records of the backstop logger (bootstrap._access_log), which sends every entry a
# second time, batched: Envoy's Fluentd logger drops what is logged while its connection is being
# made when its buffer holds one record (the immediate logger's), and the backstop's larger buffer
# keeps them. A backstop record whose exchange is already ended is the expected duplicate.
BACKSTOP_FIELD = "b"


class EndsProtocol(asyncio.Protocol):
    """One Envoy worker's log connection: each record to `on_record`, in order."""

    def __init__(
        self,
        on_record: Callable[[Mapping[str, Any]], None],
        token: str,
        refused: Callable[[], None],
        open_logs: set[asyncio.BaseTransport],
    ) -> None:
        self._on_record = on_record
        self._open_logs = open_logs  # so that a stopping ext_proc can close them (Authz.close_logs)
        self._token = token.encode()
        self._refused = refused
        self._proven = not token
        # frames the stream: finds where each message ends without decoding it; its buffer starts
        # small and grows with what comes (by default it would take READ_BYTES per connection)
        self._framer = msgpack.Unpacker(max_buffer_size=READ_BYTES, read_size=4096, **RECORD_LIMITS)
        self._pending = bytearray()  # the bytes of messages not yet whole (and of the next ones)
        self._framed = 0  # where in the stream the last whole message ended
        self._transport: asyncio.BaseTransport | None = None
        self._unproven_bytes = 0
        self._proof_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._open_logs.add(transport)
        if not self._proven:  # (made by the Sniffer as the first bytes come)
            self._proof_deadline = asyncio.get_running_loop().call_later(PROOF_TIMEOUT_S, self._unproven)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_proof_clock()
        if self._transport is not None:
            self._open_logs.discard(self._transport)
            self._transport = None

    def _stop_proof_clock(self) -> None:
        if self._proof_deadline is not None:
            self._proof_deadline.cancel()
            self._proof_deadline = None

    def _unproven(self) -> None:
        self._stop_proof_clock()
        if not self._proven and self._transport is not None:
            self._refused()
            self._close("an access-log stream that did not prove the token in time")

    def data_received(self, data: bytes) -> None:
        if not self._proven:
            self._unproven_bytes += len(data)
            if self._unproven_bytes > PROOF_BYTES:
                self._unproven()
                return
        try:
            self._framer.feed(data)
            self._pending += data
            while self._transport is not None:  # (closed: nothing more is applied)
                try:
                    self._framer.skip()
                except msgpack.OutOfData:
                    break
                end = self._framer.tell()
                size = end - self._framed
                message = msgpack.unpackb(self._pending[:size], raw=False, **RECORD_LIMITS)
                del self._pending[:size]
                self._framed = end
                self._message(message)
            if len(self._pending) > MAX_MESSAGE_BYTES:
                raise ValueError("a message too long")
        except (msgpack.UnpackException, ValueError, TypeError) as error:  # BufferFull is a ValueError
            self._close(f"not an access-log stream ({error.__class__.__name__})")

    def _message(self, message: Any) -> None:
        if not isinstance(message, (list, tuple)) or len(message) != 2 or not isinstance(message[1], (list, tuple)):
            raise TypeError("not a forward-mode message")
        for entry in message[1]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
                raise TypeError("not a forward-mode entry")
            record = entry[1]
            if not self._proven:
                token = record.get(TOKEN_FIELD)
                if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
                    self._refused()
                    self._close("an access-log stream without the token")
                    return
                self._proven = True
                self._stop_proof_clock()
            record.pop(TOKEN_FIELD, None)  # never passed on (a sibling's record goes through the store)
            try:
                self._on_record(record)
            except Exception:  # one bad record must not end the stream (and lose the rest)
                log.exception("access-log record could not be applied")

    def _close(self, why: str) -> None:
        log.warning("closed a connection to the ext_authz port: %s", why)
        if self._transport is not None:
            self._open_logs.discard(self._transport)
            self._transport.close()
            self._transport = None


class Sniffer(asyncio.Protocol):
    """A connection to the ext_authz port until its first byte says what it is: then handed, with
    that byte, to the access-log protocol or to the calls' (calls.py)."""

    def __init__(self, http: Callable[[], asyncio.BaseProtocol], ends: Callable[[], asyncio.Protocol]) -> None:
        self._http = http
        self._ends = ends
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or not data:
            return
        protocol = self._ends() if data[0] == FORWARD_MODE else self._http()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        assert isinstance(protocol, asyncio.Protocol)
        protocol.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
