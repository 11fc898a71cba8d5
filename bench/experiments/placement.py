"""`kvroute-dev bench placement`: where conversations are placed, judged on a timed closed loop in
seconds, and how much any placement of whole conversations could gain with hindsight.

Why a second replay beside `decisions.engine_hit_rate`: on the real agent sessions the benchmark
runs a closed loop in arrival order (`bench.harness.replay`): which turn is sent next depends on
when the others end, and that decides which contexts meet in a cache. The file-order replay has no
time and ranked kvroute's default placement above sglang-router's rule, where vLLM-CPU ranks it
below (docs/benchmarks.md, "Real coding-agent sessions"). Here `clients` clients each send the
earliest-arriving turn whose conversation has nothing in flight, as the benchmark does; each engine
is vLLM's block pool with its first-come queue (`decisions.QueuedEngines`) sharing its compute
equally among its running requests; a request needs its uncached prompt at `prefill_tokens_per_s`
plus `decode_s`, times a seeded factor in [0.8, 1.2] (the spread of a real run's timings): a
placement is judged by its mean over `seeds`.

Placements: kvroute's routing core with any settings (fed a fresh engine sample before each
decision, as its scrape would show: running, waiting, KV usage), sglang-router's cache_aware rule
(`SglangRule`), or a fixed conversation → backend map. `search` improves a fixed map one
conversation at a time with the whole replay in view: not a bound (a local optimum, on this
engine model), but what placement alone could still gain.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.experiments.decisions import (
    ENGINE_BLOCK_TOKENS,
    QueuedEngines,
    ReplayedRequest,
    decided,
    engine_blocks,
    replay_fleet,
    served,
    started,
)
from bench.simulator.sim import block_hashes, prompt_tokens
from bench.workloads import trace
from bench.workloads.prompts import PromptBuilder
from extproc.core.backends import Backend
from extproc.core.engine import EngineSample
from extproc.core.exchange import Exchange
from extproc.core.router import Router
from extproc.core.settings import Settings

JITTER = (0.8, 1.2)


class Placement(Protocol):
    """Where each turn goes. `exchange`: kvroute's (None for the others), handed back to `ended`
    when the turn ends."""

    def place(self, turn: Turn, now: float, engines: QueuedEngines) -> tuple[str, Exchange | None]: ...

    def ended(self, request: ReplayedRequest, now: float) -> None: ...


class _Unlearning:
    """A placement that learns nothing from a turn's end."""

    def ended(self, request: ReplayedRequest, now: float) -> None:
        return None


LEARNING = ("send", "end")  # when kvroute's placement learns a turn (`KvroutePlacement`)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the trace as the replay sends it."""

    session: str
    body: dict[str, Any]
    tokens: list[int]
    hashes: list[int]


class KvroutePlacement:
    """kvroute's routing core, learning from its own routing (approximate mode), with a fresh
    engine sample per backend before each decision. `learn_at`: each turn is learned as it is sent
    (send: the ext_proc layout learns at the response's start, which this model does not time), or
    when it ends, as over ext_authz, the default layout (end: at the decision the backend's room is
    made and the session bound, `Router.sent`; the prompt is learned from the access log's record)."""

    def __init__(self, fleet: tuple[Backend, ...], blocks: int, learn_at: str = "send", **settings: Any) -> None:
        if learn_at not in LEARNING:
            raise ValueError(f"learn_at: one of {LEARNING}, not {learn_at!r}")
        self.fleet, self.blocks, self.learn_at = fleet, blocks, learn_at
        self.router = Router(Settings(hash_key=bytes(16), capacity_blocks=blocks, **settings))
        for backend in fleet:
            self.router.set_backend_capacity(backend.address, blocks * ENGINE_BLOCK_TOKENS)

    def place(self, turn: Turn, now: float, engines: QueuedEngines) -> tuple[str, Exchange | None]:
        router = self.router
        size = self.blocks * ENGINE_BLOCK_TOKENS
        for address, cache in engines.caches.items():
            waiting, usage = len(engines.queues[address]), cache.pool.pinned / self.blocks
            sample = EngineSample(engines.running[address], waiting, usage, 1.0, size, ENGINE_BLOCK_TOKENS)
            router.engine_sample(address, sample, now)
        headers = {"x-session-id": turn.session}
        if self.learn_at == "send":
            return served(router, turn.body, headers, self.fleet, now)
        backend, exchange = decided(router, turn.body, headers, self.fleet, now)
        router.sent(exchange, now)
        return backend, exchange

    def ended(self, request: ReplayedRequest, now: float) -> None:
        exchange = request.exchange
        if exchange is None:
            return
        if self.learn_at == "end":
            started(self.router, exchange, request.backend, now)
        exchange.end()


