"""`kvroute-dev bench decisions`: a trace through the routing core alone, deterministically.

No processes, no clocks, no concurrency noise: trace time is the clock, a fixed key hashes, four
backends serve, each request's response starts at once and it ends when the eighth request
after it begins; backend 3 leaves for requests 1,500-1,999, and backend 1 reports a smaller KV
size. Sessions: a trace's own session ids where it has them (agent traces), else a third of the
requests carry an invented one. The digest of every decision (label, backend, second choice,
matched/total blocks) shows whether a change of code changed any routing.

Precise mode: each backend is an engine of its own, the simulator's tokenizer and vLLM's block
pool (`bench.sim_engine.BlockPool`): a request pins its blocks from its response start to its
end, and the engine reports what it stored and evicted as KV events, in order, at once.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.simulator.sim import block_hashes, prompt_tokens
from bench.simulator.sim_engine import BlockPool
from bench.workloads import trace
from bench.workloads.prompts import PromptBuilder
from extproc.core.backends import Backend
from extproc.core.engine import BlockRemoved, BlockStored, EngineEvent, EngineSample
from extproc.core.exchange import Exchange, ResponseStart
from extproc.core.load import PeerLoads
from extproc.core.router import Router
from extproc.core.settings import Settings

MODES = ("approximate", "precise")
WINDOW = 8
BACKENDS = [Backend(f"10.0.0.{i}:8000") for i in range(4)]
ENGINE_BLOCK_TOKENS = 128  # vLLM-CPU's block size
ENGINE_BLOCKS = 3000  # each engine's KV cache, in blocks; backend 1's is SMALL_ENGINE_BLOCKS
SMALL_ENGINE_BLOCKS = 2000


class _Tokenizer:
    """The simulator's rendering and tokenizer, as precise mode's PromptTokenizer."""

    def tokens(self, body: Mapping[str, Any]) -> Sequence[int] | None:
        return prompt_tokens(body)


@dataclass(slots=True)
class EngineCache:
    """One backend's KV cache in precise mode: vLLM's block pool, reporting as events."""

    pool: BlockPool

    def serve(self, tokens: Sequence[int]) -> tuple[list[int], int, list[EngineEvent]]:
        """Pin the prompt's full blocks; how many were cached, and the events of what was stored
        and evicted."""
        hashes = block_hashes(tokens, ENGINE_BLOCK_TOKENS)
        cached = self.pool.match(hashes, len(hashes))
        self.pool.acquire(hashes, 0)
        events: list[EngineEvent] = []
        if self.pool.evicted:
            events.append(BlockRemoved(tuple(self.pool.evicted)))
            self.pool.evicted.clear()
        if cached < len(hashes):
            size = ENGINE_BLOCK_TOKENS
            stored = BlockStored(
                tuple(hashes[cached:]),
                hashes[cached - 1] if cached else None,
                tuple(tokens[cached * size : len(hashes) * size]),
                size,
                (),
            )
            events.append(stored)
        return hashes, cached, events


def run(path: Path, limit: int, out: Path | None = None, mode: str = "approximate") -> dict[str, Any]:
    """Replay `limit` requests of the trace; return hit rate, labels and the decisions' digest."""
    requests = trace.read(path, limit)
    builder = PromptBuilder("sim-model", 4.0, 16)
    router = Router(Settings(hash_key=bytes(16), capacity_blocks=3000))
    engines: dict[str, EngineCache] = {}
    if mode == "precise":
        router.use_precise(_Tokenizer())
        for backend in BACKENDS:
            size = SMALL_ENGINE_BLOCKS if backend is BACKENDS[1] else ENGINE_BLOCKS
            engines[backend.address] = EngineCache(BlockPool(size))
            sample = EngineSample(0, 0, 0.0, 1.0, size * ENGINE_BLOCK_TOKENS, ENGINE_BLOCK_TOKENS)
            router.engine_sample(backend.address, sample, 0.0)  # the block size, before any event
    else:
        router.set_backend_capacity(BACKENDS[1].address, SMALL_ENGINE_BLOCKS * ENGINE_BLOCK_TOKENS)
    own_sessions = any(request.session_id is not None for request in requests)
    inflight: deque[tuple[Exchange, str, list[int]]] = deque()
    lines = []
    matched = total = 0
    for request in requests:
        now = request.timestamp_ms / 1000.0
        live = BACKENDS[:3] if 1500 <= request.index < 2000 else BACKENDS
        if request.index == 1500:
            router.remove_backend(BACKENDS[3].address)
            engines.pop(BACKENDS[3].address, None)
        if own_sessions:
            headers = {"x-session-id": request.session_id} if request.session_id is not None else {}
        else:
            session = str(request.hash_ids[0] % 40) if request.hash_ids else "0"
            headers = {"x-session-id": session} if request.index % 3 == 0 else {}
        parsed = router.parse(orjson.dumps(builder.body(request)), headers)
        tokens = parsed.tokens  # begin lets go of them: the engine still needs them
        exchange = router.begin(parsed, live, now)
        decision = exchange.decision
        backend = decision.backend or ""
        started(router, exchange, backend, now)
        pinned: list[int] = []
        engine = engines.get(backend)
        if engine is not None and tokens is not None:
            pinned, _, events = engine.serve(tokens)
            router.engine_events(backend, events)
        inflight.append((exchange, backend, pinned))
        if len(inflight) > WINDOW:
            ended, where, blocks = inflight.popleft()
            ended.end()
            if where in engines:
                engines[where].pool.release(blocks, 0)
        matched += decision.matched_blocks
        total += decision.total_blocks
        blocks_text = f"{decision.matched_blocks}/{decision.total_blocks}"
        lines.append(f"{decision.label.value} {decision.backend} {decision.second} {blocks_text}")
    text = "\n".join(lines)
    if out is not None:
        out.write_text(text)
    return {
        "mode": mode,
        "sessions": "trace" if own_sessions else "invented",
        "requests": len(lines),
        "hit_rate": round(matched / total, 4) if total else 0.0,
        "labels": dict(Counter(line.split()[0] for line in lines)),
        "digest": hashlib.sha256(text.encode()).hexdigest(),
    }


