"""Replicas sharing one picture through a real Redis: routers in one event loop, each with its own
link, as separate ext_proc processes would be (the Envoy test with processes is test_replicas_envoy)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
from redis.asyncio import Redis

from bench.harness.store import PASSWORD, RedisServer
from extproc.core.calibration import DEFAULT_BYTES_PER_TOKEN, PRIOR_TOKENS
from extproc.core.decision import Label
from extproc.core.exchange import Reset
from extproc.core.flow import FlowQueue, Held, QueueLimits, Refusal
from extproc.core.load import PeerLoads
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.replicas.redis_link import APPLY_BLOCKS, APPLY_SLICE, FLOWS, RedisLink, _load_vector
from extproc.runtime.pool import BackendPool
from tests.test_router import FLEET, A, chat, ok

KEY = b"test-key-16bytes"
GROUP = "kvroute:test"


class Replica:
    """One router, its pool and its link, running."""

    def __init__(self, server: RedisServer, key: bytes = KEY, group: str = GROUP, **link: Any) -> None:
        self.router = Router(Settings(hash_key=key))
        self.pool = BackendPool(FLEET, self.router.remove_backend, 2)
        client = Redis.from_url(server.url, password=PASSWORD, socket_timeout=5.0, socket_connect_timeout=1.0)
        self.group = group
        self.queue = FlowQueue(QueueLimits(max_total=10))
        self.link = RedisLink(
            self.router, self.pool, client, group, heartbeat_s=0.2, peer_max_age_s=0.6, flows=self.queue, **link
        )
        self.router.replicas = self.link
        self.task = asyncio.create_task(self.link.run())

    async def stop(self, clean: bool = True) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if not clean:
                self.link.connected = False  # a crash: no goodbye
            await self.task

    def serve(self, request, now: float) -> str:
        exchange = self.router.begin(request, self.pool.backends, now)
        backend = exchange.decision.backend
        assert backend is not None
        self.router.response_started(exchange, ok(backend), now)
        exchange.end()
        return backend


async def until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait for a condition; generous, since the machine is shared (latency is measured in bench)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        code = getattr(check, "__code__", None) or check.func.__code__  # a lambda or a partial
        assert time.monotonic() < deadline, f"condition of line {code.co_firstlineno} not met in {timeout_s} s"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def replicas(server: RedisServer, count: int, **link: Any) -> AsyncIterator[list[Replica]]:
    name = f"{GROUP}:{secrets.token_hex(4)}"  # each test's replicas alone: no stream left by another test
    group = [Replica(server, group=name, **link) for _ in range(count)]
    try:
        await until(lambda: all(r.link.connected for r in group))
        yield group
    finally:
        for replica in group:
            await replica.stop()


def now() -> float:
    return time.monotonic()


def bound(router: Router, session: str) -> bool:
    return router.sessions.get(session, now()) is not None


def in_loop(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test in its own event loop (fixtures still reach it through the signature)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@in_loop
async def test_a_conversation_stays_on_one_backend_across_replicas(redis_server):
    async with replicas(redis_server, 3) as group:
        history: list[dict[str, Any]] = []
        served = []
        for turn in range(6):
            replica = group[turn % 3]  # every turn through another replica
            if turn:
                await until(functools.partial(bound, replica.router, "session:conv"))
            question = f"turn {turn}"
            served.append(replica.serve(chat(history, "conv", question), now()))
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": "answer " * 50}]
        assert len(set(served)) == 1


@in_loop
async def test_a_prefix_learned_through_one_replica_is_found_through_another(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        backend = first.serve(chat([], None, "question one"), now())
        request = chat([], None, "question two")  # the same long system prompt and tools
        await until(lambda: second.router.query(request, second.pool.backends, now()).matched_blocks > 0)
        decision = second.router.query(request, second.pool.backends, now())
        assert (decision.label, decision.backend) == (Label.PREFIX_MATCH, backend)
        await until(lambda: first.link.counts["sent"] == 1)  # counted once the store answered its write
        assert second.link.counts["applied"] == 1  # the chain (no session)
        assert second.link.lag_s < 30  # how old it was when applied, on this process's clock (not the store's)


@in_loop
async def test_load_through_one_replica_is_load_for_all_and_returns_to_zero(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        chains = [[*range(7), *range(100 * turn, 100 * turn + 5)] for turn in range(1, 6)]
        held = [first.router.loads.reserve(A, 10, chain=chain) for chain in chains]
        await until(lambda: second.router.loads.get(A).peer_active == 5)
        # five prompts of twelve blocks sharing a head of seven: 32 distinct blocks held
        assert (second.router.loads.get(A).peer_reserved, second.router.loads.get(A).peer_footprint) == (50, 32)
        for reservation in held:
            reservation.finish()
        await until(lambda: second.router.loads.get(A).peer_active == 0)
        assert (second.router.loads.get(A).peer_reserved, second.router.loads.get(A).peer_footprint) == (0, 0)


@in_loop
async def test_bytes_per_token_counts_every_replicas_requests(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        for replica in (first, second):  # the engines' counters start here
            for backend in (b.address for b in FLEET):
                replica.router.bytes_per_token.engine_tokens(backend, 1000.0)
        # The sibling's first report of the first replica's bytes is only a baseline: wait for it,
        # or under a busy machine that report could come after the requests and count none of them.
        baseline = [(first.link.replica, b.address) for b in FLEET]
        await until(lambda: all(key in second.link._peer_sent for key in baseline))
        for turn in range(20):
            backend = first.serve(chat([], "bytes", f"question {turn}"), now())  # a session: all on one backend
        sent = first.router.bytes_per_token.sent[backend]
        ratio = second.router.bytes_per_token
        await until(lambda: ratio._pending_bytes.get(backend, 0) > 0)
        ratio.engine_tokens(backend, 1000.0 + sent / 2.5)  # the engine counted the sibling's requests
        # 2.5 bytes a token, weighed with the prior; without the sibling's bytes it would fall to about 1.4
        expected = (PRIOR_TOKENS * DEFAULT_BYTES_PER_TOKEN + sent) / (PRIOR_TOKENS + sent / 2.5)
        assert ratio.value == pytest.approx(expected, rel=0.02) and ratio.value > 2.5


@in_loop
async def test_a_replica_that_dies_stops_counting_and_one_that_starts_replays(redis_server):
    async with replicas(redis_server, 1) as (survivor,):
        dying = Replica(redis_server, group=survivor.group)
        await until(lambda: dying.link.connected)
        backend = dying.serve(chat([], "s1", "hello"), now())
        dying.router.loads.reserve(A, 3)  # never released: the replica crashes with it
        await until(lambda: survivor.router.loads.get(A).peer_active == 1)
        await until(lambda: dying.link.counts["sent"] >= 2)  # its chain and session reached the store
        await dying.stop(clean=False)
        await until(lambda: survivor.router.loads.get(A).peer_active == 0)  # its heartbeats stopped
        late = Replica(redis_server, group=survivor.group)  # starts after the fact: replays the stream
        try:
            await until(lambda: late.link.connected)
            assert late.router.sessions.get("session:s1", now()) == backend
            decision = late.router.query(chat([], None, "other"), late.pool.backends, now())
            assert decision.backend == backend and decision.matched_blocks > 0
        finally:
            await late.stop()


@in_loop
async def test_a_replica_starting_on_a_long_stream_routes_while_it_replays_and_its_siblings_hear_of_it(redis_server):
    """The replay at start is applied a slice at a time, so requests are routed meanwhile (a page
    of 1,000 agent-prompt chains held the loop some 3 s); what the starting replica learns then
    waits for the writer instead of being dropped as if the store were away."""
    async with replicas(redis_server, 1) as (sibling,):
        client = Redis.from_url(redis_server.url, password=PASSWORD)
        keys = random.Random(1)
        async with client.pipeline(transaction=False) as pipe:
            for _ in range(1_100):  # more than a page of the replay
                chain = [keys.getrandbits(60) for _ in range(APPLY_BLOCKS // 2)]
                pipe.xadd(f"{sibling.group}:events", {"m": msgpack.packb(("l", "other", A, chain))})
            await pipe.execute()
        late = Replica(redis_server, group=sibling.group)
        try:
            await until(lambda: late.link.counts["applied"] > 0)
            assert not late.link.connected  # still replaying: a request comes
            backend = late.serve(chat([], None, "learned while replaying"), now())
            await until(lambda: late.link.connected)
            assert late.link.counts["dropped"] == 0
            await until(
                lambda: (
                    sibling.router.query(
                        chat([], None, "learned while replaying"), sibling.pool.backends, now()
                    ).matched_blocks
                    > 0
                )
            )
            assert sibling.router.query(chat([], None, "learned while replaying"), FLEET, now()).backend == backend
        finally:
            await late.stop()
        await client.aclose()


@in_loop
async def test_a_replica_that_stops_first_forwards_the_ends_it_was_given(redis_server):
    """A request's end (an access-log entry, ext_authz transport) that reached a replica as it
    stops still reaches the sibling that decided the request: the link sends what is queued before
    its goodbye, or that sibling would count the request in flight until its sweep."""
    async with replicas(redis_server, 1) as (decider,):
        ended: list[bytes] = []
        decider.link.on_end = ended.append
        stopping = Replica(redis_server, group=decider.group)
        await until(lambda: stopping.link.connected)
        stopping.task.cancel()  # stopping: its writer gets no turn before it is cancelled too
        assert stopping.link.forward_end(decider.link.replica, b"an entry")
        await stopping.stop()
        await until(lambda: ended == [b"an entry"])


@in_loop
async def test_an_end_that_fails_to_apply_does_not_stop_the_link(redis_server):
    async with replicas(redis_server, 2) as (decider, sibling):
        ended: list[bytes] = []

        def on_end(entry: bytes) -> None:
            if entry == b"breaks":
                raise RuntimeError("a bug in applying it")
            ended.append(entry)

        decider.link.on_end = on_end
        assert sibling.link.forward_end(decider.link.replica, b"breaks")
        assert sibling.link.forward_end(decider.link.replica, b"an entry")
        await until(lambda: ended == [b"an entry"])
        assert decider.link.connected and not decider.task.done() and decider.link.counts["bad"] == 1


@in_loop
async def test_routing_goes_on_while_the_store_is_away_and_sharing_resumes(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        redis_server.stop()
        await until(lambda: not first.link.connected and not second.link.connected)
        assert first.link.warnings() and "replica store" in first.link.warnings()[0]
        for turn in range(5):  # still routing, on the local picture
            first.serve(chat([], f"away-{turn}", "while away"), now())
        assert first.link.counts["dropped"] >= 5
        redis_server.start()
        await until(lambda: first.link.connected and second.link.connected, timeout_s=20)
        backend = first.serve(chat([], "back", "after"), now())
        await until(lambda: second.router.sessions.get("session:back", now()) == backend)


@in_loop
async def test_a_reconnection_replays_only_what_was_missed(redis_server):
    """A blink of the store replayed the whole stream: a sibling's chain and binding for a backend
    whose cache this replica had since seen reset came back with it."""
    async with replicas(redis_server, 2) as (first, second):
        backend = first.serve(chat([], "gone", "before the restart"), now())
        await until(lambda: second.router.sessions.get("session:gone", now()) == backend)
        second.router.reset_backend(backend, Reset.RESTART)  # its engine restarted: nothing of it holds
        assert second.router.sessions.get("session:gone", now()) is None
        errors = [r.link.counts["store_errors"] for r in (first, second)]
        admin = Redis.from_url(redis_server.url, password=PASSWORD)
        try:
            await admin.client_kill_filter(_type="normal", skipme=True)  # every replica's connection, once
        finally:
            await admin.aclose()
        await until(
            lambda: all(r.link.counts["store_errors"] > e for r, e in zip((first, second), errors, strict=True))
        )
        await until(lambda: first.link.connected and second.link.connected)
        later = first.serve(chat([], "after", "after the blink"), now())
        await until(lambda: second.router.sessions.get("session:after", now()) == later)  # following again
        assert second.router.sessions.get("session:gone", now()) is None  # not replayed back


@in_loop
async def test_what_a_failed_write_held_is_counted_lost(redis_server):
    """The store refuses a write (here: out of memory, writes refused): the learning it carried is
    counted dropped, not lost unsaid, and the link reconnects."""
    async with replicas(redis_server, 1) as (only,):
        admin = Redis.from_url(redis_server.url, password=PASSWORD)
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")
            dropped = only.link.counts["dropped"]
            only.serve(chat([], "refused", "while full"), now())
            await until(lambda: only.link.counts["store_errors"] > 0)
            assert only.link.counts["dropped"] > dropped
        finally:
            await admin.config_set("maxmemory", "0")
            await admin.aclose()
        await until(lambda: only.link.connected)


@in_loop
async def test_replicas_with_another_hash_key_do_not_share(redis_server):
    async with replicas(redis_server, 1) as (member,):
        stranger = Replica(redis_server, key=b"another-key-16by", group=member.group)
        try:
            await until(lambda: stranger.link.counts["store_errors"] > 0)
            assert not stranger.link.connected and "hash_key" in stranger.link.warnings()[0]
        finally:
            await stranger.stop()


@in_loop
async def test_malformed_and_foreign_entries_are_skipped(redis_server):
    async with replicas(redis_server, 1) as (replica,):
        client = Redis.from_url(redis_server.url, password=PASSWORD)
        junk = [
            b"not msgpack \xc1",
            msgpack.packb(("l", "other", A, ["not", "ints"])),
            msgpack.packb(("l", "other", A, [1, 2**63])),  # not a chain hash (60 bits): the index has no room for it
            msgpack.packb(("l", "other", A, [-1])),
            msgpack.packb(("s", "other", A, b"short")),
            msgpack.packb(("x", "other", A, 1)),
            msgpack.packb(("l", "other", "10.9.9.9:8000", [1, 2, 3])),  # not a backend of this pool
            msgpack.packb(("L", "other", "", {A: "bad"})),
            msgpack.packb(("F", "other", "", ([(0, {"x" * 500: 1.0})], 0))),  # a flow id no replica sends
            msgpack.packb(("L", "other", "", {A: (float("inf"), 0, 0)})),  # int() of it once stopped the link
            msgpack.packb(("L", "other", "", {A: (-5, 0, 0)})),
            msgpack.packb(("L", "other", "", {A: (1 << 40, 1, 0)})),
            # past MAX_ENTRY_BYTES (empty maps: 80 times their bytes once decoded), not decoded
            b"\x94\xa1L\xa5other\xa0\xdd\x00\x12\x00\x00" + b"\x80" * 0x120000,
            msgpack.packb(("L", "other", "", {f"k{i}": 0 for i in range(70_000)})),  # more than any fleet
        ]
        for message in junk:
            await client.xadd(f"{replica.group}:events", {"m": message})
        await until(lambda: replica.link.counts["bad"] >= 13)
        assert replica.router.index.entries_by_backend().get("10.9.9.9:8000") is None
        assert replica.link.counts["applied"] == 0
        # the link still follows: a sibling's learning after all that is applied
        await client.xadd(f"{replica.group}:events", {"m": msgpack.packb(("l", "other", A, [1, 2, 3]))})
        await until(lambda: replica.link.counts["applied"] == 1)
        assert replica.link.connected and replica.link.counts["bad"] == 13
        await client.aclose()


def test_a_siblings_load_vector_is_bounded_and_kept_to_this_replicas_backends():
    known = {A}.__contains__
    invented = {f"10.9.{i // 250}.{i % 250}:8000": (1, 1, 0) for i in range(2000)}
    assert _load_vector(invented | {A: (4, 2, 10**12, 30)}, known) == {A: (4, 2, 10**12, 30)}
    assert _load_vector({A: (4, 2, 7)}, known) == {A: (4, 2, 7, 0)}  # a replica of before the footprint
    assert _load_vector({A: (4, 2, 7, 3, "later", 9)}, known) == {A: (4, 2, 7, 3)}  # a later one's extra counts
    bad_vectors = [(float("inf"), 0, 0), (-1, 0, 0), (0, 1 << 31, 0), (0, 0, -1), (1.5, 0, 0), ("3", 0, 0), (1, 2)]
    bad_vectors += [(0, 0, 0, -1), (0, 0, 0, 1 << 31), (0, 0, 0, 1.0), "0000", {0: 0, 1: 0, 2: 0}, 7, None]
    for bad in bad_vectors:
        with pytest.raises((ValueError, TypeError)):
            _load_vector({A: bad}, known)


def test_peer_loads_forget_a_backend_no_sibling_loads_any_more():
    peers = PeerLoads(max_age_s=1.0)
    peers.update("r1", {f"10.9.0.{i}:8000": (1, 1, 4) for i in range(100)}, 0.0)
    peers.update("r1", {A: (2, 1, 8)}, 0.1)
    assert peers.totals(0.2) == {A: (2, 1, 8)} and len(peers._sums) == 1  # (the table, not only the view)
    peers.changes(5.0)  # r1 went quiet
    assert peers.totals(5.0) == {} and not peers._sums


@pytest.mark.parametrize("size", [1, 3])
@in_loop
async def test_stream_is_capped(redis_server, size):
    async with replicas(redis_server, size, max_events=50) as group:
        for turn in range(300):
            group[turn % size].serve(chat([], f"cap-{turn}", f"q{turn}"), now())
        await until(lambda: group[0].link.counts["sent"] >= 600 // size)
        client = Redis.from_url(redis_server.url, password=PASSWORD)
        length = await client.xlen(f"{group[0].group}:events")
        ttl = await client.pttl(f"{group[0].group}:events")
        await client.aclose()
        assert length < 300 and 0 < ttl <= 3600_000  # approximate trimming keeps about max_events


@in_loop
async def test_flow_controls_fairness_and_bound_hold_for_the_fleet(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        for i in range(4):
            first.queue.hold(0, "a", 100, 1, now=i)
        for _ in range(3):
            first.queue.pop()  # "a" served 300 through the first replica; one still held there
        second.queue.hold(0, "a", 100, 1, now=10)
        second.queue.hold(0, "b", 100, 1, now=10)
        await until(lambda: second.queue._peer_attained.get(0, {}).get("a") == 300.0)
        assert second.queue.pop().flow == "b"  # "a" had its share elsewhere
        await until(lambda: second.queue._peer_held == 1)
        for i in range(8):
            assert isinstance(second.queue.hold(0, "c", 1, 1, now=11 + i), Held)
        assert second.queue.hold(0, "c", 1, 1, now=20) is Refusal.QUEUE_FULL  # 10 for the fleet, not each
        await first.stop(clean=False)  # a sibling that dies: what it holds stops counting, what it
        await until(lambda: second.queue._peer_held == 0)  # served does not (or "a" would jump the rest)
        assert second.queue._peer_attained == {0: {"a": 300.0}}
        assert isinstance(second.queue.hold(0, "c", 1, 1, now=21), Held)


@in_loop
async def test_flow_names_reach_the_store_only_as_digests_and_siblings_read_them_back(redis_server):
    """A flow is a tenant's name (its fairness id or tenant header): the store holds its keyed
    digest, as it does sessions', and a sibling tracking the same flow reads its share back."""
    async with replicas(redis_server, 2) as (first, second):
        for i in range(2):
            first.queue.hold(0, "tenant-acme-corp", 100, 1, now=i)
        first.queue.pop()
        second.queue.hold(0, "tenant-acme-corp", 100, 1, now=5)
        await until(lambda: second.queue._peer_attained.get(0, {}).get("tenant-acme-corp") == 100.0)
        client = Redis.from_url(redis_server.url, password=PASSWORD)
        try:
            entries = await client.xrange(f"{first.group}:load")
        finally:
            await client.aclose()
        flows = [fields[b"m"] for _, fields in entries if msgpack.unpackb(fields[b"m"])[0] == FLOWS]
        assert flows and not any(b"acme" in message for message in flows)


