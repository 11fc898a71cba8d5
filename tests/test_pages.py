"""The scraper's page client against a real server that answers as servers do, and as they
should not: chunked (uvicorn, so vLLM), kept alive or closed, too long, silent, garbled, cut."""

from __future__ import annotations

import asyncio

import pytest

from extproc.runtime.pages import PageClient

ANSWERS = {
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    b"/sized": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"/close": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    b"/missing": b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found",
    b"/big": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
    b"/garbage": b"hello there\r\n\r\n",
    b"/cut": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc",
    # interim answers first: the final one is the answer
    b"/interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood",
    # an answer followed by the start of another nobody asked for
    b"/two": b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngoodHTTP/1.1 503 X\r\nContent-Length: 5\r\n\r\n",
    # neither a length nor chunks: the body ends where the server closes (HTTP/1.1 allows it)
    b"/unframed": b"HTTP/1.1 200 OK\r\n\r\nall of it",
    # an answer, after which the server closes the connection idle as the next request comes
    b"/then-idle-close": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    # one header that never ends (more than MAX_HEAD_BYTES of it), after an interim answer
    b"/endless-header": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-A: " + b"a" * (300 * 1024),
    # (sent in parts apart, so the head is whole before the trailer comes)
    b"/endless-trailer": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-A: ",
        *[b"a" * 16384] * 12,
    ),
    b"/tiny-chunks": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 50 + b"0\r\n\r\n",
}


class Server:
    """Answers each request by its path; counts connections; `/silent` is never answered."""

    def __init__(self) -> None:
        self.connections = 0
        self.asked: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        closing = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.asked.append(head)
                if closing:  # what a server's idle timeout does as a request crosses it
                    break
                path = head.split(b" ")[1]
                closing = path == b"/then-idle-close"
                if path == b"/silent":
                    await asyncio.sleep(10)
                answer = ANSWERS[path]
                for part in (answer,) if isinstance(answer, bytes) else answer:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0 if isinstance(answer, bytes) else 0.005)
                if path in (b"/close", b"/cut", b"/garbage", b"/unframed"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


def run(scenario):  # type: ignore[no-untyped-def]
    async def wrapped():  # type: ignore[no-untyped-def]
        server = Server()
        backend = await server.start()
        client = PageClient(0.5)
        try:
            return await scenario(server, backend, client)
        finally:
            client.close()
            await server.stop()

    return asyncio.run(wrapped())


def test_pages_are_read_whole_over_one_kept_alive_connection():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/chunked", 1000) == (200, b"hello world")
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert await client.get(backend, "/missing", 1000) == (404, b"not found")
        assert server.connections == 1
        head = server.asked[0]
        assert head.startswith(b"GET /chunked HTTP/1.1\r\n") and f"Host: {backend}".encode() in head
        assert b"Accept-Encoding: identity" in head  # prometheus_client would gzip otherwise

    run(scenario)


def test_a_connection_the_server_closes_or_a_page_cut_at_the_limit_is_not_reused():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/close", 1000) == (200, b"ok")
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 2
        assert await client.get(backend, "/big", 10) == (200, b"x" * 11)  # what the caller sees is too long
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 3

    run(scenario)


def test_a_silent_garbled_or_cut_answer_raises_and_the_next_request_gets_a_fresh_connection():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        with pytest.raises(TimeoutError):
            await client.get(backend, "/silent", 1000)
        with pytest.raises(ConnectionError):
            await client.get(backend, "/garbage", 1000)
        with pytest.raises(ConnectionError):
            await client.get(backend, "/cut", 1000)
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 4
        with pytest.raises(OSError):  # nobody listens there
            await client.get("127.0.0.1:9", "/sized", 1000)

    run(scenario)


def test_connections_to_backends_that_left_are_closed():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        client.keep_only([backend])
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 1
        client.keep_only(["127.0.0.1:9"])
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 2

    run(scenario)


def test_interim_answers_are_skipped_and_a_close_delimited_body_is_whole():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/interim", 1000) == (200, b"good")
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 1
        assert await client.get(backend, "/unframed", 1000) == (200, b"all of it")
        assert await client.get(backend, "/tiny-chunks", 1000) == (200, b"x" * 50)
        assert await client.get(backend, "/tiny-chunks", 9) == (200, b"x" * 10)

    run(scenario)


def test_bytes_nobody_asked_for_never_become_the_next_answer():
    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/two", 1000) == (200, b"good")
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")  # not the 503's start
        assert server.connections == 2

    run(scenario)


def test_a_request_on_a_connection_the_server_closed_idle_is_sent_again_once_on_a_new_one():
    """vLLM's server closes a connection idle for 5 s; a probe crossing that close must not read
    as a dead backend (a GET may be retried on a new connection when nothing of its answer came)."""

    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        assert await client.get(backend, "/then-idle-close", 1000) == (200, b"ok")
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert server.connections == 2

    run(scenario)


def test_an_answer_whose_head_or_trailers_never_end_is_refused_once_past_the_heads_limit():
    """httptools gathers a header's value by copying it at each read: past MAX_HEAD_BYTES of a
    head (after any interim answer) or of a chunked body's trailers the answer is refused, not
    read on until the timeout."""

    async def scenario(server: Server, backend: str, client: PageClient) -> None:
        for path in ("/endless-header", "/endless-trailer"):
            for limit in (1000, 4 << 20):  # a metrics page's limit (4 MiB) gave a head that much room
                with pytest.raises(ConnectionError, match="too large"):
                    await client.get(backend, path, limit)
        assert await client.get(backend, "/sized", 1000) == (200, b"ok")
        assert await client.get(backend, "/tiny-chunks", 1000) == (200, b"x" * 50)  # framing within bounds

    run(scenario)
