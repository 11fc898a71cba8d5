"""Index modes: how kvroute knows what each backend caches, one object per way of knowing.

*Approximate* mode learns from its own routing: a request's chain is hashed from its canonical
bytes (CBR), each backend's picture is an LRU sized by the engine's KV cache at the learned bytes
per token and weighed by how far that engine's own hit counts bear it out (trust.py); sibling
replicas' learning applies; a streamed request's prefill is held until the engine's KV events
report progress, where they flow.

*Precise* mode follows the engines' KV events: chains of token keys from the model's own
tokenizer, a picture that is what the engines report, a routed request's blocks pending there
until its engine confirms them, its prefill held until the engine stores its last block; its own
routing and siblings' teach it nothing.

`Router` keeps the request lifecycle, sessions and membership, and asks its mode for the rest.
A third mode is a class implementing `IndexMode`, put in with `Router.use`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from extproc.core.adapters import AdapterBook
from extproc.core.calibration import BytesPerToken
from extproc.core.chain import BlockHasher, TokenHasher, extra_digest
from extproc.core.churn import ChurnMeter
from extproc.core.decision import Decision
from extproc.core.engine import BlockRemoved, BlockStored, EngineSample
from extproc.core.exchange import Reset, ResponseStart, Stats
from extproc.core.index import LocalIndex, LocationIndex, Room
from extproc.core.load import LoadTracker, Reservation
from extproc.core.precise import PreciseIndex
from extproc.core.request import PromptRequest, PromptTokenizer
from extproc.core.settings import Settings
from extproc.core.trust import PredictionTrust

# Precise mode: blocks one backend may report before its picture is dropped as implausible
# (2**18 blocks of 16 tokens is 4M tokens, beyond any one engine's KV cache today).
PRECISE_MAX_BLOCKS = 1 << 18
# The approximate pictures are re-sized when the learned bytes per token moves by more than this share.
RESIZE_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class Shared:
    """The router's collaborators a mode reads and feeds; they outlive any one mode."""

    churn: ChurnMeter
    loads: LoadTracker
    trust: PredictionTrust
    bytes_per_token: BytesPerToken
    stats: Stats
    kv_tokens: Mapping[str, int]  # each backend's KV cache in tokens, as it last reported
    # Backends whose KV events report what they store (approximate mode holds a streamed
    # request's prefill until that progress covers it); known across mode switches.
    progressing: set[str]
    adapters: AdapterBook  # the LoRA adapters the engines list or run (a request naming one is keyed by it)
    # Reservations whose prefill the engine's events just showed stored, for the router to time
    # (ttft.py); it empties the list after each batch of events.
    prefilled: list[Reservation] = field(default_factory=list)


