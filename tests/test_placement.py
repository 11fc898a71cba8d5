"""LoRA adapter placement (extproc/core/placement.py): loads where none has it, more servers only
when load calls for it, unloads idle copies but never the last, and hysteresis against thrash."""

from __future__ import annotations

import pytest

from extproc.core.adapters import AdapterBook
from extproc.core.load import LoadTracker
from extproc.core.placement import DRAIN_LIMIT_S, AdapterPlacement, Move
from extproc.core.settings import Settings

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
FLEET = [A, B, C]
SETTINGS = Settings(
    adapter_sources={"sql": "/adapters/sql", "chat": "/adapters/chat"},
    adapter_max_backends=1,
    adapter_scale_out_requests=4,
    adapter_idle_s=60.0,
    adapter_min_resident_s=10.0,
)


def world() -> tuple[AdapterPlacement, AdapterBook, LoadTracker]:
    book = AdapterBook()
    for backend in FLEET:
        book.listing(backend, [])
        book.engine(backend, [], 2, now=0.0)
    return AdapterPlacement(), book, LoadTracker()


def carry_out(placement: AdapterPlacement, book: AdapterBook, moves: list[Move], now: float, ok: bool = True) -> None:
    for move in moves:
        if ok:
            book.listed_now(move.backend, move.adapter, move.load)
        placement.done(move, ok, now)


def test_only_adapters_the_policy_names_are_loaded_and_only_once_asked_for():
    placement, book, loads = world()
    assert placement.plan(SETTINGS, book, loads, FLEET, 0.0) == []  # nobody asked: nothing moves
    assert not placement.wanted(SETTINGS, "../../etc/passwd", 0.0)  # a client's name: never loaded
    assert placement.wanted(SETTINGS, "sql", 0.0)
    moves = placement.plan(SETTINGS, book, loads, FLEET, 0.1)
    assert moves == [Move(True, A, "sql", "/adapters/sql")]  # all equal: the first
    assert placement.plan(SETTINGS, book, loads, FLEET, 0.2) == []  # one move per adapter in flight
    carry_out(placement, book, moves, 0.3)
    assert book.lists(A, "sql") and placement.plan(SETTINGS, book, loads, FLEET, 0.4) == []
    assert placement.counts == {("load", "ok"): 1}


def test_a_load_goes_where_slots_are_least_taken_and_a_failed_server_is_skipped_for_a_while():
    placement, book, loads = world()
    book.engine(A, ["x", "y"], 2, now=0.0)  # both slots in use
    loads.reserve(B, 0)  # busier than C
    placement.wanted(SETTINGS, "chat", 0.0)
    (move,) = placement.plan(SETTINGS, book, loads, FLEET, 0.5)
    assert move.backend == C
    carry_out(placement, book, [move], 0.6, ok=False)
    (retry,) = placement.plan(SETTINGS, book, loads, FLEET, 1.0)
    assert retry.backend == B  # not C again within adapter_min_resident_s
    assert placement.counts[("load", "failed")] == 1


def test_a_load_goes_where_the_adapters_already_placed_draw_the_least_demand():
    """Slots alone would put a second adapter beside a popular one on the first server, and that
    server would take most of the requests; demand spreads them."""
    placement, book, loads = world()
    for second in range(5):  # sql is popular
        placement.wanted(SETTINGS, "sql", second)
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 5.0), 5.0)
    assert book.lists(A, "sql")
    placement.wanted(SETTINGS, "chat", 6.0)
    (move,) = placement.plan(SETTINGS, book, loads, FLEET, 6.0)
    assert move.backend == B  # not beside sql, though A's slots are as free
    assert placement.demand("sql", 64.0) == pytest.approx(placement.demand("sql", 4.0) / 2)  # halved in a minute


