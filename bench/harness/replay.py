"""`kvroute-dev bench replay`: send a trace through a router and measure what the fleet did with it.

Per request: TTFT, end-to-end latency, prompt and cached tokens (from `usage`), the backend that
served (`x-kvroute-backend`, the simulator's `x-sim-backend`, or the round-robin Envoy's
`x-bench-upstream`), status. Per run: the prompt cache hit rate measured on the backends (deltas
of `vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`), latency percentiles,
requests per backend (deltas of `vllm:request_success_total`) and their max/mean, errors.

Pacing: the trace's own arrival times divided by `speedup`, or a closed loop of `concurrency`
workers. A session's requests go in order, each after the previous one finished. In a closed loop a
worker either runs one session to its end (`sessions`: only `concurrency` conversations are ever
live) or takes the earliest-arriving request whose session has nothing in flight (`arrival`: every
conversation the trace has started stays live between its turns, as agents' do while their tools
run, so the caches must hold many more contexts than there are requests in flight).
"""

from __future__ import annotations

import asyncio
import heapq
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson
from tqdm import tqdm

from bench.workloads.prompts import PromptBuilder
from bench.workloads.trace import TraceRequest, chains

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)
UPSTREAM_HEADER = "x-bench-upstream"  # the benchmark's round-robin Envoy names the backend it picked
BACKEND_HEADERS = ("x-kvroute-backend", "x-sim-backend", UPSTREAM_HEADER)  # first present wins
METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    # the engines' own time to first token: the client's minus this is what the path to them adds
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:num_preemptions_total",  # running requests put back to wait for KV blocks (recomputed later)
    # where the engines' time to first token goes: waiting to be scheduled, then scheduled until the
    # first token; the rest is the server's front end (parsing, templating, tokenizing)
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    # engine steps and the tokens they computed
    "vllm:iteration_tokens_total_sum",
    "vllm:iteration_tokens_total_count",
)


@dataclass(slots=True)
class Record:
    """What one request did."""

    index: int
    status: int
    ttft_ms: float | None
    e2e_ms: float
    prompt_tokens: int
    cached_tokens: int
    backend: str | None
    error: str | None = None
    sent_at: float = 0.0  # perf_counter when it was sent: the order the bound is computed on
    predicted_tokens: int | None = None  # kvroute's prediction of the cached tokens (x-kvroute-cached-tokens)
    decision: str | None = None  # why kvroute chose the backend (x-kvroute-decision)
    output_tokens: int = 0  # tokens generated (usage)
    predicted_ttft_ms: float | None = None  # kvroute's prediction of the time to first token (x-kvroute-ttft-ms)
    retry_after_s: float | None = None  # a refusal's retry-after
    token_gaps_ms: list[float] = field(default_factory=list)  # between content chunks after the first: ITL


ORDERS = ("sessions", "arrival")  # how a closed loop's workers pick their next request (module docstring)


@dataclass(frozen=True, slots=True)
class Pacing:
    speedup: float | None = None
    concurrency: int | None = None
    duration_s: float | None = None
    order: str = "sessions"  # one of ORDERS; closed loop only


async def scrape(session: aiohttp.ClientSession, backends: Sequence[str]) -> dict[str, dict[str, float]]:
    """The counters of METRICS on each backend, summed over labels."""
    out: dict[str, dict[str, float]] = {}
    for backend in backends:
        async with session.get(f"http://{backend}/metrics") as response:
            text = await response.text()
        totals = dict.fromkeys(METRICS, 0.0)
        for name, value in _SAMPLE.findall(text):
            if name in totals:
                totals[name] += float(value)
        out[backend] = totals
    return out


