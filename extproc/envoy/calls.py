"""Envoy's ext_authz calls over HTTP/1.1, read by a small asyncio protocol instead of aiohttp's
server (authz.py decides them; docs/envoy.md#the-ext_authz-transport).

Why: aiohttp's request machinery (its request and response objects, URL routing, header
multidicts, its writer) cost about 140 µs of CPU a call at 8 KB and 16 concurrent, against about
30 for a bare protocol (`kvroute-dev bench floors`: `ext_authz_http` against `ext_authz_raw`), a
third of all kvroute spent per request on this transport.

The only callers are Envoy's ext_authz HTTP client and its health checker, so this reads what
they send and nothing more: one call at a time on a connection (bytes of a next call wait until
the current one is answered; reading goes on meanwhile, so that a caller leaving is seen at once,
and pauses past `MAX_HEAD_BYTES` of them, or while the caller does not read its answers), its body
sized by `Content-Length` (ASCII digits only). Anything else is answered and the connection closed:
a head that does not parse 400, a head over `MAX_HEAD_BYTES` 431, or not whole `HEAD_TIMEOUT_S`
after its first byte 408, a body not whole `HEAD_TIMEOUT_S` after its head plus a second for each
`MIN_BODY_BYTES_PER_S` it declares 408 (a `Content-Length` that lies, a body trickled in), a body
over `MAX_BODY_BYTES` 413, a chunked body 501 (a 5xx: Envoy treats it as the service failing, and
its failure mode decides). The head is judged before the
body is read (`admit`: a call without the token is refused then, so an unauthenticated caller makes
nothing buffer its body). A connection that closes while its call is being decided cancels it (a
request held by flow control leaves the queue at once). A connection idle between calls stays:
Envoy keeps its pool's open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

from extproc.envoy.bootstrap import BODY_LIMIT

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # Envoy's own default limit on a request's headers is 60 KiB
HEAD_TIMEOUT_S = 10.0  # Envoy writes a head at once: one trickled in slower holds a connection for nothing
MAX_SIZE_DIGITS = 10  # a Content-Length past MAX_BODY_BYTES is refused anyway
MAX_BODY_BYTES = BODY_LIMIT  # what kvroute's Envoy buffers and sends (with_request_body)
# Envoy sends a body it buffered at once, over loopback or a pod network: far faster than this.
MIN_BODY_BYTES_PER_S = 1024 * 1024
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(slots=True)
class Call:
    """One call: its method, its target (path and query, as sent), its headers (names in lower
    case; of a repeated name, the last), its body."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes


def answer(status: int, headers: Iterable[tuple[str, str]] = (), body: bytes = b"") -> bytes:
    """An HTTP/1.1 response as sent. A header value with a line break is left out: it would end
    the head (kvroute's own values never hold one; this keeps it so)."""
    head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
    for name, value in headers:
        if "\r" not in value and "\n" not in value:
            head.append(f"{name}: {value}\r\n".encode())
    head.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(head) + body


_MALFORMED = answer(400, body=b"malformed request")
_HEAD_TOO_LARGE = answer(431)
_TOO_SLOW = answer(408)
_BODY_TOO_LARGE = answer(413)
_CHUNKED = answer(501, body=b"chunked bodies are not read here")
FAILED = answer(500)