def test_adapters_asked_for_at_once_are_spread_by_their_demand_in_one_round():
    """Every adapter's first request comes in the same moment (clients start together): the round
    that loads them all must count the loads it has already planned, or all go to one server."""
    placement, book, loads = world()
    settings = Settings(adapter_sources={f"a{i}": f"/adapters/a{i}" for i in range(4)}, adapter_max_backends=1)
    for adapter, requests in (("a0", 3), ("a1", 1), ("a2", 1), ("a3", 1)):
        for _ in range(requests):
            placement.wanted(settings, adapter, 0.0)
    moves = placement.plan(settings, book, loads, [A, B], 0.0)
    where = {m.adapter: m.backend for m in moves}
    assert where == {"a0": A, "a1": B, "a2": B, "a3": B}  # the popular one alone, as the others' sum


def test_load_calls_for_more_servers_and_idle_copies_go_but_never_the_last():
    placement, book, loads = world()
    placement.wanted(SETTINGS, "sql", 0.0)
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 0.0), 0.0)
    busy = [loads.reserve(A, 0, "sql") for _ in range(4)]  # 4 in flight on its only holder
    (more,) = placement.plan(SETTINGS, book, loads, FLEET, 1.0)
    assert more.load and more.backend != A
    carry_out(placement, book, [more], 1.0)
    for reservation in busy:
        reservation.finish()
    # two holders, beyond adapter_max_backends: the idle one goes once it was idle for the hold
    assert placement.plan(SETTINGS, book, loads, FLEET, 5.0) == []  # loaded 4 s ago: kept
    loads.reserve(A, 0, "sql")  # A stays in use
    # idle here is what this replica saw: the copy takes no new requests, siblings are told, and it
    # goes once the engine runs none of its requests (a sibling's may still come)
    assert placement.plan(SETTINGS, book, loads, FLEET, 12.0) == []
    assert book.listers("sql", FLEET) == [A] and placement.moving_off() == {"sql": (more.backend, A)}
    sample(book, loads, more.backend, 14.5, ["sql"])  # past the grace, but a sibling's request runs there
    assert placement.plan(SETTINGS, book, loads, FLEET, 14.5) == []
    sample(book, loads, more.backend, 15.0, [])
    (less,) = placement.plan(SETTINGS, book, loads, FLEET, 15.0)
    assert less == Move(False, more.backend, "sql", "/adapters/sql")
    carry_out(placement, book, [less], 15.0)
    assert placement.moving_off() == {}
    # the last holder stays however long it idles
    assert placement.plan(SETTINGS, book, loads, FLEET, 10_000.0) == []
    assert book.lists(A, "sql")