class SglangRule(_Unlearning):
    """sglang-router's cache_aware rule without its load gates (they never open at this
    concurrency): the backend whose tree matches more than `threshold` of the prompt, else the
    one whose tree is smallest; its trees keep every block sent (they are pruned far above these
    traces' sizes)."""

    def __init__(self, fleet: tuple[Backend, ...], threshold: float = 0.3) -> None:  # sglang-router 0.3.2 default
        self.trees: dict[str, set[int]] = {backend.address: set() for backend in fleet}
        self.threshold = threshold

    def place(self, turn: Turn, now: float, engines: QueuedEngines) -> tuple[str, Exchange | None]:
        best, matched = "", -1
        for backend, tree in self.trees.items():
            held = next((i for i, h in enumerate(turn.hashes) if h not in tree), len(turn.hashes))
            if held > matched:
                best, matched = backend, held
        if not turn.hashes or matched <= self.threshold * len(turn.hashes):
            best = min(self.trees, key=lambda backend: len(self.trees[backend]))
        self.trees[best].update(turn.hashes)
        return best, None


class FixedPlacement(_Unlearning):
    """Each conversation on the backend a map names (the first backend if it names none)."""

    def __init__(self, fleet: tuple[Backend, ...], backend_of: Mapping[str, int]) -> None:
        self.fleet, self.backend_of = fleet, backend_of

    def place(self, turn: Turn, now: float, engines: QueuedEngines) -> tuple[str, Exchange | None]:
        return self.fleet[self.backend_of.get(turn.session, 0)].address, None


@dataclass(frozen=True, slots=True)
class Workload:
    """A trace's first requests as conversations of turns, and the engines' size."""

    conversations: list[list[Turn]]
    arrivals: list[list[float]]  # each turn's arrival time in the trace (ms), for the send order
    blocks: int  # each engine's KV blocks
    fleet: tuple[Backend, ...]

    @property
    def sessions(self) -> list[str]:
        return [turns[0].session for turns in self.conversations]


def load(
    path: Path, limit: int = 480, backends: int = 2, capacity_ratio: float = 0.5, max_input_tokens: int = 12_000
) -> Workload:
    """The trace's first `limit` requests (with their own session ids, else one conversation
    each), prompts cut to `max_input_tokens`; engines holding `capacity_ratio` of the working set."""
    builder = PromptBuilder("sim-model", 4.0, 16)
    grouped: dict[str, list[Turn]] = defaultdict(list)
    arrivals: dict[str, list[float]] = defaultdict(list)
    unique: set[int] = set()
    for request in trace.read(path, limit, max_input_tokens):
        session = request.session_id if request.session_id is not None else f"request-{request.index}"
        body = builder.body(request)
        tokens = prompt_tokens(body) or []
        hashes = block_hashes(tokens, ENGINE_BLOCK_TOKENS)
        unique.update(hashes)
        grouped[session].append(Turn(session, body, tokens, hashes))
        arrivals[session].append(request.timestamp_ms)
    blocks = engine_blocks(len(unique), capacity_ratio, backends)
    return Workload(list(grouped.values()), [arrivals[s] for s in grouped], blocks, replay_fleet(backends))


class _Sent:
    """A turn in flight: its request in the engines, its conversation, the work it has left."""

    __slots__ = ("conversation", "left", "request")

    def __init__(self, request: ReplayedRequest, conversation: int) -> None:
        self.request, self.conversation = request, conversation
        self.left: float | None = None  # seconds of the engine's whole compute, set when it starts


def replay(
    workload: Workload,
    placement: Placement,
    seed: int = 0,
    clients: int = 16,
    prefill_tokens_per_s: float = 2500.0,
    decode_s: float = 0.05,
) -> tuple[float, dict[str, str]]:
    """One timed closed-loop run: the share of prompt tokens the engines found cached, and where
    each conversation's first turn went."""
    jitter = random.Random(seed)
    engines = QueuedEngines(workload.fleet, workload.blocks, True, None)
    ready = [(arrival[0], g) for g, arrival in enumerate(workload.arrivals)]
    heapq.heapify(ready)
    position = [0] * len(workload.conversations)
    inflight: list[_Sent] = []
    first: dict[str, str] = {}
    now = 0.0
    while ready or inflight:
        while ready and len(inflight) < clients:
            _, g = heapq.heappop(ready)
            turn = workload.conversations[g][position[g]]
            backend, exchange = placement.place(turn, now, engines)
            first.setdefault(turn.session, backend)
            sent = _Sent(ReplayedRequest(exchange, backend, turn.tokens), g)
            engines.arrive(sent.request)
            inflight.append(sent)
        now += _advance(inflight, engines, jitter, prefill_tokens_per_s, decode_s)
        for sent in [s for s in inflight if s.left is not None and s.left <= 1e-9]:
            inflight.remove(sent)
            placement.ended(sent.request, now)
            engines.end(sent.request)
            g = sent.conversation
            position[g] += 1
            if position[g] < len(workload.conversations[g]):
                heapq.heappush(ready, (workload.arrivals[g][position[g]], g))
    prompt = sum(len(turn.tokens) for turns in workload.conversations for turn in turns)
    return (engines.cached_blocks * ENGINE_BLOCK_TOKENS / prompt if prompt else 0.0), first


