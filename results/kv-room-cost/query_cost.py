"""The decision's cost with KV room weighed (kv_room_everywhere) and without: Router.query over four
backends with fresh engine samples, best of five repeats of 20,000, each setting twice, alternated.
Run from the repository root: .venv/bin/python results/kv-room-cost/query_cost.py"""

import timeit

from extproc.core.backends import Backend
from extproc.core.engine import EngineSample
from extproc.core.router import Router
from tests.test_router import chat, make_router

FLEET = [Backend(f"10.0.0.{i}:8000") for i in range(4)]
CALLS = 20_000


def per_query_us(router: Router) -> float:
    request = chat([], "s", "hello")
    router.query(request, FLEET, 1.0)
    best = min(timeit.repeat(lambda: router.query(request, FLEET, 1.0), number=CALLS, repeat=5))
    return best / CALLS * 1e6


for on in (True, False, True, False):
    router = make_router(kv_room_everywhere=on)
    for backend in FLEET:
        router.engine_sample(backend.address, EngineSample(1, 0, 0.3, 100.0, 300_000, 16), 0)
    print(f"kv room {on}: {per_query_us(router):.2f} us per query")
