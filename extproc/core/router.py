"""The routing core's API for any gateway: a request lifecycle, plus backend membership.

    begin(request)           decision + load reservation (counted as a decision)
    response_started(...)    the core decides whether to learn, and what the response headers say
    end()                    release whatever the request still holds, exactly once

`query` is the dry run: a decision with no reservation, not counted. Adapters (Envoy ext_proc,
the HTTP lease API) only translate their protocol into these calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from extproc.core.backends import Backend
from extproc.core.calibration import BytesPerToken
from extproc.core.chain import BlockHasher, TokenHasher, extra_digest
from extproc.core.churn import ChurnMeter
from extproc.core.decision import Decision, Label, decide
from extproc.core.engine import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EngineSample
from extproc.core.homes import PrefixHomes
from extproc.core.index import BoundedIndex, LocalIndex, LocationIndex
from extproc.core.load import LoadTracker, Reservation
from extproc.core.precise import PreciseIndex
from extproc.core.pressure import CachePressure
from extproc.core.replicas import ReplicaLink
from extproc.core.request import PromptRequest, PromptTokenizer, parse_request
from extproc.core.sessions import SessionTable
from extproc.core.settings import Settings
from extproc.core.trust import PredictionTrust

# Precise mode: blocks one backend may report before its picture is dropped as implausible
# (2**18 blocks of 16 tokens is 4M tokens, beyond any one engine's KV cache today).
PRECISE_MAX_BLOCKS = 1 << 18
# The pictures are re-sized when the learned bytes per token moves by more than this share.
RESIZE_SHARE = 0.02


def _extra_keys(lora: str | None, salt: str | None, blocks: int) -> list[bytes]:
    """Each block's extra keys as vLLM publishes them: the LoRA adapter's name on every block, the
    cache salt on the first one only."""
    if lora is None:
        return [extra_digest((salt,))] if salt else []
    first = extra_digest((lora, salt) if salt else (lora,))
    return [first] + [extra_digest((lora,))] * (blocks - 1) if blocks else []


class Reset(StrEnum):
    """Why a backend's cached picture was dropped while the backend stayed in the pool."""

    RESTART = "restart"  # its process start time changed
    CACHE_CLEARED = "cache_cleared"  # AllBlocksCleared
    SEQUENCE_RESTART = "sequence_restart"  # its event sequence numbers went back: a new publisher
    EVENTS_LOST = "events_lost"  # precise mode: events were missed and could not be replayed


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

    __slots__ = ("_ended", "_ratio", "decision", "outcome", "predicted_blocks", "request")

    def __init__(
        self,
        request: PromptRequest | None,
        decision: Decision,
        predicted_blocks: int = 0,
        ratio: BytesPerToken | None = None,
    ) -> None:
        self.request = request
        self.decision = decision
        self.predicted_blocks = predicted_blocks  # leading blocks expected cached where it was sent
        self.outcome: Outcome | None = None
        self._ratio = ratio  # told the request's size when it ends, beside the engine's token count
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
        if self._ratio is not None and self.request is not None and self.outcome is not None:
            self._ratio.ended(self.outcome.served, self.request.cbr_bytes)
        return True


class Stats:
    """What the core did, as plain counters; the metrics adapter exports them."""

    __slots__ = ("bad_events", "decisions", "events", "learned", "rerouted", "resets", "untokenized")

    def __init__(self) -> None:
        self.decisions: dict[str, int] = dict.fromkeys(Label, 0)
        self.learned = 0
        self.rerouted = 0
        self.resets: dict[str, int] = dict.fromkeys(Reset, 0)
        self.events: dict[str, int] = {kind.__name__: 0 for kind in (BlockStored, BlockRemoved, AllBlocksCleared)}
        self.bad_events = 0  # decoded events the index refused (inconsistent sizes, token ids out of range)
        self.untokenized = 0  # precise mode: requests the tokenizer could not take (placed on load alone)


