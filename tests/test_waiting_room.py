"""Flow control on the event loop (extproc/runtime/waiting_room.py): holding, dispatching one at a
time, weights and priorities from the settings, cancellation and a graceful stop."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from extproc.core.backends import Backend
from extproc.core.flow import Held, Refusal, State
from extproc.core.objectives import RequestClass
from extproc.core.settings import Settings
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics
from extproc.units import priorities

BACKENDS = [Backend("10.0.0.1:8000")]


class Fleet:
    """Room for `slots` requests at a time; a dispatched request takes one until it ends."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running = 0

    def room(self, _backends: object) -> bool:
        return self.running < self.slots


def clock() -> float:
    return asyncio.get_running_loop().time()


def make(settings: Settings, fleet: Fleet, now: Callable[[], float] = clock) -> WaitingRoom:
    return WaitingRoom(lambda: settings, fleet.room, WaitingRoomMetrics(CollectorRegistry()), now)


def klass(flow: str, priority: int = 0) -> RequestClass:
    return RequestClass(priority, flow, None, None, True)


def test_a_request_goes_at_once_while_there_is_room_and_nothing_is_held():
    async def main() -> None:
        room = make(Settings(hash_key=bytes(16)), Fleet(1))
        assert room.goes_now(BACKENDS)
        off = make(Settings(hash_key=bytes(16), flow_control=False), Fleet(0))
        assert off.goes_now(BACKENDS)  # flow control off: never held

    asyncio.run(main())


def test_held_requests_run_one_at_a_time_by_weight_as_slots_free():
    async def main() -> None:
        fleet = Fleet(0)
        room = make(Settings(hash_key=bytes(16), flow_weights={"gold": 2}), fleet)
        order: list[str] = []

        async def request(flow: str) -> None:
            assert not room.goes_now(BACKENDS)
            held = await room.wait(klass(flow), 100, 10, BACKENDS)
            assert isinstance(held, Held) and held.state is State.DISPATCHED
            fleet.running += 1  # it reserved its backend
            order.append(flow)
            room.started(held)

        tasks = [asyncio.create_task(request(f)) for _ in range(6) for f in ("gold", "bronze")]
        await asyncio.sleep(0.01)
        assert len(room) == 12 and not order
        fleet.slots = 9  # room for nine
        room.pump()
        await asyncio.sleep(0.05)
        assert len(order) == 9 and len(room) == 3
        assert Counter(order) == {"gold": 6, "bronze": 3}  # two to one while both waited
        fleet.slots = 12
        room.pump()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_cancelled_request_frees_its_place_and_a_stop_answers_everything_held():
    async def main() -> None:
        settings = Settings(hash_key=bytes(16), queue_max_requests=2)
        room = make(settings, Fleet(0))
        first = asyncio.create_task(room.wait(klass("a"), 1, 1, BACKENDS))
        second = asyncio.create_task(room.wait(klass("a"), 1, 1, BACKENDS))
        await asyncio.sleep(0.01)
        assert await room.wait(klass("a"), 1, 1, BACKENDS) is Refusal.BAND_FULL
        first.cancel()
        await asyncio.sleep(0.01)
        assert len(room) == 1
        third = asyncio.create_task(room.wait(klass("a"), 1, 1, BACKENDS))
        await asyncio.sleep(0.01)
        room.drain()
        evicted = [await second, await third]
        assert all(isinstance(h, Held) and h.state is State.EVICTED for h in evicted) and len(room) == 0
        assert await room.wait(klass("a"), 1, 1, BACKENDS) is Refusal.QUEUE_FULL  # stopping: none held now

    asyncio.run(main())


