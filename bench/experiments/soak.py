"""`kvroute-dev bench soak`: never-repeating prompts and session ids through the local stack, to
show that the ext_proc's memory plateaus where its configured capacities say it should.

Every request has a prompt and a session id no other request has, so without bounds the index
and the session table would grow with the request count. The ext_proc runs with a fixed index
capacity per backend and a session capacity; its resident memory (VmRSS) is sampled while the
requests run, and compared with the prediction: the RSS after a short warm-up plus what the
configured capacities can hold at the measured cost per entry (bytes per index entry from
`kvroute-dev bench core`; bytes per session binding and per prefix home measured here, with
tracemalloc). Each request's prompt head is new too, so the prefix homes fill to their capacity.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.harness.processes import rss_bytes
from bench.harness.stack import Stack, layout_for
from extproc.core import homes
from extproc.core.sessions import SessionTable

BACKENDS = 4
CAPACITY_BLOCKS = 8192  # per backend
SESSION_CAPACITY = 50_000
BYTES_PER_ENTRY = 48.9  # `kvroute-dev bench core` at 1 M entries (docs/benchmarks.md)
WARMUP = 2_000
FAST_SIM = ["--token-s", "0", "--step-s", "0", "--default-max-tokens", "1"]


def bytes_per_session(count: int = 50_000) -> float:
    """Memory of one session binding (keyed digest, shared backend string, last use), measured."""
    table = SessionTable(1e9, count, b"k" * 16)
    backends = [f"10.0.0.{i}:8000" for i in range(BACKENDS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        table.bind(f"session:soak-{i}", backends[i % BACKENDS], float(i))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / count


def bytes_per_home(count: int = homes.CAPACITY) -> float:
    """Memory of one prefix home (its head's key, a shared backend string), measured."""
    table = homes.PrefixHomes()
    backends = [f"10.0.0.{i}:8000" for i in range(BACKENDS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        table.place((i * 0x9E3779B97F4A7C15) & ((1 << 60) - 1), backends[i % BACKENDS])  # 60-bit keys, as heads are
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / count


async def _drive(url: str, total: int, concurrency: int, progress: list[int]) -> int:
    """Closed loop: `concurrency` workers send `total` unique requests; returns the failures."""
    failures = 0
    counter = iter(range(total))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        for i in counter:
            body = {
                "model": "sim-model",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": f"unique prompt {i}: " + f"{i:x} " * 400}],
            }
            headers = {"content-type": "application/json", "x-session-id": f"soak-{i}"}
            async with session.post(url, data=orjson.dumps(body), headers=headers) as response:
                await response.read()
                failures += response.status != 200
            progress[0] += 1

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return failures


def main(
    requests: int = 200_000,
    concurrency: int = 32,
    extproc_env: dict[str, str] | None = None,
    body_mode: str = "buffered",
    transport: str = "ext_proc",
) -> dict[str, Any]:
    """Run the soak; print and return the RSS samples and the prediction. `body_mode` is Envoy's
    (full_duplex: as picker gateways run it, the response stream included); `transport` how it
    asks kvroute."""
    extproc_env = extproc_env or {}
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    extproc_args = ["--capacity-auto", "false", "--capacity-blocks", str(CAPACITY_BLOCKS)]
    extproc_args += ["--session-capacity", str(SESSION_CAPACITY), "--log-level", "warning"]
    per_session = bytes_per_session()
    per_home = bytes_per_home()
    env = {**os.environ, **extproc_env}
    stack = Stack(
        workdir,
        sims=BACKENDS,
        sim_args=FAST_SIM,
        extproc_args=extproc_args,
        extproc_env=env,
        transport=transport,
        **layout_for(body_mode),
    )
    with stack:
        pid = stack.processes["extproc"].pid
        url = f"{stack.url}/v1/chat/completions"
        asyncio.run(_drive(url, WARMUP, concurrency, [0]))
        baseline = rss_bytes(pid)
        predicted = baseline + BACKENDS * CAPACITY_BLOCKS * BYTES_PER_ENTRY + SESSION_CAPACITY * per_session
        predicted += homes.CAPACITY * per_home
        progress = [0]
        samples: list[tuple[int, int]] = []

        async def run() -> int:
            drive = asyncio.create_task(_drive(url, requests, concurrency, progress))
            while not drive.done():
                samples.append((progress[0], rss_bytes(pid)))
                await asyncio.sleep(2)
            return await drive

        started = time.monotonic()
        failures = asyncio.run(run())
        took = time.monotonic() - started
        samples.append((progress[0], rss_bytes(pid)))
        state = stack.debug_state()
    mib = 1024 * 1024
    result = {
        "requests": requests,
        "failures": failures,
        "seconds": round(took, 1),
        "index_entries": state["index_entries"],
        "sessions": state["sessions"],
        "rss_baseline_mib": round(baseline / mib, 1),
        "rss_predicted_mib": round(predicted / mib, 1),
        "rss_final_mib": round(samples[-1][1] / mib, 1),
        "rss_max_mib": round(max(r for _, r in samples) / mib, 1),
        "final_over_predicted": round(samples[-1][1] / predicted, 3),
        "rss_by_requests_mib": [(n, round(r / mib, 1)) for n, r in samples[:: max(1, len(samples) // 12)]],
        "bytes_per_session": round(per_session, 1),
        "bytes_per_home": round(per_home, 1),
        "extproc_env": extproc_env,
        "body_mode": body_mode,
        "transport": transport,
    }
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return result