async def send(
    session: aiohttp.ClientSession,
    url: str,
    request: TraceRequest,
    body: dict[str, Any],
    extra_headers: dict[str, str] | None = None,
) -> Record:
    """One streamed chat request, measured; never raises for what the router or backend answers."""
    headers = {"content-type": "application/json", **(extra_headers or {})}
    if request.session_id is not None:
        headers["x-session-id"] = request.session_id
    started = time.perf_counter()
    ttft = None
    last = 0.0
    gaps: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as response:
            backend = next((response.headers[name] for name in BACKEND_HEADERS if name in response.headers), None)
            predicted = response.headers.get("x-kvroute-cached-tokens")
            predicted_ttft = response.headers.get("x-kvroute-ttft-ms", "")
            decision = response.headers.get("x-kvroute-decision")
            if response.status != 200:
                await response.read()
                record = Record(request.index, response.status, None, _ms(started), 0, 0, backend, "http status")
                record.decision = decision
                retry = response.headers.get("retry-after", "")
                record.retry_after_s = float(retry) if retry.isdigit() else None
                return record
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = (now - started) * 1000
                    else:
                        gaps.append(round((now - last) * 1000, 2))
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        return Record(request.index, 0, ttft, _ms(started), 0, 0, None, f"{type(exc).__name__}: {exc}")
    details = usage.get("prompt_tokens_details") or {}
    return Record(
        request.index,
        200,
        ttft,
        _ms(started),
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        backend,
        predicted_tokens=int(predicted) if predicted is not None and predicted.isdigit() else None,
        decision=decision,
        output_tokens=int(usage.get("completion_tokens") or 0),
        predicted_ttft_ms=float(predicted_ttft) if predicted_ttft.isdigit() else None,
        token_gaps_ms=gaps,
    )


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


