"""One learning past a full backend picture: a picture at its limit (a GPU's KV cache in blocks),
then one response teaching `new` blocks it does not hold. Wall time of that one learn.

    PYTHONPATH=<checkout> python results/floors-34/learn-stall/stall.py   # output.txt: before and after aace5d9
"""

import random
import time

from extproc.core.index import LocalIndex

rng = random.Random(1)
for limit, new in ((20_000, 100), (100_000, 300)):
    index = LocalIndex(ttl_s=1e9, capacity_blocks=limit)
    for _ in range(0, limit, 64):
        index.learn([rng.getrandbits(60) for _ in range(64)], "b", 0.0)
    chain = [rng.getrandbits(60) for _ in range(new)]
    t = time.perf_counter()
    index.learn(chain, "b", 1.0)
    print(f"limit {limit}, {new} new blocks: {(time.perf_counter() - t) * 1e3:.1f} ms")
