"""The routing core's API for any gateway: a request lifecycle, plus backend membership.

    begin(request)           decision + load reservation (counted as a decision)
    response_started(...)    the core decides whether to learn, and what the response headers say
    end()                    release whatever the request still holds, exactly once

`query` is the dry run: a decision with no reservation, not counted. Adapters (Envoy ext_proc,
the HTTP lease API) only translate their protocol into these calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from extproc.core.adapters import AdapterBook
from extproc.core.attribution import ReuseAttribution
from extproc.core.backends import Backend, Role
from extproc.core.calibration import BytesPerToken
from extproc.core.churn import ChurnMeter
from extproc.core.decision import Decision, DecisionInputs, Label
from extproc.core.departures import RecentlyLeft
from extproc.core.engine import AllBlocksCleared, EngineEvent, EngineSample
from extproc.core.exchange import BackendState, Exchange, Outcome, Reset, ResponseStart, RouterState, Stats
from extproc.core.homes import PrefixHomes
from extproc.core.index import LocationIndex
from extproc.core.load import LoadTracker, Reservation
from extproc.core.modes import ApproximateMode, IndexMode, PreciseMode, Shared
from extproc.core.pairs import cheapest_prefill, prefill_candidates, splits
from extproc.core.pipeline import Pipeline, assemble
from extproc.core.pressure import CachePressure
from extproc.core.replicas import ReplicaLink
from extproc.core.request import PromptRequest, PromptTokenizer, parse_request
from extproc.core.sessions import NO_CONTEXT, SessionTable, context_of, continued
from extproc.core.settings import MAX_OUTPUT_COST, Settings
from extproc.core.shortlist import shortlist
from extproc.core.trust import PredictionTrust
from extproc.core.ttft import TTFTModel

# Parsing and hashing cost about 2 ms at 256 KiB; tokenizing (precise mode) about 1 us a token.
SLOW_READ_BYTES = 256 * 1024
SLOW_READ_BYTES_PRECISE = 16 * 1024


class Router:
    """Owns the index, sessions and load of one router process. Not thread-safe: one event loop."""

    __slots__ = (
        "_keys",
        "_kv_tokens",
        "_last_now",
        "_left",
        "_shared",
        "_starts",
        "_turn",
        "adapters",
        "attribution",
        "bytes_per_token",
        "churn",
        "homes",
        "loads",
        "mode",
        "pipeline",
        "pressure",
        "replicas",
        "sessions",
        "settings",
        "stats",
        "trust",
        "ttft",
    )

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.churn = ChurnMeter(settings.churn_half_life_s)
        self.sessions = SessionTable(settings.session_ttl_s, settings.session_capacity, settings.hash_key)
        self.homes = PrefixHomes()
        self.pressure = CachePressure()  # how much of their context returning conversations find evicted
        self.loads = LoadTracker()
        self.replicas: ReplicaLink | None = None  # sibling replicas to tell what is learned and bound
        self.stats = Stats()
        self._kv_tokens: dict[str, int] = {}
        self._left = RecentlyLeft()  # backends that left, whose reported sizes are kept a while
        self.bytes_per_token = BytesPerToken()  # CBR bytes per engine token, learned from engine samples
        self.trust = PredictionTrust()  # approximate mode: how far each backend's picture holds, per its engine
        self.ttft = TTFTModel()  # each backend's time to first token in the work ahead (ttft.py)
        self.adapters = AdapterBook()  # the engines' LoRA adapters (adapters.py)
        self.attribution = ReuseAttribution()  # reuse available, routed, delivered (attribution.py)
        self._shared = Shared(
            self.churn, self.loads, self.trust, self.bytes_per_token, self.stats, self._kv_tokens, set(), self.adapters
        )
        self.mode: IndexMode = ApproximateMode(settings, self._shared)
        self.pipeline: Pipeline = assemble(self.adapters)  # the decision's stages (pipeline.py)
        self._starts: dict[str, float] = {}
        self._turn = 0
        self._last_now = 0.0  # the latest decision's time: events batches that come without one
        self._keys = 0  # counts the changes of what chains are keyed by (mode, block size, hash key)

    @property
    def index(self) -> LocationIndex:
        """The current mode's picture of every backend's cache."""
        return self.mode.index

    @property
    def precise(self) -> bool:
        """Routing on token keys fed by engine events (else on learned text prefixes)."""
        return self.mode.precise

    @property
    def slow_read_bytes(self) -> int:
        """Bodies above this take the adapters' event loop too long to parse and hash (tokenize):
        they are read in a worker thread."""
        return SLOW_READ_BYTES_PRECISE if self.mode.precise else SLOW_READ_BYTES

    def join(self, replicas: ReplicaLink, turn: int) -> None:
        """Route as one of several replicas, told through `replicas`. `turn` (random per process)
        starts the counter that rotates ties and moves the shortlist's window: replicas started
        together would otherwise rotate in step and send their new conversations to the same few
        backends (bench.experiments.decisions.engine_hit_rate with replicas). The counter also
        advances with each sibling's binding (`peer_bound`), so the replicas rotate through the
        fleet's turns as one router does through its own, each from its own offset. Only requests
        that bind a conversation are shared turns: requests without a session move only their own
        replica's counter."""
        self.replicas = replicas
        self._turn = turn

    def use(self, make: Callable[[Settings, Shared], IndexMode]) -> None:
        """Switch to the index mode `make` builds (any IndexMode: a third one needs no change
        here); what was learned before no longer applies."""
        self._drop_all()
        self.mode.leave()
        self.mode = make(self.settings, self._shared)
        self.ttft.clear()  # blocks of another size
        self._keys += 1

    def use_precise(self, tokenizer: PromptTokenizer) -> None:
        """Switch to precise mode with this tokenizer."""
        self.use(lambda settings, shared: PreciseMode(settings, shared, tokenizer))

    def use_approximate(self) -> None:
        """Switch to (or stay in) approximate mode."""
        if type(self.mode) is not ApproximateMode:
            self.use(ApproximateMode)

    def _drop_all(self) -> None:
        for backend in list(self.index.entries_by_backend()):
            self.index.remove_backend(backend)
            self.churn.remove_backend(backend)

    def reconfigure(self, settings: Settings) -> None:
        """Apply new settings live, keeping what the index holds. A new key makes every known
        chain meaningless, and so does a new block size in approximate mode (precise mode's blocks
        are the engines'), so the index is emptied; sessions and reservations stay. (Emptying a
        precise index would lose the prefixes the engines still hold: they report only new blocks.)"""
        resized = settings.block_size != self.settings.block_size and not self.mode.precise
        rehash = resized or settings.hash_key != self.settings.hash_key
        if rehash:
            self._drop_all()  # before a precise index is replaced: its backends' turnover goes too
            self.ttft.clear()
            self._keys += 1
        self.settings = settings
        self.churn.half_life_s = settings.churn_half_life_s
        self.mode.reconfigure(settings, rehash)
        self.sessions.configure(settings.session_ttl_s, settings.session_capacity, settings.hash_key)

    def set_backend_capacity(self, backend: str, kv_tokens: int) -> None:
        """A backend reported its KV cache size in tokens; with `capacity_auto`, the approximate
        picture of it is sized by it. The size is kept, so a later change of settings can re-derive it."""
        self._kv_tokens[backend] = kv_tokens
        self._left.back(backend)
        self.mode.set_capacity(backend, kv_tokens)

    def parse(self, body: bytes | str | Mapping[str, Any], headers: Mapping[str, str]) -> PromptRequest:
        """A request body as routing sees it, tokenized in precise mode. Raises InvalidRequest.
        CPU-bound on large bodies: adapters may run it off their event loop."""
        settings = self.settings
        return parse_request(body, headers, settings.session_headers, settings.tenant_header, self.mode.tokenizer)

    def chain_of(self, request: PromptRequest) -> list[int]:
        """The request's block chain, hashed once and kept on the request: token keys in precise
        mode (none until the engines' block size is known, or if the prompt could not be
        tokenized), CBR hashes otherwise."""
        return self.mode.chain_of(request)

    def block_tokens(self) -> float:
        """Tokens per block of the current chains: exact in precise mode, estimated otherwise."""
        return self.mode.block_tokens()

    def query(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Decision:
        """Dry run: the decision `begin` would make now, with no reservation and not counted."""
        adapter = self.adapters.adapter_of(request.model)
        candidates, positions = self._candidates(request, backends, adapter)
        chain = self.chain_of(request)
        session_backend, session_blocks = None, 0
        if request.session_key is not None:
            # a binding to a backend not among the candidates is passed over, not forgotten: this is
            # a dry run too, and the turn served elsewhere rebinds it
            binding = self.sessions.binding(request.session_key, now)
            if binding is not None and binding[0] in (candidates if positions is None else positions):
                session_backend, session_blocks = binding[0], continued(binding[1], chain)
        home = self.homes.get(chain[0]) if chain else None
        bound = (session_backend, session_blocks, home)
        weighs_room = self._weighs_kv_room(backends)
        if self._shortlisting(adapter, candidates):
            kept = set(self.index.holders(chain[0], now)) if chain else set()
            kept.update(b for b in (session_backend, home) if b is not None)
            short = shortlist(candidates, kept, self._turn, positions)
            decision = self._weigh(request, adapter, short, chain, bound, weighs_room, now)
            if decision.backend is not None:
                return decision
            # every shortlisted backend refused it (its limit, the TTFT objective): the whole
            # fleet is weighed before the request is refused
        return self._weigh(request, adapter, candidates, chain, bound, weighs_room, now)

    def _weighs_kv_room(self, backends: Sequence[Backend]) -> bool:
        """KV room is weighed (rules.kv_room) in every fleet with `kv_room_everywhere`, else where
        requests may be split (pairs.py), as decode backends then hold long-running contexts."""
        settings = self.settings
        if settings.kv_room_cost <= 0:
            return False
        if settings.kv_room_everywhere:
            return True
        if settings.pd_threshold_tokens <= 0:
            return False
        return settings.pd_flexible or self.pipeline.memo.disaggregated(backends)

    def _kv_room(self, candidates: Sequence[str], chain: list[int], now: float) -> dict[str, float]:
        """Blocks of the current chains each candidate's KV cache has for `chain`: what the requests
        in flight there leave free, of kvroute's (this replica's and its siblings', waiting ones
        too, which no sample shows yet) or of the running ones at the engine's last fresh sample
        (other clients' too), whichever takes more, plus the head of the prompt a request of its
        own in flight there already holds; none where the cache size is not reported."""
        per_block = self.block_tokens()
        room: dict[str, float] = {}
        if per_block <= 0:
            return room
        for backend in candidates:
            load, tokens = self.loads.get(backend), self._kv_tokens.get(backend)
            if not tokens:
                continue
            size = tokens / per_block
            taken = float(load.footprint + load.peer_footprint)
            if load.engine_fresh(now):
                used = min(max(load.engine_kv_usage, 0.0), 1.0)  # a gauge out of range says nothing more
                taken = max(taken, used * size)
            room[backend] = size - taken + load.prompts.shared(chain)
        return room

    def _candidates(
        self, request: PromptRequest, backends: Sequence[Backend], adapter: str | None
    ) -> tuple[list[str], dict[str, int] | None]:
        """The backends that may serve the request, and their positions where the pipeline keeps
        them (the pool's tuple, no LoRA `adapter` named)."""
        if isinstance(backends, tuple) and adapter is None:
            return self.pipeline.kept_candidates(request, backends)
        return self.pipeline.candidates(request, backends), None

    def _shortlisting(self, adapter: str | None, candidates: Sequence[str]) -> bool:
        """A large fleet's decision weighs a shortlist (shortlist.py), unless the request names a
        LoRA `adapter` (where it is loaded matters beyond the shortlist)."""
        return adapter is None and len(candidates) > self.settings.shortlist_above > 0

    def _weigh(
        self,
        request: PromptRequest,
        adapter: str | None,
        candidates: list[str],
        chain: list[int],
        bound: tuple[str | None, int, str | None],
        weighs_room: bool,
        now: float,
    ) -> Decision:
        """The pipeline's decision among these candidates; `weighs_room`: with their KV room."""
        session_backend, session_blocks, home = bound
        picture, matched, home = self.mode.picture(chain, candidates, home, now)
        churn = self.churn.rates(candidates, now)
        bootstrap = not request.followup or not chain
        self._turn += 1
        gate_factor, home_ties = self._pressure_terms()
        inputs = DecisionInputs(
            candidates=candidates,
            matched=matched,
            picture=picture,
            churn=churn,
            total_blocks=len(chain),
            loads=self.loads,
            settings=self.settings,
            now=now,
            turn=self._turn,
            session_backend=session_backend,
            session_blocks=session_blocks,
            bootstrap=bootstrap,
            home=home,
            gate_factor=gate_factor,
            block_tokens=self.block_tokens() if session_backend is not None else 0.0,
            home_ties=home_ties,
            ttft_objective_s=request.ttft_objective_s,
            sheddable=request.sheddable,
            ttft=self.ttft,
            adapter=adapter,
            kv_room=self._kv_room(candidates, chain, now) if weighs_room else None,
        )
        return self.pipeline.decide(inputs)

    def cost_tokens(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> float:
        """What the request will cost where its prompt is best cached now: uncached prompt tokens
        plus the output it may generate (`default_output_tokens` when it sets no limit), flow
        control's measure of a flow's share. Nothing is counted or changed."""
        chain = self.chain_of(request)
        adapter = self.adapters.adapter_of(request.model)
        candidates, positions = self._candidates(request, backends, adapter)
        if chain and self._shortlisting(adapter, candidates):
            known = positions if positions is not None else set(candidates)
            candidates = [b for b in self.index.holders(chain[0], now) if b in known]  # only they hold any
        matched = self.mode.picture(chain, candidates, None, now)[1]
        uncached = (len(chain) - max(matched.values(), default=0)) * self.block_tokens()
        output = self.settings.default_output_tokens if request.output_tokens is None else request.output_tokens
        return uncached + min(output, MAX_OUTPUT_COST)  # a client's max_tokens, bounded

    def begin(self, request: PromptRequest, backends: Sequence[Backend], now: float) -> Exchange:
        """Choose a backend among the healthy ones serving the request's model and reserve the
        load it adds; the returned exchange must be ended (`end`) however the request ends."""
        decision = self.query(request, backends, now)
        self._last_now = now
        request.keys = self._keys
        request.cbr_bytes = len(request.cbr)
        request.cbr = b""  # the chain is all the exchange needs from here: hold no copy of the body
        request.tokens = None
        predicted = decision.matched_blocks
        reservation = None
        if decision.backend is not None:
            if decision.returning is not None:  # (a refusal is no return: its retries would count again)
                self.pressure.returned(*decision.returning)
            self._place_home(request, decision.backend)
            reservation = self._reserve(request, decision.backend, decision.total_blocks - decision.matched_blocks, now)
            predicted = self.mode.routed(request, decision, reservation, now)
        self.stats.decisions[decision.label] += 1
        return Exchange(request, decision, reservation, predicted, self.bytes_per_token)

    def _reserve(self, request: PromptRequest, backend: str, blocks: int, now: float) -> Reservation:
        """The load a request sent to `backend` adds there, with what its TTFT is predicted from
        (the work queued ahead of it, the requests beside it)."""
        load = self.loads.get(backend)
        ahead, in_flight = load.reserved_blocks + load.peer_reserved, load.requests(now)
        adapter = self.adapters.adapter_of(request.model)
        reservation = self.loads.reserve(backend, blocks, adapter, self.chain_of(request))
        reservation.sent_at, reservation.work, reservation.in_flight = now, ahead + reservation.blocks, in_flight
        reservation.predicted_s = self.ttft.predict(backend, reservation.work, in_flight)
        return reservation

    def prefill_again(self, exchange: Exchange) -> None:
        """The prefill hand-off failed: the decode backend computes the prompt after all, its
        prefill reserved there again and held until its engine shows it done."""
        reservation, request = exchange.reservation, exchange.request
        if reservation is not None and request is not None and reservation.prefill_again():
            self.mode.hold_prefill(request, reservation)

    def prefill_leg(self, exchange: Exchange, backends: Sequence[Backend], now: float) -> Exchange | None:
        """Split a decided request (pairs.py): an exchange for its prefill leg on the prefill
        backend where it costs least, with that prefill reserved there; None to serve it whole.
        The leg's exchange learns and releases like any other (`response_started`, `end`)."""
        request, decision = exchange.request, exchange.decision
        if request is None or decision.backend is None or decision.label in (Label.SHED, Label.SHED_SLO):
            return None
        uncached = (decision.total_blocks - exchange.predicted_blocks) * self.block_tokens()
        if not splits(uncached, self.settings.pd_threshold_tokens):
            return None
        candidates = prefill_candidates(backends, request.model, decision.backend, self.settings.pd_flexible)
        if not candidates:
            return None
        chain = self.chain_of(request)
        picture, matched, _ = self.mode.picture(chain, [b.address for b in candidates], None, now)
        chosen = cheapest_prefill(candidates, matched, len(chain), self.loads, decision.backend)
        if chosen is None:
            return None
        backend, held = chosen
        if exchange.reservation is not None:  # the decode backend pulls the prompt instead of computing it
            exchange.reservation.release_prefill()
        leg = decision._replace(
            label=Label.PREFILL,
            backend=backend,
            second=None,
            matched_blocks=held,
            picture_blocks=picture.get(backend, 0),  # the prefill backend's, which trust checks there
            returning=None,
        )
        reservation = self._reserve(request, backend, len(chain) - held, now)
        predicted = self.mode.routed(request, leg, reservation, now)
        self.stats.decisions[Label.PREFILL] += 1
        return Exchange(request, leg, reservation, predicted, self.bytes_per_token)

    def _pressure_terms(self) -> tuple[float, bool]:
        """What cache pressure does to decisions now: the balance gates' factor, and whether a
        head's home wins among equal holders (the configured gates and ties when
        `cache_pressure_gates` is off)."""
        if not self.settings.cache_pressure_gates:
            return 1.0, True
        return self.pressure.gate_factor(), self.pressure.home_ties()

    def _place_home(self, request: PromptRequest, backend: str) -> None:
        """The first placement of a prompt head (or the first since its home left) becomes its home.
        A home only absent from this request's candidates (a failed probe, a gateway's subset hint,
        at its request limit) stays: a brief absence must not move the head's home for good."""
        chain = self.chain_of(request)
        if chain and self.homes.get(chain[0]) is None:
            self.homes.place(chain[0], backend)

    def _by_load(self, backends: Sequence[Backend], now: float) -> Decision:
        """The decision with nothing known of the prompt: least loaded healthy backend, ties rotated."""
        self._turn += 1
        candidates = [b.address for b in backends if b.healthy and b.role is not Role.PREFILL]
        inputs = DecisionInputs(
            candidates=candidates,
            matched={},
            total_blocks=0,
            loads=self.loads,
            settings=self.settings,
            now=now,
            turn=self._turn,
        )
        return self.pipeline.decide(inputs)

    def least_loaded(self, backends: Sequence[Backend], now: float) -> str | None:
        """An address for a request kvroute does not route by its prompt (another path, a GET):
        nothing reserved, learned or counted."""
        return self._by_load(backends, now).backend

    def begin_unreadable(self, backends: Sequence[Backend], now: float) -> Exchange:
        """A request whose body could not be read: least loaded healthy backend, reserved."""
        decision = self._by_load(backends, now)
        reservation = None
        if decision.backend is not None:
            reservation = self.loads.reserve(decision.backend, 0)
            decision = decision._replace(label=Label.FALLBACK)
        self.stats.decisions[decision.label] += 1
        return Exchange(None, decision, reservation)

    def response_started(self, exchange: Exchange, start: ResponseStart, now: float) -> Outcome:
        """The response began. A 2xx sent by a known backend teaches the index (and binds the
        session) where it was really served; a refused connection is reported so the adapter can
        drop that backend. Only the first call counts. The prefill is over unless the response is
        streamed: then the engine's events release it where they can be followed (precise mode,
        or a backend whose events report progress), else this is the last sign kvroute gets."""
        if exchange.outcome is not None:
            return exchange.outcome
        decision = exchange.decision
        reservation = exchange.reservation
        request = exchange.request
        success = 200 <= start.status < 300
        if exchange.room is not None:  # learned below, or never: no longer beside the picture
            exchange.room.give_back()
        if exchange.unsent is not None and not success and request is not None:
            self._unbind_sent(exchange, request, now)
        if reservation is not None:
            self.mode.response_started(reservation, request, start, success)
        served = start.upstream if start.known else ""
        # (a request whose chain was keyed before the picture's keys changed teaches nothing)
        learned = (
            bool(served) and success and start.from_upstream and request is not None and request.keys == self._keys
        )
        if learned and request is not None:  # (the second test only narrows the type)
            self.learn(request, served, now, bind=decision.label is not Label.PREFILL)
            if reservation is not None and reservation.backend == served:
                reservation.learned_at = now
        rerouted = bool(served) and served != decision.backend
        if rerouted:
            self.stats.rerouted += 1
        backend = served or decision.backend or ""
        headers: tuple[tuple[str, str], ...] = ()
        if success:
            if backend == decision.backend:
                matched = exchange.predicted_blocks
            else:  # rerouted: what the decision knew about the backend that served
                matched = next((c.matched for c in decision.candidates if c.backend == backend), 0)
            block_tokens = self.block_tokens()
            if served and request is not None and decision.label is not Label.PREFILL:  # a split: its decode leg's
                self.attribution.served(decision, served, matched, block_tokens)
                exchange.routed = served, matched * block_tokens
            if self.settings.decision_headers:  # never on errors
                headers = self.decision_headers(exchange, backend, matched)
        exchange.outcome = Outcome(backend, learned, bool(served) and start.connect_failed, rerouted, headers)
        return exchange.outcome

    def decision_headers(self, exchange: Exchange, backend: str, matched: int) -> tuple[tuple[str, str], ...]:
        """What the client is told of its request's decision: why, where, how much of the prompt
        was cached there (`matched` blocks) and the time to first token kvroute expected."""
        decision, reservation = exchange.decision, exchange.reservation
        headers: tuple[tuple[str, str], ...] = (
            ("x-kvroute-decision", f"queued,{decision.label.value}" if exchange.queued else decision.label.value),
            ("x-kvroute-backend", backend),
            ("x-kvroute-prefix", f"{matched}/{decision.total_blocks}"),
            ("x-kvroute-cached-tokens", str(round(matched * self.block_tokens()))),
        )
        if reservation is not None and reservation.predicted_s is not None:
            headers += (("x-kvroute-ttft-ms", str(round(reservation.predicted_s * 1000))),)
        return headers

    def engine_reported(self, exchange: Exchange, cached_tokens: int) -> None:
        """The engine's own count of the request's cached prompt tokens (its response's usage,
        where the adapter reads the response body): the per-request reuse account. Once."""
        routed, exchange.routed = exchange.routed, None
        if routed is not None and cached_tokens >= 0:
            self.attribution.responded(routed[0], cached_tokens, routed[1])

    def learn(self, request: PromptRequest, backend: str, now: float, bind: bool = True) -> int:
        """The backend now holds this prompt (and, with `bind`, the session: not where a prefill leg
        ran, which serves no turn); returns how many blocks were new there. In precise mode the
        engine's events say what it holds: only the session is bound here."""
        replicas = self.replicas
        added, shared = self.mode.learn(request, backend, now)
        if replicas is not None and shared:
            replicas.learned(backend, shared)
        self.stats.learned += 1
        if bind and request.session_key is not None:
            session = self.sessions.bind(request.session_key, backend, now, context_of(self.chain_of(request)))
            if replicas is not None:
                replicas.bound(session, backend)
        return added

    def sent(self, exchange: Exchange, now: float) -> None:
        """For a transport that reports a request's end but not its response's start (ext_authz):
        the request went to its backend, whose engine stores its uncached blocks at the prefill,
        long before that end, and uses the prefix it holds. The picture makes room for them and
        counts that prefix as just used, now, keeping the new blocks' room until the end; and the
        conversation's next turn, should it come before the end is reported, follows this one to
        its backend (the session is bound, its prompt's size there not known yet). Nothing is
        learned."""
        request, backend = exchange.request, exchange.decision.backend
        if request is None or backend is None:
            return
        pictured = exchange.decision.picture_blocks  # what the picture holds there, not trust's discount of it
        held = self.chain_of(request)[:pictured]
        exchange.room = self.mode.make_room(backend, held, exchange.decision.total_blocks - pictured, now)
        if request.session_key is not None:
            exchange.unsent = self.sessions.binding(request.session_key, now) or ("", NO_CONTEXT)
            self.sessions.bind(request.session_key, backend, now)

    def _unbind_sent(self, exchange: Exchange, request: PromptRequest, now: float) -> None:
        """A request `sent` bound its session for was not served: the binding it replaced comes
        back (none: the session is unbound), as the ext_proc transport, which binds only on a 2xx,
        would have left it; unless a later turn has bound it since."""
        key = request.session_key
        before, exchange.unsent = exchange.unsent, None
        if key is None or before is None or self.sessions.binding(key, now) != (exchange.decision.backend, NO_CONTEXT):
            return
        if before[0]:
            self.sessions.bind(key, before[0], now, before[1])
        else:
            self.sessions.forget(key)

    def peer_learned(self, chain: Sequence[int], backend: str, when: float) -> None:
        """A sibling replica learned that a known backend holds this chain (at `when`, on this
        process's clock). Precise mode ignores it: every replica follows the engines' own events."""
        self.mode.peer_learned(chain, backend, when)

    def peer_bound(self, session: bytes, backend: str, when: float) -> None:
        """A sibling replica bound a session (by digest) to a known backend: a turn of the fleet's,
        counted in this replica's rotation too: without it replicas' independent counters spread
        new conversations as unevenly as chance (docs/benchmarks.md#replicas)."""
        self._turn += 1
        self.sessions.bind_digest(session, backend, when)

    def forget(self, session_key: str) -> bool:
        """Drop a session binding; True if there was one."""
        return self.sessions.forget(session_key)

    def remove_backend(self, backend: str) -> None:
        """A backend left: drop its locations, turnover, load and session bindings at once; its prefix
        homes answer nothing from now on, and go as they are met."""
        self.index.remove_backend(backend)
        self.sessions.leave(backend)
        self._forget_turnover(backend)
        self._shared.progressing.discard(backend)
        self.loads.remove_backend(backend)
        self.adapters.remove_backend(backend)
        self.homes.remove_backend(backend)
        self._starts.pop(backend, None)
        self.bytes_per_token.forget(backend)
        self.ttft.forget(backend)
        self.attribution.forget(backend)
        forgotten = self._left.left(backend)  # its reported size kept while it may come back
        if forgotten is not None:
            self._kv_tokens.pop(forgotten, None)
            self.mode.forget_capacity(forgotten)

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
        self._forget_turnover(backend)
        if reason is not None:
            self.stats.resets[reason] += 1

    def _forget_turnover(self, backend: str) -> None:
        """What was measured of the backend's cache: how fast it turned over, how far to trust it."""
        self.churn.remove_backend(backend)
        self.trust.forget(backend)

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
        if sample.cache_queries is not None and sample.cache_hits is not None:
            self.trust.engine(backend, sample.cache_queries, sample.cache_hits)
        if sample.cache_hits is not None:
            self.attribution.engine(backend, sample.cache_hits)
        if sample.ttft_sum is not None and sample.ttft_count is not None:
            self.ttft.engine(backend, sample.ttft_sum, sample.ttft_count)
        if sample.prompt_tokens is not None:
            self.bytes_per_token.engine_tokens(backend, sample.prompt_tokens)
        if sample.lora_slots is not None:
            self.adapters.engine(backend, sample.lora_running, sample.lora_slots, now)
        self.mode.engine_sample(backend, sample)

    def engine_events(
        self, backend: str, events: Iterable[EngineEvent], previous: float | None = None, now: float | None = None
    ) -> None:
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
        for event in events:
            self.stats.events[type(event).__name__] += 1
            if isinstance(event, AllBlocksCleared):
                after = None if previous is None else max(previous, self.loads.get(backend).settled_at)
                self.reset_backend(backend, Reset.CACHE_CLEARED, after)
            elif not self.mode.engine_event(backend, event, self._last_now if now is None else now):
                self.stats.bad_events += 1
        prefilled = self._shared.prefilled
        if now is not None:  # the batch arrived now: each request it completes had its first token about then
            for reservation in prefilled:
                self.ttft.observe(
                    reservation.backend,
                    reservation.work,
                    reservation.in_flight,
                    now - reservation.sent_at,
                    reservation.predicted_s,
                )
        prefilled.clear()

    def events_lost(self, backend: str, reason: Reset) -> None:
        """The backend's event stream broke (a gap that could not be replayed, a new publisher).
        In precise mode its picture is no longer known and is dropped; approximate mode never
        used those events for locations, so a new publisher (a restart) resets it as well."""
        self._stop_progress(backend)
        if self.mode.resets_on_lost_events(reason):
            self.reset_backend(backend, reason)

    def _stop_progress(self, backend: str) -> None:
        """The backend's progress can no longer be followed: its held prefill is released now and
        its streamed requests release at response start until its events flow again."""
        progressing = self._shared.progressing
        if backend in progressing:
            progressing.discard(backend)
            self.loads.get(backend).release_awaiting()

    def _backend_state(self, backend: str) -> BackendState:
        load = self.loads.get(backend)
        return BackendState(
            load.reserved_blocks,
            load.active,
            load.peer_reserved,
            load.peer_active,
            load.footprint,
            load.peer_footprint,
            load.engine_requests,
            load.engine_kv_usage,
        )

    def state(self) -> RouterState:
        """Sizes and load, for metrics and /debug/state."""
        by_backend = self.index.entries_by_backend()
        return RouterState(
            index=self.mode.name,
            index_entries=sum(by_backend.values()),
            index_shed=self.index.shed,
            index_entries_by_backend=by_backend,
            sessions=len(self.sessions),
            load={backend: self._backend_state(backend) for backend in self.loads.snapshot()},
            resets={str(reason): count for reason, count in self.stats.resets.items()},
            bytes_per_token=round(self.bytes_per_token.value, 3),
            prediction_trust={b: round(t, 3) for b, t in self.trust.values.items()},
            prefix_homes=len(self.homes),
            cache_pressure=round(self.pressure.lost, 4),
            gate_factor=round(self._pressure_terms()[0], 3),
            engine_events=dict(self.stats.events),
            reuse=self.attribution.state(),
        )