class IndexMode(Protocol):
    """What differs between ways of knowing the caches; every method is the router's question."""

    name: ClassVar[str]  # as /debug/state and the metrics say it
    precise: ClassVar[bool]  # fed by the engines' events: adapters subscribe and tokenize for it
    tokenizer: PromptTokenizer | None  # requests are tokenized for this mode's chains (None: not)

    @property
    def index(self) -> LocationIndex:
        """The picture of every backend's cache."""
        ...

    def chain_of(self, request: PromptRequest) -> list[int]:
        """The request's block chain, made once and kept on the request."""
        ...

    def block_tokens(self) -> float:
        """Tokens per block of the chains (exact or estimated)."""
        ...

    def picture(
        self, chain: Sequence[int], candidates: Sequence[str], home: str | None, now: float
    ) -> tuple[dict[str, int], Mapping[str, int], str | None]:
        """Leading blocks each candidate holds as the picture shows them, as decisions should weigh
        them, and the prompt head's home if decisions may follow it."""
        ...

    def routed(self, request: PromptRequest, decision: Decision, reservation: Reservation, now: float) -> int:
        """The request was sent where decided: record it; returns the blocks expected cached there."""
        ...

    def hold_prefill(self, request: PromptRequest, reservation: Reservation) -> None:
        """Hold the reservation's prefill until the engine shows it done, as `routed` does (its
        prefill, handed to a prefill server, is its backend's own again)."""
        ...

    def response_started(
        self, reservation: Reservation, request: PromptRequest | None, start: ResponseStart, success: bool
    ) -> None:
        """The response began: release the prefill unless the engine's events will."""
        ...

    def learn(self, request: PromptRequest, backend: str, now: float) -> tuple[int, list[int] | None]:
        """The backend served the prompt: blocks new there, and the chain to tell siblings (None: no)."""
        ...

    def peer_learned(self, chain: Sequence[int], backend: str, when: float) -> None:
        """A sibling replica learned that the backend holds the chain."""
        ...

    def set_capacity(self, backend: str, kv_tokens: int) -> None:
        """The backend reported its KV cache size."""
        ...

    def forget_capacity(self, backend: str) -> None:
        """The size the backend reported is forgotten (it left, long enough ago)."""
        ...

    def make_room(self, backend: str, held: Sequence[int], blocks: int, now: float) -> Room | None:
        """A request is prefilling on the backend, to be learned only later (a transport that
        reports a request's end, not its response's start): it uses the prefix `held` there (at
        `now`) and stores this many new blocks, in room the picture keeps until it is given back."""
        ...

    def engine_sample(self, backend: str, sample: EngineSample) -> None:
        """One scrape of the backend's metrics, after the router took what every mode takes."""
        ...

    def engine_event(self, backend: str, event: BlockStored | BlockRemoved, now: float) -> bool:
        """One stored or removed event of the backend (its batch arrived at `now`); False if it was
        refused as inconsistent."""
        ...

    def resets_on_lost_events(self, reason: Reset) -> bool:
        """Whether the backend's picture is no longer known when its event stream breaks so."""
        ...

    def reconfigure(self, settings: Settings, rehash: bool) -> None:
        """New settings; `rehash`: a new block size or key, so every chain changes (the router has
        already emptied the index)."""
        ...

    def leave(self) -> None:
        """Another mode takes over."""
        ...


