"""Issue 34: a precise-mode lookup of a 7,500-block prompt over 32 candidates that hold all of it,
then 625 blocks of it (best of five calls). Run: python results/stalls-34/precise_lookup.py"""

import random
import time

from extproc.core.chain import TokenHasher
from extproc.core.precise import PreciseIndex, _Held

random.seed(1)
index = PreciseIndex(TokenHasher(bytes(16)), 10**7)
chain = [random.getrandbits(60) for _ in range(7500)]
backends = [f"10.0.0.{i}:8000" for i in range(32)]
for backend in backends:
    held = index._backends[backend] = _Held()
    held.keys.update(dict.fromkeys(chain, 1))


def best_of_five(what: str) -> None:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matched = index.lookup(chain, backends, 1.0)
        best = min(best, time.perf_counter() - start)
    print(f"{what}: {best * 1e3:.2f} ms", set(matched.values()))


best_of_five("all held")
for backend in backends:
    for key in chain[625:]:
        del index._backends[backend].keys[key]
best_of_five("625 held")
