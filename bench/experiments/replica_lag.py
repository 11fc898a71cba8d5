"""`kvroute-dev bench replica-lag`: how long until one replica's news reaches a sibling through a
real Redis, and what telling costs the replica on its hot path.

Two routers with their links in one event loop (as two processes would be, minus the scheduler):
replica A learns a prompt, binds a session or takes a reservation; the time until replica B's
picture shows it is measured by polling B every 0.2 ms. Also the cost of the hooks a routed
request calls (`learned` and `bound`: pack a message and queue it), and of applying one sibling
request's chain and binding (index and session updates, without the message decoding).

`ingest`: how many sibling blocks one replica applies per second while it routes: a driver puts
many replicas' learning (chains of 32 blocks over a fleet of 64 backends) into the real stream,
and the replica drains it through XREAD while deciding fresh requests in the same event loop; its
decisions per second are measured alone first, on the same prompts.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import orjson
from redis.asyncio import Redis

from bench.experiments.decisions import started
from bench.harness.store import PASSWORD, RedisServer
from bench.workload import conversation
from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.replicas.redis_link import LEARNED, RedisLink
from extproc.runtime.pool import BackendPool

FLEET = [Backend(f"10.0.0.{i}:8000") for i in range(1, 5)]
KEY = bytes(range(16))


def _replica(url: str) -> tuple[Router, BackendPool, RedisLink]:
    router = Router(Settings(hash_key=KEY))
    pool = BackendPool(FLEET, router.remove_backend, 2)
    link = RedisLink(router, pool, Redis.from_url(url, password=PASSWORD), "kvroute:lag")
    router.replicas = link
    return router, pool, link


async def _until(check: Any, timeout_s: float = 5.0) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError("a sibling's news did not arrive")
        await asyncio.sleep(0.0002)
    return time.perf_counter() - start


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 3),
        "max_ms": round(1000 * ordered[-1], 3),
    }


async def _one(a: Router, b: Router, pool_a: BackendPool, pool_b: BackendPool, i: int) -> tuple[float, float, float]:
    """One routed request through A: seconds until B sees its prefix, its session, its reservation."""
    request = a.parse(conversation(8000, seed=i), {"x-session-id": f"lag-{i}"})
    exchange = a.begin(request, pool_a.backends, time.monotonic())
    backend = exchange.decision.backend or ""
    load = b.loads.get(backend)
    reserved = await _until(lambda: load.peer_active == 1)
    started(a, exchange, backend, time.monotonic())
    probe = b.parse(conversation(8000, seed=i), {})
    learned = await _until(lambda: b.query(probe, pool_b.backends, time.monotonic()).matched_blocks > 0)
    bound = await _until(lambda: b.sessions.get(f"session:lag-{i}", time.monotonic()) is not None)
    exchange.end()
    await _until(lambda: load.peer_active == 0)
    return learned, bound, reserved


async def _measure(url: str, samples: int) -> dict[str, Any]:
    a, pool_a, link_a = _replica(url)
    b, pool_b, link_b = _replica(url)
    tasks = [asyncio.create_task(link_a.run()), asyncio.create_task(link_b.run())]
    try:
        await _until(lambda: link_a.connected and link_b.connected)
        measured = [await _one(a, b, pool_a, pool_b, i) for i in range(samples)]
        learn, bind, load = (list(column) for column in zip(*measured, strict=True))
        chain = list(range(200))
        start = time.perf_counter()
        for _ in range(10_000):
            link_a.learned(FLEET[0].address, chain)
            link_a.bound(KEY, FLEET[0].address)
        hooks_us = (time.perf_counter() - start) / 10_000 * 1e6
        chains = [b.chain_of(b.parse(conversation(8000, seed=i), {})) for i in range(1000)]
        start = time.perf_counter()
        for i, chain in enumerate(chains):  # what each sibling request costs this replica, once it arrives
            b.peer_learned(chain, FLEET[i % 4].address, time.monotonic())
            b.peer_bound(KEY, FLEET[i % 4].address, time.monotonic())
        apply_us = (time.perf_counter() - start) / len(chains) * 1e6
        return {
            "samples": samples,
            "learned_prefix_visible": _percentiles(learn),
            "session_visible": _percentiles(bind),
            "reservation_visible": _percentiles(load),
            "hooks_per_request_us": round(hooks_us, 2),
            "apply_per_sibling_request_us": round(apply_us, 2),
            "blocks_per_request": len(chains[0]),
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


INGEST_CHAIN = 32
INGEST_FLEET = tuple(Backend(f"10.1.{i // 256}.{i % 256}:8000") for i in range(64))


async def _decisions(router: Router, pool: BackendPool, bodies: list[bytes], stop: asyncio.Event) -> int:
    """Decide (and finish) fresh requests until `stop`, yielding to the loop after each."""
    done = 0
    while not stop.is_set():
        exchange = router.begin(router.parse(bodies[done % len(bodies)], {}), pool.backends, time.monotonic())
        exchange.end()
        done += 1
        await asyncio.sleep(0)
    return done


async def _ingest(url: str, entries: int) -> dict[str, Any]:
    router = Router(Settings(hash_key=KEY, capacity_blocks=1_000_000))
    pool = BackendPool(INGEST_FLEET, router.remove_backend, 2)
    link = RedisLink(router, pool, Redis.from_url(url, password=PASSWORD), "kvroute:ingest", max_events=entries * 2)
    router.replicas = link
    bodies = [orjson.dumps(conversation(8000, seed=i)) for i in range(200)]
    task = asyncio.create_task(link.run())
    driver = Redis.from_url(url, password=PASSWORD)
    try:
        await _until(lambda: link.connected)
        stop = asyncio.Event()
        alone = asyncio.create_task(_decisions(router, pool, bodies, stop))
        await asyncio.sleep(2.0)
        stop.set()
        alone_rate = await alone / 2.0
        rng = random.Random(7)
        async with driver.pipeline(transaction=False) as pipe:
            for _ in range(entries):
                backend = INGEST_FLEET[rng.randrange(len(INGEST_FLEET))].address
                chain = [rng.getrandbits(60) for _ in range(INGEST_CHAIN)]
                pipe.xadd("kvroute:ingest:events", {"m": msgpack.packb((LEARNED, "driver", backend, chain))})
            before = link.counts["applied"]
            start = time.perf_counter()
            await pipe.execute()
        stop = asyncio.Event()
        routing = asyncio.create_task(_decisions(router, pool, bodies, stop))
        await _until(lambda: link.counts["applied"] - before >= entries, timeout_s=120.0)
        elapsed = time.perf_counter() - start
        stop.set()
        decided = await routing
        return {
            "entries": entries,
            "blocks": entries * INGEST_CHAIN,
            "seconds": round(elapsed, 2),
            "sibling_blocks_per_s": round(entries * INGEST_CHAIN / elapsed),
            "decisions_per_s_while_ingesting": round(decided / elapsed),
            "decisions_per_s_alone": round(alone_rate),
            "bad": link.counts["bad"],
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await driver.aclose()


def run(samples: int = 200, ingest: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir)).start()
        try:
            if ingest:
                return asyncio.run(_ingest(server.url, ingest))
            return asyncio.run(_measure(server.url, samples))
        finally:
            server.stop()