def test_requests_whose_clients_left_in_the_turn_room_opened_are_cancelled_not_dispatched():
    """Many clients leave in one loop turn (their connections lost) and a slot frees in the same
    turn: none of them is dispatched, counted as such or charged to its flow, and the queue is
    passed over without one call stacked on another per request (a thousand gave RecursionError)."""

    async def main() -> None:
        fleet = Fleet(0)
        registry = CollectorRegistry()
        room = WaitingRoom(lambda: Settings(hash_key=bytes(16)), fleet.room, WaitingRoomMetrics(registry), clock)
        tasks = [asyncio.create_task(room.wait(klass("f"), 1.0, 10, BACKENDS)) for _ in range(1000)]
        await asyncio.sleep(0)
        assert len(room) == 1000
        for task in tasks:
            task.cancel()
        fleet.slots = 10**9
        room.pump()
        await asyncio.gather(*tasks, return_exceptions=True)
        outcomes = "kvroute_queue_outcomes_total"
        assert registry.get_sample_value(outcomes, {"priority": "0", "outcome": "cancelled"}) == 1000
        assert registry.get_sample_value(outcomes, {"priority": "0", "outcome": "dispatched"}) is None
        assert len(room) == 0 and not room._dispatching
        served = await room.wait(klass("f"), 1.0, 10, BACKENDS)  # and the next one held goes
        assert isinstance(served, Held) and served.state is State.DISPATCHED
        room.started(served)

    asyncio.run(main())


def test_held_requests_and_their_wait_are_counted_by_flow_under_bounded_labels():
    """Queue length and time held per flow, as per band: named only for the flows
    queue_metric_flows lists, every other as 'other'; back to 0 however each left."""

    async def main() -> None:
        registry = CollectorRegistry()
        fleet = Fleet(0)
        settings = Settings(hash_key=bytes(16), queue_metric_flows=("gold",))
        room = WaitingRoom(lambda: settings, fleet.room, WaitingRoomMetrics(registry), clock)

        def held(flow: str) -> float | None:
            return registry.get_sample_value("kvroute_queue_flow_requests", {"flow": flow})

        tasks = [asyncio.create_task(room.wait(klass(f), 1, 1, BACKENDS)) for f in ("gold", "tenant-x", "tenant-y")]
        await asyncio.sleep(0.01)
        assert (held("gold"), held("other"), held("tenant-x")) == (1, 2, None)
        tasks[2].cancel()
        await asyncio.sleep(0.01)
        assert held("other") == 1
        fleet.slots = 1
        room.pump()
        first = await asyncio.wait_for(asyncio.shield(tasks[0]), 5)  # gold: the first held
        assert isinstance(first, Held) and first.state is State.DISPATCHED
        waited = registry.get_sample_value("kvroute_queue_flow_wait_seconds_count", {"flow": "gold"})
        assert waited == 1 and held("gold") == 0
        room.drain()
        assert (await tasks[1]).state is State.EVICTED  # type: ignore[union-attr]
        assert held("gold") == held("other") == 0

    asyncio.run(main())


def test_objectives_priorities_come_from_the_policy_and_inference_objectives_win():
    settings = Settings(hash_key=bytes(16), objective_priorities={"batch": -1, "chat": 5})

    class Watcher:
        def priorities(self) -> dict[str, int]:
            return {"chat": 9}

    assert priorities(settings, None) == {"batch": -1, "chat": 5}
    assert priorities(settings, Watcher()) == {"batch": -1, "chat": 9}  # type: ignore[arg-type]


def test_a_late_started_call_never_lets_two_requests_into_one_slot():
    async def main() -> None:
        fleet = Fleet(0)
        room = make(Settings(hash_key=bytes(16)), fleet)
        tasks = [asyncio.create_task(room.wait(klass(f), 1, 1, BACKENDS)) for f in "abc"]
        await asyncio.sleep(0.01)
        fleet.slots = 1
        room.pump()
        first = await asyncio.wait_for(asyncio.shield(tasks[0]), 1)
        assert isinstance(first, Held) and first.state is State.DISPATCHED
        fleet.running = 1  # it reserved its backend: the fleet is full again
        room.started(first)
        room.started(first)  # a second, late call for the same request changes nothing
        await asyncio.sleep(0.01)
        assert len(room) == 2 and not tasks[1].done() and not tasks[2].done()
        fleet.running = 0
        room.pump()
        second = await asyncio.wait_for(tasks[1], 1)
        assert isinstance(second, Held) and second.state is State.DISPATCHED
        room.started(first)  # the first one again, while the second is being dispatched
        await asyncio.sleep(0.01)
        assert not tasks[2].done()  # still one at a time
        room.drain()
        await tasks[2]

    asyncio.run(main())


def test_requests_with_no_healthy_candidate_are_not_held():
    async def main() -> None:
        room = make(Settings(hash_key=bytes(16)), Fleet(0))
        assert room.goes_now([Backend("10.0.0.9:8000", healthy=False)])  # the router answers at once

    asyncio.run(main())


