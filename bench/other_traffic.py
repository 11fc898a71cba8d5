"""Traffic no router sees: one client sending unique prompts straight to one backend, back to back.

On a shared fleet the engines also serve requests that did not pass through the router (another
tenant's gateway, a batch job, a health prober that sends real prompts). They evict blocks the
router believes cached and take engine time; `bench compare --other-traffic TOKENS` runs this
client beside each router so the routers are compared on such a fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp
import orjson

from bench.workload import text

T = TypeVar("T")


async def _send_forever(backend: str, model: str, chars: int) -> None:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for seed in itertools.count():
            content = text(random.Random(seed), chars)  # never repeats: nothing of it is ever a hit
            body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
            try:
                async with session.post(f"http://{backend}/v1/chat/completions", data=orjson.dumps(body)) as response:
                    await response.read()
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.5)  # the backend is restarting or gone: try again, never fail the run


async def beside(work: Awaitable[T], backend: str, model: str, chars: int) -> T:
    """Run `work` while the other client sends prompts of `chars` characters to `backend`."""
    other = asyncio.create_task(_send_forever(backend, model, chars))
    try:
        return await work
    finally:
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other
