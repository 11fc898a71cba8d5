"""`kvroute-dev bench latency`: what kvroute adds to Envoy, and what one ext_proc process sustains.

Runs the same requests through two stacks over the same fast simulated backends (no prefill or
decode time): Envoy alone with round robin, and Envoy + kvroute's ext_proc. Reports p50/p99
latency at concurrency 1 and 16 for 8 KB and 84 KB chat bodies answered with one token, and for
8 KB bodies answered with streams of 16 and 256 tokens paced 1 ms apart (one SSE event, one body
chunk each: what a full-duplex response stream costs the ext_proc), their differences, and the
ext_proc's CPU seconds per request (from /proc), whose inverse is the request rate one ext_proc process sustains on one
core. Then what a disaggregated request costs kvroute (`measure_split`): the same 8 KB bodies
through kvroute over one decode server, served whole and split (the ext_proc runs each one's
prefill leg on a second server, then hands the decode leg on), simulated servers that speak the
hand-off with no compute or transfer time. Client, Envoy, ext_proc and backends share this
machine's cores, so compare the two stacks within one run, not across runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.observability import Jaeger
from bench.harness.processes import cpu_seconds, free_port, spawn, stop, wait_http
from bench.harness.stack import Stack, dev_command, layout_for
from bench.workload import conversation

FAST_SIM = ["--token-s", "0", "--step-s", "0", "--default-max-tokens", "1"]
# Streams paced at 1 ms a token, so each SSE event is its own body chunk (unpaced, the events of
# a stream coalesce into a few reads and the response stream would look cheaper than it is).
PACED_SIM = ["--token-s", "0", "--step-s", "0.001"]


async def send_all(url: str, bodies: list[bytes], concurrency: int) -> tuple[list[float], float]:
    """Send every body once with `concurrency` workers; return latencies (ms) and wall seconds."""
    latencies: list[float] = []
    queue = list(reversed(bodies))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
                ) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"status {response.status}")
                latencies.append((time.perf_counter() - start) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


# (body bytes, concurrency, streamed response tokens or 0 for one token in one JSON answer), per
# simulator pacing; 256 paced tokens at concurrency 1 would take minutes, so only at 16.
CASES = {
    "fast": [(8_000, 1, 0), (8_000, 16, 0), (84_000, 1, 0), (84_000, 16, 0)],
    "paced": [(8_000, 1, 16), (8_000, 16, 16), (8_000, 16, 256)],
}
SIM_ARGS = {"fast": FAST_SIM, "paced": PACED_SIM}


def followups(size: int, count: int, stream_tokens: int = 0) -> list[bytes]:
    """Follow-ups of a handful of conversations, so kvroute really looks up and learns."""
    bases = [conversation(size, seed=s) for s in range(8)]
    out = []
    for i in range(count):
        body = bases[i % len(bases)]
        body["messages"].append({"role": "user", "content": f"question {i}"})
        body["model"] = "sim-model"
        if stream_tokens:
            body.update(stream=True, max_tokens=stream_tokens)  # the simulator answers exactly that many
        out.append(orjson.dumps(body))
        body["messages"].pop()
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def load_figures(latencies: list[float], wall: float) -> dict[str, float]:
    """One load's latency p50 and p99 (ms) and requests a second."""
    return {
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(percentile(latencies, 0.99), 3),
        "rps": round(len(latencies) / wall, 1),
    }


