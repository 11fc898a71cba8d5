"""`kvroute-dev bench cancelled-streams`: does a grpc.aio server keep memory for every stream its
client resets? Envoy, left at its default, resets each ext_proc stream when its HTTP request ends,
and the ext_proc's RSS behind such an Envoy grew by about 110 bytes a request (`bench soak`, before
kvroute's Envoy configurations turned on its graceful close) while driven with clean half-closes it
plateaus. This isolates the cause from kvroute's code: a bare grpc.aio server of the ext_proc
service (one empty reply per message) in its own process, driven with streams that end by a
half-close or by a cancel (RST_STREAM), its VmRSS sampled. grpcio's aio layer drops a batch's
C-side op array when the batch fails or its awaiter is cancelled (grpc/grpc#43360); rerun this
after a grpcio upgrade to see whether the growth is gone. The same service on grpcio's threaded
server (`grpc.server` with a thread pool) is measured alongside, as the way around it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import grpc

from bench.harness.processes import rss_bytes
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc

SERVERS: dict[str, str] = {}
SERVERS["aio"] = """
import asyncio
import grpc
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc

class Reply(pb_grpc.ExternalProcessorServicer):
    async def Process(self, messages, context):
        async for _ in messages:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())

async def main():
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Reply(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
SERVERS["threads"] = """
from concurrent import futures
import grpc
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc

class Reply(pb_grpc.ExternalProcessorServicer):
    def Process(self, messages, context):
        for _ in messages:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())

server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
pb_grpc.add_ExternalProcessorServicer_to_server(Reply(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""
MESSAGES = 3  # request headers, body, response headers: an ext_proc stream in buffered mode
CONCURRENCY = 32


async def _stream(stub: pb_grpc.ExternalProcessorStub, cancel: bool) -> None:
    """One stream: three messages and their replies, then a half-close or a cancel."""
    open_until_cancelled = asyncio.Event()

    async def messages():
        for _ in range(MESSAGES):
            yield pb.ProcessingRequest(request_headers=pb.HttpHeaders())
        if cancel:
            await open_until_cancelled.wait()  # never half-closed: it ends by the cancel below

    call = stub.Process(messages())
    replies = 0
    async for _ in call:
        replies += 1
        if cancel and replies == MESSAGES:
            call.cancel()
            break


async def _drive(port: int, streams: int, cancel: bool) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        remaining = iter(range(streams))

        async def worker() -> None:
            for _ in remaining:
                await _stream(stub, cancel)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def measure(streams: int, cancel: bool, steps: int = 5, server_kind: str = "aio") -> dict[str, Any]:
    """The server's RSS after each of `steps` equal shares of `streams`."""
    server = subprocess.Popen([sys.executable, "-c", SERVERS[server_kind]], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        samples = []
        for step in range(1, steps + 1):
            asyncio.run(_drive(port, streams // steps, cancel))
            samples.append((step * (streams // steps), round(rss_bytes(server.pid) / 2**20, 1)))
    finally:
        server.kill()
        server.wait()
    first, last = samples[0], samples[-1]
    per_stream = (last[1] - first[1]) * 2**20 / (last[0] - first[0])
    return {
        "server": server_kind,
        "end": "cancel" if cancel else "half-close",
        "grpcio": grpc.__version__,
        "rss_mib_by_streams": samples,
        "bytes_per_stream_after_first_step": round(per_stream, 1),
    }


def main(streams: int) -> None:
    import orjson

    for server_kind in SERVERS:
        for cancel in (False, True):
            print(orjson.dumps(measure(streams, cancel, server_kind=server_kind)).decode(), flush=True)
