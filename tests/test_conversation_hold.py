"""Holding new conversations while the live ones' contexts fill the caches (`conversation_hold_share`):
the live contexts' sum, the core's rule, and the wait on the event loop."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.core.backends import Backend
from extproc.core.live_contexts import LiveContexts
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime import conversation_hold
from extproc.runtime.conversation_hold import ConversationHold, ConversationHoldMetrics

FLEET = (Backend("10.0.0.1:8000"), Backend("10.0.0.2:8000"))
WORDS = " ".join(f"word{i}" for i in range(4000))  # a long prompt: many blocks


def test_a_conversation_is_live_for_the_window_after_its_last_turn_and_counts_that_turns_blocks():
    live = LiveContexts(window_s=10.0, capacity=100)
    live.served(b"a", 5, now=0.0)
    live.served(b"b", 7, now=4.0)
    assert live.blocks(9.0) == 12
    live.served(b"a", 9, now=8.0)  # a's context grew; its first turn no longer counts
    assert live.blocks(12.0) == 16  # a's turn at 0 left the window, but a is live from 8
    assert live.blocks(15.0) == 9  # b's last turn, at 4, is out of the window
    assert live.blocks(18.5) == 0 and len(live) == 0


def test_past_capacity_the_conversations_served_longest_ago_go_and_the_queue_stays_bounded():
    live = LiveContexts(window_s=1e9, capacity=3)
    for i in range(5):
        live.served(bytes([i]), 10, now=float(i))
    assert len(live) == 3 and live.blocks(5.0) == 30
    for t in range(100):  # one conversation's many turns within one window
        live.served(b"x", 1, now=10.0 + t)
    assert len(live._queue) <= 2 * 3 + 16 and live.blocks(109.0) == 21  # x (1) and the two before it (10 each)


@given(
    st.lists(
        st.tuples(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), st.integers(0, 50), st.floats(0, 5)), max_size=60
    ),
    st.floats(0.5, 20),
)
def test_the_sum_answers_as_a_pass_over_each_conversations_last_turn(turns, window_s):
    live = LiveContexts(window_s=window_s, capacity=3)
    latest: dict[bytes, tuple[float, int]] = {}
    now = 0.0
    for session, blocks, step in turns:
        now += step
        live.served(session, blocks, now)
        latest.pop(session, None)
        latest[session] = (now, blocks)
        while len(latest) > 3:
            del latest[next(iter(latest))]
        expected = sum(b for t, b in latest.values() if t >= now - window_s)
        assert live.blocks(now) == expected
        latest = {s: (t, b) for s, (t, b) in latest.items() if t >= now - window_s}


def _router(share: float = 0.5, **settings: object) -> Router:
    router = Router(Settings(conversation_hold_share=share, conversation_hold_window_s=60.0, **settings))
    for backend in FLEET:
        router.set_backend_capacity(backend.address, 20_000)
    return router


def _request(router: Router, session: str | None, text: str = WORDS):
    headers = {"x-session-id": session} if session is not None else {}
    return router.parse({"model": "m", "messages": [{"role": "user", "content": text}]}, headers)


def test_a_first_turn_is_held_while_the_live_contexts_and_its_prompt_exceed_the_share():
    router = _router(share=0.5)
    room = 2 * 20_000 / router.block_tokens()
    first = _request(router, "new")
    blocks = len(router.chain_of(first))
    assert blocks < 0.5 * room and not router.crowded_by(first, FLEET, 0.0)
    huge = _request(router, "huge", " ".join([WORDS] * 40))
    assert len(router.chain_of(huge)) > 0.5 * room and not router.crowded_by(huge, FLEET, 0.0)  # nothing live
    served = 0
    while served + blocks <= 0.5 * room:  # conversations served until the next one's prompt no longer fits
        request = _request(router, f"live-{served}", f"{served} {WORDS}")
        router.learn(request, FLEET[served % 2].address, 1.0)
        served += len(router.chain_of(request))
    assert router.crowded_by(first, FLEET, 2.0)
    assert not router.crowded_by(first, FLEET, 62.0)  # the live ones' last turns left the window
    # a returning turn (its session bound) and a request naming no session are never held
    assert not router.crowded_by(_request(router, "live-0", f"0 {WORDS}"), FLEET, 2.0)
    assert not router.crowded_by(_request(router, None), FLEET, 2.0)
    # unknown cache sizes: never held
    assert not router.crowded_by(first, (Backend("10.0.0.9:8000"),), 2.0)


def test_off_by_default_nothing_is_counted_and_nothing_held():
    router = _router(share=0.0)
    for i in range(50):
        router.learn(_request(router, f"s{i}", f"{i} {WORDS}"), FLEET[0].address, 1.0)
    assert len(router.live) == 0 and not router.crowded_by(_request(router, "new"), FLEET, 2.0)
    router.reconfigure(Settings(conversation_hold_share=0.5))
    router.learn(_request(router, "s", WORDS), FLEET[0].address, 3.0)
    assert len(router.live) == 1
    router.reconfigure(Settings())  # switched off: what it counted goes
    assert len(router.live) == 0


def _crowded_router(clock: list[float]) -> tuple[Router, object]:
    router = _router(share=0.5, conversation_hold_max_s=5.0)
    room = 2 * 20_000 / router.block_tokens()
    served = 0
    while served <= 0.5 * room:
        request = _request(router, f"live-{served}", f"{served} {WORDS}")
        router.learn(request, FLEET[0].address, clock[0])
        served += len(router.chain_of(request))
    return router, _request(router, "new")


def _outcomes(registry: CollectorRegistry) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in registry.collect()
        if metric.name == "kvroute_conversation_hold_outcomes"
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


@pytest.mark.parametrize("ending", ["room", "timeout", "cancelled"])
def test_a_held_first_turn_goes_on_when_room_comes_or_at_its_longest_and_a_client_leaving_frees_it(
    monkeypatch: pytest.MonkeyPatch, ending: str
):
    """Time is the test's: the rule is looked at each tick (here every 1 ms of real time)."""
    monkeypatch.setattr(conversation_hold, "TICK_S", 0.001)
    clock = [0.0]
    router, request = _crowded_router(clock)
    registry = CollectorRegistry()
    hold = ConversationHold(ConversationHoldMetrics(registry, lambda: 0), lambda: clock[0])

    async def main() -> None:
        waiter = asyncio.create_task(hold.wait(router, request, FLEET))
        for _ in range(20):
            await asyncio.sleep(0.002)
        assert not waiter.done() and hold.held == 1
        if ending == "room":
            clock[0] = 61.0  # the live contexts' last turns leave the window
        elif ending == "timeout":
            clock[0] = 5.0  # still crowded, but held as long as it may be
        else:
            waiter.cancel()
        with pytest.raises(asyncio.CancelledError) if ending == "cancelled" else _nothing():
            await asyncio.wait_for(waiter, 5)
        assert hold.held == 0

    asyncio.run(main())
    assert _outcomes(registry) == {ending: 1.0}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> bool:
        return False


def test_beyond_the_most_held_a_first_turn_goes_on_at_once(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(conversation_hold, "MAX_HELD", 0)
    clock = [0.0]
    router, request = _crowded_router(clock)
    registry = CollectorRegistry()
    asyncio.run(
        ConversationHold(ConversationHoldMetrics(registry, lambda: 0), lambda: clock[0]).wait(router, request, FLEET)
    )
    assert _outcomes(registry) == {"full": 1.0}
