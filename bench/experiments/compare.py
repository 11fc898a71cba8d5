"""`kvroute-dev bench compare`: one trace, the same backends, every router, cold caches each time.

Backends are simulated (`--backends N`, one `kvroute-dev sim` process) or real vLLM-CPU servers
(`--backends vllm-cpu:N`, bench/harness/fleets.py). Their total prompt cache is
`--capacity-ratio` times the trace slice's working set, which is what makes routers differ. Each
router's run starts with every backend's prefix cache reset. Belady's MIN bound
(bench/harness/oracle.py) makes every hit rate read as a fraction of what is possible.
"""

from __future__ import annotations

import asyncio
import logging
import math
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness import peers, report
from bench.harness.fleets import (
    ENGINE_SCHEDULING,
    SIM_BLOCK_TOKENS,
    Fleet,
    SimFleet,
    VllmFleet,
    chars_per_token,
    counter,
    post,
)
from bench.harness.processes import cpu_seconds
from bench.harness.replay import Pacing, replay
from bench.harness.stack import Stack
from bench.simulator.sim import DEFAULT_TOKENIZER
from bench.workloads.other_traffic import OtherTraffic
from bench.workloads.prompts import PromptBuilder
from bench.workloads.trace import BLOCK_TOKENS, TraceRequest, read, working_set_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompareOptions:
    trace: Path
    limit: int
    out: Path
    capacity_ratio: float = 1.0
    backends: int = 4
    vllm_cpu: bool = False
    routers: tuple[str, ...] = peers.ROUTERS
    pacing: Pacing = field(default_factory=lambda: Pacing(speedup=10.0))
    max_output_tokens: int = 32
    max_input_tokens: int | None = None
    sim_args: tuple[str, ...] = ()
    sim_block_tokens: int = SIM_BLOCK_TOKENS
    sim_tokenizer: str = DEFAULT_TOKENIZER  # the simulator's: bytes (4 a token) or words (varying, as a real one's)
    extproc_replicas: int = 1  # kvroute's ext_proc processes (shared through Redis, or not: kvroute-unshared)
    engine_scheduling: str = ENGINE_SCHEDULING[0]  # vLLM-CPU servers beside the routers (VllmFleet)
    max_loras: int = 2  # adapters a server's batch holds at once, when the trace names adapters
    other_traffic_tokens: int = 0  # prompts of this size sent straight to the first backend meanwhile
    envoy_graceful_close: bool = True  # kvroute's Envoy half-closes ext_proc streams (False: resets them)


def start_fleet(options: CompareOptions, requests: Sequence[TraceRequest]) -> Fleet:
    """The backends, with a total prompt cache of `capacity_ratio` times the requests' working set."""
    cache_tokens = math.ceil(options.capacity_ratio * working_set_blocks(requests) * BLOCK_TOKENS)
    workdir = options.out / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    longest = max(r.input_tokens for r in requests) + options.max_output_tokens
    adapters = sorted({r.adapter for r in requests if r.adapter is not None})
    if options.vllm_cpu:
        roles = peers.fleet_roles(options.routers, options.backends)
        return VllmFleet(
            options.backends,
            cache_tokens,
            longest,
            workdir,
            options.engine_scheduling,
            roles,
            adapters,
            options.max_loras,
        )
    return SimFleet(
        options.backends,
        cache_tokens,
        workdir,
        options.sim_args,
        options.sim_block_tokens,
        longest,
        options.sim_tokenizer,
        adapters,
        options.max_loras,
    )


def runnable(options: CompareOptions, fleet: Fleet) -> tuple[list[str], dict[str, str]]:
    """The routers that can run on this fleet, and why the others cannot."""
    skipped = {}
    for name in options.routers:
        base = peers.router_spec(name)[0]
        if fleet.tokenizer_dir is None and base == "kvroute-precise":
            skipped[name] = "needs real vLLM backends (the model's tokenizer and KV events)"
        if base in peers.FLEET_ROLES and not fleet.kv_transfer:
            skipped[name] = "needs servers that speak vLLM's kv_transfer_params (vLLM-CPU with NIXL)"
        if base == peers.PLACEMENT and not fleet.adapters:
            skipped[name] = "needs a trace that names LoRA adapters"
        if options.extproc_replicas == 1 and base == "kvroute-unshared":
            skipped[name] = "the same as kvroute with one replica"
    return [r for r in options.routers if r not in skipped], skipped


