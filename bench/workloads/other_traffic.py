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


class OtherTraffic:
    """One client sending prompts of `chars` characters to `backend`, and what became of them."""

    def __init__(self, backend: str, model: str, chars: int) -> None:
        self.backend = backend
        self.model = model
        self.chars = chars
        self.served = 0
        self.failed = 0  # refused or lost: a run whose other traffic failed did not test what it says

    async def _send_forever(self) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        headers = {"content-type": "application/json"}
        url = f"http://{self.backend}/v1/chat/completions"
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            for seed in itertools.count():
                content = text(random.Random(seed), self.chars)  # never repeats: nothing of it is ever a hit
                body = {"model": self.model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
                try:
                    async with session.post(url, data=orjson.dumps(body)) as response:
                        await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    self.served += 1
                else:
                    self.failed += 1
                    await asyncio.sleep(0.5)  # never hammer a backend that refuses; never fail the run

    async def beside(self, work: Awaitable[T]) -> T:
        """Run `work` while sending."""
        sender = asyncio.create_task(self._send_forever())
        try:
            return await work
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