def measure(
    requests: int,
    workdir: Path,
    body_mode: str = "buffered",
    extproc_args: tuple[str, ...] = (),
    extproc_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Both stacks over one set of backends; one row per case (body size, concurrency, streamed
    tokens). `body_mode` full_duplex configures kvroute's Envoy as endpoint-picker gateways do
    (bodies streamed both ways, the destination read from `envoy.lb` metadata); full_duplex_request
    streams only the request. `extproc_args`: settings for the ext_proc (flow control off, say);
    `extproc_env`: its environment (tracing's OTEL_* variables, say)."""
    results = []
    for pacing, cases in CASES.items():
        workload = (SIM_ARGS[pacing], cases)
        results += _measure_cases(requests, workdir / pacing, body_mode, workload, extproc_args, extproc_env)
    return results


def _measure_cases(
    requests: int,
    workdir: Path,
    body_mode: str,
    workload: tuple[list[str], list[tuple[int, int, int]]],
    extproc_args: tuple[str, ...],
    extproc_env: dict[str, str] | None,
) -> list[dict[str, Any]]:
    results = []
    sim_args, cases = workload
    kvroute = Stack(
        workdir / "kvroute",
        sims=4,
        sim_args=sim_args,
        extproc_args=extproc_args,
        extproc_env=extproc_env,
        **layout_for(body_mode),
    )
    plain = Stack(workdir / "plain", backends=kvroute.backends, ext_proc=False)
    with kvroute, plain:
        extproc_pid = kvroute.processes["extproc"].pid
        for size, concurrency, tokens in cases:
            bodies = followups(size, requests, tokens)
            asyncio.run(send_all(plain.url, bodies[:50], concurrency))  # warm-up
            asyncio.run(send_all(kvroute.url, bodies[:50], concurrency))
            row: dict[str, Any] = {
                "body_mode": body_mode,
                "body_bytes": len(bodies[0]),
                "concurrency": concurrency,
                "streamed_tokens": tokens,
            }
            for name, stack in (("envoy", plain), ("kvroute", kvroute)):
                figures, cpu = _timed(stack.url, bodies, concurrency, extproc_pid)
                row.update({f"{name}_{key}": value for key, value in figures.items()})
                if name == "kvroute":
                    row["extproc_cpu_us_per_request"] = round(cpu * 1e6, 1)
                    row["extproc_rps_per_core"] = round(1 / cpu, 1) if cpu else None
            row["added_p50_ms"] = round(row["kvroute_p50_ms"] - row["envoy_p50_ms"], 3)
            row["added_p99_ms"] = round(row["kvroute_p99_ms"] - row["envoy_p99_ms"], 3)
            results.append(row)
    return results


def _timed(url: str, bodies: list[bytes], concurrency: int, extproc_pid: int) -> tuple[dict[str, float], float]:
    """One load through a stack: its latency p50 and p99 (ms) and requests a second, and the
    ext_proc's CPU seconds per request meanwhile."""
    cpu_before = cpu_seconds([extproc_pid])
    latencies, wall = asyncio.run(send_all(url, bodies, concurrency))
    cpu = cpu_seconds([extproc_pid]) - cpu_before
    return load_figures(latencies, wall), cpu / len(latencies)


SPLIT_CASES = [(8_000, 1), (8_000, 16)]  # (body bytes, concurrency)
EVERY_REQUEST_SPLIT = ("--pd-threshold-tokens", "256")  # each new 8 KB prompt is about 2,000 tokens


def measure_split(
    requests: int,
    workdir: Path,
    body_mode: str = "buffered",
    extproc_args: tuple[str, ...] = (),
    extproc_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per SPLIT_CASES case: latency and ext_proc CPU per request served whole and split,
    and what the split adds."""
    ports = [free_port(), free_port()]
    args = [a for p in ports for a in ("--port", str(p))]
    workdir.mkdir(parents=True, exist_ok=True)
    sims = spawn(
        dev_command("sim", *args, *FAST_SIM, "--kv-connector", "--transfer-block-s", "0"), workdir / "sims.log"
    )
    try:
        prefill, decode = (f"127.0.0.1:{p}" for p in ports)
        for backend in (prefill, decode):
            wait_http(f"http://{backend}/health", process=sims)
        layout = layout_for(body_mode)
        split_args = (*extproc_args, "--backend", f"{prefill}@prefill", *EVERY_REQUEST_SPLIT)
        whole = Stack(
            workdir / "whole", backends=[decode], extproc_args=extproc_args, extproc_env=extproc_env, **layout
        )
        split = Stack(workdir / "split", backends=[decode], extproc_args=split_args, extproc_env=extproc_env, **layout)
        results = []
        with whole, split:
            for case, (size, concurrency) in enumerate(SPLIT_CASES):
                row: dict[str, Any] = {"case": "split", "body_mode": body_mode, "body_bytes": size}
                row["concurrency"] = concurrency
                for name, stack in (("whole", whole), ("split", split)):
                    # new to the decode server each time (the other stack's prompts would be cached there)
                    bodies = _new_prompts(size, requests + 50, first=(2 * case + (name == "split")) * 100_000)
                    asyncio.run(send_all(stack.url, bodies[:50], concurrency))  # warm-up
                    figures, cpu = _timed(stack.url, bodies[50:], concurrency, stack.processes["extproc"].pid)
                    row.update({f"{name}_{key}": figures[key] for key in ("p50_ms", "p99_ms")})
                    row[f"{name}_extproc_cpu_us_per_request"] = round(cpu * 1e6, 1)
                row["added_p50_ms"] = round(row["split_p50_ms"] - row["whole_p50_ms"], 3)
                row["added_cpu_us_per_request"] = round(
                    row["split_extproc_cpu_us_per_request"] - row["whole_extproc_cpu_us_per_request"], 1
                )
                row["split_share"] = _split_share(split)
                results.append(row)
        return results
    finally:
        stop(sims)


def _new_prompts(size: int, count: int, first: int) -> list[bytes]:
    """Prompts no backend has seen (a split is for a long uncached prompt), seeded from `first`."""
    bodies = []
    for seed in range(first, first + count):
        body = conversation(size, seed=seed)
        body["model"] = "sim-model"
        bodies.append(orjson.dumps(body))
    return bodies


def _split_share(stack: Stack) -> float:
    """The share of the stack's LLM requests so far that were split (the rest were served whole)."""
    with urllib.request.urlopen(f"{stack.admin_url}/metrics", timeout=10) as response:
        page = response.read().decode()
    split = decided = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "kvroute_disaggregation_total" and sample.labels.get("outcome") == "split":
                split += sample.value
            elif sample.name == "kvroute_decisions_total" and sample.labels.get("decision") != "prefill":
                decided += sample.value
    return round(split / decided, 3) if decided else 0.0


def main(requests: int, body_mode: str = "buffered", extproc_args: tuple[str, ...] = (), tracing: bool = False) -> None:
    """`tracing`: every request traced (sampler always on), its spans exported over OTLP to a real
    collector (Jaeger all-in-one, bench/harness/observability.py) beside the stacks."""
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-") as tmp, contextlib.ExitStack() as collector:
        env = None
        if tracing:
            jaeger = collector.enter_context(Jaeger(Path(tmp) / "jaeger"))
            env = {**os.environ, **jaeger.exporter_env(), "OTEL_TRACES_SAMPLER": "always_on"}
        rows = measure(requests, Path(tmp), body_mode, extproc_args, env)
        rows += measure_split(requests, Path(tmp) / "split", body_mode, extproc_args, env)
        for row in rows:
            print(orjson.dumps({**row, "tracing": tracing}).decode(), flush=True)
