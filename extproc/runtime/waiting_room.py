"""Flow control on the event loop: a request that finds every backend saturated waits here, and
the adapter answers Envoy only when its turn comes (as the endpoint picker does).

The queue's order and bounds are the core's (`extproc/core/flow.py`), saturation too
(`extproc/core/saturation.py`); this module only turns them into waiting coroutines. A request
goes at once when nothing is held and some backend has room; otherwise it joins the queue, so a
newcomer never overtakes a held request. One held request is dispatched at a time: it reserves its
backend (`started`) before the next is weighed, so a freed slot is never given twice. A tick
expires requests held past their TTL and catches room that opened without a release (an engine
sample, a backend added). The routing decision is made when a request is dispatched, on the
state then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.core.backends import Backend
from extproc.core.flow import FlowQueue, Held, QueueLimits, Refusal, State
from extproc.core.objectives import RequestClass
from extproc.core.settings import Settings

log = logging.getLogger(__name__)

TICK_S = 0.05  # how often held requests are looked at without a release
OTHER_FLOWS = "other"  # the metric label of every flow queue_metric_flows does not name
STALLED_S = 1.0  # a dispatched request that has not reserved its backend by then no longer blocks the next


class WaitingRoomMetrics:
    """Flow control's metrics, by priority band (flow labels are left to a bounded scheme)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.held = Gauge("kvroute_queue_requests", "Requests held by flow control", ["priority"], registry=registry)
        self.outcomes = Counter(
            "kvroute_queue_outcomes",
            "Requests that met flow control, by how they left it: now (never held), dispatched, "
            "expired, evicted, cancelled, band_full, queue_full",
            ["priority", "outcome"],
            registry=registry,
        )
        self.flow_outcomes = Counter(
            "kvroute_queue_flow_outcomes",
            "Requests flow control held, by flow (only the flows queue_metric_flows names; the rest as "
            "'other') and how they left it",
            ["flow", "outcome"],
            registry=registry,
        )
        self.flow_cost = Counter(
            "kvroute_queue_flow_cost_tokens",
            "Cost (uncached prompt tokens plus expected output) of the held requests dispatched, by flow: "
            "each flow's share of what was served while the fleet was saturated",
            ["flow"],
            registry=registry,
        )
        self.flow_held = Gauge(
            "kvroute_queue_flow_requests",
            "Requests held by flow control, by flow (only the flows queue_metric_flows names; the rest as 'other')",
            ["flow"],
            registry=registry,
        )
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.wait_seconds = Histogram(
            "kvroute_queue_wait_seconds", "Time held before dispatch", ["priority"], buckets=buckets, registry=registry
        )
        self.flow_wait_seconds = Histogram(
            "kvroute_queue_flow_wait_seconds",
            "Time held before dispatch, by flow (only the flows queue_metric_flows names; the rest as 'other')",
            ["flow"],
            buckets=buckets,
            registry=registry,
        )


