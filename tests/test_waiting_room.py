"""Flow control on the event loop (extproc/runtime/waiting_room.py): holding, dispatching one at a
time, weights and priorities from the settings, cancellation and a graceful stop."""

from __future__ import annotations

import asyncio
from collections import Counter

from prometheus_client import CollectorRegistry

from extproc.core.backends import Backend
from extproc.core.flow import Refusal, State
from extproc.core.objectives import RequestClass
from extproc.core.settings import Settings
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics
from extproc.service import priorities

BACKENDS = [Backend("10.0.0.1:8000")]


class Fleet:
    """Room for `slots` requests at a time; a dispatched request takes one until it ends."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running = 0

    def room(self, _backends: object) -> bool:
        return self.running < self.slots


def make(settings: Settings, fleet: Fleet) -> WaitingRoom:
    return WaitingRoom(lambda: settings, fleet.room, lambda: BACKENDS, WaitingRoomMetrics(CollectorRegistry()), clock)


def clock() -> float:
    return asyncio.get_running_loop().time()


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
            assert await room.wait(klass(flow), 100, 10) is State.DISPATCHED
            fleet.running += 1  # it reserved its backend
            order.append(flow)
            room.started()

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
        first = asyncio.create_task(room.wait(klass("a"), 1, 1))
        second = asyncio.create_task(room.wait(klass("a"), 1, 1))
        await asyncio.sleep(0.01)
        assert await room.wait(klass("a"), 1, 1) is Refusal.BAND_FULL
        first.cancel()
        await asyncio.sleep(0.01)
        assert len(room) == 1
        third = asyncio.create_task(room.wait(klass("a"), 1, 1))
        await asyncio.sleep(0.01)
        room.drain()
        assert await second is State.EVICTED and await third is State.EVICTED and len(room) == 0

    asyncio.run(main())


def test_objectives_priorities_come_from_the_policy_and_inference_objectives_win():
    settings = Settings(hash_key=bytes(16), objective_priorities={"batch": -1, "chat": 5})

    class Watcher:
        def priorities(self) -> dict[str, int]:
            return {"chat": 9}

    assert priorities(settings, None) == {"batch": -1, "chat": 5}
    assert priorities(settings, Watcher()) == {"batch": -1, "chat": 9}  # type: ignore[arg-type]
