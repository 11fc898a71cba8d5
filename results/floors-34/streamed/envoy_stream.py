"""Envoy's and the ext_proc's CPU per request for streamed responses of 1 and 32 tokens, kvroute over
ext_authz, two simulated backends whose steps take 5 ms (each SSE chunk written on its own).

    python results/floors-34/streamed/envoy_stream.py   # from the checkout, in .venv (2026-12-05)
"""

import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import aiohttp

from bench.harness.processes import cpu_seconds
from bench.harness.stack import Stack

SIM = ["--step-s", "0.005", "--token-s", "0"]
REQUESTS = 800


async def send(url: str, count: int, tokens: int, concurrency: int = 16) -> float:
    """`count` streamed chat requests; the mean lines a response had."""
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            body = {
                "model": "sim-model",
                "stream": True,
                "max_tokens": tokens,
                "messages": [{"role": "user", "content": f"q{i} " + "word " * 1500}],
            }
            headers = {"x-session-id": f"s{i}"}
            async with slots, session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
                assert response.status == 200, (response.status, await response.text())
                return sum([1 async for _ in response.content])

        lines = await asyncio.gather(*(one(i) for i in range(count)))
        return sum(lines) / len(lines)


with (
    tempfile.TemporaryDirectory() as scratch,
    Stack(Path(scratch), sims=2, sim_args=SIM, transport="ext_authz") as stack,
):
    time.sleep(3)
    asyncio.run(send(stack.url, 100, 4))
    for round_ in range(2):
        for tokens in (1, 32):
            pids = {name: stack.processes[name].pid for name in ("envoy", "extproc")}
            before = {name: cpu_seconds([pid]) for name, pid in pids.items()}
            started = time.monotonic()
            lines = asyncio.run(send(stack.url, REQUESTS, tokens))
            elapsed = time.monotonic() - started
            used = {name: (cpu_seconds([pid]) - before[name]) / REQUESTS * 1e6 for name, pid in pids.items()}
            print(
                f"round {round_} max_tokens {tokens}: lines a response {lines:.0f}, Envoy {used['envoy']:.0f} µs a"
                f" request, ext_proc {used['extproc']:.0f}, {elapsed:.1f} s"
            )
