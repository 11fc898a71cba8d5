"""The values an adapter exchanges with the routing core: what the gateway saw when a response
began (`ResponseStart`), the core's reading of it (`Outcome`), the handle kept per request
(`Exchange`), why a backend's picture was dropped (`Reset`), and what the core did and holds
(`Stats`, `RouterState`), for metrics and /debug/state. Protocol-neutral: the Envoy processor
and the HTTP lease API both speak only these."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from extproc.core.calibration import BytesPerToken
from extproc.core.decision import Decision, Label
from extproc.core.engine import AllBlocksCleared, BlockRemoved, BlockStored
from extproc.core.index import Room
from extproc.core.load import Reservation
from extproc.core.request import PromptRequest
from extproc.core.sessions import Context


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

    __slots__ = (
        "_ended",
        "_ratio",
        "decision",
        "outcome",
        "predicted_blocks",
        "queued",
        "request",
        "reservation",
        "room",
        "routed",
        "unsent",
    )

    def __init__(
        self,
        request: PromptRequest | None,
        decision: Decision,
        reservation: Reservation | None = None,
        predicted_blocks: int = 0,
        ratio: BytesPerToken | None = None,
    ) -> None:
        self.request = request
        self.decision = decision
        self.reservation = reservation  # the load it puts on its backend until released (load.py)
        self.room: Room | None = None  # its unlearned blocks' room in the picture (Router.sent)
        # Router.sent bound its session ahead of the outcome: the binding it replaced (its
        # backend and its last prompt's Context; "" if none), put back should the request not be served
        self.unsent: tuple[str, Context] | None = None
        self.predicted_blocks = predicted_blocks  # leading blocks expected cached where it was sent
        self.outcome: Outcome | None = None
        self.queued = False  # flow control held it before it was decided
        # Counted in the reuse account (attribution.py): the backend that served it and the tokens
        # kvroute's picture showed cached there, until the engine's own count of them is read.
        self.routed: tuple[str, float] | None = None
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
        if self.reservation is not None:
            self.reservation.finish()
        if self.room is not None:
            self.room.give_back()
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


@dataclass(frozen=True, slots=True)
class BackendState:
    """One backend's load as the core holds it."""

    reserved_blocks: int  # prefill kvroute's own requests reserved there
    active: int  # kvroute's own requests in flight there
    peer_reserved_blocks: int  # sibling replicas' reservations, as last published
    peer_active: int
    footprint_blocks: int  # distinct blocks of the prompts of kvroute's own requests in flight there (KV room)
    peer_footprint_blocks: int  # the siblings', as last published
    engine_requests: int  # running + waiting at the engine's last sample
    engine_kv_usage: float  # share of its KV blocks running requests pin


@dataclass(frozen=True, slots=True)
class RouterState:
    """Sizes, load and what the adaptive rules conclude now: one snapshot, read by attribute."""

    index: str  # the index mode's name
    index_entries: int
    index_shed: int  # locations dropped to keep the index within its memory bound, so far
    index_entries_by_backend: dict[str, int]
    sessions: int
    load: dict[str, BackendState]
    resets: dict[str, int]
    bytes_per_token: float
    prediction_trust: dict[str, float]  # backends trusted less than fully
    prefix_homes: int
    cache_pressure: float  # share of their last prompt returning conversations find evicted
    gate_factor: float  # how much the balance gates are widened while no candidate is idle
    engine_events: dict[str, int]
    reuse: dict[str, float | None]  # prefix reuse available, routed, delivered (attribution.py)

    def as_json(self) -> dict[str, Any]:
        """For /debug/state."""
        return asdict(self)
