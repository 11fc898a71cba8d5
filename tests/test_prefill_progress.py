"""Approximate mode follows a real engine's prefill progress: a simulated vLLM server publishing
KV events over ZMQ, kvroute's own subscriber and router. A streamed response starts before the
prefill; the reservation stays until the engine reports the blocks stored, not until the end."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson

from bench.simulator.sim import SimConfig, serve
from extproc.core.backends import Backend
from extproc.core.exchange import ResponseStart
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime.pool import BackendPool
from extproc.vllm.subscriber import EventSubscriber
from tests.e2e import until

# Prefill of the 2,000-token prompts below takes 0.5 s.
SLOW = SimConfig(block_size=16, token_s=0.00025, step_s=0.0, kv_events=True)


def body(letter: str) -> dict:
    content = f"{letter} " * 4000  # 8,000 bytes: 2,000 of the simulator's tokens
    return {"model": "sim-model", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": content}]}


def test_a_streamed_prefill_is_held_until_the_engines_events_report_it_stored():
    async def main() -> None:
        (runner,) = await serve([0], SLOW)
        backend = f"127.0.0.1:{runner.addresses[0][1]}"
        router = Router(Settings(hash_key=b"test-key-16bytes"))
        subscriber = EventSubscriber(router, BackendPool([Backend(backend)], router.remove_backend, 1))
        follow = asyncio.create_task(subscriber.run(follow_interval_s=0.05))
        try:
            async with aiohttp.ClientSession() as session:

                async def send(letter: str, hold: bool) -> None:
                    request = parse_request(body(letter), {})
                    exchange = router.begin(request, [Backend(backend)], 0.0)
                    url = f"http://{backend}/v1/chat/completions"
                    data, headers = orjson.dumps(body(letter)), {"content-type": "application/json"}
                    async with session.post(url, data=data, headers=headers) as response:
                        start = ResponseStart(backend, known=True, status=response.status, from_upstream=True)
                        router.response_started(exchange, start, 0.0)  # headers: before the prefill
                        reserved = router.loads.snapshot()[backend][0]
                        assert reserved == (exchange.reservation.blocks if hold else 0)
                        if hold:  # the engine's events drain it while the request still runs
                            await until(lambda: router.loads.snapshot()[backend] == (0, 1))
                        await response.read()
                    exchange.end()

                await until(lambda: subscriber.status.get(backend, "").startswith("subscribed"))
                await asyncio.sleep(0.3)  # ZMQ's slow joiner
                await send("a", hold=False)  # nothing heard from the engine yet: released at headers
                await until(lambda: router.stats.events["BlockStored"] > 0)
                await send("b", hold=True)
                assert router.loads.snapshot()[backend] == (0, 0)
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            await runner.cleanup()

    asyncio.run(main())