def run_router(
    fleet: Fleet,
    name: str,
    requests: Sequence[TraceRequest],
    builder: PromptBuilder,
    pacing: Pacing,
    prompts: dict[int, Any],
    workdir: Path,
    replicas: int = 1,
    other_traffic_tokens: int = 0,
    graceful_close: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One router over the fleet with cold caches: its summary (hit rate against the MIN bound on
    the order its requests were really sent) and its per-request records. With
    `other_traffic_tokens`, another client sends prompts of that size straight to the first
    backend while the router runs (`bench.other_traffic`)."""
    base, flags = peers.router_spec(name)
    placing = base == peers.PLACEMENT
    fleet.reset(adapters_listed=not placing)
    router = peers.start(
        base,
        fleet.backends,
        workdir / peers.workdir_name(name),
        fleet.tokenizer_dir,
        replicas,
        graceful_close,
        flags,
        fleet.adapter_paths() if placing else None,
    )
    try:
        cpu_before = cpu_seconds(router.pids())
        parts_before = router.cpu_by_process()
        swaps_before = fleet.adapter_swaps()
        work = replay(router.url, requests, builder, pacing, fleet.backends, label=name)
        other = None
        if other_traffic_tokens:
            chars = round(other_traffic_tokens * builder.chars_per_token)
            other = OtherTraffic(fleet.backends[0], fleet.model, chars)
            work = other.beside(work)
        summary = asyncio.run(work)
        if other is not None:
            summary["other_traffic"] = {"served": other.served, "failed": other.failed}
        # On a shared machine the router's CPU is taken from the engines beside it.
        summary["router_cpu_s"] = round(cpu_seconds(router.pids()) - cpu_before, 2)
        if parts_before:  # kvroute's stack: which of its processes took it
            after = router.cpu_by_process()
            summary["router_cpu_by_process_s"] = {k: round(after[k] - v, 2) for k, v in parts_before.items()}
        if fleet.adapters:  # slot swaps: each loads an adapter and, once the slots are full, evicts one
            swaps = fleet.adapter_swaps() - swaps_before
            summary["adapter_swaps"] = swaps
            summary["adapter_swaps_per_min"] = round(60 * swaps / summary["wall_s"], 1) if summary["wall_s"] else None
        if router.stack is not None and router.stack.ext_proc:
            summary.update(reuse(router.stack))
            if router.stack.transport == "ext_authz":
                summary.update(ends(router.stack))
        if placing and router.stack is not None:  # placement's own loads and unloads (vLLM's runtime API)
            admin = f"127.0.0.1:{router.stack.admin_port}"
            for action in ("load", "unload"):
                moves = counter(admin, "kvroute_adapter_placements_total", declared=True, action=action, outcome="ok")
                summary[f"adapter_placement_{action}s"] = round(moves)
        summary["exited"] = router.exited()
        if summary["exited"]:
            log.error("%s: %s exited during the run: its figures are void", name, ", ".join(summary["exited"]))
        if summary.get("errors"):  # their time is in no percentile: a router that refuses looks faster
            log.warning("%s: %d requests failed; its TTFT and E2E figures leave them out", name, summary["errors"])
    finally:
        router.stop()
    records = summary.pop("records")
    hit = summary["hit_rate"]
    # The bound on the order this router's requests were really sent (closed loop differs from the trace).
    sent = sorted((r for r in records if r["status"] == 200), key=lambda r: r["sent_at"])
    bound = fleet.ideal([prompts[r["index"]] for r in sent])["bound"]
    summary["bound_hit_rate"] = round(bound, 4)
    summary["fraction_of_bound"] = round(hit / bound, 4) if hit is not None and bound else None
    return summary, records


def ends(stack: Stack) -> dict[str, int]:
    """The ext_authz transport's request ends (docs/envoy.md): the entries Envoy's immediate
    access logger dropped, and the requests kvroute ended from the backstop's copy (those dropped,
    and those whose copy overtook their own record)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.envoy_admin_port}/stats?format=json", timeout=10) as page:
        stats = {s["name"]: s.get("value", 0) for s in orjson.loads(page.read())["stats"] if "name" in s}
    admins = [f"127.0.0.1:{port}" for port in stack.admin_ports]
    return {
        "ends_dropped_by_envoy": int(stats.get("access_logs.fluentd.kvroute_ends.entries_lost", 0)),
        "ends_late": round(sum(counter(a, "kvroute_errors_total", declared=True, kind="late_end") for a in admins)),
    }


