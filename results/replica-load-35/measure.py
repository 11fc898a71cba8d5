"""Issue 35: what one sibling's load message costs a replica at 1,000 backends, whole vector
against delta (one backend changed): bytes on the wire, and CPU to apply it (decode, merge, hand
the changed sums to the router). In process, no Redis: python results/replica-load-35/measure.py"""

import time

import msgpack

from bench.experiments.core import fleet
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.replicas.redis_link import LOAD, LOAD_DELTA, RedisLink
from extproc.runtime.pool import BackendPool

backends = tuple(fleet(1000))
router = Router(Settings(hash_key=b"k" * 16))
pool = BackendPool(backends, router.remove_backend, 3)
link = RedisLink(router, pool, client=None, group="g")  # type: ignore[arg-type]  # _apply only
vector = {b.address: (0, 0, 0) for b in backends}
whole = msgpack.packb((LOAD, "sibling", "", vector))
link._apply(b"1-0", {b"m": whole}, 0.0)
link._apply_peer_loads(time.monotonic())
changed = dict(vector)
rounds = 500
start = time.perf_counter()
for i in range(rounds):
    link._apply(f"{2 + i}-0".encode(), {b"m": whole}, 0.0)
    link._apply_peer_loads(time.monotonic())
whole_us = (time.perf_counter() - start) / rounds * 1e6
start = time.perf_counter()
for i in range(rounds):
    address = backends[i % 1000].address
    delta = msgpack.packb((LOAD_DELTA, "sibling", "", {address: (i % 7, i % 3, i)}))
    link._apply(f"{1000 + i}-0".encode(), {b"m": delta}, 0.0)
    link._apply_peer_loads(time.monotonic())
delta_us = (time.perf_counter() - start) / rounds * 1e6
print(
    {
        "backends": 1000,
        "whole_bytes": len(whole),
        "delta_bytes": len(delta),
        "whole_apply_us": round(whole_us, 1),
        "delta_apply_us": round(delta_us, 1),
        "bad": link.counts["bad"],
    }
)