async def replay(
    url: str,
    requests: Sequence[TraceRequest],
    builder: PromptBuilder,
    pacing: Pacing,
    backends: Sequence[str] = (),
    label: str = "replay",
    headers: Callable[[TraceRequest], dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Run the trace through `url`; return the run's summary with every record. `headers`: each
    request's own headers beyond its session's (its tenant's, say)."""
    groups = chains(list(requests))
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    progress = tqdm(total=len(requests), desc=label, unit="req", leave=False, disable=None)  # off without a TTY
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = await scrape(session, backends)
        start = time.monotonic()
        deadline = start + pacing.duration_s if pacing.duration_s else float("inf")

        async def run_chain(chain: list[TraceRequest]) -> None:
            for request in chain:
                if pacing.speedup:
                    await asyncio.sleep(
                        max(0.0, start + request.timestamp_ms / 1000 / pacing.speedup - time.monotonic())
                    )
                if time.monotonic() >= deadline:
                    return
                sent_at = time.perf_counter()
                extra = headers(request) if headers is not None else None
                record = await send(session, url, request, builder.body(request), extra)
                record.sent_at = sent_at
                records.append(record)
                progress.update()

        if pacing.concurrency and pacing.order == "arrival":
            await _arrival_order(groups, pacing.concurrency, lambda request: run_chain([request]))
        elif pacing.concurrency:
            queue = list(reversed(groups))

            async def worker() -> None:
                while queue:
                    await run_chain(queue.pop())

            await asyncio.gather(*(worker() for _ in range(pacing.concurrency)))
        else:
            await asyncio.gather(*(run_chain(chain) for chain in groups))
        wall = time.monotonic() - start
        after = await scrape(session, backends)
    progress.close()
    return summarize(records, before, after, wall)


async def _arrival_order(
    groups: list[list[TraceRequest]], workers: int, send: Callable[[TraceRequest], Awaitable[None]]
) -> None:
    """Closed loop in the trace's order: each free worker sends the earliest-arriving request whose
    session's previous turn has finished; a session's next turn becomes ready when its last ends."""
    ready: list[tuple[float, int, int]] = [(chain[0].timestamp_ms, chain[0].index, g) for g, chain in enumerate(groups)]
    heapq.heapify(ready)
    position = [0] * len(groups)
    in_flight = 0
    changed = asyncio.Condition()

    def can_go() -> bool:  # a turn is ready, or none can become ready: all are sent
        return bool(ready) or in_flight == 0

    async def worker() -> None:
        nonlocal in_flight
        while True:
            async with changed:
                await changed.wait_for(can_go)
                if not ready:
                    return  # nothing ready and nothing in flight that could make something ready
                _, _, g = heapq.heappop(ready)
                in_flight += 1
            try:
                await send(groups[g][position[g]])
            finally:
                async with changed:
                    in_flight -= 1
                    position[g] += 1
                    if position[g] < len(groups[g]):
                        following = groups[g][position[g]]
                        heapq.heappush(ready, (following.timestamp_ms, following.index, g))
                    changed.notify_all()

    await asyncio.gather(*(worker() for _ in range(workers)))


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1)  # noqa: E731
    return {"p50": round(statistics.median(ordered), 1), "p90": pick(0.9), "p99": pick(0.99)}


def _mean_ms(total_s: float, count: float) -> float | None:
    return round(1000 * total_s / count, 1) if count else None


def summarize(
    records: list[Record], before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall_s: float
) -> dict[str, Any]:
    """One run's figures; the hit rate is the backends' own count."""
    ok = [r for r in records if r.status == 200]
    delta = {b: {k: after[b][k] - before[b][k] for k in METRICS} for b in after}
    engine = {k: sum(d[k] for d in delta.values()) for k in METRICS}  # the whole fleet's
    queries = engine["vllm:prefix_cache_queries_total"]
    hits = engine["vllm:prefix_cache_hits_total"]
    per_backend = {b: int(d["vllm:request_success_total"]) for b, d in delta.items()}
    mean = statistics.mean(per_backend.values()) if per_backend else 0
    firsts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    ttft = _percentiles(firsts)
    engine_firsts = engine["vllm:time_to_first_token_seconds_count"]
    scheduled = engine["vllm:request_queue_time_seconds_count"]
    steps = engine["vllm:iteration_tokens_total_count"]
    e2e = _percentiles([r.e2e_ms for r in ok])
    itl = _percentiles([gap for r in ok for gap in r.token_gaps_ms])
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    predicted = [r for r in ok if r.predicted_tokens is not None and r.prompt_tokens]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 1),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "hit_rate_usage": round(sum(r.cached_tokens for r in ok) / prompt_tokens, 4) if prompt_tokens else None,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p90_ms": ttft["p90"],
        "ttft_p99_ms": ttft["p99"],
        "engine_ttft_mean_ms": _mean_ms(engine["vllm:time_to_first_token_seconds_sum"], engine_firsts),
        "engine_queue_mean_ms": _mean_ms(engine["vllm:request_queue_time_seconds_sum"], scheduled),
        "engine_prefill_mean_ms": _mean_ms(engine["vllm:request_prefill_time_seconds_sum"], scheduled),
        "engine_steps": int(steps),
        "engine_tokens_per_step": round(engine["vllm:iteration_tokens_total_sum"] / steps, 1) if steps else None,
        "engine_preemptions": int(engine["vllm:num_preemptions_total"]),
        "ttft_mean_ms": round(statistics.mean(firsts), 1) if firsts else None,
        "itl_p50_ms": itl["p50"],
        "itl_p90_ms": itl["p90"],
        "e2e_p50_ms": e2e["p50"],
        "e2e_p90_ms": e2e["p90"],
        "e2e_p99_ms": e2e["p99"],
        "requests_per_backend": per_backend,
        "load_max_over_mean": round(max(per_backend.values()) / mean, 3) if mean else None,
        # kvroute's own prediction against what the backend reported, in tokens per request
        "prediction_mae_tokens": round(statistics.mean(abs(r.predicted_tokens - r.cached_tokens) for r in predicted), 1)
        if predicted
        else None,
        # the same as a share of each request's prompt (the cached fraction predicted against the real one)
        "prediction_mae_fraction": round(
            statistics.mean(abs(r.predicted_tokens - r.cached_tokens) / r.prompt_tokens for r in predicted), 4
        )
        if predicted
        else None,
        "records": [asdict(r) for r in sorted(records, key=lambda r: r.index)],
    }