def test_an_adapter_does_not_thrash_between_servers_under_bursts():
    placement, book, loads = world()
    placement.wanted(SETTINGS, "sql", 0.0)
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 0.0), 0.0)
    moves = 0
    for second in range(1, 120):  # a burst every 20 s, quiet between
        burst = [loads.reserve(A, 0, "sql") for _ in range(4)] if second % 20 == 0 else []
        for backend in FLEET:  # the engines report each second (an idle copy goes only on a fresh report)
            sample(book, loads, backend, float(second), [])
        done = placement.plan(SETTINGS, book, loads, FLEET, float(second))
        carry_out(placement, book, done, float(second))
        moves += len(done)
        for reservation in burst:
            reservation.finish()
    # each burst may add a copy, each copy is kept adapter_min_resident_s: never a move a second
    assert 0 < moves <= 2 * (120 // 20)
    assert sum(book.has(b, "sql") for b in FLEET) == 1  # the last burst's copy went once it idled


def test_what_placement_remembers_of_a_server_goes_with_it():
    placement, book, loads = world()
    placement.wanted(SETTINGS, "sql", 0.0)
    (move,) = placement.plan(SETTINGS, book, loads, FLEET, 0.0)
    carry_out(placement, book, [move], 0.0, ok=False)  # remembered: not retried there for a while
    placement.keep({b for b in FLEET if b != move.backend})
    book.remove_backend(move.backend)
    (again,) = placement.plan(SETTINGS, book, loads, [move.backend, *FLEET], 0.5)  # back, with a new pod
    assert again.backend == move.backend


FOUR = Settings(
    adapter_sources={f"a{i}": f"/adapters/a{i}" for i in range(4)},
    adapter_max_backends=1,
    adapter_min_resident_s=10.0,
)


def sample(book: AdapterBook, loads: LoadTracker, backend: str, at: float, running: list[str]) -> None:
    """One scrape of the backend's engine: its load, and the adapters it runs."""
    loads.get(backend).report(len(running), 0, 0.0, at)
    book.engine(backend, running, 2, now=at)


def placed_evenly() -> tuple[AdapterPlacement, AdapterBook, LoadTracker, list[str], list[str]]:
    """Four adapters asked for once each at the start, so two land on each of A and B."""
    placement, book, loads = world()
    for i in range(4):
        placement.wanted(FOUR, f"a{i}", 0.0)
    carry_out(placement, book, placement.plan(FOUR, book, loads, [A, B], 0.0), 0.0)
    on_a = sorted(a for a in (f"a{i}" for i in range(4)) if book.lists(A, a))
    on_b = sorted(a for a in (f"a{i}" for i in range(4)) if book.lists(B, a))
    assert len(on_a) == len(on_b) == 2
    return placement, book, loads, on_a, on_b


def ask(placement: AdapterPlacement, adapter: str, requests: int, at: float) -> None:
    for _ in range(requests):
        placement.wanted(FOUR, adapter, at)


def test_an_uneven_split_moves_the_adapter_that_evens_it_and_the_old_copy_goes_once_its_requests_end():
    """Adapters are placed on their first requests, before their popularity shows; when one
    server's adapters turn out to draw most of the demand, one moves: loaded on the other server,
    then no longer routed to on the first, and unloaded there once its requests have ended."""
    placement, book, loads, (popular, second), (rare, rarer) = placed_evenly()
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    ask(placement, rare, 2, 1.0)
    ask(placement, rarer, 2, 1.0)
    (move,) = placement.plan(FOUR, book, loads, [A, B], 5.0)  # placed before their demand showed: may move
    # A draws 18 against B's 6: moving the popular one would leave 7 against 17, the second evens
    # them (11 against 13)
    assert move == Move(True, B, second, f"/adapters/{second}")
    in_flight = loads.reserve(A, 0, second)
    carry_out(placement, book, [move], 12.0)
    assert placement.plan(FOUR, book, loads, [A, B], 13.0) == []  # moved off A: no unload before DRAIN_GRACE_S
    assert book.listers(second, [A, B]) == [B]  # new requests go to B only
    book.listing(A, [popular, second])  # the engine's listing still names it: still moved off
    assert book.listers(second, [A, B]) == [B]
    assert placement.moving_off() == {second: (A, B)}  # what sibling replicas are told
    sample(book, loads, A, 15.0, [second])
    assert placement.plan(FOUR, book, loads, [A, B], 15.0) == []  # past the grace, but a request still runs there
    in_flight.finish()
    assert placement.plan(FOUR, book, loads, [A, B], 15.5) == []  # the engine still reports one (a sibling's)
    sample(book, loads, A, 16.0, [])
    assert placement.plan(FOUR, book, loads, [A, B], 18.5) == []  # that report is stale: one could run unseen
    sample(book, loads, A, 19.0, [])
    (unload,) = placement.plan(FOUR, book, loads, [A, B], 19.0)
    assert unload == Move(False, A, second, f"/adapters/{second}")
    carry_out(placement, book, [unload], 19.0)
    assert [b for b in (A, B) if book.lists(b, second)] == [B] and placement.moving_off() == {}
    for tenth in range(191, 200):  # evened: nothing more moves
        assert placement.plan(FOUR, book, loads, [A, B], tenth / 10) == []
    assert placement.counts == {("load", "ok"): 5, ("unload", "ok"): 1}
    ask(placement, rare, 20, 19.9)  # now B draws 33 against A's 11
    # `second` back to A would even them alone, but it just left A (hold 10 s); `rare` to A alone
    # would not, but with `popular` to B next it does (23 against 21): a swap, one move at a time
    (first,) = placement.plan(FOUR, book, loads, [A, B], 20.0)
    assert first == Move(True, A, rare, f"/adapters/{rare}")
    carry_out(placement, book, [first], 20.1)
    assert placement.plan(FOUR, book, loads, [A, B], 20.2) == []
    sample(book, loads, B, 22.2, [])
    (drained,) = placement.plan(FOUR, book, loads, [A, B], 22.2)
    assert drained == Move(False, B, rare, f"/adapters/{rare}")
    carry_out(placement, book, [drained], 22.3)
    assert placement.plan(FOUR, book, loads, [A, B], 24.9) == []  # a balance move at most every 5 s
    (then,) = placement.plan(FOUR, book, loads, [A, B], 25.0)
    assert then == Move(True, B, popular, f"/adapters/{popular}")


def test_no_move_where_none_evens_the_split_nor_on_little_demand_nor_when_its_load_fails():
    placement, book, loads, (popular, other), _ = placed_evenly()
    ask(placement, popular, 6, 1.0)
    ask(placement, other, 5, 1.0)
    assert placement.plan(FOUR, book, loads, [A, B], 11.0) == []  # 15 requests' worth: too few to judge by
    ask(placement, popular, 20, 11.0)
    # A draws 33 against 2: moving the popular one would leave 6 against 29, the other 27 against
    # 8; neither halves the gap
    assert placement.plan(FOUR, book, loads, [A, B], 12.0) == []
    ask(placement, other, 20, 12.0)
    (move,) = placement.plan(FOUR, book, loads, [A, B], 13.0)
    assert move.load and move.backend == B
    carry_out(placement, book, [move], 13.5, ok=False)  # B refused it: it stays on A, routed as before
    assert book.lists(A, move.adapter) and book.listers(move.adapter, [A, B]) == [A]
    later = placement.plan(FOUR, book, loads, [A, B], 18.5)  # (the popular one may go now)
    assert all(m.adapter != move.adapter for m in later)  # not retried on B within the hold (10 s)


def test_a_balance_move_is_called_off_when_its_new_server_leaves_or_its_old_copy_will_not_unload():
    placement, book, loads, (popular, second), _ = placed_evenly()
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    (move,) = placement.plan(FOUR, book, loads, [A, B], 5.0)
    assert move == Move(True, B, second, f"/adapters/{second}")
    carry_out(placement, book, [move], 5.5)
    assert placement.plan(FOUR, book, loads, [A, B], 6.0) == [] and book.listers(second, [A, B]) == [B]
    book.remove_backend(B)  # the new copy's server left: A's copy is routed to again
    assert placement.plan(FOUR, book, loads, [A], 7.0) == []
    assert book.listers(second, [A]) == [A] and book.lists(A, second) and placement.moving_off() == {}
    # a move whose old copy fails to unload UNLOAD_TRIES times is given up, both copies kept
    placement, book, loads, (popular, second), _ = placed_evenly()
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    carry_out(placement, book, placement.plan(FOUR, book, loads, [A, B], 5.0), 5.0)
    assert placement.plan(FOUR, book, loads, [A, B], 6.0) == []
    at = 8.0
    for _ in range(3):
        sample(book, loads, A, at, [])
        (unload,) = placement.plan(FOUR, book, loads, [A, B], at)
        carry_out(placement, book, [unload], at, ok=False)
        at += 10.0  # retried after the hold
    sample(book, loads, A, at, [])
    assert placement.plan(FOUR, book, loads, [A, B], at) == []
    assert placement.moving_off() == {} and book.listers(second, [A, B]) == [A, B]

    # a copy whose requests are never seen to end (a count that leaked, a request that runs on)
    # is routed to again after DRAIN_LIMIT_S, so one stuck drain does not stop every later move
    placement, book, loads, (popular, second), _ = placed_evenly()
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    carry_out(placement, book, placement.plan(FOUR, book, loads, [A, B], 5.0), 5.0)
    assert placement.plan(FOUR, book, loads, [A, B], 6.0) == [] and book.listers(second, [A, B]) == [B]
    loads.reserve(A, 0, second)  # never finished
    sample(book, loads, A, 6.0 + DRAIN_LIMIT_S, [])
    assert placement.plan(FOUR, book, loads, [A, B], 6.0 + DRAIN_LIMIT_S) == []  # still draining
    assert placement.moving_off() == {second: (A, B)}
    sample(book, loads, A, 6.5 + DRAIN_LIMIT_S, [])
    assert placement.plan(FOUR, book, loads, [A, B], 6.5 + DRAIN_LIMIT_S) == []
    assert placement.moving_off() == {} and book.listers(second, [A, B]) == [A, B]
    assert placement.counts[("unload", "called_off")] == 1


def test_a_balance_move_another_replica_claimed_is_dropped_here():
    placement, book, loads, (popular, second), _ = placed_evenly()
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    (move,) = placement.plan(FOUR, book, loads, [A, B], 5.0)
    assert placement.balancing(move)
    placement.skip(move)
    assert not placement.balancing(move) and placement.plan(FOUR, book, loads, [A, B], 6.0) == []
    assert book.listers(second, [A, B]) == [A]  # nothing was moved off


def test_the_placer_tells_siblings_of_each_copy_moved_off_and_again_while_the_move_lasts():
    from extproc.core.backends import Backend
    from extproc.core.router import Router
    from extproc.runtime.placer import RETELL_S, AdapterPlacer
    from extproc.runtime.pool import BackendPool

    router = Router(FOUR)
    told: list[tuple[str, str, str]] = []
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, 2)
    placer = AdapterPlacer(router, pool, tell_leaving=lambda *word: told.append(word))
    placement, book, loads = placer.placement, router.adapters, router.loads
    for backend in (A, B):
        book.listing(backend, [])
    for i in range(4):
        placement.wanted(FOUR, f"a{i}", 0.0)
    carry_out(placement, book, placement.plan(FOUR, book, loads, [A, B], 0.0), 0.0)
    popular, second = sorted(a for a in (f"a{i}" for i in range(4)) if book.lists(A, a))
    ask(placement, popular, 10, 1.0)
    ask(placement, second, 6, 1.0)
    (move,) = placement.plan(FOUR, book, loads, [A, B], 5.0)
    placer._tell(5.0)
    assert told == []  # loading on B: A still serves it
    carry_out(placement, book, [move], 6.0)
    loads.reserve(A, 0, second)  # a long request keeps the move going
    for at in (7.0, 7.5, 7.0 + RETELL_S):
        assert placement.plan(FOUR, book, loads, [A, B], at) == []
        placer._tell(at)
    assert told == [(A, second, B), (A, second, B)]  # once, and again RETELL_S later


