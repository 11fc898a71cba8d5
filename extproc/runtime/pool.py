"""The backend set: which addresses may be routed to, and which of them are up.

Only addresses in this set are ever written into the destination header. A backend that fails
its health checks (or refuses a connection Envoy reports) leaves the routing core at once:
index entries, session bindings and reservations go with it. It comes back when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable

import aiohttp

from extproc.core.backends import Backend

log = logging.getLogger(__name__)

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_cache_tokens(metrics_text: str) -> int | None:
    """KV cache size in tokens from vLLM's `vllm:cache_config_info` (num_gpu_blocks x block_size)."""
    match = _CACHE_INFO.search(metrics_text)
    if match is None:
        return None
    labels = dict(_LABEL.findall(match.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


class BackendPool:
    """Known backends with their health, probed on `/health`."""

    def __init__(
        self,
        backends: Iterable[Backend],
        on_down: Callable[[str], None],
        unhealthy_after: int,
        on_capacity: Callable[[str, int], None] = lambda _address, _tokens: None,
    ) -> None:
        self._on_down = on_down
        self._on_capacity = on_capacity
        self._unhealthy_after = unhealthy_after
        self._backends: dict[str, Backend] = {}
        self._failures: dict[str, int] = {}
        self._sized: set[str] = set()
        self.replace(backends)

    def replace(self, backends: Iterable[Backend]) -> None:
        """Adopt a new backend set; backends that left are dropped from routing at once."""
        incoming = {b.address: b for b in backends}
        for address in self._backends.keys() - incoming.keys():
            self._on_down(address)
            self._failures.pop(address, None)
            self._sized.discard(address)
        self._backends = {
            address: Backend(
                b.address, b.models, self._backends[address].healthy if address in self._backends else True
            )
            for address, b in incoming.items()
        }

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def is_known(self, address: str) -> bool:
        return address in self._backends

    def healthy_count(self) -> int:
        return sum(b.healthy for b in self._backends.values())

    def mark(self, address: str, up: bool) -> None:
        """Record one health observation; flip state after `unhealthy_after` failures or one success."""
        backend = self._backends.get(address)
        if backend is None:
            return
        if up:
            self._failures[address] = 0
            if not backend.healthy:
                log.info("backend %s is up again", address)
                self._backends[address] = Backend(address, backend.models, True)
            return
        self._failures[address] = self._failures.get(address, 0) + 1
        if backend.healthy and self._failures[address] >= self._unhealthy_after:
            log.warning("backend %s is down: dropping its locations, sessions and load", address)
            self._backends[address] = Backend(address, backend.models, False)
            self._on_down(address)

    def mark_refused(self, address: str) -> None:
        """Envoy could not connect to it: down now, without waiting for the probes."""
        for _ in range(self._unhealthy_after):
            self.mark(address, False)

    async def probe_forever(self, interval_s: float, timeout_s: float) -> None:
        """GET /health on every backend each interval, concurrently; read each one's KV cache
        size once from /metrics."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                backends = list(self._backends)
                results = await asyncio.gather(*(self._probe(session, a) for a in backends))
                for address, up in zip(backends, results, strict=True):
                    self.mark(address, up)
                unsized = [a for a, up in zip(backends, results, strict=True) if up and a not in self._sized]
                for address, tokens in zip(
                    unsized, await asyncio.gather(*(self._size(session, a) for a in unsized)), strict=True
                ):
                    if tokens is not None and address in self._backends:
                        self._sized.add(address)
                        self._on_capacity(address, tokens)
                await asyncio.sleep(interval_s)

    @staticmethod
    async def _size(session: aiohttp.ClientSession, address: str) -> int | None:
        try:
            async with session.get(f"http://{address}/metrics") as response:
                return kv_cache_tokens(await response.text()) if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return None

    @staticmethod
    async def _probe(session: aiohttp.ClientSession, address: str) -> bool:
        try:
            async with session.get(f"http://{address}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