class Router:
    """Owns the index, sessions and load of one router process. Not thread-safe: one event loop."""

    __slots__ = (
        "_kv_tokens",
        "_prefill_sweep_at",
        "_prefilling",
        "_progressing",
        "_sized_at",
        "_starts",
        "_turn",
        "bytes_per_token",
        "churn",
        "hasher",
        "homes",
        "index",
        "loads",
        "pressure",
        "replicas",
        "sessions",
        "settings",
        "stats",
        "token_hasher",
        "tokenizer",
        "trust",
    )

    def __init__(self, settings: Settings, index: LocationIndex | None = None) -> None:
        self.settings = settings
        self.hasher = BlockHasher(settings.block_size, settings.hash_key)
        self.token_hasher = TokenHasher(settings.hash_key)
        self.index: LocationIndex = index or self._approximate_index(settings)
        self.tokenizer: PromptTokenizer | None = None
        self.churn = ChurnMeter(settings.churn_half_life_s)
        self.sessions = SessionTable(settings.session_ttl_s, settings.session_capacity, settings.hash_key)
        self.homes = PrefixHomes()
        self.pressure = CachePressure()  # how much of their context returning conversations find evicted
        self.loads = LoadTracker()
        self.replicas: ReplicaLink | None = None  # sibling replicas to tell what is learned and bound
        self.stats = Stats()
        self._kv_tokens: dict[str, int] = {}
        self.bytes_per_token = BytesPerToken()  # CBR bytes per engine token, learned from engine samples
        self.trust = PredictionTrust()  # approximate mode: how far each backend's picture holds, per its engine
        self._sized_at = self.bytes_per_token.value  # the ratio the pictures were last sized with
        self._starts: dict[str, float] = {}
        # Precise mode: (backend, key of a prompt's last full block) -> reservations whose prefill
        # lasts until the engine reports that block stored.
        self._prefilling: dict[tuple[str, int], list[Reservation]] = {}
        self._prefill_sweep_at = 1024
        # Approximate mode: backends whose KV events report what they store, so a streamed
        # request's prefill is held until the engine's progress covers it.
        self._progressing: set[str] = set()
        self._turn = 0

    @staticmethod
    def _approximate_index(settings: Settings) -> LocalIndex:
        return LocalIndex(settings.location_ttl_s, settings.capacity_blocks)

    @property
    def precise(self) -> bool:
        """Routing on token keys fed by engine events (else on learned text prefixes)."""
        return isinstance(self.index, PreciseIndex)

    def use_precise(self, tokenizer: PromptTokenizer) -> None:
        """Switch to precise mode with this tokenizer; what was learned before no longer applies."""
        self._drop_all()
        self.index = PreciseIndex(self.token_hasher, PRECISE_MAX_BLOCKS)
        self.tokenizer = tokenizer

    def use_approximate(self) -> None:
        """Switch to (or stay in) approximate mode."""
        if self.precise:
            self._drop_all()
            self.index = self._approximate_index(self.settings)
            self._size_index()
        self.tokenizer = None

    def _drop_all(self) -> None:
        for backend in list(self.index.entries_by_backend()):
            self.index.remove_backend(backend)
            self.churn.remove_backend(backend)

    def reconfigure(self, settings: Settings) -> None:
        """Apply new settings live, keeping the index it was given. A new block size or key makes
        every known chain meaningless, so the index is emptied; sessions and reservations stay."""
        if (settings.block_size, settings.hash_key) != (self.settings.block_size, self.settings.hash_key):
            self.hasher = BlockHasher(settings.block_size, settings.hash_key)
            self.token_hasher = TokenHasher(settings.hash_key)
            self._drop_all()  # before a precise index is replaced: its backends' turnover goes too
            if self.precise:
                self.index = PreciseIndex(self.token_hasher, PRECISE_MAX_BLOCKS)
        self.settings = settings
        self.churn.half_life_s = settings.churn_half_life_s
        self._size_index()
        self.sessions.configure(settings.session_ttl_s, settings.session_capacity, settings.hash_key)

    def _size_index(self) -> None:
        self._sized_at = self.bytes_per_token.value
        settings = self.settings
        if isinstance(self.index, BoundedIndex):
            capacities = {b: self._blocks(t) for b, t in self._kv_tokens.items()} if settings.capacity_auto else {}
            self.index.configure(settings.location_ttl_s, settings.capacity_blocks, capacities)

    def set_backend_capacity(self, backend: str, kv_tokens: int) -> None:
        """A backend reported its KV cache size in tokens; with `capacity_auto`, size its LRU by it.
        The size is kept, so a later change of settings can re-derive it."""
        self._kv_tokens[backend] = kv_tokens
        if self.settings.capacity_auto and isinstance(self.index, BoundedIndex):
            self.index.set_capacity(backend, self._blocks(kv_tokens))

    def _blocks(self, kv_tokens: int) -> int:
        """A KV cache of so many tokens as CBR blocks, at the learned bytes per token."""
        return max(1, int(kv_tokens * self.bytes_per_token.value) // self.settings.block_size)

    def parse(self, body: bytes | str | Mapping[str, Any], headers: Mapping[str, str]) -> PromptRequest:
        """A request body as routing sees it, tokenized in precise mode. Raises InvalidRequest.
        CPU-bound on large bodies: adapters may run it off their event loop."""
        settings = self.settings
        tokenizer = self.tokenizer if self.precise else None
        return parse_request(body, headers, settings.session_headers, settings.tenant_header, tokenizer)

    def chain_of(self, request: PromptRequest) -> list[int]:
        """The request's block chain, hashed once and kept on the request: token keys in precise
        mode (none until the engines' block size is known, or if the prompt could not be
        tokenized), CBR hashes otherwise."""
        if request.chain is None:
            index = self.index
            if isinstance(index, PreciseIndex):
                if request.tokens is None:
                    self.stats.untokenized += 1
                if request.tokens is None or index.block_size is None:
                    request.chain = []
                else:
                    lora = request.model if request.model in index.lora_names else None
                    extras = _extra_keys(lora, request.cache_salt, len(request.tokens) // index.block_size)
                    request.chain = self.token_hasher.chain(request.tokens, index.block_size, extras)
            else:
                request.chain = self.hasher.chain(request.cbr)
        return request.chain

    def block_tokens(self) -> float:
        """Tokens per block of the current chains: exact in precise mode, estimated otherwise."""
        index = self.index
        if isinstance(index, PreciseIndex):
            return float(index.block_size or 0)
        return self.settings.block_size / self.bytes_per_token.value

    def query(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Decision:
        """Dry run: the decision `begin` would make now, with no reservation and not counted."""
        candidates = [b.address for b in backends if b.serves(request.model)]
        chain = self.chain_of(request)
        session_backend, session_blocks = None, 0
        if request.session_key is not None:
            binding = self.sessions.binding(request.session_key, now)
            if binding is not None and binding[0] not in candidates:
                self.sessions.forget(request.session_key)
            elif binding is not None:
                session_backend, session_blocks = binding
        picture = self.index.lookup(chain, candidates, now)
        trusted = self.settings.prediction_trust and not self.precise
        matched = self.trust.apply(picture) if trusted else picture
        home = self.homes.get(chain[0]) if chain else None
        if trusted and home is not None and self.trust.of(home) < 1.0:
            home = None  # the engine contradicts kvroute's picture there: a home would pull like a held prefix
        churn = {backend: self.churn.rate(backend, now) for backend in candidates}
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
            now,
            home,
            *self._pressure_terms(),
        )
        if decision.backend is not None:
            decision.picture_blocks = picture.get(decision.backend, 0)
        if session_backend is not None and session_blocks:
            decision.returning = (session_blocks, picture.get(session_backend, 0))
        return decision

    def begin(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Exchange:
        """Choose a backend among the healthy ones serving the request's model and reserve the
        load it adds; the returned exchange must be ended (`end`) however the request ends."""
        decision = self.query(request, backends, now)
        request.cbr_bytes = len(request.cbr)
        request.cbr = b""  # the chain is all the exchange needs from here: hold no copy of the body
        request.tokens = None
        predicted = decision.matched_blocks
        index = self.index
        if decision.returning is not None:
            self.pressure.returned(*decision.returning)
        if decision.backend is not None:
            self._place_home(request, decision)
            decision.reservation = self.loads.reserve(decision.backend, decision.total_blocks - decision.matched_blocks)
            if isinstance(index, PreciseIndex):  # the engine confirms later; until then the blocks are pending
                chain = self.chain_of(request)
                predicted = index.confirmed(chain, decision.backend)
                self.churn.add(decision.backend, index.learn(chain, decision.backend, now), now)
                if predicted < len(chain):
                    self._await_prefill((decision.backend, chain[-1]), decision.reservation)
            else:
                self.trust.routed(decision.backend, decision.picture_blocks * self.block_tokens())
                if request.stream and decision.backend in self._progressing:
                    self.loads.get(decision.backend).await_progress(decision.reservation)
        self.stats.decisions[decision.label] += 1
        return Exchange(request, decision, predicted, self.bytes_per_token)

    def _pressure_terms(self) -> tuple[float, bool]:
        """What cache pressure does to decisions now: the balance gates' factor, and whether a
        head's home wins among equal holders (the configured gates and ties when
        `cache_pressure_gates` is off)."""
        if not self.settings.cache_pressure_gates:
            return 1.0, True
        return self.pressure.gate_factor(), self.pressure.home_ties()

    def _place_home(self, request: PromptRequest, decision: Decision) -> None:
        """The first placement of a prompt head (or the first since its home left) becomes its home."""
        chain = self.chain_of(request)
        if not chain:
            return
        home = self.homes.get(chain[0])
        if home is None or all(c.backend != home for c in decision.candidates):
            self.homes.place(chain[0], decision.backend)

    def _await_prefill(self, block: tuple[str, int], reservation: Reservation) -> None:
        """Hold the reservation's prefill until the engine stores the prompt's last block (streaming
        responses start before the prefill, so the response start says nothing). Entries of requests
        that ended are swept from time to time, so the table stays bounded by the requests in flight."""
        self._prefilling.setdefault(block, []).append(reservation)
        if len(self._prefilling) > self._prefill_sweep_at:  # amortized: the next sweep waits for twice as many
            waiting = ((key, [r for r in held if not r.finished]) for key, held in self._prefilling.items())
            self._prefilling = {key: held for key, held in waiting if held}
            self._prefill_sweep_at = 2 * len(self._prefilling) + 1024

    def _by_load(self, backends: Sequence[Backend], now: float) -> Decision:
        """The decision with nothing known of the prompt: least loaded healthy backend, ties rotated."""
        self._turn += 1
        candidates = [b.address for b in backends if b.healthy]
        return decide(candidates, {}, {}, 0, self.loads, None, False, self.settings, self._turn, now)

    def least_loaded(self, backends: Sequence[Backend], now: float) -> str | None:
        """An address for a request kvroute does not route by its prompt (another path, a GET):
        nothing reserved, learned or counted."""
        return self._by_load(backends, now).backend

    def begin_unreadable(self, backends: Sequence[Backend], now: float) -> Exchange:
        """A request whose body could not be read: least loaded healthy backend, reserved."""
        decision = self._by_load(backends, now)
        if decision.backend is not None:
            decision.label = Label.FALLBACK
            decision.reservation = self.loads.reserve(decision.backend, 0)
        self.stats.decisions[decision.label] += 1
        return Exchange(None, decision)

    def response_started(self, exchange: Exchange, start: ResponseStart, now: float) -> Outcome:
        """The response began. A 2xx sent by a known backend teaches the index (and binds the
        session) where it was really served; a refused connection is reported so the adapter can
        drop that backend. Only the first call counts. The prefill is over unless the response is
        streamed: then the engine's events release it where they can be followed (precise mode,
        or a backend whose events report progress), else this is the last sign kvroute gets."""
        if exchange.outcome is not None:
            return exchange.outcome
        decision = exchange.decision
        reservation = decision.reservation
        request = exchange.request
        success = 200 <= start.status < 300
        if reservation is not None and not self.precise:
            prefilling = (
                success and request is not None and request.stream and start.upstream in ("", reservation.backend)
            )
            if not (prefilling and reservation.backend in self._progressing):
                reservation.release_prefill()
        served = start.upstream if start.known else ""
        learned = bool(served) and success and start.from_upstream and request is not None
        if learned and request is not None:  # (the second test only narrows the type)
            self.learn(request, served, now)
            if reservation is not None and reservation.backend == served:
                reservation.learned_at = now
        rerouted = bool(served) and served != decision.backend
        if rerouted:
            self.stats.rerouted += 1
        backend = served or decision.backend or ""
        headers: tuple[tuple[str, str], ...] = ()
        if self.settings.decision_headers and success:  # never on errors
            if backend == decision.backend:
                matched = exchange.predicted_blocks
            else:  # rerouted: what the decision knew about the backend that served
                matched = next((c.matched for c in decision.candidates if c.backend == backend), 0)
            headers = (
                ("x-kvroute-decision", decision.label.value),
                ("x-kvroute-backend", backend),
                ("x-kvroute-prefix", f"{matched}/{decision.total_blocks}"),
                ("x-kvroute-cached-tokens", str(round(matched * self.block_tokens()))),
            )
        exchange.outcome = Outcome(backend, learned, bool(served) and start.connect_failed, rerouted, headers)
        return exchange.outcome

    def learn(self, request: PromptRequest, backend: str, now: float) -> int:
        """The backend now holds this prompt (and session); returns how many blocks were new there.
        In precise mode the engine's events say what it holds: only the session is bound here."""
        added = 0
        replicas = self.replicas
        if not self.precise:
            chain = self.chain_of(request)
            added = self.index.learn(chain, backend, now)
            self.churn.add(backend, added, now)
            if replicas is not None and chain:
                replicas.learned(backend, chain)
        self.stats.learned += 1
        if request.session_key is not None:
            session = self.sessions.bind(request.session_key, backend, now, len(self.chain_of(request)))
            if replicas is not None:
                replicas.bound(session, backend)
        return added

    def peer_learned(self, chain: Sequence[int], backend: str, when: float) -> None:
        """A sibling replica learned that a known backend holds this chain (at `when`, on this
        process's clock). Precise mode ignores it: every replica follows the engines' own events."""
        if not self.precise:
            self.churn.add(backend, self.index.learn(chain, backend, when), when)

    def peer_bound(self, session: bytes, backend: str, when: float) -> None:
        """A sibling replica bound a session (by digest) to a known backend."""
        self.sessions.bind_digest(session, backend, when)

    def forget(self, session_key: str) -> bool:
        """Drop a session binding; True if there was one."""
        return self.sessions.forget(session_key)

    def remove_backend(self, backend: str) -> None:
        """A backend left: drop its locations, turnover, session bindings and load at once."""
        self.reset_backend(backend, None)
        self._progressing.discard(backend)
        self.loads.remove_backend(backend)
        self.homes.remove_backend(backend)
        self._starts.pop(backend, None)
        self.bytes_per_token.forget(backend)

    def reset_backend(self, backend: str, reason: Reset | None, emptied_after: float | None = None) -> None:
        """The backend's cache is not what kvroute believed (restarted, cleared, events lost): drop
        its locations, turnover and session bindings, so the next requests are placed on merit.
        Its in-flight load stays: those requests are still running. `emptied_after`: the cache was
        emptied at some moment after this one, so what was learned and bound since is kept."""
        if emptied_after is None:
            self.index.remove_backend(backend)
            self.sessions.remove_backend(backend)
        else:
            self.index.forget_before(backend, emptied_after)
            self.sessions.remove_backend(backend, emptied_after)
        self.churn.remove_backend(backend)
        self.trust.forget(backend)
        if reason is not None:
            self.stats.resets[reason] += 1

    def engine_sample(self, backend: str, sample: EngineSample, now: float) -> None:
        """One scrape of a known backend's /metrics: its own load, a restart (new process start
        time) and its KV cache size."""
        self.loads.get(backend).report(sample.running, sample.waiting, sample.kv_usage, now)
        if sample.start_time is not None:
            before = self._starts.get(backend)
            self._starts[backend] = sample.start_time
            if before is not None and before != sample.start_time:
                self.reset_backend(backend, Reset.RESTART)
        if sample.cache_tokens is not None and self._kv_tokens.get(backend) != sample.cache_tokens:
            self.set_backend_capacity(backend, sample.cache_tokens)
        index = self.index
        if isinstance(index, PreciseIndex) and index.block_size is None and sample.block_size:
            index.block_size = sample.block_size  # from vllm:cache_config_info, before any event
        if sample.cache_queries is not None and sample.cache_hits is not None:
            self.trust.engine(backend, sample.cache_queries, sample.cache_hits)
        if sample.prompt_tokens is not None:
            self.bytes_per_token.engine_tokens(backend, sample.prompt_tokens)
            if abs(self.bytes_per_token.value - self._sized_at) > RESIZE_SHARE * self._sized_at:
                self._size_index()  # every backend's picture follows the learned ratio

    def engine_events(self, backend: str, events: Iterable[EngineEvent], previous: float | None = None) -> None:
        """A batch of a known backend's KV cache events, in order. A cleared cache resets the backend
        in both modes; stores and removals feed the precise index. In approximate mode stores are
        the engine's progress: they drain the prefill its streamed requests hold.

        `previous`: when the backend's previous batch arrived (router clock). vLLM publishes a clear
        with its next step, which on an idle engine is the step of the first requests sent after the
        clear, and kvroute learned those at their response start, before the clear arrives. The clear
        happened after `previous` and after every request that ended there had been learned (vLLM
        clears only while nothing runs, or preempts what runs to compute it again), so what was
        learned since then is kept: the requests still in flight, which the engine computes after
        the clear. Without `previous`, all of it goes."""
        index = self.index
        for event in events:
            self.stats.events[type(event).__name__] += 1
            if isinstance(event, AllBlocksCleared):
                after = None if previous is None else max(previous, self.loads.get(backend).settled_at)
                self.reset_backend(backend, Reset.CACHE_CLEARED, after)
            elif not isinstance(index, PreciseIndex):
                if isinstance(event, BlockStored):
                    self._progressing.add(backend)
                    tokens = len(event.block_hashes) * event.block_size
                    self.loads.get(backend).progress(tokens / self.block_tokens())
            else:
                try:
                    if isinstance(event, BlockStored):
                        for key in index.stored(backend, event):
                            for reservation in self._prefilling.pop((backend, key), ()):
                                reservation.release_prefill()
                    elif isinstance(event, BlockRemoved):
                        index.removed(backend, event)
                except (ValueError, OverflowError, TypeError):
                    self.stats.bad_events += 1

    def events_lost(self, backend: str, reason: Reset) -> None:
        """The backend's event stream broke (a gap that could not be replayed, a new publisher).
        In precise mode its picture is no longer known and is dropped; approximate mode never
        used those events for locations, so a new publisher (a restart) resets it as well."""
        self._stop_progress(backend)
        if self.precise or reason is Reset.SEQUENCE_RESTART:
            self.reset_backend(backend, reason)

    def _stop_progress(self, backend: str) -> None:
        """The backend's progress can no longer be followed: its held prefill is released now and
        its streamed requests release at response start until its events flow again."""
        if backend in self._progressing:
            self._progressing.discard(backend)
            self.loads.get(backend).release_awaiting()

    def _load_state(self, backend: str, reserved: int, active: int) -> dict[str, Any]:
        load = self.loads.get(backend)
        return {
            "reserved_blocks": reserved,
            "active": active,
            "peer_reserved_blocks": load.peer_reserved,  # sibling replicas' reservations
            "peer_active": load.peer_active,
            "engine_requests": load.engine_requests,
            "engine_kv_usage": load.engine_kv_usage,
        }

    def state(self) -> dict[str, Any]:
        """Sizes and load, for metrics and /debug/state."""
        by_backend = self.index.entries_by_backend()
        return {
            "index_entries": sum(by_backend.values()),
            "index_entries_by_backend": by_backend,
            "sessions": len(self.sessions),
            "load": {b: self._load_state(b, r, a) for b, (r, a) in self.loads.snapshot().items()},
            "index": "precise" if self.precise else "approximate",
            "resets": {str(reason): count for reason, count in self.stats.resets.items()},
            "bytes_per_token": round(self.bytes_per_token.value, 3),
            "prediction_trust": {b: round(t, 3) for b, t in self.trust.values.items()},
            "prefix_homes": len(self.homes),
            "cache_pressure": {
                "lost": round(self.pressure.lost, 4),
                "gate_factor": round(self._pressure_terms()[0], 3),  # as decisions apply it
            },
            "engine_events": dict(self.stats.events),
        }
