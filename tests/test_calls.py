"""The ext_authz port's HTTP/1.1 (extproc/envoy/calls.py) over real loopback sockets: calls in
turn on a kept-alive connection, a head refused before its body is read, what Envoy never sends
refused and the connection closed, a caller that leaves cancelling its call, and arbitrary bytes
never breaking the server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.envoy.calls import MAX_BODY_BYTES, MAX_HEAD_BYTES, Call, CallProtocol, answer

Handler = Callable[[Call], Awaitable[bytes]]


class Server:
    """A CallProtocol port on loopback; what it was asked, refused, and what the loop reported."""

    def __init__(self, handle: Handler | None = None) -> None:
        self.calls: list[Call] = []
        self.malformed = 0
        self.why: list[str] = []  # each refusal's reason, in order
        self.open: set[CallProtocol] = set()
        self.loop_errors: list[dict[str, Any]] = []
        self._handle = handle
        self.port = 0
        self._server: asyncio.Server | None = None

    @staticmethod
    def _admit(_method: str, target: str, _headers: dict[str, str]) -> bytes | None:
        return answer(403, body=b"refused") if target == "/refused" else None

    async def _echo(self, call: Call) -> bytes:
        self.calls.append(call)
        if self._handle is not None:
            return await self._handle(call)
        return answer(200, [("x-target", call.target)], call.body)

    def _refused(self, why: str) -> None:
        self.malformed += 1
        self.why.append(why)

    async def __aenter__(self) -> Server:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: self.loop_errors.append(context))
        self._server = await loop.create_server(
            lambda: CallProtocol(self._admit, self._echo, self._refused, self.open), "127.0.0.1", 0
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        await asyncio.gather(*(call.finish(1.0) for call in list(self.open)))


async def _exchange(port: int, *pieces: bytes) -> bytes:
    """Write the pieces (a pause between them), then read until the server closes or goes quiet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        received = b""
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.3)
            except TimeoutError:
                return received
            if not data:
                return received + b"<closed>"
            received += data
    finally:
        writer.close()


async def _trickle(port: int, pieces: list[bytes], pause_s: float) -> bytes:
    """Send the pieces a pause apart until the server closes; what it answered."""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)
        for piece in pieces:
            try:
                await loop.sock_sendall(sock, piece)
            except ConnectionError:  # refused meanwhile
                break
            await asyncio.sleep(pause_s)
        received = b""
        try:
            while data := await asyncio.wait_for(loop.sock_recv(sock, 65536), 5.0):
                received += data
        except ConnectionResetError:  # closed with our last bytes unread
            pass
        return received


def _request(body: bytes = b"", target: str = "/kvroute/route/v1/chat/completions", **headers: str) -> bytes:
    head = f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
    return head.encode() + b"\r\n" + body


def test_calls_on_a_kept_alive_connection_are_answered_in_turn():
    """Two calls, the first split across writes, the second sent before the first's answer: each
    reaches the handler whole (headers by their lower-case name), and the answers come in order."""

    async def scenario() -> None:
        async with Server() as server:
            first, second = _request(b"a" * 5000, X_Session_Id="s1"), _request(b"b" * 10, "/kvroute/route/x")
            received = await _exchange(server.port, first[:30], first[30:4000], first[4000:] + second)
            assert received.count(b"HTTP/1.1 200 OK\r\n") == 2 and not received.endswith(b"<closed>")
            assert received.index(b"a" * 5000) < received.index(b"x-target: /kvroute/route/x")
            one, two = server.calls
            assert (one.method, one.target, one.body) == ("POST", "/kvroute/route/v1/chat/completions", b"a" * 5000)
            assert one.headers["x-session-id"] == "s1" and one.headers["content-length"] == "5000"
            assert two.body == b"b" * 10 and server.malformed == 0

    asyncio.run(scenario())