@in_loop
async def test_with_the_store_away_each_replica_falls_back_to_its_own_share_and_bound(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        for i in range(3):
            first.queue.hold(0, "a", 100, 1, now=i)
        first.queue.pop()  # "a" served 100 through the first replica; two still held there
        a = second.link._digest("a")  # a flow the second does not track stays by its digest
        await until(lambda: second.queue._peer_attained.get(0, {}).get(a) == 100.0 and second.queue._peer_held == 2)
        redis_server.stop()
        await until(lambda: not second.link.connected)
        assert second.link.warnings() and "replica store" in second.link.warnings()[0]  # /readyz says so
        # What the siblings hold no longer bounds this replica, and what they serve from now on is
        # not heard: its share of new turns is its own. What they had served still counts, so no
        # flow is handed every turn for the outage (nor the others when the store is back).
        await until(lambda: second.queue._peer_held == 0)
        assert second.queue._peer_attained == {0: {a: 100.0}}
        for i in range(10):
            assert isinstance(second.queue.hold(0, "c", 1, 1, now=11 + i), Held)  # 10 held here alone
        redis_server.start()
        await until(lambda: first.link.connected and second.link.connected, timeout_s=20)


@in_loop
async def test_a_replica_leaves_a_turn_to_the_sibling_holding_the_less_served_flow(redis_server):
    async with replicas(redis_server, 2) as (first, second):
        for i in range(3):
            second.queue.hold(0, "a", 100, 1, now=i)
        second.queue.pop()  # "a" served 100 through the second replica, two still held there
        first.queue.hold(0, "b", 100, 1, now=5)  # "b", served nothing, waits at the first
        await until(lambda: second.queue._peer_heads == {0: 0.0})
        assert second.queue.pop(now=now()) is None  # "b"'s turn, and it is the first replica's
        assert first.queue.pop(now=now()).flow == "b"  # ...which takes it (the fleet's least served)
        await until(lambda: 0 not in second.queue._peer_heads)
        assert second.queue.pop(now=now()).flow == "a"  # nothing waits elsewhere: its own goes at once


@in_loop
async def test_replicas_agree_on_one_adapter_load_and_the_store_away_leaves_each_acting_alone(redis_server):
    from bench.simulator.sim import SimConfig, serve
    from extproc.core.backends import Backend
    from extproc.runtime.placer import AdapterPlacer

    runners = await serve([0, 0], SimConfig(runtime_lora=True, max_loras=1))
    servers = [f"127.0.0.1:{runner.addresses[0][1]}" for runner in runners]
    settings = Settings(hash_key=KEY, adapter_sources={"sql": "/adapters/sql"})
    try:
        async with replicas(redis_server, 2) as (one, two):
            placers = []
            for replica in (one, two):
                replica.router.reconfigure(settings)
                replica.pool = BackendPool([Backend(s) for s in servers], replica.router.remove_backend, 2)
                for server in servers:
                    replica.router.adapters.listing(server, [])
                placer = AdapterPlacer(replica.router, replica.pool, claim=replica.link.claim)
                placer.placement.wanted(settings, "sql", time.monotonic())
                placers.append(placer)
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(placer.round(session) for placer in placers))
            moves = [sum(p.placement.counts.values()) for p in placers]
            assert sorted(moves) == [0, 1]  # one replica loaded it, the other left it to that one
            assert await one.link.claim("other", 5.0) and not await two.link.claim("other", 5.0)
            assert await one.link.claim("other", 5.0)  # its own claim holds for itself
        # with no store to ask, a replica acts alone, as without siblings
        router = Router(Settings(hash_key=KEY))
        away = RedisLink(
            router, BackendPool(FLEET, router.remove_backend, 2), Redis.from_url("redis://127.0.0.1:9"), GROUP
        )
        assert await away.claim("sql", 5.0)
    finally:
        for runner in runners:
            await runner.cleanup()