def test_the_loop_sleeps_while_nothing_is_held_and_expires_what_is():
    """Its 20 Hz tick only runs while something is held (alone, that timer was about half an
    idle ext_proc's CPU); a request held later still expires at its TTL."""

    class Counted(WaitingRoom):
        ticks = 0

        def _tick(self) -> None:
            Counted.ticks += 1
            super()._tick()

    async def main() -> None:
        settings = Settings(hash_key=bytes(16), queue_ttl_s=0.2)
        room = Counted(lambda: settings, Fleet(0).room, WaitingRoomMetrics(CollectorRegistry()), clock)
        loop = asyncio.create_task(room.run())
        await asyncio.sleep(0.3)
        assert Counted.ticks == 0
        held = await asyncio.wait_for(room.wait(klass("a"), 1.0, 10, BACKENDS), 2.0)
        assert isinstance(held, Held) and held.state is State.EXPIRED
        assert Counted.ticks > 0
        loop.cancel()

    asyncio.run(main())


def test_a_turn_weighs_the_room_of_requests_for_the_same_candidates_once():
    """Every flow's head is asked in a turn; requests for the same candidates (the pool's tuple)
    are weighed once: a thousand full backends judged for each of 256 flows held the loop 117 ms."""

    class Counted(Fleet):
        calls = 0

        def room(self, _backends: object) -> bool:
            self.calls += 1
            return super().room(_backends)

    async def main() -> None:
        fleet = Counted(0)
        room = make(Settings(hash_key=bytes(16)), fleet)
        pool = tuple(BACKENDS)
        tasks = [asyncio.create_task(room.wait(klass(f"flow-{i}"), 100, 10, pool)) for i in range(50)]
        await asyncio.sleep(0.01)
        assert len(room) == 50
        fleet.calls = 0
        room.pump()
        assert fleet.calls == 1  # no room for any of the 50 flows' heads, found once
        room.drain()
        assert all(h.state is State.EVICTED for h in await asyncio.gather(*tasks))

    asyncio.run(main())


def test_a_request_held_for_the_whole_fleet_waits_for_room_in_the_fleet_of_its_turn():
    """Held while the one backend was saturated; that backend leaves and another joins with room:
    its turn comes on the newcomer, not on the snapshot of its arrival."""

    async def main() -> None:
        pool = {"backends": (Backend("10.0.0.1:8000"),)}
        saturated = {"10.0.0.1:8000"}

        def room(backends: object) -> bool:
            return any(b.address not in saturated for b in backends)  # type: ignore[attr-defined]

        waiting = WaitingRoom(
            lambda: Settings(hash_key=bytes(16)),
            room,
            WaitingRoomMetrics(CollectorRegistry()),
            clock,
            lambda: pool["backends"],
        )
        task = asyncio.create_task(waiting.wait(klass("a"), 100, 10, pool["backends"]))
        await asyncio.sleep(0.01)
        assert len(waiting) == 1
        pool["backends"] = (Backend("10.0.0.2:8000"),)  # the policy's fleet changed
        waiting.pump()
        held = await asyncio.wait_for(task, 1.0)
        assert isinstance(held, Held) and held.state is State.DISPATCHED

    asyncio.run(main())