class _Malformed(Exception):
    def __init__(self, reply: bytes, why: str) -> None:
        self.reply = reply
        self.why = why


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str], int, bool]:
    """(method, target, headers, body size, keep the connection) of a request's head, without
    its blank line; _Malformed with the answer to send if it is not one this server reads."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed(_MALFORMED, "a head that is not UTF-8") from None
    lines = text.split("\r\n")
    request_line = lines[0].split(" ")
    if len(request_line) != 3 or request_line[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Malformed(_MALFORMED, "a bad request line")
    method, target, version = request_line
    if not method.isalpha() or not target.startswith("/"):
        raise _Malformed(_MALFORMED, "a bad method or target")
    headers: dict[str, str] = {}
    size: str | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name[-1] in " \t" or name[0] in " \t":  # no name, or obsolete folding
            raise _Malformed(_MALFORMED, "a bad header line")
        name, value = name.lower(), value.strip(" \t")
        if name == "content-length":
            if not (value.isascii() and value.isdigit() and len(value) <= MAX_SIZE_DIGITS):  # not "²", not "١٢"
                raise _Malformed(_MALFORMED, "a bad Content-Length")
            if size is not None and size != value:  # conflicting sizes: smuggling
                raise _Malformed(_MALFORMED, "conflicting Content-Lengths")
            size = value
        elif name == "transfer-encoding":
            raise _Malformed(_CHUNKED, "a chunked body")
        headers[name] = value
    length = int(size) if size is not None else 0
    if length > MAX_BODY_BYTES:
        raise _Malformed(_BODY_TOO_LARGE, "a body too large")
    connection = headers.get("connection", "").lower()
    keep = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return method, target, headers, length, keep


@dataclass(slots=True)
class _Head:
    """An admitted call's head: the call (its body to come), where its body starts in the buffer,
    how long it is, and whether the connection stays open after the answer."""

    call: Call
    start: int
    length: int
    keep: bool


class CallProtocol(asyncio.Protocol):
    """One connection's calls: each head judged by `admit` (the answer refusing it, which closes
    the connection, or None to read on), each call then handed to `handle` once whole and answered
    with the bytes it returns (`answer`). `malformed` is told why of each call refused unread."""

    def __init__(
        self,
        admit: Callable[[str, str, dict[str, str]], bytes | None],
        handle: Callable[[Call], Awaitable[bytes]],
        malformed: Callable[[str], None],
        open_calls: set[CallProtocol],
    ) -> None:
        self._admit = admit
        self._handle = handle
        self._malformed = malformed
        self._open = open_calls  # so that a stopping ext_proc can wait for and close them
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None  # the call being decided
        self._head: _Head | None = None  # the call whose body is still coming, its head admitted
        self._scanned = 0  # bytes of the buffer already searched for a head's end
        self._writable = True  # the caller reads its answers (asyncio's write-buffer flow control)
        self._deadline: asyncio.TimerHandle | None = None  # a call begun, not yet whole

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._open.discard(self)
        self._buffer.clear()
        self._head = None
        self._stop_clock()
        if self._task is not None:
            self._task.cancel()

    def pause_writing(self) -> None:
        self._writable = False  # no next call, and nothing more read, until the caller reads
        self._flow()

    def resume_writing(self) -> None:
        self._writable = True
        if self._task is None:
            self._next()
        self._flow()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._task is None:
            self._next()
        self._flow()

    def _flow(self) -> None:
        """Read on while a call's bytes are awaited; past MAX_HEAD_BYTES of a next call's (not
        Envoy's way: it waits for each answer), or while answers are not read, pause."""
        transport = self._transport
        if transport is None:
            return
        waiting = self._task is None and self._writable
        if not waiting and (len(self._buffer) > MAX_HEAD_BYTES or not self._writable):
            if transport.is_reading():
                transport.pause_reading()
        elif not transport.is_reading():
            transport.resume_reading()

    def _start_clock(self, seconds: float) -> None:
        """What has begun of a call (its head, or its body) must be whole within `seconds`."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(seconds, self._too_slow)

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self._malformed("not whole in time")
        self._refuse(_TOO_SLOW)

    def _next(self) -> None:
        """Start the next call if its bytes are all in (its head parsed and admitted once)."""
        transport, buffer = self._transport, self._buffer
        if transport is None or not self._writable:
            return
        head = self._head
        if head is None:
            end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))  # (not the whole head again each read)
            if end > MAX_HEAD_BYTES or (end < 0 and len(buffer) > MAX_HEAD_BYTES):
                self._malformed("head too large")
                self._refuse(_HEAD_TOO_LARGE)
                return
            if end < 0:
                self._scanned = len(buffer)
                if buffer:
                    self._start_clock(HEAD_TIMEOUT_S)
                return
            self._scanned = 0
            self._stop_clock()
            try:
                method, target, headers, length, keep = _parse_head(bytes(buffer[:end]))
            except _Malformed as refused:
                self._malformed(refused.why)
                self._refuse(refused.reply)
                return
            refusal = self._admit(method, target, headers)
            if refusal is not None:
                self._refuse(refusal)
                return
            head = self._head = _Head(Call(method, target, headers, b""), end + 4, length, keep)
        finish = head.start + head.length
        if len(buffer) < finish:
            self._start_clock(HEAD_TIMEOUT_S + head.length / MIN_BODY_BYTES_PER_S)
            return
        self._stop_clock()
        self._head = None
        with memoryview(buffer) as view:  # one copy of the body (a slice and bytes() were two: 32 MiB, 33 ms)
            head.call.body = view[head.start : finish].tobytes()
        del buffer[:finish]
        self._task = asyncio.get_running_loop().create_task(self._serve(head.call, head.keep))

    async def _serve(self, call: Call, keep: bool) -> None:
        try:
            reply = await self._handle(call)
        except Exception:
            log.exception("ext_authz call failed; Envoy's failure mode decides")
            reply = FAILED
        self._task = None
        transport = self._transport
        if transport is None:
            return
        transport.write(reply)
        if not keep:
            transport.close()
            return
        self._next()
        self._flow()

    def _refuse(self, reply: bytes) -> None:
        """A call this server does not read: answered, the connection closed."""
        if self._transport is not None:
            self._transport.write(reply)
            self._transport.close()
        self._buffer.clear()
        self._head = None
        self._scanned = 0
        self._stop_clock()

    async def finish(self, timeout_s: float) -> None:
        """Stopping: the call being decided is given `timeout_s` to be answered, then the
        connection closes."""
        task = self._task
        if task is not None:
            await asyncio.wait([task], timeout=timeout_s)
        if self._transport is not None:
            self._transport.close()
