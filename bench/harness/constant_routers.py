"""Constant-answer routers: the least a routing call can cost over each transport Envoy offers.

Each answers every call with replies serialized once at start, naming the backends in turn, and
never parses what Envoy sends (an ext_proc message's phase is read from its first byte: Envoy
writes the `request` oneof, fields 2-7, before any other field). So what one costs per request is
the transport's floor: Envoy's side of it, and the server framework's (grpc.aio or aiohttp) on
the router's. `bench/experiments/floors.py` runs them; run one with
`python -m bench.harness.constant_routers TRANSPORT PORT BACKEND...`.

- `ext_proc`: Envoy's external processor (kvroute's transport), every phase Envoy sends answered;
- `ext_authz_grpc`: Envoy's external authorization over gRPC (`Authorization.Check`), the request
  body included, the destination set through the OK response's headers;
- `ext_authz_http`: the same over plain HTTP/1.1: the body posted, the destination a header of a
  200 answer (Envoy's `allowed_upstream_headers` lets it through to the upstream request);
- `ext_authz_raw`: the same HTTP/1.1 calls read by a bare asyncio protocol instead of aiohttp's
  server (the request's end found from its Content-Length, the answer written as prepared bytes):
  what the HTTP framework itself costs.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc

from extproc.envoy.headers import DESTINATION_HEADER
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.service import KEEPALIVE_TOLERANCE

TRANSPORTS = ("ext_proc", "ext_authz_grpc", "ext_authz_http", "ext_authz_raw")
_LIMIT = 64 * 1024 * 1024  # messages carry whole bodies


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (numbers and lengths here are below 128 and 2**14)."""
    size = len(payload)
    length = bytes([size]) if size < 128 else bytes([size & 0x7F | 0x80, size >> 7])
    return bytes([number << 3 | 2]) + length + payload


def check_response(backend: str) -> bytes:
    """envoy.service.auth.v3.CheckResponse: status OK (field 1, code 0: empty), ok_response
    (field 3) whose headers (field 2, HeaderValueOption) set the destination (header field 1:
    HeaderValue key 1, value 2); Envoy overwrites a request header named in an OK response."""
    header = _field(1, _field(1, DESTINATION_HEADER.encode()) + _field(2, backend.encode()))
    return _field(1, b"") + _field(3, _field(2, header))


def _ext_proc_replies(backend: str) -> dict[int, bytes]:
    """The reply to each phase's first byte (ProcessingRequest field number << 3 | 2)."""
    destination = pb.HeaderValueOption(
        header=pb.HeaderValue(key=DESTINATION_HEADER, raw_value=backend.encode()),
        append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    routed = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[destination]))
    replies = {
        2: pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        3: pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        4: pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed)),
        5: pb.ProcessingResponse(response_body=pb.BodyResponse()),
    }
    return {number << 3 | 2: reply.SerializeToString() for number, reply in replies.items()}


def _turns(backends: Sequence[str]) -> Iterator[int]:
    return itertools.cycle(range(len(backends)))


async def _grpc_server(port: int, backends: Sequence[str], transport: str) -> grpc.aio.Server:
    """grpc.aio with kvroute's own server options, and the health service Envoy's checks ask."""
    turn = _turns(backends)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _LIMIT),
            ("grpc.max_send_message_length", _LIMIT),
            *KEEPALIVE_TOLERANCE,
        ]
    )
    if transport == "ext_proc":
        replies = [_ext_proc_replies(b) for b in backends]

        async def process(
            requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext[bytes, bytes]
        ) -> AsyncIterator[bytes]:
            answers = replies[next(turn)]
            async for message in requests:
                yield answers[message[0]]

        service = grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": grpc.stream_stream_rpc_method_handler(process)}
        )
    else:
        checks = [check_response(b) for b in backends]

        async def check(_request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            return checks[next(turn)]

        service = grpc.method_handlers_generic_handler(
            "envoy.service.auth.v3.Authorization", {"Check": grpc.unary_unary_rpc_method_handler(check)}
        )
    server.add_generic_rpc_handlers((service,))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _http_app(backends: Sequence[str]) -> web.Application:
    """Any path: the body read, 200 with the destination header (GET /health for the bench)."""
    turn = _turns(backends)

    async def check(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(headers={DESTINATION_HEADER: backends[next(turn)]})

    app = web.Application(client_max_size=_LIMIT)
    app.router.add_route("*", "/{tail:.*}", check)
    return app


class _RawCheck(asyncio.Protocol):
    """HTTP/1.1 calls, one after another on a connection: each answered once its body is in."""

    def __init__(self, answers: Sequence[bytes], turn: Iterator[int]) -> None:
        self._answers = answers
        self._turn = turn
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self._buffer[:end]).lower() + b"\r\n"
            at = head.find(b"\r\ncontent-length:")
            size = int(head[at + 17 : head.index(b"\r\n", at + 2)]) if at >= 0 else 0
            if len(self._buffer) < end + 4 + size:
                return
            del self._buffer[: end + 4 + size]
            assert self._transport is not None
            self._transport.write(self._answers[next(self._turn)])


async def serve(transport: str, port: int, backends: Sequence[str]) -> None:
    """Serve until killed."""
    if transport == "ext_authz_raw":
        turn = _turns(backends)
        answers = [
            f"HTTP/1.1 200 OK\r\n{DESTINATION_HEADER}: {b}\r\nContent-Length: 0\r\n\r\n".encode() for b in backends
        ]
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: _RawCheck(answers, turn), "127.0.0.1", port)
    elif transport == "ext_authz_http":
        runner = web.AppRunner(_http_app(backends), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    else:
        server = await _grpc_server(port, backends, transport)
        await server.wait_for_termination()
    await asyncio.Event().wait()


if __name__ == "__main__":
    name, port_text, *addresses = sys.argv[1:]
    if name not in TRANSPORTS or not addresses:
        sys.exit(f"usage: constant_routers {{{','.join(TRANSPORTS)}}} PORT BACKEND...")
    asyncio.run(serve(name, int(port_text), addresses))