def test_requests_held_when_flow_control_is_turned_off_all_go():
    """A policy turned flow control off while requests were held: newcomers go at once, and the
    held ones must not wait behind them for room that never comes."""

    async def main() -> None:
        settings = {"now": Settings(hash_key=bytes(16))}
        waiting = WaitingRoom(lambda: settings["now"], Fleet(0).room, WaitingRoomMetrics(CollectorRegistry()), clock)

        async def request() -> Held | Refusal:
            held = await waiting.wait(klass("a"), 100, 10, BACKENDS)
            if isinstance(held, Held):
                waiting.started(held)
            return held

        tasks = [asyncio.create_task(request()) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert len(waiting) == 3
        settings["now"] = Settings(hash_key=bytes(16), flow_control=False)
        waiting.pump()
        held = await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
        assert all(isinstance(h, Held) and h.state is State.DISPATCHED for h in held)

    asyncio.run(main())


def test_a_publish_judges_the_fleets_room_once():
    """`heads()` runs on every publish to the siblings: a request held for the whole fleet has the
    fleet's room judged once, not again for the request."""

    async def main() -> None:
        x = Backend("10.0.0.1:8000")
        judged: list[int] = []
        full = True

        def room(backends: object) -> bool:
            judged.append(1)
            return not full

        waiting = WaitingRoom(
            lambda: Settings(hash_key=bytes(16)), room, WaitingRoomMetrics(CollectorRegistry()), clock, lambda: (x,)
        )
        task = asyncio.create_task(waiting.wait(klass("a"), 100, 10, None))  # held for the whole fleet
        await asyncio.sleep(0.01)
        assert len(waiting) == 1
        full = False
        judged.clear()
        assert waiting.heads() == {0: 0.0}
        assert len(judged) == 1
        waiting.drain()
        await task

    asyncio.run(main())


def test_the_siblings_are_told_no_head_held_for_a_model_whose_backends_are_full():
    """The replica link publishes `heads()`. A request held because its own candidates are full
    while the fleet has room elsewhere is no sibling's reason to leave a turn to this replica; with
    the whole fleet full it is (a freed slot then goes to the fleet's next turn)."""

    async def main() -> None:
        x, y = Backend("10.0.0.1:8000"), Backend("10.0.0.2:8000")
        full = {x.address}

        def room(backends: object) -> bool:
            return any(b.address not in full for b in backends)  # type: ignore[attr-defined]

        waiting = WaitingRoom(
            lambda: Settings(hash_key=bytes(16)), room, WaitingRoomMetrics(CollectorRegistry()), clock, lambda: (x, y)
        )
        task = asyncio.create_task(waiting.wait(klass("a"), 100, 10, (x,)))  # its model is served by x alone
        await asyncio.sleep(0.01)
        assert len(waiting) == 1 and waiting.shares() == ({}, 1)
        assert waiting.heads() == {}  # held for x, while y has room
        full.add(y.address)
        assert waiting.heads() == {0: 0.0}  # the whole fleet full: its turn, for the siblings to leave to it
        full.clear()
        assert waiting.heads() == {0: 0.0}  # x has room: it can run
        waiting.drain()
        await task

    asyncio.run(main())


def test_a_request_whose_deadline_passes_as_it_arrives_is_answered_expired_and_leaves_nothing():
    """An objective (or a TTL) too short for the clock to tell from now: the request expires as
    it is held, and is answered so at once, its gauges and labels back where they were. The clock
    reads 2^40 s, where 1e-12 s is below its step whatever the machine's uptime (the loop's own
    clock, a few minutes after a boot, still tells them apart)."""

    async def main() -> None:
        for settings, request_class in (
            (Settings(hash_key=bytes(16)), RequestClass(-1, "a", 1e-12, "sheddable", True)),
            (Settings(hash_key=bytes(16), queue_ttl_s=1e-12), klass("a")),
        ):
            room = make(settings, Fleet(0), lambda: 2.0**40)
            held = await asyncio.wait_for(room.wait(request_class, 1, 1, BACKENDS), 1.0)
            assert isinstance(held, Held) and held.state is State.EXPIRED
            assert len(room) == 0 and not room._labels and not room._waiting
            assert room._metrics.held.labels(str(request_class.priority))._value.get() == 0

    asyncio.run(main())


def test_a_turn_with_the_whole_fleet_full_weighs_no_held_request():
    """Every held request's candidates are of the fleet: with none of the fleet's backends having
    room none can run, and the turn says so without a pass over the queue (each arrival and tick
    read up to 64 requests of every flow: 3 ms at 4,096 held)."""

    async def main() -> None:
        asked: list[object] = []
        fleet = Fleet(0)

        def room(candidates: object) -> bool:
            asked.append(candidates)
            return fleet.room(candidates)

        waiting = WaitingRoom(
            lambda: Settings(hash_key=bytes(16)), room, WaitingRoomMetrics(CollectorRegistry()), clock, lambda: BACKENDS
        )
        tasks = [  # each with candidates of its own (a gateway's subset hint), judged apart
            asyncio.create_task(waiting.wait(klass(f"f{i % 64}"), 1, 1, [Backend("10.0.0.1:8000")])) for i in range(512)
        ]
        await asyncio.sleep(0)
        asked.clear()
        waiting.pump()
        assert len(asked) == 1  # the fleet, once
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
