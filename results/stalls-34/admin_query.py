"""The worst event-loop gap while the control API answers one large dry-run query: 59 MiB of one
text, and 13 MiB of tiny text parts.

    PYTHONPATH=<checkout> python results/stalls-34/admin_query.py   # admin_query.txt
"""

import asyncio
import time

import orjson
from aiohttp.test_utils import TestClient, TestServer

from extproc.admin.app import Admin
from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
TOKEN = "t" * 32
PARTS = [{"type": "text", "text": "ab"}] * (20 * 2**20 // 42)
BODIES = {
    "59 MiB of one text": {"model": "m", "messages": [{"role": "user", "content": "x" * (59 * 2**20)}]},
    "tiny text parts (2 characters each)": {"model": "m", "messages": [{"role": "user", "content": PARTS}]},
}


class Ticker:
    """The longest gap between turns of the loop while it runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.running = True

    async def run(self) -> None:
        last = time.perf_counter()
        while self.running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst, last = max(self.worst, now - last), now


async def main() -> None:
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=1)
    admin = Admin(router, pool, Metrics(router, pool), clock=time.monotonic)
    server = TestServer(admin.control_app(TOKEN))
    async with TestClient(server, headers={"authorization": f"Bearer {TOKEN}"}) as client:
        for label, body in BODIES.items():
            data = orjson.dumps({"body": body, "dry_run": True})
            ticker = Ticker()
            task = asyncio.create_task(ticker.run())
            await asyncio.sleep(0.01)
            start = time.perf_counter()
            response = await client.post("/v1/query", data=data)
            await response.read()
            total_ms = (time.perf_counter() - start) * 1000
            ticker.running = False
            await task
            print(
                f"{label}: {len(data) / 2**20:.1f} MiB posted, status {response.status}, "
                f"answered in {total_ms:.0f} ms, worst loop gap {ticker.worst * 1000:.0f} ms"
            )


asyncio.run(main())
