"""What the session table costs at its default capacity (100,000 bindings): a bind, a cache reset
and a departure of one backend, and its memory, over 2 and over 1,000 backends.
`python results/stalls-34/session_resets.py` from the repository's root (run at two commits to compare)."""

import statistics
import time
import tracemalloc

from extproc.core.sessions import SessionTable

N = 100_000


def filled(backends: int) -> SessionTable:
    table = SessionTable(ttl_s=1e9, capacity=N, key=bytes(16))
    for i in range(N):
        table.bind(f"session-{i}", f"10.0.{i % backends // 250}.{i % backends % 250}:8000", float(i))
    return table


for backends in (2, 1000):
    tracemalloc.start()
    table = filled(backends)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    binds = []
    for round_ in range(5):
        start = time.perf_counter()
        for i in range(10_000):
            table.bind(f"session-{i}", f"10.0.{i % backends // 250}.{i % backends % 250}:8000", N + round_ * 10_000 + i)
        binds.append((time.perf_counter() - start) / 10_000 * 1e6)
    resets, leaves = [], []
    for b in range(min(3, backends)):  # each on a table as filled: half of the backend's bindings used by then
        table = filled(backends)
        name = f"10.0.{b // 250}.{b % 250}:8000"
        start = time.perf_counter()
        table.remove_backend(name, before=N / 2)
        resets.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        table.leave(name)
        table.bind("again", name, 2 * N)  # bound to again at the same address
        leaves.append((time.perf_counter() - start) * 1e3)
    print(
        f"{backends} backends: {memory / 2**20:.1f} MiB for {N:,} bindings; bind {statistics.median(binds):.2f} µs; "
        f"reset of one backend {statistics.median(resets):.2f} ms; "
        f"departure and a bind {statistics.median(leaves):.2f} ms"
    )