def reuse(stack: Stack) -> dict[str, float | None]:
    """kvroute's own account of the reuse it was offered and took (docs/observability.md), over
    its replicas, as shares of the prompt tokens it served: available (the best candidate's
    cached prefix) and routed (the chosen backend's). Delivered is the run's hit rate, from the
    engines' own counters, as for every router."""
    admins = [f"127.0.0.1:{port}" for port in stack.admin_ports]
    prompt = sum(counter(a, "kvroute_prompt_tokens_total", declared=True) for a in admins)
    shares: dict[str, float | None] = {}
    for name in ("available", "routed"):
        tokens = sum(counter(a, f"kvroute_reuse_{name}_tokens_total", declared=True) for a in admins)
        shares[f"reuse_{name}"] = round(tokens / prompt, 4) if prompt else None
    return shares


def prompt_builder(fleet: Fleet, options: CompareOptions) -> PromptBuilder:
    """Prompts of the trace's lengths in the fleet's own tokens."""
    return PromptBuilder(fleet.model, chars_per_token(fleet.backends[0], fleet.model), options.max_output_tokens)


def describe(options: CompareOptions, requests: Sequence[TraceRequest], fleet: Fleet) -> dict[str, Any]:
    """What a run ran on: trace, fleet and its cache, for the head of its results."""
    return {
        "trace": options.trace.name,
        "requests": len(requests),
        "backends": options.backends,
        "backend_kind": "vllm-cpu" if options.vllm_cpu else "sim",
        "capacity_ratio": options.capacity_ratio,
        "capacity_blocks_per_backend": fleet.capacity_blocks,
        "backend_block_tokens": fleet.block_tokens,
        "extproc_replicas": options.extproc_replicas,
        "engine_scheduling": options.engine_scheduling if options.vllm_cpu else None,
        "other_traffic_tokens": options.other_traffic_tokens,
        "envoy_graceful_close": options.envoy_graceful_close,
        "adapters": list(fleet.adapters),
        "max_loras": options.max_loras,
    }


WARM_UP_REQUESTS = 4  # per server


def warm_up(fleet: Fleet, builder: PromptBuilder, requests: Sequence[TraceRequest]) -> None:
    """Send every server a few of the trace's first requests before any router runs (each router
    then starts on emptied caches): a server's first requests are slower, which would count
    against whichever router runs first (docs/benchmarks.md, issue 31: a router that routed as
    kvroute did had a 37 % lower E2E p50 run second, and was level with it run first)."""
    for backend in fleet.backends:
        for request in requests[:WARM_UP_REQUESTS]:
            body = {**builder.body(request), "stream": False, "max_tokens": 4}
            body.pop("stream_options", None)
            post(f"http://{backend}/v1/chat/completions", body)


def load_requests(options: CompareOptions) -> list[TraceRequest]:
    return read(options.trace, options.limit, options.max_input_tokens)


def run(options: CompareOptions) -> dict[str, Any]:
    """Run every router; write results.json, summary.md, plots and per-request records."""
    requests = load_requests(options)
    working_set_tokens = working_set_blocks(requests) * BLOCK_TOKENS
    workdir = options.out / "logs"
    fleet = start_fleet(options, requests)
    try:
        builder = prompt_builder(fleet, options)
        prompts = fleet.prompts(requests, builder)
        warm_up(fleet, builder, requests)
        ideal = fleet.ideal([prompts[r.index] for r in requests])  # in trace order
        rows: dict[str, dict[str, Any]] = {}
        records: dict[str, list[dict[str, Any]]] = {}
        routers, skipped = runnable(options, fleet)
        for name in routers:
            summary, records[name] = run_router(
                fleet,
                name,
                requests,
                builder,
                options.pacing,
                prompts,
                workdir,
                options.extproc_replicas,
                options.other_traffic_tokens,
                options.envoy_graceful_close,
            )
            hit = summary["hit_rate"]
            summary["fraction_of_lru"] = round(hit / ideal["lru"], 4) if hit is not None and ideal["lru"] else None
            rows[name] = summary
    finally:
        fleet.stop()
    results = {
        **describe(options, requests, fleet),
        "working_set_tokens": working_set_tokens,
        "pacing": {
            "speedup": options.pacing.speedup,
            "concurrency": options.pacing.concurrency,
            "order": options.pacing.order,
        },
        "max_output_tokens": options.max_output_tokens,
        "max_input_tokens": options.max_input_tokens,
        "oracle_hit_rate": round(ideal["lru"], 4),
        "bound_hit_rate_trace_order": round(ideal["bound"], 4),
        "routers": rows,
        "skipped": skipped,
    }
    report.write(results, records, options.out)
    return results
