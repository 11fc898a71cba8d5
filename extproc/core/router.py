"""The routing core's API for any gateway: a request lifecycle, plus backend membership.

    begin(request)           decision + load reservation (counted as a decision)
    response_started(...)    the core decides whether to learn, and what the response headers say
    end()                    release whatever the request still holds, exactly once

`query` is the dry run: a decision with no reservation, not counted. Adapters (Envoy ext_proc,
the HTTP lease API) only translate their protocol into these calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.backends import Backend
from extproc.core.chain import BlockHasher
from extproc.core.churn import ChurnMeter
from extproc.core.decision import Decision, Label, decide
from extproc.core.index import BoundedIndex, LocalIndex, LocationIndex
from extproc.core.load import LoadTracker
from extproc.core.request import PromptRequest
from extproc.core.sessions import SessionTable
from extproc.core.settings import Settings

# Bytes of CBR per backend token, to translate a KV cache size in tokens into blocks: about 4
# for English text with a BPE tokenizer (what vLLM's tokenizers and kvroute's simulator see).
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """What the gateway saw when the response began, in protocol-neutral terms."""

    upstream: str  # the backend that served, as the gateway reports it ("" if it does not say)
    known: bool  # the upstream is one of the pool's backends
    status: int  # HTTP status of the response
    from_upstream: bool  # the backend sent it (not a local reply of the gateway)
    connect_failed: bool = False  # the gateway could not connect to the upstream


@dataclass(frozen=True, slots=True)
class Outcome:
    """The core's reading of a response start: what it learned and what to tell the client."""

    served: str  # the backend that served (the chosen one when the gateway does not say)
    learned: bool
    refused: bool  # the served backend refused the connection: the adapter should mark it down
    rerouted: bool  # served by another backend than the first choice
    headers: tuple[tuple[str, str], ...]


class Exchange:
    """One routed request from decision to end: the handle an adapter keeps per request."""

    __slots__ = ("_ended", "decision", "outcome", "request")

    def __init__(self, request: PromptRequest | None, decision: Decision) -> None:
        self.request = request
        self.decision = decision
        self.outcome: Outcome | None = None
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self) -> bool:
        """Release whatever the request still holds. True the first time, False after."""
        if self._ended:
            return False
        self._ended = True
        if self.decision.reservation is not None:
            self.decision.reservation.finish()
        return True


class Stats:
    """What the core did, as plain counters; the metrics adapter exports them."""

    __slots__ = ("decisions", "learned", "rerouted")

    def __init__(self) -> None:
        self.decisions: dict[str, int] = dict.fromkeys(Label, 0)
        self.learned = 0
        self.rerouted = 0