class ApproximateMode:
    """Locations learned from kvroute's own routing, per backend an LRU of CBR block hashes."""

    name: ClassVar[str] = "approximate"
    precise: ClassVar[bool] = False
    __slots__ = ("_progressing", "_shared", "_sized_at", "hasher", "index", "settings", "tokenizer")
    _progressing: set[str]

    def __init__(self, settings: Settings, shared: Shared) -> None:
        self.settings = settings
        self._shared = shared
        self.hasher = BlockHasher(settings.block_size, settings.hash_key)
        self.index = LocalIndex(settings.location_ttl_s, settings.capacity_blocks)
        self.tokenizer: PromptTokenizer | None = None
        self._progressing = shared.progressing
        self._sized_at = shared.bytes_per_token.value  # the ratio the pictures were last sized with
        self._size()

    def _size(self) -> None:
        self._sized_at = self._shared.bytes_per_token.value
        settings = self.settings
        capacities = {b: self._blocks(t) for b, t in self._shared.kv_tokens.items()} if settings.capacity_auto else {}
        bound = int(settings.index_memory_mib * 2**20)
        self.index.configure(settings.location_ttl_s, settings.capacity_blocks, capacities, max_bytes=bound)

    def _blocks(self, kv_tokens: int) -> int:
        """A KV cache of so many tokens as CBR blocks, at the learned bytes per token."""
        return max(1, int(kv_tokens * self._shared.bytes_per_token.value) // self.settings.block_size)

    def chain_of(self, request: PromptRequest) -> list[int]:
        if request.chain is None:
            request.chain = self.hasher.chain(request.cbr)
        return request.chain

    def block_tokens(self) -> float:
        return self.settings.block_size / self._shared.bytes_per_token.value

    def picture(
        self, chain: Sequence[int], candidates: Sequence[str], home: str | None, now: float
    ) -> tuple[dict[str, int], Mapping[str, int], str | None]:
        picture = self.index.lookup(chain, candidates, now)
        self._in_flight(picture, chain, candidates)
        if not self.settings.prediction_trust:
            return picture, picture, home
        trust = self._shared.trust
        if home is not None and trust.of(home) < 1.0:
            home = None  # the engine contradicts kvroute's picture there: a home would pull like a held prefix
        return picture, trust.apply(picture), home

    def _in_flight(self, picture: dict[str, int], chain: Sequence[int], candidates: Sequence[str]) -> None:
        """A head that a request in flight on a backend carries counts as held there: the engine
        computes it once, ahead of this request (it runs them in order), or has it already. The
        picture learns a request only at its response's start, over ext_authz at its end: until
        then a second request with that head saw none of it there, and reserved, and made the
        picture evict room for, all of it again (`in_flight_heads`)."""
        if not self.settings.in_flight_heads:
            return
        loads = self._shared.loads
        for backend in candidates:
            load = loads.known(backend)
            if load is not None and load.active:
                flying = load.prompts.shared(chain)  # type: ignore[arg-type]  # (a list's blocks, compared)
                if flying > picture.get(backend, 0):
                    picture[backend] = flying

    def routed(self, request: PromptRequest, decision: Decision, reservation: Reservation, now: float) -> int:
        backend = reservation.backend
        self._shared.trust.routed(backend, decision.picture_blocks * self.block_tokens())
        self.hold_prefill(request, reservation)
        return decision.matched_blocks

    def hold_prefill(self, request: PromptRequest, reservation: Reservation) -> None:
        """A streamed response starts before its prefill ends: the engine's progress drains it."""
        if request.stream and reservation.backend in self._progressing:
            self._shared.loads.get(reservation.backend).await_progress(reservation)

    def response_started(
        self, reservation: Reservation, request: PromptRequest | None, start: ResponseStart, success: bool
    ) -> None:
        if not (_may_prefill(reservation, request, start, success) and reservation.backend in self._progressing):
            reservation.release_prefill()

    def learn(self, request: PromptRequest, backend: str, now: float) -> tuple[int, list[int] | None]:
        chain = self.chain_of(request)
        added = self.index.learn(chain, backend, now)
        self._shared.churn.add(backend, added, now)
        return added, chain

    def peer_learned(self, chain: Sequence[int], backend: str, when: float) -> None:
        self._shared.churn.add(backend, self.index.learn(chain, backend, when), when)

    def set_capacity(self, backend: str, kv_tokens: int) -> None:
        if self.settings.capacity_auto:
            self.index.set_capacity(backend, self._blocks(kv_tokens))

    def forget_capacity(self, backend: str) -> None:
        self.index.forget_capacity(backend)

    def make_room(self, backend: str, held: Sequence[int], blocks: int, now: float) -> Room:
        """The engine uses the prefix and evicts for the new blocks at the prefill: so does the
        picture, now."""
        return self.index.make_room(backend, held, blocks, now)

    def engine_sample(self, backend: str, sample: EngineSample) -> None:
        value = self._shared.bytes_per_token.value
        if sample.prompt_tokens is not None and abs(value - self._sized_at) > RESIZE_SHARE * self._sized_at:
            self._size()  # every backend's picture follows the learned ratio

    def engine_event(self, backend: str, event: BlockStored | BlockRemoved, now: float) -> bool:
        """Stores are the engine's progress: they drain the prefill its streamed requests hold."""
        if isinstance(event, BlockStored):
            self._progressing.add(backend)
            tokens = len(event.block_hashes) * event.block_size
            self._shared.loads.get(backend).progress(tokens / self.block_tokens(), self._shared.prefilled)
        return True

    def resets_on_lost_events(self, reason: Reset) -> bool:
        return reason is Reset.SEQUENCE_RESTART  # a new publisher: the engine restarted

    def reconfigure(self, settings: Settings, rehash: bool) -> None:
        self.settings = settings
        if rehash:
            self.hasher = BlockHasher(settings.block_size, settings.hash_key)
        self._size()

    def leave(self) -> None:
        """Another mode takes over: streamed prefill held for progress is released now, as no
        other mode drains it (which backends report progress stays known)."""
        for backend in self._progressing:
            self._shared.loads.get(backend).release_awaiting()


class PreciseMode:
    """Locations as the engines' KV events report them, keyed by the model's own tokens."""

    name: ClassVar[str] = "precise"
    precise: ClassVar[bool] = True
    __slots__ = ("_prefill_entries", "_prefill_sweep_at", "_prefilling", "_shared", "hasher", "index", "tokenizer")

    def __init__(self, settings: Settings, shared: Shared, tokenizer: PromptTokenizer) -> None:
        self._shared = shared
        self.tokenizer: PromptTokenizer | None = tokenizer
        self.hasher = TokenHasher(settings.hash_key)
        self.index = PreciseIndex(self.hasher, PRECISE_MAX_BLOCKS)
        # (backend, key of a prompt's last full block) -> reservations whose prefill lasts until
        # the engine reports that block stored
        self._prefilling: dict[tuple[str, int], list[Reservation]] = {}
        self._prefill_entries = 0  # reservations listed in _prefilling, ended ones included
        self._prefill_sweep_at = 1024

    def chain_of(self, request: PromptRequest) -> list[int]:
        """Token keys: none until the engines' block size is known, or if the prompt could not be
        tokenized."""
        if request.chain is None:
            index = self.index
            if request.tokens is None:
                self._shared.stats.untokenized += 1
            if request.tokens is None or index.block_size is None:
                request.chain = []
            else:
                # An adapter's blocks carry its name: known from the engines' events or listings
                # (an adapter not seen in events yet must not be keyed as the base model)
                model = request.model
                known = model in index.lora_names or self._shared.adapters.adapter_of(model) is not None
                lora = model if known else None
                extras = _extra_keys(lora, request.cache_salt, len(request.tokens) // index.block_size)
                request.chain = self.hasher.chain(request.tokens, index.block_size, extras)
        return request.chain

    def block_tokens(self) -> float:
        return float(self.index.block_size or 0)

    def picture(
        self, chain: Sequence[int], candidates: Sequence[str], home: str | None, now: float
    ) -> tuple[dict[str, int], Mapping[str, int], str | None]:
        picture = self.index.lookup(chain, candidates, now)
        return picture, picture, home

    def routed(self, request: PromptRequest, decision: Decision, reservation: Reservation, now: float) -> int:
        """The blocks are pending there until the engine confirms them; what it confirmed already
        is the prediction."""
        backend = reservation.backend
        chain = self.chain_of(request)
        predicted = self.index.confirmed(chain, backend)
        self.index.learn(chain, backend, now)  # its turnover is counted as the engine stores it
        if predicted < len(chain):
            self._await_prefill((backend, chain[-1]), reservation)
        return predicted

    def hold_prefill(self, request: PromptRequest, reservation: Reservation) -> None:
        chain = self.chain_of(request)
        if chain and self.index.confirmed(chain, reservation.backend) < len(chain):
            self._await_prefill((reservation.backend, chain[-1]), reservation)

    def _await_prefill(self, block: tuple[str, int], reservation: Reservation) -> None:
        """Hold the reservation's prefill until the engine stores the prompt's last block (streaming
        responses start before the prefill, so the response start says nothing). Entries of requests
        that ended are swept from time to time, so the table stays bounded by the requests in flight.
        The sweep counts entries, not blocks: requests repeating one prompt share its block's list,
        which grew without end where the engine never reported that block (already cached there)."""
        self._prefilling.setdefault(block, []).append(reservation)
        self._prefill_entries += 1
        if self._prefill_entries > self._prefill_sweep_at:  # amortized: the next sweep waits for twice as many
            waiting = ((key, [r for r in held if not r.finished]) for key, held in self._prefilling.items())
            self._prefilling = {key: held for key, held in waiting if held}
            self._prefill_entries = sum(len(held) for held in self._prefilling.values())
            self._prefill_sweep_at = 2 * self._prefill_entries + 1024

    def response_started(
        self, reservation: Reservation, request: PromptRequest | None, start: ResponseStart, success: bool
    ) -> None:
        """The engine's events release the prefill, not the response start, unless the start says
        it is over or will not happen there."""
        if not _may_prefill(reservation, request, start, success):
            reservation.release_prefill()

    def learn(self, request: PromptRequest, backend: str, now: float) -> tuple[int, list[int] | None]:
        """The engine's events say what it holds: nothing is learned from routing."""
        return 0, None

    def peer_learned(self, chain: Sequence[int], backend: str, when: float) -> None:
        """Every replica follows the engines' own events: a sibling's learning adds nothing."""

    def set_capacity(self, backend: str, kv_tokens: int) -> None:
        """The engine's events bound the picture: its size is not needed."""

    def forget_capacity(self, backend: str) -> None:
        """(Nothing kept.)"""

    def make_room(self, backend: str, held: Sequence[int], blocks: int, now: float) -> None:
        """The engine's events report what its prefill evicts, when it does."""
        return None

    def engine_sample(self, backend: str, sample: EngineSample) -> None:
        index = self.index
        if index.block_size is None and sample.block_size:
            index.block_size = sample.block_size  # from vllm:cache_config_info, before any event

    def engine_event(self, backend: str, event: BlockStored | BlockRemoved, now: float) -> bool:
        """Stores and removals feed the index; what a store adds is the cache's turnover (churn.py),
        the same for every replica, since all follow the same events (and counting other clients'
        traffic too), where counting its own routing left each replica blind to its siblings'."""
        try:
            if isinstance(event, BlockStored):
                added = self.index.stored(backend, event)
                if added:
                    self._shared.churn.add(backend, len(added), now)
                for key in added:
                    released = self._prefilling.pop((backend, key), ())
                    self._prefill_entries -= len(released)
                    for reservation in released:
                        if not reservation.finished:
                            self._shared.prefilled.append(reservation)
                        reservation.release_prefill()
            else:
                self.index.removed(backend, event)
        except (ValueError, OverflowError, TypeError):  # inconsistent sizes, token ids out of range
            return False
        return True

    def resets_on_lost_events(self, reason: Reset) -> bool:
        return True  # the picture was the events: without them it is unknown

    def reconfigure(self, settings: Settings, rehash: bool) -> None:
        if rehash:
            self.hasher = TokenHasher(settings.hash_key)
            self.index = PreciseIndex(self.hasher, PRECISE_MAX_BLOCKS)

    def leave(self) -> None:
        """Another mode takes over: prefill held until the engine stores a prompt's last block is
        released now, as the next mode's picture will not look for it."""
        for held in self._prefilling.values():
            for reservation in held:
                reservation.release_prefill()
        self._prefilling.clear()
        self._prefill_entries = 0


def _may_prefill(reservation: Reservation, request: PromptRequest | None, start: ResponseStart, success: bool) -> bool:
    """Whether the request's prefill may still be running at its response's start: a streamed 2xx
    from the backend it was sent to (vLLM sends a stream's headers at once). A response that is not
    streamed starts after its prefill; an error, or another backend serving (a retry), says this
    engine will not do it."""
    return success and request is not None and request.stream and start.upstream in ("", reservation.backend)


def _extra_keys(lora: str | None, salt: str | None, blocks: int) -> list[bytes]:
    """Each block's extra keys as vLLM publishes them: the LoRA adapter's name on every block, the
    cache salt on the first one only."""
    if lora is None:
        return [extra_digest((salt,))] if salt else []
    first = extra_digest((lora, salt) if salt else (lora,))
    return [first] + [extra_digest((lora,))] * (blocks - 1) if blocks else []