class _Fanout:
    """In-process stand-in for the replica link (extproc/core/replicas.py): what one replica learns
    and binds reaches its siblings `lag` requests later, as the Redis link delivers it a round trip
    later; the replicas' load reaches them at once (the link's 20 ms vector)."""

    def __init__(self, routers: list[Router], lag: int) -> None:
        self.routers = routers
        self.lag = lag
        self._news: deque[tuple[int, Router, str, Any]] = deque()  # (due, sender, kind, payload)
        self.sender: Router | None = None
        self.turn = 0
        self._peers = [PeerLoads(float("inf")) for _ in routers]  # each router's view of the others' load

    def learned(self, backend: str, chain: Sequence[int]) -> None:
        self._news.append((self.turn + self.lag, self.sender, "learned", (backend, list(chain))))  # type: ignore[arg-type]

    def bound(self, session: bytes, backend: str) -> None:
        self._news.append((self.turn + self.lag, self.sender, "bound", (backend, session)))  # type: ignore[arg-type]

    def deliver(self, now: float) -> None:
        """The news now due, to every sibling of its sender; every replica's load to the others."""
        while self._news and self._news[0][0] <= self.turn:
            _, sender, kind, (backend, payload) = self._news.popleft()
            for router in self.routers:
                if router is not sender:
                    if kind == "learned":
                        router.peer_learned(payload, backend, now)
                    else:
                        router.peer_bound(payload, backend, now)
        if len(self.routers) > 1:  # summed as the link sums its siblings' vectors (PeerLoads)
            snapshots = [router.loads.published() for router in self.routers]
            for index, (router, peers) in enumerate(zip(self.routers, self._peers, strict=True)):
                for other, snapshot in enumerate(snapshots):
                    if other != index:
                        peers.update(str(other), snapshot, now)
                router.loads.set_peers(peers.totals(now))