@in_loop
async def test_siblings_move_an_adapter_as_told_forget_the_word_unless_said_again_and_skip_a_stale_one(
    redis_server, monkeypatch
):
    from extproc.replicas import redis_link

    async with replicas(redis_server, 2) as (one, two):
        old, new, other = (b.address for b in FLEET[:3])
        two.router.reconfigure(dataclasses.replace(two.router.settings, adapter_sources=(("ours", "/adapters/ours"),)))
        book = two.router.adapters
        for backend in (old, other):
            book.listing(backend, ["ours"])
        book.listing(new, [])
        # a word older than LEAVING_FRESH_S is not applied (here every word is); the chain after it is
        monkeypatch.setattr(redis_link, "LEAVING_FRESH_S", -60.0)
        one.link.adapter_leaving(old, "ours", new)
        one.serve(chat([], None, "question one"), now())
        await until(lambda: two.link.counts["applied"] >= 2)
        assert book.listers("ours", [old, new]) == [old]
        monkeypatch.setattr(redis_link, "LEAVING_FRESH_S", 30.0)
        one.link.adapter_leaving(old, "ours", new)
        # the new copy counts before its listing is read again, the old one takes no new requests
        await until(lambda: book.listers("ours", [old, new, other]) == [new, other])
        assert book.any_leaving()
        monkeypatch.setattr(redis_link, "LEAVING_FRESH_S", 0.5)  # not said again: forgotten
        await until(lambda: not book.any_leaving(), timeout_s=5)
        assert book.listers("ours", [old, new]) == [old, new]
        one.link.adapter_leaving(old, "not a name!", new)  # malformed: counted, skipped
        one.link.adapter_leaving(old, "ours", "10.9.9.9:1")  # to a backend not in the pool: skipped
        one.link.adapter_leaving(old, "theirs", new)  # an adapter the policy does not place: skipped
        await until(lambda: two.link.counts["bad"] == 3)
        assert not book.any_leaving() and book.listers("theirs", [old, new, other]) == []
        # a word heard before the store went away still ages out while it is away
        monkeypatch.setattr(redis_link, "LEAVING_FRESH_S", 30.0)
        one.link.adapter_leaving(old, "ours", new)
        await until(book.any_leaving)
        redis_server.stop()
        try:
            await until(lambda: not two.link.connected)
            monkeypatch.setattr(redis_link, "LEAVING_FRESH_S", 0.5)
            await until(lambda: not book.any_leaving(), timeout_s=8)
        finally:
            redis_server.start()