def test_a_placer_whose_claim_swallowed_its_stop_still_stops():
    """The claim is a Redis command, which can swallow a cancel (extproc/runtime/stopping.py): the
    rounds must end anyway, or the ext_proc's shutdown waits for ever."""
    import asyncio
    import contextlib

    from extproc.core.backends import Backend
    from extproc.core.router import Router
    from extproc.runtime.placer import AdapterPlacer
    from extproc.runtime.pool import BackendPool

    async def claim_then_swallow(name: str, hold: float) -> bool:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # as wait_for leaves it: the cancel requested, never raised
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        return True

    async def scenario() -> None:
        router = Router(SETTINGS)
        refusing = "127.0.0.1:9"  # (a load carried out there is refused at once)
        pool = BackendPool([Backend(refusing)], router.remove_backend, 2)
        router.adapters.listing(refusing, [])
        placer = AdapterPlacer(router, pool, clock=lambda: 1.0, claim=claim_then_swallow)
        placer.placement.wanted(SETTINGS, "sql", 1.0)  # a load to claim
        running = asyncio.create_task(placer.run(0.05))
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(10):  # (rounds that went on: TimeoutError)
                await running

    asyncio.run(scenario())


def test_a_request_waiting_for_its_adapter_stops_waiting_when_no_load_is_coming():
    """The load failed (or no server may take the adapter yet) and nothing is in flight: the
    requests waiting for it go on after that round, not each at the end of its own timeout."""
    import asyncio

    from extproc.core.backends import Backend
    from extproc.core.router import Router
    from extproc.runtime.placer import AdapterPlacer
    from extproc.runtime.pool import BackendPool

    async def scenario() -> tuple[list[bool], int, dict[tuple[str, str], int]]:
        router = Router(SETTINGS)
        refusing = "127.0.0.1:9"  # a load carried out there is refused at once
        pool = BackendPool([Backend(refusing)], router.remove_backend, 2)
        router.adapters.listing(refusing, [])
        placer = AdapterPlacer(router, pool)
        running = asyncio.create_task(placer.run(0.05))
        try:
            async with asyncio.timeout(60):  # (each would wait its whole 600 s otherwise)
                answers = [await placer.ensure("sql", 600.0) for _ in range(3)]
        finally:
            running.cancel()
        return answers, placer.rounds, dict(placer.placement.counts)

    answers, rounds, counts = asyncio.run(scenario())
    assert answers == [False, False, False]
    assert counts == {("load", "failed"): 1}  # one load tried; the next rounds wait out its hold
    assert rounds <= 12