class ReplayedRequest:
    """One replayed request in flight: waiting in its engine's queue (`pinned` None) or running."""

    __slots__ = ("backend", "cached", "exchange", "hashes", "pinned", "tokens")

    def __init__(self, exchange: Exchange | None, backend: str, tokens: list[int]) -> None:
        self.exchange, self.backend, self.tokens = exchange, backend, tokens
        self.hashes = block_hashes(tokens, ENGINE_BLOCK_TOKENS)
        self.pinned: list[int] | None = None
        self.cached = 0  # blocks it found cached when it started


class QueuedEngines:
    """The replay's engines: a block pool each, and (`queued`) vLLM's first-come queue in front of
    it: a request whose blocks do not fit beside the running ones' waits, holding none, and what
    it finds cached is counted when it starts; meanwhile the running ones' prompts may evict it."""

    def __init__(self, fleet: Sequence[Backend], blocks: int, queued: bool, followers: list[Router] | None) -> None:
        self.caches = {backend.address: EngineCache(BlockPool(blocks)) for backend in fleet}
        self.queues: dict[str, deque[ReplayedRequest]] = {backend.address: deque() for backend in fleet}
        self.running = dict.fromkeys(self.caches, 0)
        self.queued = queued
        self.followers = followers  # precise mode: the routers that follow the engines' events
        self.cached_blocks = 0

    def arrive(self, request: ReplayedRequest) -> None:
        queue, pool = self.queues[request.backend], self.caches[request.backend].pool
        if self.queued and self.running[request.backend] and (queue or not pool.can_acquire(request.hashes, 0)):
            queue.append(request)
        else:
            self._start(request)

    def end(self, request: ReplayedRequest) -> None:
        """A running request ends: its blocks unpinned, the queue's head started while it fits."""
        backend = request.backend
        queue, pool = self.queues[backend], self.caches[backend].pool
        pool.release(request.pinned or [], 0)
        self.running[backend] -= 1
        while queue and (not self.running[backend] or pool.can_acquire(queue[0].hashes, 0)):
            self._start(queue.popleft())

    def _start(self, request: ReplayedRequest) -> None:
        pinned, cached, events = self.caches[request.backend].serve(request.tokens)
        request.pinned, request.cached = pinned, cached
        self.running[request.backend] += 1
        self.cached_blocks += cached
        for follower in self.followers or ():
            follower.engine_events(request.backend, events)


def engine_blocks(working_set: int, capacity_ratio: float, backends: int) -> int:
    """Each replayed engine's KV blocks: together they hold `capacity_ratio` of the working set."""
    return max(1, int(working_set * capacity_ratio / backends))


def replay_fleet(backends: int) -> tuple[Backend, ...]:
    """The replay's backends, as one tuple (as the pool hands them over)."""
    return tuple(Backend(f"10.0.0.{i}:8000") for i in range(backends))


def decided(
    router: Router, body: Mapping[str, Any], headers: Mapping[str, str], fleet: tuple[Backend, ...], now: float
) -> tuple[str, Exchange]:
    """A request routed: the backend it went to (the first if none was chosen) and its exchange."""
    exchange = router.begin(router.parse(orjson.dumps(body), headers), fleet, now)
    return exchange.decision.backend or fleet[0].address, exchange


def started(router: Router, exchange: Exchange, backend: str, now: float) -> None:
    """The request's response started at `backend` (a 2xx): what the router learns then."""
    router.response_started(exchange, ResponseStart(backend, known=True, status=200, from_upstream=True), now)


def served(
    router: Router, body: Mapping[str, Any], headers: Mapping[str, str], fleet: tuple[Backend, ...], now: float
) -> tuple[str, Exchange]:
    """A request routed and its response started at once: the backend it went to and its
    exchange, to end when the request ends."""
    backend, exchange = decided(router, body, headers, fleet, now)
    started(router, exchange, backend, now)
    return backend, exchange


