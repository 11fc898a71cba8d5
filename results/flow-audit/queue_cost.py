"""What weighing a long queue costs the event loop, at the revision given and in the checkout:
making room for a large newcomer (evicting many) and passing over a head that cannot run.

Run from the checkout: .venv/bin/python results/flow-audit/queue_cost.py REV
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.revisions import module_at, module_now


def costs(flow: ModuleType, size: int) -> tuple[float, int, float]:
    """(ms to make room for a newcomer as large as half the bytes, how many it evicted, ms of
    one pop that passes over every flow's head)"""
    limits = flow.QueueLimits(max_requests=size, max_total=size, max_bytes=size, max_flows=256)
    queue = flow.FlowQueue(limits)
    for i in range(size):
        queue.hold(0, f"f{i % 2}", 1, 1, now=i * 1e-4)
    started = time.perf_counter()
    queue.hold(0, "new", 1, size // 2, now=1.0)
    room = (time.perf_counter() - started) * 1e3
    evicted = len(queue.ended(now=1.0))
    started = time.perf_counter()
    queue.pop(lambda _held: False)
    return room, evicted, (time.perf_counter() - started) * 1e3


old = module_at(sys.argv[1], "extproc/core/flow.py", "flow_old")
new = module_now("extproc/core/flow.py", "flow_new")
for size in (1024, 4096):
    for label, flow in (("before", old), ("after", new)):
        room, evicted, passed = costs(flow, size)
        print(f"{size} held, {label}: room for the newcomer {room:.1f} ms ({evicted} evicted);", end=" ")
        print(f"a pop past every head {passed:.2f} ms")
