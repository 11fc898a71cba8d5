"""Scrape every backend's /metrics on a short interval: the engine's own load (it sees all
clients, kvroute only its own), a restart (a new process start time) and the KV cache size. Only
the families routing reads are asked for (metrics.FAMILIES_PAGE): rendering vLLM's whole page
costs the engine five times the CPU, taken from prefills on a small machine; a server that does
not serve that page is scraped whole from then on. Every
`LISTING_EVERY` rounds (the first included) its /v1/models too: the LoRA adapters it serves, known
before its first request of them (its LoRA metric appears only with one). A page is read
`SLICE_BYTES` at a time, with the event loop's other work between slices: a page may grow to
megabytes (a long-lived LoRA server keeps a series for every set of adapters it ran together),
and its 4 MiB bound read at once held the loop some 40 ms.

One round scrapes its backends concurrently and takes at most the interval; a backend that does
not answer in time is skipped for that round (health is the pool's job, not this loop's). A fleet
larger than `engine_scrapes_per_s` x interval is scraped a slice per round (rotation.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from extproc.core.engine import EngineSample
from extproc.core.router import Router
from extproc.runtime.pages import PageClient
from extproc.runtime.pool import BackendPool
from extproc.runtime.rotation import Rotation
from extproc.vllm.metrics import FAMILIES_PAGE, PAGE, PageReader
from extproc.vllm.models import MAX_PAGE_BYTES, listed_adapters

log = logging.getLogger(__name__)

LISTING_EVERY = 8  # samples of a backend: every 2 s at the default 0.25 s interval
SLICE_BYTES = 128 * 1024  # of a page read between two turns of the event loop: about 1 ms of reading at most
# Where a slice may end: after any of the line breaks str.splitlines knows, as UTF-8 (none of
# them can sit inside another character's bytes), so a page separated by any of them is sliced.
_LINE_BREAK = re.compile(rb"[\n\r\x0b\x0c\x1c-\x1e]|\xc2\x85|\xe2\x80[\xa8\xa9]")


class EngineScraper:
    """Feeds the router with engine samples."""

    def __init__(self, router: Router, pool: BackendPool, clock: Callable[[], float] = time.monotonic) -> None:
        self._router = router
        self._pool = pool
        self._clock = clock
        self.failures = 0  # scrapes that failed or were not a vLLM engine's page
        self._started: float | None = None  # when `run` began (None: scraping is off)
        self._sampled_at: dict[str, float] = {}  # backend -> when its last good sample came
        self._samples: dict[str, int] = {}  # backend -> good samples, for its /v1/models every LISTING_EVERY
        self._whole_page: set[str] = set()  # backends that answered FAMILIES_PAGE without a sample
        self.rotation = Rotation()  # which backends a round scrapes (`run` paces it by the rate)

    async def run(self, interval_s: float, scrapes_per_s: float = float("inf")) -> None:
        """Scrape until cancelled, at most `scrapes_per_s`. Survives any error: counts, logs, goes on."""
        if scrapes_per_s != float("inf"):
            self.rotation.pace(scrapes_per_s, interval_s)
        self._started = self._clock()
        client = PageClient(max(interval_s, 0.05))
        try:
            while True:
                started = self._clock()
                try:
                    await self.scrape(client)
                except Exception:  # a bug must not stop load and restart tracking
                    self.failures += 1
                    log.exception("engine scrape round failed; scraping goes on")
                await asyncio.sleep(max(0.0, interval_s - (self._clock() - started)))
        finally:
            client.close()

    async def scrape(self, client: PageClient) -> None:
        """One round over the next healthy backends (all of them, in a fleet within the rate)."""
        client.keep_only(b.address for b in self._pool.backends)
        self._forget()
        backends = self.rotation.take([b.address for b in self._pool.backends if b.healthy])
        samples = await asyncio.gather(*(self._sample(client, b) for b in backends))
        now = self._clock()
        listing = []
        for backend, sample in zip(backends, samples, strict=True):
            if sample is None:
                self.failures += 1
            elif self._pool.is_known(backend):
                try:
                    self._router.engine_sample(backend, sample, now)
                except Exception:  # one engine's odd page must not cost the others their samples
                    self.failures += 1
                    log.exception("engine sample of %s could not be applied", backend)
                    continue
                self._sampled_at[backend] = now
                count = self._samples[backend] = self._samples.get(backend, 0) + 1
                if count % LISTING_EVERY == 1:
                    listing.append(backend)
        if listing:
            await self._listings(client, listing)

    def ages(self) -> dict[str, float]:
        """Seconds since each healthy backend's last good sample (since scraping began, for one
        never sampled): a routable backend whose engine feed went stale is routed on old load.
        None while scraping is off: empty."""
        started = self._started
        if started is None:
            return {}
        now = self._clock()
        self._forget()
        return {b.address: now - self._sampled_at.get(b.address, started) for b in self._pool.backends if b.healthy}

    def _forget(self) -> None:
        """What is kept of backends that left goes; and a backend down is counted from its first
        sample again once back, so that sample lists its adapters (the router forgot them when it
        went down). Each round, not only when kvroute's own /metrics is read."""
        healthy = {b.address for b in self._pool.backends if b.healthy}
        for down in [b for b in self._samples.keys() | self._whole_page if b not in healthy]:
            self._samples.pop(down, None)
            self._whole_page.discard(down)
        known = {b.address for b in self._pool.backends}
        for gone in [b for b in self._sampled_at if b not in known]:
            del self._sampled_at[gone]

    async def _listings(self, client: PageClient, backends: list[str]) -> None:
        pages = await asyncio.gather(*(self._page(client, b, "/v1/models") for b in backends))
        for backend, page in zip(backends, pages, strict=True):
            adapters = listed_adapters(page) if page is not None else None
            if adapters is None:
                self.failures += 1
            elif self._pool.is_known(backend):
                self._router.adapters.listing(backend, adapters)

    async def _sample(self, client: PageClient, backend: str) -> EngineSample | None:
        """The backend's sample from the families' page, else (remembered once it answered that
        page with something else) from its whole page; None if it has none (never an exception:
        one engine's page must not cost the others their round)."""
        try:
            return await self._read_sample(client, backend)
        except Exception:
            log.exception("engine page of %s could not be read", backend)
            return None

    async def _read_sample(self, client: PageClient, backend: str) -> EngineSample | None:
        if backend not in self._whole_page:
            answered, page = await self._fetch(client, backend, FAMILIES_PAGE)
            sample = await _sample_of(page)
            if sample is not None or not answered:
                return sample
        sample = await _sample_of(await self._page(client, backend, PAGE))
        if sample is not None:
            self._whole_page.add(backend)
        return sample

    @classmethod
    async def _page(cls, client: PageClient, backend: str, path: str) -> bytes | None:
        return (await cls._fetch(client, backend, path))[1]

    @staticmethod
    async def _fetch(client: PageClient, backend: str, path: str) -> tuple[bool, bytes | None]:
        """(whether the server answered, its 200 page)."""
        try:
            status, page = await client.get(backend, path, MAX_PAGE_BYTES)
        except (TimeoutError, OSError):
            return False, None
        return True, page if status == 200 else None


async def _sample_of(page: bytes | None) -> EngineSample | None:
    """The page's sample, read a slice of whole lines at a time, the loop let run between them."""
    if page is None:
        return None
    reader = PageReader()
    start = 0
    while True:
        border = _LINE_BREAK.search(page, start + SLICE_BYTES)
        if border is None:
            reader.read(page[start:].decode(errors="replace"))
            return reader.sample()
        reader.read(page[start : border.end()].decode(errors="replace"))
        start = border.end()
        await asyncio.sleep(0)
