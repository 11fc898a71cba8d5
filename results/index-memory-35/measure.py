"""Bytes per (block, backend) location in approximate mode's index once its LRUs have turned over,
by tracemalloc: random 60-bit chains (as chain.HASH_MASK makes them) learned round after round
over N backends until the index's memory bound (or, unbounded, each backend's capacity) makes it
drop entries. Run from the clone:
`.venv/bin/python results/index-memory-35/measure.py`."""

import gc
import random
import tracemalloc

from extproc.core.index import LocalIndex


def run(backends: int, rounds: int, chain: int, max_bytes: int | None, capacity: int = 10**7) -> None:
    rng = random.Random(7)
    names = [f"10.1.{i // 250}.{i % 250}:8000" for i in range(backends)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = LocalIndex(ttl_s=1e9, capacity_blocks=capacity, learn_share=1.0, max_bytes=max_bytes)
    for r in range(rounds):
        for name in names:
            index.learn([rng.getrandbits(60) for _ in range(chain)], name, float(r))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = sum(index.entries_by_backend().values())
    print(
        f"backends {backends:5} chain {chain:3} bound {max_bytes or '-'!s:>9} capacity {capacity:>8}: "
        f"{entries:8} locations, {used / entries:6.1f} bytes each, {used / 2**20:6.1f} MiB, "
        f"estimate {index.memory_bytes() / 2**20:6.1f} MiB, shed {index.shed}"
    )


if __name__ == "__main__":
    mib = 2**20
    run(64, 40, 16, None)  # no turnover: what bench core's table shows
    run(64, 300, 16, 8 * mib)
    run(8, 2000, 16, 24 * mib)
    run(1024, 40, 16, 48 * mib)
    run(4, 2000, 64, 8 * mib)
    run(64, 1000, 1, 8 * mib)
    run(64, 400, 2, 8 * mib)
    run(64, 300, 16, None, capacity=4096)  # turnover by each backend's capacity, no process bound