@pytest.mark.parametrize(
    ("entries", "blocks", "turns"),
    [
        (2_000, 32, 2_000 // APPLY_SLICE // 2),  # a slice of entries; whole read batches gave 3 turns
        (4 * APPLY_SLICE, APPLY_BLOCKS, 4 * APPLY_SLICE // 2),  # a turn per chain; per 32 entries gave 5
    ],
)
@in_loop
async def test_a_backlog_of_siblings_learning_is_applied_between_the_requests_routed(
    redis_server, entries, blocks, turns
):
    """Sibling chains arrive at once: the link applies them a slice at a time and lets the event
    loop run in between (a ticker sees the count of applied entries move in steps), rather than
    holding the loop while requests wait. A slice is cut by its entries and by the blocks of their
    chains: agent prompts make chains of hundreds of blocks (32 of 940 held the loop about 100 ms).
    How fast: `bench replica-lag --ingest`."""
    async with replicas(redis_server, 1) as (replica,):
        client = Redis.from_url(redis_server.url, password=PASSWORD)
        seen: set[int] = set()

        async def ticker() -> None:
            while True:
                seen.add(replica.link.counts["applied"])
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        keys = random.Random(0)  # chain hashes are spread over 60 bits; consecutive ones would pile up in probes
        async with client.pipeline(transaction=False) as pipe:
            for _ in range(entries):
                chain = [keys.getrandbits(60) for _ in range(blocks)]
                pipe.xadd(f"{replica.group}:events", {"m": msgpack.packb(("l", "other", A, chain))})
            await pipe.execute()
        await until(lambda: replica.link.counts["applied"] >= entries)
        task.cancel()
        assert len(seen) >= turns
        await client.aclose()


@in_loop
async def test_between_whole_vectors_a_replica_sends_only_the_backends_whose_load_changed(redis_server):
    async with replicas(redis_server, 2) as (one, two):
        client = Redis.from_url(redis_server.url, password=PASSWORD)

        async def messages() -> list[tuple[str, dict]]:
            entries = await client.xrange(f"{one.group}:load")
            unpacked = [msgpack.unpackb(fields[b"m"], use_list=False) for _, fields in entries]
            return [(kind, vector) for kind, replica, _, vector in unpacked if replica == one.link.replica]

        await until(lambda: len(two.link._peers) == 1)
        before = len(await messages())
        exchange = one.router.begin(chat([], session="s"), one.pool.backends, now())
        backend = exchange.decision.backend
        await until(lambda: two.router.loads.get(backend).peer_active == 1)
        exchange.end()
        await until(lambda: two.router.loads.get(backend).peer_active == 0)
        sent = (await messages())[before:]
        deltas = [vector for kind, vector in sent if kind == "D"]  # unless both changes fell on a beat
        assert deltas and all(set(vector) == {backend} for vector in deltas)
        assert any(kind == "L" and len(vector) == len(FLEET) for kind, vector in await messages())
        await client.aclose()


def test_a_stop_that_redis_py_swallows_during_the_setup_still_stops_the_link(redis_server):
    """redis-py sends each command through asyncio.wait_for, which on Python 3.11 can swallow a
    cancel that comes as the command completes: the link must not go on to follow the store (with
    tasks of its own nobody cancels), or the ext_proc's shutdown waits for ever. The swallow is
    made here as wait_for makes it: the task's cancel is requested and then not raised."""

    async def scenario() -> None:
        replica = Replica(redis_server)
        client = replica.link._client
        real_time = client.time

        async def time_then_swallow() -> Any:
            answer = await real_time()
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
            return answer

        client.time = time_then_swallow  # type: ignore[method-assign]
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(10):  # (a link that went on following never ends: TimeoutError)
                await replica.task  # stopped, never connected
        assert replica.task.done() and not replica.link.connected

    asyncio.run(scenario())
