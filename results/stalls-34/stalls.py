"""Single calls on the event loop whose time grows with a table, at production sizes: the worst
one call of each, wall ms. Random 60-bit keys, as chain hashes are. Sizes: a backend's picture of
25,000 blocks (a GPU's KV cache of 200,000 vLLM blocks at about 128 tokens a kvroute block) unless
said; 8 backends; 100,000 session bindings; 65,536 prefix homes.

    PYTHONPATH=<checkout> python results/stalls-34/stalls.py   # output.txt: 60084e9 and the commit after the fixes
"""

import asyncio
import random
import time

import msgpack
from prometheus_client import CollectorRegistry

from extproc.core.backends import Backend
from extproc.core.engine import AllBlocksCleared
from extproc.core.homes import CAPACITY as HOMES
from extproc.core.index import LocalIndex
from extproc.core.load import LoadTracker
from extproc.core.objectives import RequestClass
from extproc.core.router import Router
from extproc.core.saturation import has_room
from extproc.core.sessions import SessionTable
from extproc.core.settings import Settings
from extproc.replicas import redis_link
from extproc.runtime.pool import BackendPool
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics

rng = random.Random(1)
PICTURE = 25_000
FLEET = [f"10.0.0.{i}:8000" for i in range(8)]


def ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def chain(blocks: int) -> list[int]:
    return [rng.getrandbits(60) for _ in range(blocks)]


def full_index(blocks: int, ttl: float = 1e9) -> LocalIndex:
    index = LocalIndex(ttl, blocks)
    for backend in FLEET:
        for _ in range(0, blocks, 64):
            index.learn(chain(64), backend, 0.0)
    return index


def router_with_tables(backends: list[str], blocks: int) -> Router:
    router = Router(Settings(hash_key=bytes(16), capacity_blocks=blocks, capacity_auto=False))
    for backend in backends:
        for _ in range(0, blocks, 64):
            router.index.learn(chain(64), backend, 1.0)
    for i in range(100_000):
        router.sessions.bind(f"session:{i}", backends[i % len(backends)], 1.0)
    for i in range(HOMES):
        router.homes.place(rng.getrandbits(60), backends[i % len(backends)])
    return router


def report(what: str, value: float) -> None:
    print(f"{what}: {value:.1f} ms")


# A learning past a full picture (100,000 blocks: precise-mode sizes, or a large CBR cache)
index = LocalIndex(1e9, 100_000)
for _ in range(0, 100_000, 64):
    index.learn(chain(64), "b", 0.0)
report("learning 300 new blocks into a full picture of 100,000", ms(lambda: index.learn(chain(300), "b", 1.0)))

# The first lookup after a quiet spell longer than the TTL (600 s)
index = full_index(PICTURE, ttl=600.0)
report(f"first lookup after a quiet spell, 8 x {PICTURE:,} expired", ms(lambda: index.lookup(chain(40), FLEET, 700.0)))

# The first bind after a quiet spell longer than the TTL
sessions = SessionTable(3600.0, 200_000, bytes(16))
for i in range(100_000):
    sessions.bind(f"session:{i}", "a", i * 1e-3)
report("first bind after a quiet spell, 100,000 bindings expired", ms(lambda: sessions.bind("new", "a", 10_000.0)))

# Learning at the memory bound, 200 backends: the worst of 300 learnings of 900 new blocks
index = LocalIndex(1e9, 100_000)
names = [f"b{i}" for i in range(200)]
for name in names:
    for _ in range(5000 // 64):
        index.learn(chain(64), name, 0.0)
index._max_bytes = index.memory_bytes()
report(
    "learning 900 new blocks at the memory bound, 200 backends (worst of 300)",
    max(ms(lambda i=i: index.learn(chain(900), names[i % 200], 1e6 + i)) for i in range(300)),
)


# Flow control's turn with every one of 1,000 backends full, 256 flows holding requests
async def turn() -> float:
    loads = LoadTracker()
    pool = tuple(Backend(f"10.3.{i // 250}.{i % 250}:8000") for i in range(1000))
    for backend in pool:
        loads.get(backend.address).report(8, 4, 0.95, 0.0)  # requests wait there: saturated
    settings = Settings(hash_key=bytes(16))
    room = WaitingRoom(
        lambda: settings,
        lambda backends: has_room(loads, [b.address for b in backends], settings, 0.5, 8.0),
        WaitingRoomMetrics(CollectorRegistry()),
        lambda: 0.5,
    )
    tasks = [
        asyncio.create_task(room.wait(RequestClass(0, f"f{i}", None, None, True), 100, 10, pool)) for i in range(256)
    ]
    await asyncio.sleep(0.05)
    took = ms(room.pump)
    room.drain()
    await asyncio.gather(*tasks)
    return took


report("flow control's turn, 1,000 full backends, 256 flows", asyncio.run(turn()))

# Siblings' learning between two turns of the loop: agent prompts' chains of 940 blocks into full
# pictures; a slice was APPLY_SLICE entries, now as many as reach APPLY_BLOCKS blocks
router = Router(Settings(hash_key=bytes(16), capacity_blocks=PICTURE, capacity_auto=False))
for backend in FLEET:
    for _ in range(0, PICTURE, 64):
        router.index.learn(chain(64), backend, 1.0)
link = redis_link.RedisLink(router, BackendPool([Backend(b) for b in FLEET], router.remove_backend, 3), None, "g")
entries = [
    (f"{1000 + i}-0".encode(), {b"m": msgpack.packb((redis_link.LEARNED, "sibling", FLEET[i % 8], chain(940)))})
    for i in range(redis_link.APPLY_SLICE)
]
blocks = getattr(redis_link, "APPLY_BLOCKS", None)
per_slice = redis_link.APPLY_SLICE if blocks is None else -(-blocks // 940) + (blocks % 940 == 0)
report(
    f"siblings' learning between two turns ({per_slice} chains of 940 blocks)",
    ms(lambda: [link._apply(*entry, 0.0) for entry in entries[:per_slice]]),
)

# A rollout dropping 50 of 200 backends, and one backend leaving (2,000-block pictures)
backends = [f"10.4.0.{i}:8000" for i in range(200)]
router = router_with_tables(backends, 2_000)
pool = BackendPool([Backend(b) for b in backends], router.remove_backend, 3)
report("a rollout dropping 50 of 200 backends", ms(lambda: pool.replace([Backend(b) for b in backends[50:]])))
report("one backend leaving", ms(lambda: router.remove_backend(backends[60])))

# The same rollout with pictures of 25,000 blocks (64 backends, 50 leave)
backends = [f"10.5.0.{i}:8000" for i in range(64)]
router = router_with_tables(backends, PICTURE)
pool = BackendPool([Backend(b) for b in backends], router.remove_backend, 3)
report(
    "a rollout dropping 50 of 64 backends (25,000-block pictures)",
    ms(lambda: pool.replace([Backend(b) for b in backends[50:]])),
)

# Still above 5 ms (not changed here): a cache cleared while the picture is full (8 x 25,000)
router = router_with_tables(FLEET, PICTURE)
router.loads.get(FLEET[4]).settled_at = 0.5
report(
    "a cache cleared (AllBlocksCleared with its moment), picture of 25,000",
    ms(lambda: router.engine_events(FLEET[4], [AllBlocksCleared()], previous=0.5, now=2.0)),
)