def test_a_request_waiting_for_a_load_a_sibling_claimed_lets_the_rounds_keep_their_pace():
    """A sibling replica holds the load's claim: this one waits for its word, one round each
    interval, not woken into round after round (each a claim asked of the store) for as long as
    the request waits."""
    import asyncio

    from extproc.core.backends import Backend
    from extproc.core.router import Router
    from extproc.runtime.placer import AdapterPlacer
    from extproc.runtime.pool import BackendPool

    claims = 0

    async def theirs(_name: str, _hold: float) -> bool:
        nonlocal claims
        claims += 1
        return False  # a sibling holds it

    async def scenario() -> bool:
        router = Router(SETTINGS)
        pool = BackendPool([Backend("127.0.0.1:9")], router.remove_backend, 2)
        router.adapters.listing("127.0.0.1:9", [])
        placer = AdapterPlacer(router, pool, claim=theirs)
        running = asyncio.create_task(placer.run(0.5))
        try:
            return await placer.ensure("sql", 1.2)
        finally:
            running.cancel()

    assert asyncio.run(scenario()) is False  # nothing came within its wait
    assert 1 <= claims <= 5, claims  # a round every 0.5 s, and the one asked at once


def test_a_round_reports_every_move_it_planned_whatever_the_engine_answers_or_the_round_meets():
    """A load answered with an error body that is no UTF-8 (and large), a claim that fails, a
    policy that drops the adapter while its move is claimed: each move is reported, so the adapter
    is planned again later (one left pending was never planned again, and its requests waited for
    a load that never came), and nothing is loaded the policy no longer lists."""
    import asyncio
    import dataclasses

    import aiohttp
    from aiohttp import web

    from extproc.core.backends import Backend
    from extproc.core.router import Router
    from extproc.runtime.placer import AdapterPlacer
    from extproc.runtime.pool import BackendPool

    async def scenario() -> None:
        posts: list[bytes] = []

        async def load(request: web.Request) -> web.Response:
            posts.append(await request.read())
            return web.Response(status=500, body=b"\xff\xfe" * 100_000)

        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            address = f"127.0.0.1:{port}"
            router = Router(SETTINGS)
            pool = BackendPool([Backend(address)], router.remove_backend, 2)
            router.adapters.listing(address, [])
            now = [1.0]
            claims: list[str] = []

            async def claim(name: str, hold: float) -> bool:
                claims.append(name)
                if len(claims) == 2:
                    raise ConnectionError("the store went away")
                if len(claims) == 3:  # the policy drops every adapter while this move is claimed
                    router.reconfigure(dataclasses.replace(router.settings, adapter_sources=()))
                return True

            placer = AdapterPlacer(router, pool, clock=lambda: now[0], claim=claim)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                for round_ in range(3):
                    placer.placement.wanted(router.settings, "sql", now[0])
                    if round_ == 1:
                        with pytest.raises(ConnectionError):
                            await placer.round(session)
                    else:
                        await placer.round(session)
                    assert not placer.placement.pending("sql")
                    now[0] += 100.0  # past the failed server's pause
            assert len(posts) == 1  # the first round's; the third's adapter was dropped before its POST
            assert placer.placement.counts == {("load", "failed"): 3}
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_copies_past_k_go_once_a_spike_is_over_though_each_still_takes_requests():
    """Routing spreads what is left of a spike over every copy, so none is ever idle: a copy past
    `adapter_max_backends` goes once one copy fewer would carry the requests in flight at half the
    scale-out mark (it stayed on, every copy of the three used, for an hour)."""
    placement, book, loads = world()  # k = 1, scale-out at 4 in flight a copy
    placement.wanted(SETTINGS, "sql", 0.0)
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 0.0), 0.0)
    running: list = []
    for t in range(1, 40):  # a spike: 12 in flight, spread over the copies as routing spreads them
        holders = [b for b in FLEET if book.lists(b, "sql")]
        for reservation in running:
            reservation.finish()
        running = [loads.reserve(holders[i % len(holders)], 0, "sql") for i in range(12)]
        for backend in FLEET:
            sample(book, loads, backend, float(t), [])
        carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, float(t)), float(t))
    assert sum(book.has(b, "sql") for b in FLEET) == 3
    for t in range(40, 400):  # over: one request in flight on each copy
        holders = [b for b in FLEET if book.lists(b, "sql")]
        for reservation in running:
            reservation.finish()
        running = [loads.reserve(b, 0, "sql") for b in holders]
        for backend in FLEET:
            sample(book, loads, backend, float(t), [])
        carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, float(t)), float(t))
    assert sum(book.has(b, "sql") for b in FLEET) == 1