def test_a_head_refused_by_admit_is_answered_before_its_body_is_read():
    """(As a call without the token is: it makes nothing buffer the body it announces.)"""

    async def scenario() -> None:
        async with Server() as server:
            announced = b"POST /refused HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % MAX_BODY_BYTES
            received = await _exchange(server.port, announced, b"x" * 1000)
            assert received == answer(403, body=b"refused") + b"<closed>"
            assert server.calls == [] and server.malformed == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        (b"POST /x\r\n\r\n", b"400"),  # no version
        (b"POST /x HTTP/2.0\r\n\r\n", b"400"),
        (b"POST x HTTP/1.1\r\n\r\n", b"400"),  # not a path
        (b"POST /x HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"POST /x HTTP/1.1\r\nA: 1\r\n folded\r\n\r\n", b"400"),  # obsolete line folding
        (b"POST /x HTTP/1.1\r\nA : 1\r\n\r\n", b"400"),  # space before the colon
        (b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", b"400"),
        (b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"400"),
        ("POST /x HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n".encode(), b"400"),  # a digit int() refuses
        ("POST /x HTTP/1.1\r\nContent-Length: \u0661\u0662\r\n\r\n".encode(), b"400"),  # one it reads as 12
        (b"POST /x HTTP/1.1\r\nContent-Length: " + b"1" * 5000 + b"\r\n\r\n", b"400"),  # past int()'s digits
        (b"POST /x HTTP/1.1\r\nA: \xff\xfe\r\n\r\n", b"400"),  # not UTF-8
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", b"501"),
        (b"POST /x HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), b"413"),
        (b"POST /x HTTP/1.1\r\nA: " + b"a" * (MAX_HEAD_BYTES + 1), b"431"),  # no end in sight
        (b"POST /x HTTP/1.1\r\nA: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n", b"431"),
    ],
)
def test_what_envoy_never_sends_is_refused_and_the_connection_closed(sent: bytes, status: bytes):
    async def scenario() -> None:
        async with Server() as server:
            received = await _exchange(server.port, sent, _request())  # a good call after it is not read
            assert received.startswith(b"HTTP/1.1 " + status) and received.endswith(b"<closed>")
            assert received.count(b"HTTP/1.1") == 1
            assert server.calls == [] and server.malformed == 1 and server.loop_errors == []

    asyncio.run(scenario())


def test_connection_close_and_http_1_0_end_the_connection_after_the_answer():
    async def scenario() -> None:
        async with Server() as server:
            closing = await _exchange(server.port, _request(b"x", Connection="close"), _request())
            assert closing.count(b"200 OK") == 1 and closing.endswith(b"<closed>")
            old = await _exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n")
            assert old.startswith(b"HTTP/1.1 200") and old.endswith(b"<closed>")
            kept = await _exchange(server.port, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            assert kept.startswith(b"HTTP/1.1 200") and not kept.endswith(b"<closed>")

    asyncio.run(scenario())


def test_a_caller_that_leaves_cancels_its_call():
    """As aiohttp's handler cancellation did: flow control's held request leaves its queue."""

    async def scenario() -> None:
        gone = asyncio.Event()

        async def hold(_call: Call) -> bytes:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                gone.set()
                raise
            return answer(200)

        async with Server(hold) as server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request(b"held"))
            await writer.drain()
            while not server.calls:
                await asyncio.sleep(0.005)
            writer.close()
            await asyncio.wait_for(gone.wait(), 2.0)
            assert not server.open and server.loop_errors == []

    asyncio.run(scenario())


def test_a_failing_handler_answers_500_and_the_connection_goes_on():
    async def scenario() -> None:
        async def flaky(call: Call) -> bytes:
            if call.body == b"boom":
                raise RuntimeError("boom")
            return answer(204)

        async with Server(flaky) as server:
            received = await _exchange(server.port, _request(b"boom") + _request(b"fine"))
            assert received.startswith(b"HTTP/1.1 500") and b"HTTP/1.1 204" in received
            assert not received.endswith(b"<closed>")

    asyncio.run(scenario())


def test_stopping_waits_for_the_call_being_decided_then_closes():
    async def scenario() -> None:
        release = asyncio.Event()

        async def slow(_call: Call) -> bytes:
            await release.wait()
            return answer(200, body=b"late")

        async with Server(slow) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request())
            await writer.drain()
            while not server.calls:
                await asyncio.sleep(0.005)
            (call,) = server.open
            asyncio.get_running_loop().call_later(0.05, release.set)
            await call.finish(2.0)
            received = await reader.read()
            assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"late")
            writer.close()

    asyncio.run(scenario())


