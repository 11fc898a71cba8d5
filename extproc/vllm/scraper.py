"""Scrape every backend's /metrics on a short interval: the engine's own load (it sees all
clients, kvroute only its own), a restart (a new process start time) and the KV cache size.

One round scrapes all backends concurrently and takes at most the interval; a backend that does
not answer in time is skipped for that round (health is the pool's job, not this loop's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from extproc.core.router import Router
from extproc.runtime.pool import BackendPool
from extproc.vllm.metrics import engine_sample

log = logging.getLogger(__name__)


class EngineScraper:
    """Feeds the router with engine samples."""

    def __init__(self, router: Router, pool: BackendPool, clock: Callable[[], float] = time.monotonic) -> None:
        self._router = router
        self._pool = pool
        self._clock = clock
        self.failures = 0  # scrapes that failed or were not a vLLM engine's page

    async def run(self, interval_s: float) -> None:
        """Scrape until cancelled. Survives any error: counts, logs, goes on."""
        timeout = aiohttp.ClientTimeout(total=max(interval_s, 0.05))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                started = self._clock()
                try:
                    await self.scrape(session)
                except Exception:  # a bug must not stop load and restart tracking
                    self.failures += 1
                    log.exception("engine scrape round failed; scraping goes on")
                await asyncio.sleep(max(0.0, interval_s - (self._clock() - started)))

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        """One round over every known backend."""
        backends = [b.address for b in self._pool.backends if b.healthy]
        pages = await asyncio.gather(*(self._page(session, b) for b in backends))
        now = self._clock()
        for backend, page in zip(backends, pages, strict=True):
            sample = engine_sample(page) if page is not None else None
            if sample is None:
                self.failures += 1
            elif self._pool.is_known(backend):
                self._router.engine_sample(backend, sample, now)

    @staticmethod
    async def _page(session: aiohttp.ClientSession, backend: str) -> str | None:
        try:
            async with session.get(f"http://{backend}/metrics") as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return None
