"""The ext_authz path's Python work per request, without sockets: Authz.answer on a whole call and
Authz.ended on its record, on a real router over 4 backends, 8 KB follow-ups. CPU µs a request
(time.process_time), best of 5 rounds of 2,000.

    python results/floors-34/lean-calls/handler_bench.py   # from the checkout, in .venv
"""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.experiments.latency import followups
from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.envoy.authz import Authz
from extproc.envoy.calls import Call
from extproc.envoy.headers import DESTINATION_HEADER, EXCHANGE_HEADER, ROUTE_PREFIX
from extproc.envoy.processor import Processor
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

BACKENDS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
HEAD = {"authorization": "Bearer tok", "content-type": "application/json", "x-request-id": "r", "host": "h"}
router = Router(Settings(hash_key=b"k" * 16, decision_headers=True))
pool = BackendPool([Backend(b) for b in BACKENDS], router.remove_backend, unhealthy_after=2)
metrics = Metrics(router, pool)
authz = Authz(Processor(router, pool, metrics), metrics, "tok")
bodies = followups(8_000, 2000)


async def one(body: bytes) -> None:
    call = Call("POST", ROUTE_PREFIX + "/v1/chat/completions", {**HEAD, "content-length": str(len(body))}, body)
    head = (await authz.answer(call)).split(b"\r\n\r\n")[0].decode()
    fields = dict(line.split(": ", 1) for line in head.split("\r\n")[1:])
    record = {"x": fields[EXCHANGE_HEADER], "u": fields[DESTINATION_HEADER], "c": 200, "d": "via_upstream"}
    authz.ended({**record, "f": "-"})


async def main() -> None:
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for body in bodies:
            await one(body)
        rounds.append((time.process_time() - start) / len(bodies) * 1e6)
    print(f"{min(rounds):.1f} us a request (rounds: {', '.join(f'{r:.0f}' for r in rounds)})")


asyncio.run(main())
