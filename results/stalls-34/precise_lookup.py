"""Issue 34: a precise-mode lookup of a 7,500-block prompt over 32 candidates that hold all of it,
then 625 blocks of it (best of five calls). Run: python results/stalls-34/precise_lookup.py"""

import random
import time

from extproc.core.chain import TokenHasher
from extproc.core.precise import PreciseIndex, _Held

random.seed(1)
idx = PreciseIndex(TokenHasher(bytes(16)), 10**7)
chain = [random.getrandbits(60) for _ in range(7500)]
backends = [f"10.0.0.{i}:8000" for i in range(32)]
for b in backends:
    h = _Held()
    for k in chain:
        h.keys[k] = 1
    idx._backends[b] = h
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    r = idx.lookup(chain, backends, 1.0)
    best = min(best, time.perf_counter() - t)
print("all held: %.2f ms" % (best * 1e3), set(r.values()))
for b in backends:
    h = idx._backends[b]
    for k in chain[625:]:
        del h.keys[k]
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    r = idx.lookup(chain, backends, 1.0)
    best = min(best, time.perf_counter() - t)
print("625 held: %.2f ms" % (best * 1e3), set(r.values()))