def engine_hit_rate(
    path: Path,
    limit: int,
    mode: str,
    backends: int = 2,
    capacity_ratio: float = 0.5,
    window: int = 16,
    max_input_tokens: int | None = 12_000,
    replicas: int = 1,
    lag: int = 0,
    shared: bool = True,
    offsets: int = 0,
    engine_queue: bool = False,
    **settings: Any,
) -> float:
    """Replay `limit` requests of an agent trace (its own session ids) in file order on `backends`
    engines whose caches together hold `capacity_ratio` of the working set; the share of prompt
    tokens the engines found cached. `window` clients keep a request each in flight: when the
    next is sent, the oldest running one ends. Without `engine_queue` every request runs at once,
    its blocks pinned beyond the cache if need be; with it, as in vLLM, one that does not fit
    waits (`QueuedEngines`). Approximate mode learns from its own routing; precise mode gets the
    engines' events.
    `replicas`: that many routers take the requests in turn (as Envoy spreads its streams), sharing
    what they learn and bind `lag` requests later and their load at once (`_Fanout`), or nothing
    (`shared` false: replicas each on its own, for comparison). `offsets` seeds the replicas'
    random turn offsets (0: as pinned since they were introduced)."""
    requests = trace.read(path, limit, max_input_tokens)
    builder = PromptBuilder("sim-model", 4.0, 16)
    bodies = [builder.body(request) for request in requests]
    prompts = [prompt_tokens(body) or [] for body in bodies]
    unique = {h for tokens in prompts for h in block_hashes(tokens, ENGINE_BLOCK_TOKENS)}
    blocks = engine_blocks(len(unique), capacity_ratio, backends)
    fleet = replay_fleet(backends)
    routers = [Router(Settings(hash_key=bytes(16), capacity_blocks=blocks, **settings)) for _ in range(replicas)]
    fanout = _Fanout(routers if shared else routers[:1], lag)
    engines = QueuedEngines(fleet, blocks, engine_queue, routers if mode == "precise" else None)
    turns = random.Random(replicas + 1000 * offsets)  # each replica process starts its turn counter at random
    for router in routers:
        if replicas > 1 and shared:
            router.join(fanout, turns.randrange(1 << 30))
        if mode == "precise":
            router.use_precise(_Tokenizer())
        for backend in fleet:
            if mode == "precise":
                sample = EngineSample(0, 0, 0.0, 1.0, blocks * ENGINE_BLOCK_TOKENS, ENGINE_BLOCK_TOKENS)
                router.engine_sample(backend.address, sample, 0.0)
            else:
                router.set_backend_capacity(backend.address, blocks * ENGINE_BLOCK_TOKENS)
    inflight: deque[ReplayedRequest] = deque()
    for turn, (request, body, tokens) in enumerate(zip(requests, bodies, prompts, strict=True)):
        now = request.timestamp_ms / 1000.0
        router = routers[turn % replicas]
        fanout.sender, fanout.turn = router, turn
        fanout.deliver(now)
        headers = {"x-session-id": request.session_id} if request.session_id is not None else {}
        backend, exchange = served(router, body, headers, fleet, now)
        sent = ReplayedRequest(exchange, backend, tokens)
        engines.arrive(sent)
        inflight.append(sent)
        if len(inflight) > window:
            _end_oldest_running(inflight, engines)
    while inflight:  # every request waiting is served
        _end_oldest_running(inflight, engines)
    prompt_total = sum(len(tokens) for tokens in prompts)
    return engines.cached_blocks * ENGINE_BLOCK_TOKENS / prompt_total if prompt_total else 0.0


def _end_oldest_running(inflight: deque[ReplayedRequest], engines: QueuedEngines) -> None:
    """The oldest request in flight that runs ends (one waiting cannot end before it runs)."""
    ended = next(r for r in inflight if r.pinned is not None)
    inflight.remove(ended)
    if ended.exchange is not None:
        ended.exchange.end()
    engines.end(ended)
