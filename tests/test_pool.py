"""The backend pool: health transitions, removal, and KV cache sizes read from vLLM metrics."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from bench.simulator.sim import SimConfig, serve
from extproc.core.backends import Backend
from extproc.runtime.pages import PageClient
from extproc.runtime.pool import BackendPool
from extproc.runtime.rotation import Rotation

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


async def _until(check, attempts: int = 200, pause_s: float = 0.02) -> None:
    """Poll `check` (the test's assertions say what was reached)."""
    for _ in range(attempts):
        if check():
            return
        await asyncio.sleep(pause_s)


async def _stop(probes: asyncio.Task, runners=()) -> None:
    probes.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        async with asyncio.timeout(5):  # a loop that swallowed the cancel fails here, not hangs
            await probes
    for runner in runners:
        await runner.cleanup()


def _recorded_rounds(pool: BackendPool) -> list[str]:
    """The kind of each probe round the pool runs from now on: scheduled, or for suspects alone."""
    rounds: list[str] = []
    probe_round = pool._probe_round

    async def recorded(client: PageClient, scheduled: bool = True) -> None:
        rounds.append("scheduled" if scheduled else "suspects")
        await probe_round(client, scheduled)

    pool._probe_round = recorded  # type: ignore[method-assign]
    return rounds


def test_down_after_threshold_up_after_one_success():
    dropped: list[str] = []
    pool = BackendPool([Backend(A), Backend(B)], dropped.append, unhealthy_after=2)
    pool.mark(A, False)
    assert pool.healthy_count() == 2 and not dropped
    pool.mark(A, False)
    assert pool.healthy_count() == 1 and dropped == [A]
    pool.mark(A, False)
    assert dropped == [A]  # dropped once, not on every failure
    pool.mark(A, True)
    assert pool.healthy_count() == 2


def test_replace_drops_leavers_and_keeps_health_of_stayers():
    dropped: list[str] = []
    pool = BackendPool([Backend(A), Backend(B)], dropped.append, unhealthy_after=1)
    pool.mark(B, False)
    pool.replace([Backend(B, frozenset({"m"})), Backend("10.0.0.3:8000")])
    assert dropped == [B, A]
    assert {b.address: (b.healthy, b.models) for b in pool.backends} == {
        B: (False, frozenset({"m"})),
        "10.0.0.3:8000": (True, frozenset()),
    }
    assert not pool.is_known(A)


def test_probes_find_which_real_servers_are_up():
    async def scenario() -> None:
        runners = await serve([0], SimConfig(block_size=16, capacity_blocks=300))
        address = f"127.0.0.1:{runners[0].addresses[0][1]}"
        pool = BackendPool([Backend(address), Backend("127.0.0.1:9")], lambda _a: None, 1)
        probes = asyncio.create_task(pool.probe_forever(0.05, 1.0))
        try:
            await _until(lambda: pool.healthy_count() == 1 and not pool.backends[1].healthy, 100, 0.05)
        finally:
            await _stop(probes, runners)
        assert [b.address for b in pool.backends if b.healthy] == [address]

    asyncio.run(scenario())


async def _slow_health_server(delay_s: float) -> tuple[web.AppRunner, str]:
    async def health(_request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


def test_a_suspect_is_dropped_only_when_its_own_probe_fails():
    async def scenario() -> None:
        runners = await serve([0], SimConfig())
        alive = f"127.0.0.1:{runners[0].addresses[0][1]}"
        dead = "127.0.0.1:9"  # nothing listens: connection refused
        dropped: list[str] = []
        pool = BackendPool([Backend(alive), Backend(dead)], dropped.append, unhealthy_after=3)
        probes = asyncio.create_task(pool.probe_forever(3600, 1.0))  # only suspects wake it
        try:
            await asyncio.sleep(0.3)  # the first round: one failure each is not enough
            assert dropped == []
            pool.mark_suspect(alive)
            pool.mark_suspect(dead)
            await _until(lambda: dropped, 100)
            assert dropped == [dead]  # confirmed by its own probe, at once
            assert {b.address for b in pool.backends if b.healthy} == {alive}
        finally:
            await _stop(probes, runners)

    asyncio.run(scenario())


def test_a_suspect_takes_no_new_requests_until_its_probe_answers_unless_it_is_the_last_up():
    """The next request must not race the probe to an address that just refused a connection
    (tests/test_e2e_envoy.py: a picker gateway cannot retry elsewhere)."""

    async def scenario() -> None:
        runners = await serve([0, 0], SimConfig())
        first, second = (f"127.0.0.1:{r.addresses[0][1]}" for r in runners)
        dropped: list[str] = []
        pool = BackendPool([Backend(first), Backend(second)], dropped.append, unhealthy_after=3)
        probes = asyncio.create_task(pool.probe_forever(3600, 1.0))  # only suspects wake it
        try:
            await asyncio.sleep(0.3)  # the first round
            pool.mark_suspect(first)
            assert [(b.address, b.healthy) for b in pool.backends] == [(first, False), (second, True)]
            assert pool.healthy_count() == 2
            await _until(lambda: all(b.healthy for b in pool.backends))
            assert all(b.healthy for b in pool.backends) and dropped == []  # it answered: routed to again
            pool.mark_suspect(first)
            pool.mark_suspect(second)  # no other one up: still the best guess
            assert all(b.healthy for b in pool.backends)
            # stopped while woken (as at shutdown): the loop ends (wait_for swallowed this cancel)
        finally:
            await _stop(probes, runners)

    asyncio.run(scenario())


def test_a_slow_health_answer_is_busy_not_down():
    async def scenario() -> None:
        runner, slow = await _slow_health_server(0.5)
        dropped: list[str] = []
        pool = BackendPool([Backend(slow)], dropped.append, unhealthy_after=1)
        probes = asyncio.create_task(pool.probe_forever(0.01, 0.05))
        try:
            await _until(lambda: pool._slow.get(slow, 0) >= 1)
            assert not dropped and pool.healthy_count() == 1  # slow once: busy, still routable
            await _until(lambda: dropped)
            assert dropped == [slow]  # a backend that never answers does leave, SLOW_FACTOR times later
        finally:
            await _stop(probes, [runner])

    asyncio.run(scenario())


def test_the_probe_loop_survives_an_error_and_goes_on():
    async def scenario() -> None:
        dropped: list[str] = []

        def on_down(address: str) -> None:
            dropped.append(address)
            if len(dropped) == 1:
                raise RuntimeError("a bug in a callback")

        pool = BackendPool([Backend("127.0.0.1:9"), Backend("127.0.0.1:10")], on_down, unhealthy_after=1)
        probes = asyncio.create_task(pool.probe_forever(0.01, 0.2))
        try:
            await _until(lambda: len(dropped) == 2, 300, 0.01)
            assert pool.probe_errors == 1  # the round that raised was logged and counted...
            assert sorted(dropped) == ["127.0.0.1:10", "127.0.0.1:9"]  # ...and the next round went on
            assert not probes.done()
        finally:
            await _stop(probes)

    asyncio.run(scenario())


def test_the_backends_are_one_tuple_until_the_set_or_its_health_changes():
    """The routing core keeps the candidates per model while it is handed the same tuple."""
    pool = BackendPool([Backend(A), Backend(B)], lambda _: None, unhealthy_after=1)
    view = pool.backends
    pool.mark(A, True)  # already up: nothing changes
    assert pool.backends is view
    pool.mark(A, False)
    down = pool.backends
    assert down is not view and [b.healthy for b in down] == [False, True]
    pool.mark(A, True)
    assert pool.backends is not down and all(b.healthy for b in pool.backends)
    same = pool.backends
    pool.replace([Backend(B)])
    assert pool.backends is not same and [b.address for b in pool.backends] == [B]


def test_a_fleet_past_the_rate_is_visited_a_slice_per_round_and_every_backend_in_turn():
    rotation = Rotation()
    rotation.pace(1.0, 2.0)  # two a round
    fleet = [f"b{i}" for i in range(5)]
    rounds = [rotation.take(fleet) for _ in range(5)]
    assert rounds == [["b0", "b1"], ["b2", "b3"], ["b4", "b0"], ["b1", "b2"], ["b3", "b4"]]
    assert Rotation().take(fleet) == fleet  # no rate: all of it, each round
    rotation.pace(4.0, 2.0)
    assert rotation.take(fleet) == fleet  # within the rate: all of it, each round
    rotation.pace(200.0, 2.0)
    assert rotation.per_round == 400
    rotation.pace(0.1, 0.25)
    assert rotation.per_round == 1


def test_probes_past_the_rate_take_a_slice_but_a_suspect_at_once():
    async def scenario() -> None:
        runners = await serve([0, 0, 0, 0], SimConfig())
        up = [f"127.0.0.1:{r.addresses[0][1]}" for r in runners]
        dead = "127.0.0.1:9"  # nothing listens: refused
        pool = BackendPool([Backend(a) for a in [*up, dead]], lambda _: None, unhealthy_after=2)
        seen: list[str] = []
        observe = pool._observe

        def counting(address: str, result: str, suspect: bool) -> None:
            seen.append(address)
            observe(address, result, suspect)

        pool._observe = counting  # type: ignore[method-assign]  # which addresses each round probed
        pool._rotation.per_round = 2
        client = PageClient(1.0)
        await pool._probe_round(client)
        assert seen == up[:2]
        pool.mark_suspect(dead)
        seen.clear()
        await pool._probe_round(client)
        assert seen == [*up[2:4], dead]
        client.close()
        for runner in runners:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_suspect_wakes_a_round_of_its_own_even_when_reported_during_one():
    """Woken for a suspect, the loop probes the suspect alone (probing every backend at each
    refused connection counted failures against all of them, dropping one after a blip), and a
    suspect reported while a round is under way is probed as it ends, not an interval later."""
    dead = "127.0.0.1:9"

    async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads, never answers: each probe waits its timeout

    async def scenario() -> tuple[list[str], float, dict[str, int]]:
        servers = [await asyncio.start_server(silent, "127.0.0.1", 0) for _ in range(5)]
        others = [f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers]
        dropped: list[str] = []
        pool = BackendPool([Backend(a) for a in [dead, *others]], dropped.append, unhealthy_after=3)
        rounds = _recorded_rounds(pool)
        probes = asyncio.create_task(pool.probe_forever(3600, 0.3))
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(0.1)  # the first (scheduled) round is under way: its probes wait 0.3 s
            reported = loop.time()
            pool.mark_suspect(dead)
            await _until(lambda: dropped, 100)  # (its own probe confirmed it down)
            taken = loop.time() - reported
        finally:
            await _stop(probes)
            for server in servers:
                server.close()
        return rounds, taken, {a: pool._slow.get(a, 0) + pool._failures.get(a, 0) for a in others}

    rounds, taken, counted = asyncio.run(scenario())
    assert rounds[:2] == ["scheduled", "suspects"], rounds
    assert all(count <= 1 for count in counted.values()), counted  # only the scheduled round's
    assert taken < 2.0, taken  # as the first round ended, not at the next interval (an hour)


def test_refused_connections_reported_more_often_than_the_interval_do_not_put_off_its_round():
    """Each suspect woke the loop and its wait started over, so with Envoy reporting refused
    connections more often than the interval the whole fleet's round never came again: a backend
    down was never probed back up."""

    async def scenario() -> list[str]:
        runners = await serve([0], SimConfig())
        alive = f"127.0.0.1:{runners[0].addresses[0][1]}"
        pool = BackendPool([Backend(alive), Backend("127.0.0.1:9")], lambda _a: None, unhealthy_after=1)
        rounds = _recorded_rounds(pool)
        probes = asyncio.create_task(pool.probe_forever(0.3, 1.0))
        try:
            for _ in range(15):  # 1.5 s of reports every 0.1 s: five intervals
                await asyncio.sleep(0.1)
                pool.mark_suspect(alive)
        finally:
            await _stop(probes, runners)
        return rounds

    rounds = asyncio.run(scenario())
    assert rounds.count("scheduled") >= 3, rounds
