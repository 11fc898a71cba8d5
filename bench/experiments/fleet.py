"""`kvroute-dev bench fleet`: a simulated fleet of many backends serving several models for several
tenants, through Envoy and one ext_proc at the highest rate this machine sustains, then through
the routing core alone, beyond what the processes can carry.

Workload (bench/workloads/models.py): the agentic shape once per model, each session one
tenant's (sent as the fairness header), merged by time; a new seed per load level, so each level
brings new conversations (the shared system prompts stay cached from the levels before).

Through Envoy: one `kvroute-dev sim` process per model serves that model's share of the backends
(one port each, engines answering at once, so the router's path is what saturates), and one
ext_proc serves one policy per model (a YAML `policies` list) behind one Envoy. Closed loops of
increasing concurrency; per level: requests a second, latency, the hit rate the engines report,
and each process's CPU per request (from /proc). Client, Envoy, ext_proc and simulators share
this machine's cores: the rate where adding clients stops adding requests a second is the most
the machine sustains, not the most the ext_proc does.

Through the core: the same kind of trace straight into one Router per model (as the ext_proc's
policies hold them) over the same number of backends, each backend an in-process engine (vLLM's
block pool, bench/simulator/sim_engine.py) that serves the request's blocks and reports its load
as a scrape would; a request ends when the `window`-th after it starts. The routing calls alone
are timed (parse, decide, learn, end): their inverse is the decision rate one core sustains.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.experiments.decisions import ENGINE_BLOCK_TOKENS, EngineCache, started
from bench.harness.processes import cpu_seconds
from bench.harness.replay import Pacing, replay
from bench.harness.stack import Stack
from bench.simulator.sim import prompt_tokens
from bench.simulator.sim_engine import BlockPool
from bench.workloads import models as workload
from bench.workloads.prompts import PromptBuilder
from extproc.core.backends import Backend
from extproc.core.engine import EngineSample
from extproc.core.exchange import Exchange
from extproc.core.router import Router
from extproc.core.settings import Settings

INSTANT_SIM = ["--token-s", "0", "--step-s", "0", "--default-max-tokens", "1"]
ENGINE_BLOCKS = 4096  # each in-process engine's KV cache in the core run, in 128-token blocks


def model_names(count: int) -> tuple[str, ...]:
    return tuple(f"model-{chr(ord('a') + i)}" for i in range(count))


def through_envoy(
    backends: int, models: int, sessions: int, tenants: int, concurrencies: Sequence[int], workdir: Path
) -> list[dict[str, Any]]:
    """One row per concurrency level (module docstring)."""
    names = model_names(models)
    builder = PromptBuilder(names[0], workload.CHARS_PER_TOKEN, max_output_tokens=1)
    stack = Stack(workdir, sims=backends, sim_args=INSTANT_SIM, policy_models=names, transport="ext_authz")
    rows = []
    with stack:
        roles = {"extproc": [stack.processes["extproc"].pid], "envoy": [stack.processes["envoy"].pid]}
        roles["simulators"] = [p.pid for name, p in stack.processes.items() if name.startswith("sim")]
        for level, concurrency in enumerate(concurrencies):
            requests = workload.generate(names, sessions, tenants, seed=level + 1)
            before = {role: cpu_seconds(pids) for role, pids in roles.items()}
            started = time.perf_counter()
            summary = asyncio.run(
                replay(
                    stack.url,
                    requests,
                    builder,
                    Pacing(concurrency=concurrency),
                    label=f"fleet:{concurrency}",
                    headers=workload.tenant_headers,
                )
            )
            wall = time.perf_counter() - started  # (the summary's is rounded to 0.1 s: 0 for a fast small run)
            used = {role: cpu_seconds(pids) - before[role] for role, pids in roles.items()}
            ok = summary["ok"]
            rows.append(
                {
                    "path": "envoy",
                    "backends": backends,
                    "models": models,
                    "tenants": tenants,
                    "concurrency": concurrency,
                    "requests": len(requests),
                    "ok": ok,
                    "failed": dict(
                        Counter(_failure(record) for record in summary["records"] if record["status"] != 200)
                    ),
                    "requests_per_s": round(ok / wall, 1),
                    "e2e_p50_ms": summary["e2e_p50_ms"],
                    "e2e_p99_ms": summary["e2e_p99_ms"],
                    "hit_rate": summary["hit_rate_usage"],
                    **{
                        f"{role}_cpu_us_per_request": round(cpu / ok * 1e6, 1) if ok else None
                        for role, cpu in used.items()
                    },
                    **{f"{role}_cores": round(cpu / wall, 2) for role, cpu in used.items()},
                }
            )
    return rows


def _failure(record: dict[str, Any]) -> str:
    """What a failed request got: its status and kvroute's decision, or the client's error."""
    if record["status"]:
        return f"{record['status']} {record['decision'] or ''}".strip()
    return str(record["error"]).split(":", 1)[0]


def through_core(backends: int, models: int, sessions: int, tenants: int, window: int = 64) -> dict[str, Any]:
    """The routing core alone over the same fleet (module docstring); one row."""
    names = model_names(models)
    requests = workload.generate(names, sessions, tenants, seed=1)
    builder = PromptBuilder(names[0], workload.CHARS_PER_TOKEN, max_output_tokens=1)
    share = backends // models
    fleets = {
        name: tuple(Backend(f"10.{m}.{i // 250}.{i % 250}:8000", frozenset({name})) for i in range(share))
        for m, name in enumerate(names)
    }
    routers = {name: Router(Settings(hash_key=bytes(16), capacity_blocks=ENGINE_BLOCKS)) for name in names}
    engines = {b.address: EngineCache(BlockPool(ENGINE_BLOCKS)) for fleet in fleets.values() for b in fleet}
    running = dict.fromkeys(engines, 0)
    cache_tokens = ENGINE_BLOCKS * ENGINE_BLOCK_TOKENS
    inflight: deque[tuple[Exchange, str, list[int], float]] = deque()
    spent: list[float] = []
    cached_tokens = prompt_total = 0
    for request in requests:
        now = request.timestamp_ms / 1000.0
        name = request.adapter or names[0]
        router = routers[name]
        body = orjson.dumps(builder.body(request))
        headers = {"x-session-id": str(request.session_id), **workload.tenant_headers(request)}
        began = time.perf_counter()
        exchange = router.begin(router.parse(body, headers), fleets[name], now)
        backend = exchange.decision.backend or fleets[name][0].address
        started(router, exchange, backend, now)
        cost = time.perf_counter() - began
        tokens = prompt_tokens(orjson.loads(body)) or []
        pinned, cached, _ = engines[backend].serve(tokens)
        cached_tokens += cached * ENGINE_BLOCK_TOKENS
        prompt_total += len(tokens)
        running[backend] += 1
        usage = engines[backend].pool.pinned / ENGINE_BLOCKS
        router.engine_sample(
            backend, EngineSample(running[backend], 0, usage, 1.0, cache_tokens, ENGINE_BLOCK_TOKENS), now
        )
        inflight.append((exchange, backend, pinned, cost))
        if len(inflight) > window:
            ended, where, held, cost = inflight.popleft()
            began = time.perf_counter()
            ended.end()
            spent.append(cost + time.perf_counter() - began)
            engines[where].pool.release(held, 0)
            running[where] -= 1
    ordered = sorted(spent)
    return {
        "path": "core",
        "backends": backends,
        "models": models,
        "tenants": tenants,
        "requests": len(requests),
        "hit_rate": round(cached_tokens / prompt_total, 4) if prompt_total else None,
        "request_p50_us": round(statistics.median(ordered) * 1e6, 1),
        "request_p99_us": round(ordered[int(len(ordered) * 0.99)] * 1e6, 1),
        "decisions_per_s_per_core": round(len(ordered) / sum(ordered), 1),
    }


def main(backends: int, models: int, sessions: int, tenants: int, concurrencies: Sequence[int], core: bool) -> None:
    """The Envoy levels, then the core run; one JSON line each."""
    with tempfile.TemporaryDirectory(prefix="kvroute-fleet-") as directory:
        for row in through_envoy(backends, models, sessions, tenants, concurrencies, Path(directory)):
            print(orjson.dumps(row).decode(), flush=True)
    if core:
        print(orjson.dumps(through_core(backends, models, sessions, tenants)).decode(), flush=True)
