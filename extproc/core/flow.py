"""Flow control's queue: which held request runs next once a backend has room, and which are
refused instead of held.

When no candidate can take a request now, the adapter holds it here instead of sending it to wait
inside an engine, where nothing can reorder it. Dispatch order:

- strict priority between bands (an `InferenceObjective`'s priority; below zero is sheddable);
- within a band, fair share between flows by the cost they were served (uncached prompt tokens
  plus expected output, divided by the flow's weight): the backlogged flow that has attained the
  least goes next. A flow that comes back after idling starts level with the least-served
  backlogged flow, so idling banks no credit;
- within a flow, earliest deadline first: a request's TTFT objective, else its band's TTL (so
  requests without an objective go in arrival order, and an objective only moves a request ahead
  of those that would expire before it). A sheddable request (priority below zero) expires at its
  objective: held past it, it would be refused when dispatched anyway (SLO admission).

Bounds: each band holds at most `max_requests` and `max_bytes`; past its TTL a held request
expires (the adapter answers 429; `ended` lists them). The queue as a whole holds at most
`max_total`; when full, a request evicts the newest held request of the lowest sheddable band
below its own priority. Still full (or its band is), a request of a flow holding fewer in its band
than another flow there takes the place of that flow's newest (evicted, answered 429), so one
flow cannot keep the others out by filling the queue first; else it is refused. At most
`max_flows` distinct flows are tracked per band; later ones share one overflow flow, so a flood
of distinct flow ids can neither grow memory nor starve the flows already known; the default flow
and the flows the policy weighs are never lumped in with them nor forgotten (they are few, and
named by the operator, not by clients).

Fleet-wide: sibling replicas exchange each flow's attained cost and their held counts (`shares`,
`set_peers`), so a flow's turn counts what every replica served it and `max_total` bounds what
the fleet holds; without them each replica keeps its own share.
Pure: the caller supplies the clock and does the waiting.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from extproc.core.objectives import DEFAULT_FLOW

OVERFLOW_FLOW = "other"  # the flow of every flow id beyond `max_flows` in a band
COMPACT_AT = 64  # requests that left the queue, kept in its lists until they reach a head, before a sweep
YIELD_S = 0.3  # a turn that is a sibling replica's is left to it this long (its news comes every 0.1 s)
YIELD_MARGIN = 1.0  # tokens of attained cost within which two flows' turns are equal: no yielding on ties
SCAN_DEPTH = 64  # past a head that cannot run, how many of its flow's next requests are weighed
# The least a request is charged to its flow, in tokens: one that costs nothing by its count (its
# prompt all cached, max_tokens 0) still takes an engine step, and at no cost its flow's share
# would never grow, so it would take every turn in its band while it held requests.
MIN_COST = 16.0


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How much the queue may hold, and for how long."""

    max_requests: int = 1024  # held per band
    max_bytes: int = 256 << 20  # request bodies held per band
    max_total: int = 4096  # held in all bands together
    ttl_s: float = 30.0  # longest a request is held before it is answered 429
    max_flows: int = 256  # distinct flows tracked per band


class State(StrEnum):
    """Where a held request is."""

    WAITING = "waiting"
    DISPATCHED = "dispatched"
    CANCELLED = "cancelled"  # the client left
    EXPIRED = "expired"  # held past its band's TTL
    EVICTED = "evicted"  # made room for a request of higher priority, or of a flow holding fewer


class Refusal(StrEnum):
    """Why a request was not held: the adapter answers 429."""

    BAND_FULL = "band_full"
    QUEUE_FULL = "queue_full"