def test_a_spike_while_a_copy_is_moved_off_calls_the_move_off():
    """The copy being retired still serves the requests it has (a sibling's long stream, here):
    a spike on the copies left calls the retirement off, so the loaded copy serves again, and load
    calls for more (the retirement waited on, placement neither scaled out nor used that copy)."""
    placement, book, loads = world()  # k = 1, scale-out at 4 in flight a copy
    placement.wanted(SETTINGS, "sql", 0.0)
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 0.0), 0.0)
    burst = [loads.reserve(A, 0, "sql") for _ in range(4)]
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, 1.0), 1.0)  # a second copy
    second = next(b for b in FLEET if b != A and book.lists(b, "sql"))
    for reservation in burst:
        reservation.finish()
    now = 2.0
    while not placement.moving_off():  # A unused here, the second copy used: A starts going
        kept = loads.reserve(second, 0, "sql")
        carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, now), now)
        kept.finish()
        now += 1
    retiring = next(iter(placement.moving_off().values()))[0]
    assert book.listers("sql", FLEET) == [b for b in FLEET if b == second]
    spike = [loads.reserve(second, 0, "sql") for _ in range(40)]  # on the only copy taking requests
    for backend in FLEET:
        sample(book, loads, backend, now, ["sql"] if backend == retiring else [])  # its stream runs on
    carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, now), now)
    assert retiring in book.listers("sql", FLEET) and not placement.moving_off()
    for t in range(int(now) + 1, int(now) + 60):
        for backend in FLEET:
            sample(book, loads, backend, float(t), [])
        carry_out(placement, book, placement.plan(SETTINGS, book, loads, FLEET, float(t)), float(t))
    assert len(book.listers("sql", FLEET)) == 3
    for reservation in spike:
        reservation.finish()