class WaitingRoom:
    """Holds requests while the fleet is saturated."""

    def __init__(
        self,
        settings: Callable[[], Settings],
        room: Callable[[Sequence[Backend]], bool],
        metrics: WaitingRoomMetrics,
        clock: Callable[[], float],
        fleet: Callable[[], Sequence[Backend]] = tuple,
    ) -> None:
        """`room(candidates)`: whether one of them can take a request now. `fleet()`: the pool's
        routable backends now; a request held for all of them waits for room among those of its
        turn, not those of its arrival (a backend added meanwhile counts, one gone does not)."""
        self._settings = settings
        self._room = room
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock
        self._limits = self._limits_of(settings())
        self._weights = settings().flow_weights
        self._queue = FlowQueue(self._limits, dict(self._weights))
        # each held request's wake-up and its own candidates (whose room its turn waits for; None:
        # the whole fleet, as it is at the turn)
        self._waiting: dict[Held, tuple[asyncio.Future[State], Sequence[Backend] | None]] = {}
        self._labels: dict[Held, str] = {}  # each held request's flow label, as counted when it came
        self._holding = asyncio.Event()  # set while anything is held: `run` sleeps on it otherwise
        # the request dispatched last and when, until it has reserved its backend
        self._dispatching: tuple[Held, float] | None = None
        self._closing = False

    def __len__(self) -> int:
        return len(self._queue)

    # What the replica link shares with the siblings (its FlowShares): the queue's fairness and
    # bound, and its heads as far as they can run now.

    def shares(self) -> tuple[dict[int, dict[str, float]], int]:
        return self._queue.shares()

    def flow_names(self) -> Iterator[str]:
        return self._queue.flow_names()

    def heads(self) -> dict[int, float]:
        """A held request whose own candidates are saturated while some of the fleet has room
        (its model's backends are full) is no head: siblings would leave it turns it cannot take.
        With the whole fleet saturated every held one is, so that a freed slot goes to the
        fleet's next turn, not to whichever replica sees it first."""
        if not len(self._queue):
            return {}
        fleet = self._fleet()
        if not self._room(fleet):
            return self._queue.heads()
        return self._queue.heads(self._eligibility(fleet, True))  # the fleet judged once

    def set_peers(
        self, attained: Mapping[int, Mapping[str, float]], held: int, heads: Mapping[int, float] | None = None
    ) -> None:
        self._queue.set_peers(attained, held, heads)

    @staticmethod
    def _limits_of(settings: Settings) -> QueueLimits:
        return QueueLimits(
            max_requests=settings.queue_max_requests,
            max_bytes=settings.queue_max_bytes,
            max_total=settings.queue_max_requests,
            ttl_s=settings.queue_ttl_s,
            max_flows=settings.queue_max_flows,
        )

    def state(self) -> dict[str, object]:
        """For /debug/state (the control port, authenticated: flow names may show)."""
        waiting = self._queue.waiting()
        return {"held": len(self._queue), "bands": {str(band): flows for band, flows in waiting.items()}}

    def goes_now(self, candidates: Sequence[Backend]) -> bool:
        """The request need not wait: flow control is off, none of its candidates is healthy
        (the router answers that at once), or nothing is held and one of them has room.
        Otherwise `wait` for its turn."""
        if not self._settings().flow_control or not any(b.healthy for b in candidates):
            return True
        if self._busy(candidates):
            return False
        self._metrics.outcomes.labels("any", "now").inc()
        return True

    def may_hold(self, candidates: Sequence[Backend]) -> bool:
        """A request arriving now would be held (counted nowhere): the adapter marks such a
        request pending, so that if kvroute dies while holding it the gateway does not send it
        on unrouted. One that comes while the fleet has room is not marked: a kvroute that dies
        in the milliseconds before its decision lets it go on unrouted (fail open) instead of
        answering it 503."""
        settings = self._settings()
        return settings.flow_control and any(b.healthy for b in candidates) and self._busy(candidates)

    def _busy(self, candidates: Sequence[Backend]) -> bool:
        return bool(len(self._queue)) or self._dispatching is not None or not self._room(candidates)

    async def wait(
        self, request_class: RequestClass, cost: float, size: int, candidates: Sequence[Backend]
    ) -> Held | Refusal:
        """Hold the request until its turn, or refuse it. A returned Held that is DISPATCHED must
        be passed to `started` once it has reserved its backend; EXPIRED or EVICTED, or a
        Refusal: answer 429. A cancelled caller (the client left) frees its place at once."""
        priority = str(request_class.priority)
        if self._closing:  # stopping: counted as what it is answered
            self._metrics.outcomes.labels(priority, Refusal.QUEUE_FULL.value).inc()
            return Refusal.QUEUE_FULL
        self._reconfigure(self._settings())
        now = self._clock()
        held = self._queue.hold(request_class.priority, request_class.flow, cost, size, now, request_class.ttft_s)
        if isinstance(held, Refusal):
            self._ended(now)
            self._metrics.outcomes.labels(priority, held.value).inc()
            self._metrics.flow_outcomes.labels(self._flow_label(request_class.flow), held.value).inc()
            return held
        future: asyncio.Future[State] = asyncio.get_running_loop().create_future()
        self._waiting[held] = (future, None if candidates is self._fleet() else candidates)
        self._holding.set()
        self._metrics.held.labels(priority).inc()
        label = self._labels[held] = self._flow_label(held.flow)
        self._metrics.flow_held.labels(label).inc()
        # Registered before anything ends: a request whose deadline is already past (an objective
        # or a TTL shorter than the clock's step) is answered through its future like any other.
        self._ended(now)
        self.pump()
        try:
            await future
        except asyncio.CancelledError:
            if self._queue.cancel(held):
                self._left(held)
                self._count(held, State.CANCELLED.value)
            else:
                self.started(held)  # its turn came as it left: the next one's turn now
            raise
        finally:
            self._waiting.pop(held, None)
        if held.state is State.DISPATCHED:
            waited = self._clock() - held.arrived
            self._metrics.wait_seconds.labels(priority).observe(waited)
            self._metrics.flow_wait_seconds.labels(label).observe(waited)
        return held

    def started(self, held: Held) -> None:
        """This dispatched request reserved its backend (or gave up): weigh the next one. Only
        the request being dispatched clears the way, so a late call can never let two run."""
        if self._dispatching is not None and self._dispatching[0] is held:
            self._dispatching = None
            self.pump()

    def pump(self) -> None:
        """Dispatch the next held request whose own candidates have room now. Requests for the same
        candidates (the pool's own tuple, when every backend serves their model) are weighed once
        per pump: the queue asks for each flow's head, and with every backend full a thousand
        backends' saturation judged for each of 256 flows held the loop 117 ms."""
        while self._dispatching is None and len(self._queue):
            fleet = self._fleet()
            room = self._room(fleet) if fleet else None
            if room is False and self._settings().flow_control:  # every request's candidates are of
                return  # the fleet: none can run, and no pass over the queue says so (3 ms at 4,096 held)
            held = self._queue.pop(self._eligibility(fleet, room), self._clock())
            if held is None:
                return
            self._dispatching = (held, self._clock())
            self._finish(held)

    def _eligibility(self, fleet: Sequence[Backend] | None = None, room: bool | None = None) -> Callable[[Held], bool]:
        """Whether a held request can run now: some of its own candidates have room. Each set of
        candidates is judged once per call of this (see `pump`); `fleet` and its `room`, where the
        caller has just judged them."""
        waiting = self._waiting
        if fleet is None:
            fleet = self._fleet()
        # candidates (by identity: alive while held) -> room now
        answers: dict[int, bool] = {} if room is None else {id(fleet): room}
        released = not self._settings().flow_control  # turned off while requests were held: they all go

        def eligible(held: Held) -> bool:
            entry = waiting.get(held)
            if entry is None or entry[0].done():  # its client left: it leaves the queue at its next turn
                return False
            if released:
                return True
            candidates = fleet if entry[1] is None else entry[1]
            room = answers.get(id(candidates))
            if room is None:
                room = answers[id(candidates)] = self._room(candidates)
            return room

        return eligible

    def _ended(self, now: float) -> None:
        for held in self._queue.ended(now):
            self._finish(held)

    def _flow_label(self, flow: str) -> str:
        return flow if flow in self._settings().queue_metric_flows else OTHER_FLOWS

    def _count(self, held: Held, outcome: str) -> None:
        flow = self._flow_label(held.flow)
        self._metrics.outcomes.labels(str(held.band), outcome).inc()
        self._metrics.flow_outcomes.labels(flow, outcome).inc()
        if outcome == State.DISPATCHED.value:
            self._metrics.flow_cost.labels(flow).inc(held.cost)

    def _left(self, held: Held) -> None:
        """Out of the queue: the held gauges drop, by the labels it was counted under."""
        self._metrics.held.labels(str(held.band)).dec()
        self._metrics.flow_held.labels(self._labels.pop(held, OTHER_FLOWS)).dec()

    def _finish(self, held: Held) -> None:
        self._left(held)
        self._count(held, held.state.value)
        waiter = self._waiting.get(held)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_result(held.state)
        elif held.state is State.DISPATCHED and self._dispatching is not None and self._dispatching[0] is held:
            self._dispatching = None  # nobody waits for it any more: `pump` goes on to the next

    def _reconfigure(self, settings: Settings) -> None:
        limits = self._limits_of(settings)
        if limits != self._limits:  # a policy changed them: they apply to what arrives from now on
            self._limits = self._queue.limits = limits
        if settings.flow_weights != self._weights:
            self._weights = settings.flow_weights
            self._queue.set_weights(dict(self._weights))

    async def run(self) -> None:
        """Expire held requests past their TTL and dispatch into room that opened on its own,
        every TICK_S while anything is held; with nothing held it waits for the next (a 20 Hz
        timer alone cost an idle ext_proc about half its CPU: docs/benchmarks.md)."""
        while True:
            if not len(self._queue):
                self._holding.clear()
                await self._holding.wait()
            await asyncio.sleep(TICK_S)
            try:
                self._tick()
            except Exception:  # one bad tick must not stop expiry for good
                log.exception("flow control's tick failed")

    def _tick(self) -> None:
        if not len(self._queue):
            return
        now = self._clock()
        if self._dispatching is not None and now - self._dispatching[1] > STALLED_S:
            log.warning("a dispatched request never reserved its backend; dispatching the next")
            self._dispatching = None
        self._ended(now)
        self.pump()

    def drain(self) -> None:
        """A graceful stop: answer everything held (429) rather than leave it to a cut stream, and
        refuse what comes after."""
        self._closing = True
        for held in self._queue.evict_all():
            self._finish(held)
