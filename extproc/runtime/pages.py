"""GET a backend's small pages (/metrics, /v1/models) over one kept-alive HTTP/1.1 connection per
backend, parsed by httptools (llhttp, as uvicorn uses it), without a client library's per-request
objects, headers and timers: the scrape runs several times a second per backend, and through
aiohttp it cost an ext_proc about 0.8 ms of CPU a page (docs/benchmarks.md, "Where the stack's CPU
goes"). One request at a time per connection, as the scraper asks; a connection in an unknown
state (a timeout, a reset, a page cut short, an answer that does not parse, bytes nobody asked
for) is closed, and the next request opens a new one. Interim answers (100, 103) are skipped; a
body with neither a length nor chunks ends where the server closes. A request on a kept
connection that fails before any byte of its answer came is sent once more on a new one: the
server may have closed the connection idle as the request went (RFC 9112 9.3.1; vLLM's server
closes one idle for 5 s), which must not read as a dead backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httptools

# Pages come uncompressed: prometheus_client gzips them for a client that accepts it, which costs
# the engine and kvroute more CPU than the bytes saved on loopback or a pod network.
_HEADERS = b"Accept-Encoding: identity\r\nUser-Agent: kvroute\r\n"
# An answer's head larger than this is not read on: httptools gathers a header's value by copying
# what came so far at each read, so one endless header cost a second and 40 MB a probe.
MAX_HEAD_BYTES = 64 * 1024
# Beyond the head, the bytes of each chunk's size line and line ends (chunk extensions and all): a
# page of 1-byte chunks needs 5 of them a chunk, and a head or trailers never get more room.
CHUNK_FRAMING_BYTES = 64


class _Connection(asyncio.Protocol):
    """One kept-alive connection and the one response it is reading."""

    __slots__ = (
        "_body",
        "_chunks",
        "_framed",
        "_framing",
        "_limit",
        "_parser",
        "_status",
        "answer",
        "heard",
        "reusable",
        "transport",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.reusable = True
        self._body = bytearray()
        self._limit = 0
        self._status = 0
        self._framed = False  # the answer has a Content-Length or is chunked
        self._framing = 0  # bytes of the answer that are not its body: head, chunk sizes, trailers
        self._chunks = 0  # chunks begun: each earns CHUNK_FRAMING_BYTES of framing
        self.heard = False  # a byte of the answer came

    def request(self, head: bytes, limit: int) -> asyncio.Future[tuple[int, bytes]]:
        """Send a request; the future gets (status, at most `limit` + 1 bytes of its body)."""
        assert self.transport is not None and self.answer is None
        self.answer = asyncio.get_running_loop().create_future()
        self._body, self._limit, self._status, self._framed, self.heard = bytearray(), limit, 0, False, False
        self._framing = self._chunks = 0
        self.transport.write(head)
        return self.answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # nothing was asked (or the page was cut): not kept
            self._fail(ConnectionError("an answer nobody asked for"))
            return
        self.heard = True
        if self._framing > MAX_HEAD_BYTES + CHUNK_FRAMING_BYTES * self._chunks:  # a head or trailers without end
            self._fail(ConnectionError("an answer's head or trailers too large"))
            return
        body = len(self._body)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the server upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"not HTTP: {exc}"))
        else:
            self._framing += len(data) - max(0, len(self._body) - body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if exc is None and self._status >= 200 and not self._framed and self.answer is not None:
            self._answer()  # a body that ends at the close (RFC 9112 6.3, item 8)
        self._fail(exc or ConnectionError("closed before the answer was whole"))

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.answer is None:  # a second answer in the bytes of the first: unsolicited
            self._fail(ConnectionError("an answer nobody asked for"))
        self._status = 0  # (after an interim answer, the final one's head is counted anew)

    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_body(self, body: bytes) -> None:
        if self.answer is None:  # answered already: the page was longer than asked for
            return
        self._body += body  # not a list of chunks: a page of 1-byte chunks would cost ~40x
        if len(self._body) > self._limit:  # answered with what came; the rest is not read, so the
            self._answer()  # connection cannot be reused
            self.close()

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:  # an interim answer (100, 103): the final one follows
            return
        if not self._parser.should_keep_alive():
            self.reusable = False
        self._answer()

    def _answer(self) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_result((self._status, bytes(self._body[: self._limit + 1])))
        self._body = bytearray()

    def _fail(self, exc: BaseException) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()


class PageClient:
    """Kept-alive connections to backends (`host:port`), one each."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._connections: dict[str, _Connection] = {}

    async def get(self, backend: str, path: str, limit: int) -> tuple[int, bytes]:
        """The backend's (status, body) for `path`, the body cut at `limit` + 1 bytes. Raises
        OSError (ConnectionError) or TimeoutError when it does not answer within the timeout."""
        head = f"GET {path} HTTP/1.1\r\nHost: {backend}\r\n".encode() + _HEADERS + b"\r\n"
        kept = self._connections.pop(backend, None)
        connection = kept
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = None
                if kept is not None and kept.reusable:
                    try:
                        answer = await kept.request(head, limit)
                    except ConnectionError:
                        # The server may have closed it idle as the request went (RFC 9112
                        # 9.3.1: a GET may be retried once on a new connection).
                        if kept.heard:
                            raise
                if answer is None:
                    if kept is not None:
                        kept.close()
                    connection = await self._connect(backend)
                    answer = await connection.request(head, limit)
        except BaseException:
            if connection is not None:
                connection.close()
            raise
        assert connection is not None  # answered: some connection carried it
        if connection.reusable:
            self._connections[backend] = connection
        else:
            connection.close()
        return answer

    @staticmethod
    async def _connect(backend: str) -> _Connection:
        host, _, port = backend.rpartition(":")
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(_Connection, host.strip("[]"), int(port))
        return connection

    def keep_only(self, backends: Iterable[str]) -> None:
        """Close the connections to backends that left the pool."""
        keep = set(backends)
        for backend in [b for b in self._connections if b not in keep]:
            self._connections.pop(backend).close()

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