class Held:
    """One request waiting for room. The adapter keeps it to cancel it or to learn its fate."""

    __slots__ = ("arrived", "band", "cost", "deadline", "flow", "seq", "size", "state")

    def __init__(self, band: int, flow: str, cost: float, size: int, arrived: float, deadline: float, seq: int):
        self.band = band
        self.flow = flow
        self.cost = cost
        self.size = size
        self.arrived = arrived
        self.deadline = deadline
        self.seq = seq
        self.state = State.WAITING

    def __lt__(self, other: Held) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class _Flow:
    __slots__ = ("attained", "held", "served", "stale", "waiting", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.held = 0  # its requests waiting here
        self.served = 0.0  # cost dispatched here, over the weight: what the siblings are told
        self.attained = 0.0  # `served` plus the levelling it got coming back from idle (this replica's own)
        self.waiting: list[Held] = []  # a heap by (deadline, seq); cancelled entries are skipped lazily
        self.stale = 0  # entries taken from behind its head, left in the heap until the next rebuild

    def head(self) -> Held | None:
        waiting = self.waiting
        while waiting and waiting[0].state is not State.WAITING:
            heapq.heappop(waiting)
        return waiting[0] if waiting else None

    def first(self, eligible: Callable[[Held], bool] | None) -> Held | None:
        """The earliest-deadline request that can run now: the head, or when it cannot (its
        model's backends are saturated) the next one that can, among the first SCAN_DEPTH, so one
        model's saturation does not hold another's requests in the same flow."""
        head = self.head()
        if head is None or eligible is None or eligible(head):
            return head
        # The heap's smallest entries after its head, walked best first through its tree: the
        # work is SCAN_DEPTH's, not the flow's length (a heap of thousands is read in part).
        waiting = self.waiting
        frontier = [(waiting[i], i) for i in (1, 2) if i < len(waiting)]
        heapq.heapify(frontier)
        for _ in range(SCAN_DEPTH - 1 + self.stale):  # (the taken ones walked over, not weighed)
            if not frontier:
                break
            held, index = heapq.heappop(frontier)
            if held.state is State.WAITING and eligible(held):
                return held
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(waiting):
                    heapq.heappush(frontier, (waiting[child], child))
        return None

    def take(self, held: Held) -> None:
        """Out of the heap: the head popped; another left where it is, passed over once no longer
        waiting, and the heap rebuilt once COMPACT_AT are (removing each, a heap rebuilt each time,
        cost the flow's length at every dispatch: 2.8 ms at 16,000 held)."""
        if self.waiting[0] is held:
            heapq.heappop(self.waiting)
            return
        self.stale += 1
        if self.stale > COMPACT_AT:
            self.waiting = [h for h in self.waiting if h is not held and h.state is State.WAITING]
            heapq.heapify(self.waiting)
            self.stale = 0


class _Newest:
    """A band's waiting requests newest first, flow by flow, read in one pass from the newest
    arrival back: each flow's next is at hand, or found by reading on (bucketing the others)."""

    __slots__ = ("_arrivals", "_by_flow")

    def __init__(self, arrivals: deque[Held]) -> None:
        self._arrivals = reversed(arrivals)
        self._by_flow: dict[str, deque[Held]] = {}

    def of(self, flow: str) -> Held | None:
        """The newest waiting request of `flow` not yet handed out."""
        bucket = self._by_flow.get(flow)
        if bucket:
            return bucket.popleft()
        for held in self._arrivals:
            if held.state is not State.WAITING:
                continue
            if held.flow == flow:
                return held
            self._by_flow.setdefault(held.flow, deque()).append(held)
        return None


class _Band:
    __slots__ = ("arrivals", "bytes", "floor", "flows", "held")

    def __init__(self) -> None:
        self.flows: OrderedDict[str, _Flow] = OrderedDict()  # least recently used first
        self.arrivals: deque[Held] = deque()  # in arrival order, for expiry and eviction
        self.held = 0
        self.bytes = 0
        self.floor = 0.0  # the score of the flow dispatched last: where one back from idle starts

    def backlogged(self) -> Iterator[tuple[str, _Flow]]:
        return ((name, flow) for name, flow in self.flows.items() if flow.head() is not None)


class FlowQueue:
    """Held requests in bands of priority and flows within them."""

    def __init__(self, limits: QueueLimits, weights: Mapping[str, float] | None = None) -> None:
        self.limits = limits
        self.weights = dict(weights or {})  # flow -> weight (default 1)
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # band priorities, highest first
        self._seq = itertools.count()
        self._total = 0
        self._evicted: list[Held] = []
        self._peer_attained: Mapping[int, Mapping[str, float]] = {}  # band -> flow -> siblings' served
        self._peer_held = 0  # requests the sibling replicas hold
        # band -> the least fleet-wide attained cost of a flow a sibling holds a request of: the
        # turn that is a sibling's; and since when this queue has yielded a turn to one (pop)
        self._peer_heads: Mapping[int, float] = {}
        self._yielding_since: float | None = None

    def __len__(self) -> int:
        return self._total

    def hold(
        self, priority: int, flow: str, cost: float, size: int, now: float, ttft_s: float | None = None
    ) -> Held | Refusal:
        """Hold a request of this band and flow, costing `cost` tokens and `size` body bytes; or
        say why not. `ttft_s`: its TTFT objective, which orders it within its flow."""
        limits = self.limits
        band = self._band(priority)
        if size > limits.max_bytes:
            return Refusal.BAND_FULL
        name = self._flow_name(band, flow)  # (past max_flows, the overflow flow it joins is weighed)
        if self._band_full(band, size) and not self._push_out(band, name, size):
            return Refusal.BAND_FULL
        if (
            self._total + self._peer_held >= limits.max_total
            and not self._evict_below(priority)
            and not self._push_out(band, name, size)
        ):
            return Refusal.QUEUE_FULL
        deadline = now + (limits.ttl_s if ttft_s is None else min(ttft_s, limits.ttl_s))
        held = Held(priority, name, max(cost, MIN_COST), size, now, deadline, next(self._seq))
        state = self._flow(band, held.flow)
        if state.head() is None:  # back from idle: level with the least served of those waiting (or
            # with the last one dispatched, when none waits), so idling banks no credit
            least = min(self._scores(priority, band), default=band.floor)
            state.attained = max(state.attained, least - self._peer_attained.get(priority, {}).get(held.flow, 0.0))
        heapq.heappush(state.waiting, held)
        state.held += 1
        band.arrivals.append(held)
        band.held += 1
        band.bytes += size
        self._total += 1
        return held

    def pop(self, eligible: Callable[[Held], bool] | None = None, now: float | None = None) -> Held | None:
        """The request to dispatch next (strict priority, then the least served flow, then the
        earliest deadline), charged to its flow; None when nothing waits. `eligible`: whether a
        request can run now (some of its own candidates have room); one that cannot is passed
        over for the next one of its flow that can (`_Flow.first`), else for the next flow's, so
        requests for a saturated model do not block another's.

        With siblings (`set_peers`), a turn that is a sibling's (it holds a request of a higher
        band, or of a flow the fleet has served less) is left to it: None, for up to `YIELD_S`
        from `now`, so the sibling sees the room and takes it; after that (the sibling's news
        was stale, or its request cannot run here) this queue's own goes."""
        for priority in self._order:
            band = self._bands[priority]
            if not band.held:
                continue
            peers = self._peer_attained.get(priority, {})
            ranked = sorted(band.backlogged(), key=lambda item: item[1].attained + peers.get(item[0], 0.0))
            for name, flow in ranked:
                held = flow.first(eligible)
                if held is None:
                    continue
                if now is not None and self._yields(priority, flow.attained + peers.get(name, 0.0), now):
                    return None
                self._yielding_since = None
                flow.take(held)
                band.flows.move_to_end(name)
                band.floor = flow.attained + peers.get(name, 0.0)
                flow.attained += held.cost / flow.weight
                flow.served += held.cost / flow.weight
                self._leave(held, State.DISPATCHED)
                return held
        return None

    def _yields(self, priority: int, attained: float, now: float) -> bool:
        """This turn is a sibling's, and it has not been left to it for `YIELD_S` yet."""
        heads = self._peer_heads
        if not heads:
            return False
        theirs = any(band > priority for band in heads) or heads.get(priority, float("inf")) < attained - YIELD_MARGIN
        if not theirs:
            self._yielding_since = None
            return False
        if self._yielding_since is None:
            self._yielding_since = now
        return now - self._yielding_since < YIELD_S

    def cancel(self, held: Held) -> bool:
        """The client left: its slot is free at once. True if it was still waiting."""
        if held.state is not State.WAITING:
            return False
        self._leave(held, State.CANCELLED)
        return True

    def ended(self, now: float) -> list[Held]:
        """Requests that left the queue undispatched since the last call: held past their band's
        TTL, or a sheddable one past its TTFT objective, which it can no longer meet (expired,
        now); or evicted for another. Answer each 429."""
        ended, self._evicted = self._evicted, []
        cutoff = now - self.limits.ttl_s
        for priority, band in self._bands.items():
            if priority < 0:  # sheddable: each flow's heap is in deadline order
                for flow in band.flows.values():
                    while (head := flow.head()) is not None and head.deadline <= now:
                        self._leave(head, State.EXPIRED)
                        ended.append(head)
            arrivals = band.arrivals
            while arrivals and (arrivals[0].state is not State.WAITING or arrivals[0].arrived <= cutoff):
                held = arrivals.popleft()
                if held.state is State.WAITING:
                    self._leave(held, State.EXPIRED)
                    ended.append(held)
        return ended

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New weights (flow -> weight, others 1), for the flows known and those to come."""
        self.weights = dict(weights)
        for band in self._bands.values():
            for name, flow in band.flows.items():
                flow.weight = self.weights.get(name, 1.0)

    def shares(self) -> tuple[dict[int, dict[str, float]], int]:
        """What the sibling replicas need to share this queue's fairness and bound: each band's
        flows' cost served here (over their weights; the levelling stays local, or two replicas
        would count it twice), and the requests held here."""
        served = {p: {n: f.served for n, f in band.flows.items() if f.served} for p, band in self._bands.items()}
        return {p: flows for p, flows in served.items() if flows}, self._total

    def flow_names(self) -> Iterator[str]:
        """Every flow tracked, in any band (a flow in two bands, twice)."""
        for band in self._bands.values():
            yield from band.flows

    def heads(self, eligible: Callable[[Held], bool] | None = None) -> dict[int, float]:
        """Per band holding requests here, the least fleet-wide attained cost of its flows that
        hold one: whose turn it would be here, for the siblings to leave it to this replica.
        `eligible` (as `pop` takes it): only flows holding a request that can run now count, or
        a head for a saturated model would have every sibling yield each of its turns to it."""
        out = {}
        for priority, band in self._bands.items():
            least = min(self._scores(priority, band, eligible), default=None)
            if least is not None:
                out[priority] = least
        return out

    def _scores(self, priority: int, band: _Band, eligible: Callable[[Held], bool] | None = None) -> Iterator[float]:
        """Each backlogged flow's fleet-wide attained cost in this band: what orders their turns
        (with `eligible`, of the flows holding a request that can run now)."""
        peers = self._peer_attained.get(priority, {})
        return (
            f.attained + peers.get(n, 0.0)
            for n, f in band.backlogged()
            if eligible is None or f.first(eligible) is not None
        )

    def set_peers(
        self, attained: Mapping[int, Mapping[str, float]], held: int, heads: Mapping[int, float] | None = None
    ) -> None:
        """The siblings' summed `shares`, replacing the last: a flow's turn then counts what every
        replica served it, and the queue's bound what every replica holds (fleet-wide). `heads`:
        per band the least of the siblings' `heads`."""
        self._peer_attained = attained
        self._peer_held = min(max(0, held), self.limits.max_total)
        self._peer_heads = heads or {}

    def evict_all(self) -> list[Held]:
        """Everything held leaves, evicted (a graceful stop: answer each 429)."""
        evicted = [h for band in self._bands.values() for h in band.arrivals if h.state is State.WAITING]
        for held in evicted:
            self._leave(held, State.EVICTED)
        return evicted

    def waiting(self) -> dict[int, dict[str, int]]:
        """Held requests per band and flow, for metrics and /debug/state."""
        counts: dict[int, dict[str, int]] = {}
        for priority in self._order:
            band = self._bands[priority]
            flows = {name: sum(1 for h in flow.waiting if h.state is State.WAITING) for name, flow in band.backlogged()}
            if flows:
                counts[priority] = flows
        return counts

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
            self._order = sorted(self._bands, reverse=True)
        return band

    def _flow_name(self, band: _Band, flow: str) -> str:
        named = self.weights
        if flow in band.flows or len(band.flows) < self.limits.max_flows or flow == DEFAULT_FLOW or flow in named:
            return flow
        idle = next(
            (
                name
                for name, f in band.flows.items()
                if name != OVERFLOW_FLOW and name != DEFAULT_FLOW and name not in named and f.head() is None
            ),
            None,
        )
        if idle is None:
            return OVERFLOW_FLOW
        del band.flows[idle]  # forget the least recently served idle flow: its credit was levelled anyway
        return flow

    def _flow(self, band: _Band, name: str) -> _Flow:
        flow = band.flows.get(name)
        if flow is None:
            flow = band.flows[name] = _Flow(self.weights.get(name, 1.0))
        return flow

    def _evict_below(self, priority: int) -> bool:
        """Make room for a request of `priority`: the newest waiting request of the lowest
        sheddable band below it goes. False when there is none."""
        for low in reversed(self._order):
            if low >= priority or low >= 0:
                return False
            band = self._bands[low]
            victim = next((h for h in reversed(band.arrivals) if h.state is State.WAITING), None)
            if victim is not None:
                self._leave(victim, State.EVICTED)
                self._evicted.append(victim)
                return True
        return False

    def _band_full(self, band: _Band, size: int) -> bool:
        return band.held >= self.limits.max_requests or band.bytes + size > self.limits.max_bytes

    def _push_out(self, band: _Band, flow: str, size: int) -> bool:
        """Room for a request of `flow` made from the flow holding most in its band: that flow's
        newest go (evicted, answered 429), as many as the room needs, while it would still hold
        more than `flow` then. False, and nothing evicted, when that cannot make room."""
        own = band.flows.get(flow)
        mine = own.held if own is not None else 0
        counts = {name: f.held for name, f in band.flows.items() if f.held and name != flow}
        # the heaviest flow first (of equals, the least recently served), kept in a heap: each
        # victim costs a log of the flows, not a pass over them
        order = {name: rank for rank, name in enumerate(counts)}
        heaviest = [(-count, order[name], name) for name, count in counts.items()]
        heapq.heapify(heaviest)
        newest = _Newest(band.arrivals)
        victims: list[Held] = []
        held, used, total = band.held, band.bytes, self._total + self._peer_held
        limits = self.limits
        while held >= limits.max_requests or used + size > limits.max_bytes or total >= limits.max_total:
            while heaviest and -heaviest[0][0] != counts[heaviest[0][2]]:
                heapq.heappop(heaviest)  # a count since lowered
            if not heaviest or -heaviest[0][0] < mine + 2:  # no flow would still hold more than this one
                return False
            heavy = heaviest[0][2]
            victim = newest.of(heavy)
            if victim is None:
                return False
            victims.append(victim)
            counts[heavy] -= 1
            heapq.heapreplace(heaviest, (-counts[heavy], order[heavy], heavy))
            held, used, total = held - 1, used - victim.size, total - 1
        for victim in victims:
            self._leave(victim, State.EVICTED)
            self._evicted.append(victim)
        return True

    def _leave(self, held: Held, state: State) -> None:
        held.state = state
        band = self._bands[held.band]
        flow = band.flows.get(held.flow)
        if flow is not None:
            flow.held -= 1
        band.held -= 1
        band.bytes -= held.size
        self._total -= 1
        if len(band.arrivals) > COMPACT_AT + 2 * band.held:  # requests that left, behind a waiting head
            band.arrivals = deque(h for h in band.arrivals if h.state is State.WAITING)
            for flow in band.flows.values():
                if len(flow.waiting) > COMPACT_AT:
                    flow.waiting = [h for h in flow.waiting if h.state is State.WAITING]
                    heapq.heapify(flow.waiting)
