"""The routing core's API for any gateway: query, notify, forget, remove_backend.

query: request -> CBR chain -> index lookup -> decision -> reservation, in one step.
notify: the chosen backend began a successful response, so it now holds the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extproc.core.backends import Backend
from extproc.core.chain import BlockHasher
from extproc.core.decision import Decision, Label, decide
from extproc.core.index import LocalIndex, LocationIndex
from extproc.core.load import LoadTracker
from extproc.core.request import PromptRequest
from extproc.core.sessions import SessionTable
from extproc.core.settings import Settings

# Bytes of CBR per backend token, to translate a KV cache size in tokens into blocks: about 4
# for English text with a BPE tokenizer (what vLLM's tokenizers and kvroute's simulator see).
BYTES_PER_TOKEN = 4


class Router:
    """Owns the index, sessions and load of one router process. Not thread-safe: one event loop."""

    __slots__ = ("_kv_tokens", "_turn", "hasher", "index", "loads", "sessions", "settings")

    def __init__(self, settings: Settings, index: LocationIndex | None = None) -> None:
        self.settings = settings
        self.hasher = BlockHasher(settings.block_size, settings.hash_key)
        self.index: LocationIndex = index or LocalIndex(
            settings.location_ttl_s, settings.capacity_blocks, settings.churn_half_life_s
        )
        self.sessions = SessionTable(settings.session_ttl_s, settings.session_capacity)
        self.loads = LoadTracker()
        self._kv_tokens: dict[str, int] = {}
        self._turn = 0

    def reconfigure(self, settings: Settings) -> None:
        """Apply new settings live. A new block size or key makes every known chain meaningless,
        so the index starts afresh; sessions and in-flight reservations are kept."""
        if (settings.block_size, settings.hash_key) != (self.settings.block_size, self.settings.hash_key):
            self.hasher = BlockHasher(settings.block_size, settings.hash_key)
            self.index = LocalIndex(settings.location_ttl_s, settings.capacity_blocks, settings.churn_half_life_s)
        self.settings = settings
        capacities = {b: self._blocks(t) for b, t in self._kv_tokens.items()} if settings.capacity_auto else {}
        self.index.configure(settings.location_ttl_s, settings.capacity_blocks, settings.churn_half_life_s, capacities)
        self.sessions.configure(settings.session_ttl_s, settings.session_capacity)

    def set_backend_capacity(self, backend: str, kv_tokens: int) -> None:
        """A backend reported its KV cache size in tokens; with `capacity_auto`, size its LRU by it.
        The size is kept, so a later change of settings can re-derive it."""
        self._kv_tokens[backend] = kv_tokens
        if self.settings.capacity_auto:
            self.index.set_capacity(backend, self._blocks(kv_tokens))

    def _blocks(self, kv_tokens: int) -> int:
        return max(1, kv_tokens * BYTES_PER_TOKEN // self.settings.block_size)

    def chain_of(self, request: PromptRequest) -> list[int]:
        """The request's block chain, hashed once and kept on the request."""
        if request.chain is None:
            request.chain = self.hasher.chain(request.cbr)
        return request.chain

    def query(self, request: PromptRequest, backends: Sequence[Backend], now: float, reserve: bool = True) -> Decision:
        """Choose a backend for the request among the healthy ones serving its model.

        With `reserve`, the decision carries a Reservation that the caller must release.
        """
        candidates = [b.address for b in backends if b.serves(request.model)]
        chain = self.chain_of(request)
        session_backend = None
        if request.session_key is not None:
            session_backend = self.sessions.get(request.session_key, now)
            if session_backend is not None and session_backend not in candidates:
                self.sessions.forget(request.session_key)
                session_backend = None
        matched = self.index.lookup(chain, candidates, now)
        churn = {backend: self.index.churn(backend, now) for backend in candidates}
        bootstrap = not request.followup or not chain
        self._turn += 1
        decision = decide(
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
        if reserve and decision.backend is not None:
            novel = len(chain) - decision.matched_blocks
            decision.reservation = self.loads.reserve(decision.backend, novel)
        return decision

    def fallback(self, backends: Sequence[Backend], now: float) -> Decision:
        """Route a request whose body could not be read: least loaded healthy backend, reserved."""
        self._turn += 1
        candidates = [b.address for b in backends if b.healthy]
        decision = decide(candidates, {}, {}, 0, self.loads, None, False, self.settings, self._turn)
        if decision.backend is not None:
            decision.label = Label.FALLBACK
            decision.reservation = self.loads.reserve(decision.backend, 0)
        return decision

    def notify(self, request: PromptRequest, backend: str, now: float) -> None:
        """The backend began a successful response: it now holds this prompt (and session)."""
        self.index.learn(self.chain_of(request), backend, now)
        if request.session_key is not None:
            self.sessions.bind(request.session_key, backend, now)

    def forget(self, session_key: str) -> bool:
        """Drop a session binding; True if there was one."""
        return self.sessions.forget(session_key)

    def remove_backend(self, backend: str) -> None:
        """A backend left: drop its locations, session bindings and load at once."""
        self.index.remove_backend(backend)
        self.sessions.remove_backend(backend)
        self.loads.remove_backend(backend)

    def state(self) -> dict[str, Any]:
        """Sizes and load, for metrics and /debug/state."""
        return {
            "index_entries": self.index.entries(),
            "index_entries_by_backend": self.index.entries_by_backend(),
            "sessions": len(self.sessions),
            "load": {b: {"reserved_blocks": r, "active": a} for b, (r, a) in self.loads.snapshot().items()},
        }
