"""A cache cleared (AllBlocksCleared) at a moment after which kvroute learned nothing there (0.5:
the pictures were learned at 1.0, so all of it may be new content and stays) or everything (1.5:
all of it predates the clear and goes); 8 pictures of 25,000 blocks, 100,000 bindings.

    PYTHONPATH=<checkout> python results/stalls-34/clear.py   # clear.txt: 447f1b5 and after
"""

import random
import time

from extproc.core.engine import AllBlocksCleared
from extproc.core.router import Router
from extproc.core.settings import Settings

rng = random.Random(1)
FLEET = [f"10.0.0.{i}:8000" for i in range(8)]
r = Router(Settings(hash_key=bytes(16), capacity_blocks=25_000, capacity_auto=False))
for b in FLEET:
    for _ in range(0, 25_000, 64):
        r.index.learn([rng.getrandbits(60) for _ in range(64)], b, 1.0)
for i in range(100_000):
    r.sessions.bind(f"session:{i}", FLEET[i % 8], 1.0)
for moment, b in ((0.5, FLEET[4]), (1.5, FLEET[5])):
    t = time.perf_counter()
    r.engine_events(b, [AllBlocksCleared()], previous=moment, now=2.0)
    t1 = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    r.index.forget_before(FLEET[6 if moment < 1 else 7], moment)
    t2 = (time.perf_counter() - t) * 1e3
    print(f"moment {moment}: engine_events {t1:.1f} ms, index.forget_before alone {t2:.1f} ms")