def test_an_answer_leaves_out_a_header_value_that_would_end_its_head():
    sent = answer(200, [("a", "1"), ("b", "x\r\nset-cookie: y"), ("c", "z\n")], b"body")
    assert sent == b"HTTP/1.1 200 OK\r\na: 1\r\ncontent-length: 4\r\n\r\nbody"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=4), st.sampled_from([b"", b"\r\n\r\n", _request(b"z")]))
def test_arbitrary_bytes_never_break_the_server(pieces: list[bytes], tail: bytes):
    """Whatever a connection sends, the loop reports no protocol error, and a good call on a new
    connection is still answered."""

    async def scenario() -> None:
        async with Server() as server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for piece in [*pieces, tail]:
                writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)
            writer.close()
            answered = await _exchange(server.port, _request(b"ok", Connection="close"))
            assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b"<closed>")
            assert server.loop_errors == []

    asyncio.run(scenario())


def test_a_caller_that_pipelines_calls_and_reads_no_answer_is_held_to_a_bounded_buffer():
    """Envoy waits for each answer; a caller that sends call after call and reads nothing must not
    make the server buffer what it sends (nor the answers) without bound."""

    async def scenario() -> None:
        async with Server() as server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            call = b"GET /health HTTP/1.1\r\n\r\n"
            sent = 0
            try:
                while sent < 64 * 1024 * 1024:
                    writer.write(call * 4096)
                    sent += len(call) * 4096
                    async with asyncio.timeout(0.5):
                        await writer.drain()
            except TimeoutError:  # the server stopped reading: what it buffered is bounded
                pass
            (protocol,) = server.open
            assert len(protocol._buffer) <= MAX_HEAD_BYTES + 256 * 1024
            assert sent < 64 * 1024 * 1024
            writer.close()

    asyncio.run(scenario())


def test_a_head_trickled_in_too_slowly_is_answered_408_and_the_connection_closed(monkeypatch):
    monkeypatch.setattr("extproc.envoy.calls.HEAD_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        async with Server() as server:
            received = await _exchange(server.port, b"POST /x HTTP/1.1\r\nA: 1\r\n")
            assert received.startswith(b"HTTP/1.1 408") and received.endswith(b"<closed>")
            assert server.calls == [] and server.malformed == 1
            kept = await _exchange(server.port, _request(b"ok"))  # a whole call and then quiet: kept open
            assert kept.startswith(b"HTTP/1.1 200") and not kept.endswith(b"<closed>")

    asyncio.run(scenario())


def test_a_body_shorter_than_its_content_length_or_trickled_in_is_answered_408(monkeypatch):
    """The body's clock starts when its head is admitted: a Content-Length that lies, or a body
    sent a byte at a time, holds the connection no longer than the head may take plus a second a
    MiB declared; a call sent whole at once is not hurried by it."""
    monkeypatch.setattr("extproc.envoy.calls.HEAD_TIMEOUT_S", 0.2)
    monkeypatch.setattr("extproc.envoy.calls.MIN_BODY_BYTES_PER_S", 1000.0)  # 0.1 s more for 100 bytes

    async def scenario() -> None:
        async with Server() as server:
            lying = _request(b"x" * 100)[:-60]  # declares 100 bytes, sends 40
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(lying)
            started = asyncio.get_running_loop().time()
            received = await asyncio.wait_for(reader.read(), 5.0)  # until the server closes
            waited = asyncio.get_running_loop().time() - started
            writer.close()
            assert received.startswith(b"HTTP/1.1 408") and waited >= 0.25, (received, waited)  # 0.2 + 0.1 s
            assert server.calls == [] and server.why == ["not whole in time"]

            call = _request(b"y" * 100)
            pieces = [call[:-100]] + [call[-100 + i : len(call) - 90 + i] for i in range(0, 100, 10)]
            received = await _trickle(server.port, pieces, 0.05)  # whole after 0.5 s: too late
            assert received.startswith(b"HTTP/1.1 408") and received.count(b"HTTP/1.1") == 1
            assert server.calls == [] and server.malformed == 2

            whole = await _exchange(server.port, _request(b"z" * 100))
            assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b"z" * 100)

    asyncio.run(scenario())