def _advance(
    inflight: list[_Sent], engines: QueuedEngines, jitter: random.Random, prefill_tokens_per_s: float, decode_s: float
) -> float:
    """Run the engines until the next running turn ends (each engine's compute shared equally
    among its running turns); the seconds that took."""
    running: dict[str, list[_Sent]] = defaultdict(list)
    for sent in inflight:
        request = sent.request
        if request.pinned is None:
            continue  # waiting in its engine's queue
        if sent.left is None:
            uncached = len(request.tokens) - request.cached * ENGINE_BLOCK_TOKENS
            sent.left = (max(0, uncached) / prefill_tokens_per_s + decode_s) * jitter.uniform(*JITTER)
        running[request.backend].append(sent)
    step = min(min(s.left or 0.0 for s in group) * len(group) for group in running.values())
    for group in running.values():
        for sent in group:
            sent.left = (sent.left or 0.0) - step / len(group)
    return step


def mean_hit_rate(workload: Workload, make: Callable[[], Placement], seeds: Sequence[int]) -> tuple[float, list[float]]:
    """The mean over `seeds` of a fresh placement's hit rate, and each run's."""
    rates = [replay(workload, make(), seed)[0] for seed in seeds]
    return statistics.fmean(rates), rates


def search(
    workload: Workload,
    start: Mapping[str, int],
    seeds: Sequence[int],
    sweeps: int = 2,
) -> tuple[float, dict[str, int]]:
    """Hill climbing with hindsight: move one conversation to the other backend at a time (in a
    seeded random order, `sweeps` times over all of them) and keep the move if the mean hit rate
    over `seeds` rises. Two backends."""
    backend_of = dict(start)
    best, _ = mean_hit_rate(workload, lambda: FixedPlacement(workload.fleet, backend_of), seeds)
    order = random.Random(0)
    for _ in range(sweeps):
        sessions = workload.sessions
        order.shuffle(sessions)
        for session in sessions:
            backend_of[session] = 1 - backend_of.get(session, 0)
            rate, _ = mean_hit_rate(workload, lambda: FixedPlacement(workload.fleet, backend_of), seeds)
            if rate > best:
                best = rate
            else:
                backend_of[session] = 1 - backend_of[session]
    return best, backend_of


def main(
    path: Path,
    limit: int,
    capacity_ratio: float,
    seeds: int,
    kvroute_settings: Sequence[dict[str, Any]],
    sweeps: int,
    learn_at: str = "send",
) -> dict[str, Any]:
    """kvroute (default and each variant), sglang-router's rule, and (with `sweeps`) the search
    from two starts (where kvroute placed each conversation, and alternating by name; single moves
    stall in local optima, so the start matters), judged on seeds it was not searched on."""
    workload = load(path, limit, capacity_ratio=capacity_ratio)
    fleet, blocks = workload.fleet, workload.blocks
    judged = range(seeds)
    results: dict[str, Any] = {
        "requests": limit,
        "conversations": len(workload.conversations),
        "seeds": seeds,
        "kvroute learns at": learn_at,
    }

    def judge(make: Callable[[], Placement]) -> dict[str, Any]:
        mean, rates = mean_hit_rate(workload, make, judged)
        return {"mean": round(mean, 4), "runs": [round(r, 4) for r in rates]}

    for settings in [{}, *kvroute_settings]:
        name = "kvroute" + "".join(f" {k}={v}" for k, v in settings.items())
        results[name] = judge(lambda s=settings: KvroutePlacement(fleet, blocks, learn_at, **s))
    results["sglang-router rule"] = judge(lambda: SglangRule(fleet))
    if sweeps:
        _, first = replay(workload, KvroutePlacement(fleet, blocks, learn_at), 0)
        addresses = [b.address for b in fleet]
        starts = {
            "kvroute's placement": {session: addresses.index(backend) for session, backend in first.items()},
            "alternating": {session: i % len(fleet) for i, session in enumerate(sorted(workload.sessions))},
        }
        searched = range(seeds, seeds + 3)  # searched on other seeds than those it is judged on
        for start_name, start in starts.items():
            _, found = search(workload, start, searched, sweeps)
            results[f"searched from {start_name}"] = judge(lambda found=found: FixedPlacement(fleet, found))
    return results
