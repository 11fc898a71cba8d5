"""What reading one access-log record costs EndsProtocol, at HEAD and at the revision given
(git show REV:extproc/envoy/ends.py), records as Envoy's immediate logger sends them (one a
message) and as the backstop batches them (200 a message). Alternated, three rounds.

Run from the checkout: .venv/bin/python results/security-ends/record_cost.py [REV]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import ModuleType

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.revisions import module_at, module_now


class _Transport(asyncio.Transport):
    def close(self) -> None:
        raise AssertionError("closed")


def per_record(ends: ModuleType, batch: int, messages: int) -> float:
    record = {"x": "ab12cd34.1f3", "u": "10.0.0.1:8000", "c": "200", "d": "via_upstream", "f": "-"}
    payload = msgpack.packb(["kvroute", [[1733500000, record]] * batch])
    seen = []
    protocol = ends.EndsProtocol(seen.append, "", lambda: None, set())
    protocol.connection_made(_Transport())
    started = time.perf_counter()
    for _ in range(messages):
        protocol.data_received(payload)
    elapsed = time.perf_counter() - started
    assert len(seen) == batch * messages
    return elapsed / (batch * messages) * 1e6


revision = sys.argv[1] if len(sys.argv) > 1 else "HEAD~1"
old = module_at(revision, "extproc/envoy/ends.py", "ends_old")
new = module_now("extproc/envoy/ends.py", "ends_new")
for round_ in range(3):
    for label, ends in (("before", old), ("after", new)):
        one = per_record(ends, 1, 50_000)
        batched = per_record(ends, 200, 500)
        print(f"round {round_ + 1} {label}: {one:.2f} us a record one a message, {batched:.2f} us batched by 200")