class Router:
    """Owns the index, sessions and load of one router process. Not thread-safe: one event loop."""

    __slots__ = ("_kv_tokens", "_turn", "churn", "hasher", "index", "loads", "sessions", "settings", "stats")

    def __init__(self, settings: Settings, index: LocationIndex | None = None) -> None:
        self.settings = settings
        self.hasher = BlockHasher(settings.block_size, settings.hash_key)
        self.index: LocationIndex = index or LocalIndex(settings.location_ttl_s, settings.capacity_blocks)
        self.churn = ChurnMeter(settings.churn_half_life_s)
        self.sessions = SessionTable(settings.session_ttl_s, settings.session_capacity, settings.hash_key)
        self.loads = LoadTracker()
        self.stats = Stats()
        self._kv_tokens: dict[str, int] = {}
        self._turn = 0

    def reconfigure(self, settings: Settings) -> None:
        """Apply new settings live, keeping the index it was given. A new block size or key makes
        every known chain meaningless, so the index is emptied; sessions and reservations stay."""
        if (settings.block_size, settings.hash_key) != (self.settings.block_size, self.settings.hash_key):
            self.hasher = BlockHasher(settings.block_size, settings.hash_key)
            for backend in list(self.index.entries_by_backend()):
                self.index.remove_backend(backend)
                self.churn.remove_backend(backend)
        self.settings = settings
        self.churn.half_life_s = settings.churn_half_life_s
        if isinstance(self.index, BoundedIndex):
            capacities = {b: self._blocks(t) for b, t in self._kv_tokens.items()} if settings.capacity_auto else {}
            self.index.configure(settings.location_ttl_s, settings.capacity_blocks, capacities)
        self.sessions.configure(settings.session_ttl_s, settings.session_capacity, settings.hash_key)

    def set_backend_capacity(self, backend: str, kv_tokens: int) -> None:
        """A backend reported its KV cache size in tokens; with `capacity_auto`, size its LRU by it.
        The size is kept, so a later change of settings can re-derive it."""
        self._kv_tokens[backend] = kv_tokens
        if self.settings.capacity_auto and isinstance(self.index, BoundedIndex):
            self.index.set_capacity(backend, self._blocks(kv_tokens))

    def _blocks(self, kv_tokens: int) -> int:
        return max(1, kv_tokens * BYTES_PER_TOKEN // self.settings.block_size)

    def chain_of(self, request: PromptRequest) -> list[int]:
        """The request's block chain, hashed once and kept on the request."""
        if request.chain is None:
            request.chain = self.hasher.chain(request.cbr)
        return request.chain

    def query(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Decision:
        """Dry run: the decision `begin` would make now, with no reservation and not counted."""
        candidates = [b.address for b in backends if b.serves(request.model)]
        chain = self.chain_of(request)
        session_backend = None
        if request.session_key is not None:
            session_backend = self.sessions.get(request.session_key, now)
            if session_backend is not None and session_backend not in candidates:
                self.sessions.forget(request.session_key)
                session_backend = None
        matched = self.index.lookup(chain, candidates, now)
        churn = {backend: self.churn.rate(backend, now) for backend in candidates}
        bootstrap = not request.followup or not chain
        self._turn += 1
        return decide(
            candidates,
            matched,
            churn,
            len(chain),
            self.loads,
            session_backend,
            bootstrap,
            self.settings,
            self._turn,
        )

    def begin(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Exchange:
        """Choose a backend among the healthy ones serving the request's model and reserve the
        load it adds; the returned exchange must be ended (`end`) however the request ends."""
        decision = self.query(request, backends, now)
        request.cbr = b""  # the chain is all the exchange needs from here: hold no copy of the body
        if decision.backend is not None:
            decision.reservation = self.loads.reserve(decision.backend, decision.total_blocks - decision.matched_blocks)
        self.stats.decisions[decision.label] += 1
        return Exchange(request, decision)

    def begin_unreadable(self, backends: Sequence[Backend]) -> Exchange:
        """A request whose body could not be read: least loaded healthy backend, reserved."""
        self._turn += 1
        candidates = [b.address for b in backends if b.healthy]
        decision = decide(candidates, {}, {}, 0, self.loads, None, False, self.settings, self._turn)
        if decision.backend is not None:
            decision.label = Label.FALLBACK
            decision.reservation = self.loads.reserve(decision.backend, 0)
        self.stats.decisions[decision.label] += 1
        return Exchange(None, decision)

    def response_started(self, exchange: Exchange, start: ResponseStart, now: float) -> Outcome:
        """The response began: its prefill is done. A 2xx sent by a known backend teaches the
        index (and binds the session) where it was really served; a refused connection is
        reported so the adapter can drop that backend. Only the first call counts."""
        if exchange.outcome is not None:
            return exchange.outcome
        decision = exchange.decision
        if decision.reservation is not None:
            decision.reservation.release_prefill()
        served = start.upstream if start.known else ""
        success = 200 <= start.status < 300
        request = exchange.request
        learned = bool(served) and success and start.from_upstream and request is not None
        if learned and request is not None:  # (the second test only narrows the type)
            self.learn(request, served, now)
        rerouted = bool(served) and served != decision.backend
        if rerouted:
            self.stats.rerouted += 1
        backend = served or decision.backend or ""
        headers: tuple[tuple[str, str], ...] = ()
        if self.settings.decision_headers and success:  # never on errors
            matched = next((c.matched for c in decision.candidates if c.backend == backend), 0)
            headers = (
                ("x-kvroute-decision", decision.label.value),
                ("x-kvroute-backend", backend),
                ("x-kvroute-prefix", f"{matched}/{decision.total_blocks}"),
            )
        exchange.outcome = Outcome(backend, learned, bool(served) and start.connect_failed, rerouted, headers)
        return exchange.outcome

    def learn(self, request: PromptRequest, backend: str, now: float) -> int:
        """The backend now holds this prompt (and session); returns how many blocks were new there."""
        added = self.index.learn(self.chain_of(request), backend, now)
        self.churn.add(backend, added, now)
        self.stats.learned += 1
        if request.session_key is not None:
            self.sessions.bind(request.session_key, backend, now)
        return added

    def forget(self, session_key: str) -> bool:
        """Drop a session binding; True if there was one."""
        return self.sessions.forget(session_key)

    def remove_backend(self, backend: str) -> None:
        """A backend left: drop its locations, turnover, session bindings and load at once."""
        self.index.remove_backend(backend)
        self.churn.remove_backend(backend)
        self.sessions.remove_backend(backend)
        self.loads.remove_backend(backend)

    def state(self) -> dict[str, Any]:
        """Sizes and load, for metrics and /debug/state."""
        by_backend = self.index.entries_by_backend()
        return {
            "index_entries": sum(by_backend.values()),
            "index_entries_by_backend": by_backend,
            "sessions": len(self.sessions),
            "load": {b: {"reserved_blocks": r, "active": a} for b, (r, a) in self.loads.snapshot().items()},
        }
