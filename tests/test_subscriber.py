"""The KV event subscriber against real ZMQ sockets: a publisher that speaks vLLM's protocol
(PUB + ROUTER replay), including the garbage, restarts and gaps a real one can produce."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import selectors
import threading
import time
from typing import Any

import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from extproc.core.backends import Backend
from extproc.core.exchange import Reset
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime.pool import BackendPool
from extproc.vllm import subscriber as subscriber_module
from extproc.vllm.events import EventError, decode
from extproc.vllm.subscriber import END_SEQ, EventSubscriber, sources
from tests.e2e import until

BLOCK = 4


def stored(hash_: int, parent: int | None, start: int) -> dict:
    tokens = list(range(start, start + BLOCK))
    return {"type": "BlockStored", "block_hashes": [hash_], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip


def message(sequence: int, events: list) -> list[bytes]:
    return [b"kv", sequence.to_bytes(8, "big"), msgpack.packb([0.0, events, 0])]


class Engine:
    """The engine side: a /kv_event_sources page, a PUB socket and (optionally) a replay ROUTER."""

    def __init__(self, context: zmq.asyncio.Context, replay: bool) -> None:
        self.pub = context.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.history: list[list[bytes]] = []
        self.replays = 0  # replay requests served
        self.router = None
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
        if replay:
            self.router = context.socket(zmq.ROUTER)
            config["replay_endpoint"] = f"tcp://*:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.sources = {"0": config}

    async def send(self, sequence: int, events: list, publish: bool = True) -> None:
        frames = message(sequence, events)
        self.history.append(frames)
        if publish:
            await self.pub.send_multipart(frames)

    async def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            for frames in self.history:
                if int.from_bytes(frames[1], "big") >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", *frames])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


_until = functools.partial(until, timeout_s=5.0)


async def _scenario(replay: bool, steps) -> tuple[Router, EventSubscriber]:
    context = zmq.asyncio.Context()
    engine = Engine(context, replay)
    app = web.Application()

    async def kv_event_sources(request: web.Request) -> web.StreamResponse:
        """The page in two writes apart, as a longer page (many data-parallel ranks) comes in
        several TCP reads: read to its end, not as far as it has come."""
        page = orjson.dumps(engine.sources)
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.content_length = len(page)
        await response.prepare(request)
        await response.write(page[:20])
        await asyncio.sleep(0.05)
        await response.write(page[20:])
        return response

    app.router.add_get("/kv_event_sources", kv_event_sources)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = f"127.0.0.1:{runner.addresses[0][1]}"
    router = Router(Settings())
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]
    pool = BackendPool([Backend(backend)], router.remove_backend, 1)
    subscriber = EventSubscriber(router, pool, discovery_interval_s=0.2)
    tasks = [asyncio.create_task(subscriber.run(follow_interval_s=0.05))]
    if replay:
        tasks.append(asyncio.create_task(engine.serve_replay()))
    try:
        await _until(lambda: subscriber.status.get(backend, "").startswith("subscribed"))
        await asyncio.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
        await steps(engine, router, subscriber, backend)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
        context.destroy(linger=0)
    return router, subscriber


def test_events_are_applied_and_garbage_is_counted_without_stopping_the_stream():
    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(0, [stored(1, None, 0)])
        await engine.pub.send_multipart([b"kv", b"\x00" * 8, b"\xc1 not msgpack"])
        await engine.pub.send_multipart([b"kv, one frame only"])
        await engine.send(1, [stored(2, 1, 4), {"type": "SomethingNew"}])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 2)

    router, subscriber = asyncio.run(_scenario(False, steps))
    assert subscriber.problems["bad_message"] == 2 and subscriber.problems["unknown_event"] == 1
    assert router.stats.resets[Reset.EVENTS_LOST] == 0


def test_a_sequence_that_goes_back_is_a_new_publisher_and_resets_the_backend():
    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(5, [stored(1, None, 0)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 1)
        await engine.send(0, [stored(7, None, 100)])
        await _until(lambda: router.stats.resets[Reset.SEQUENCE_RESTART] == 1)

    router, _ = asyncio.run(_scenario(False, steps))
    assert sum(router.index.entries_by_backend().values()) == 1  # only the new publisher's block


def test_a_gap_is_filled_from_the_replay_socket():
    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(0, [stored(1, None, 0)])
        await engine.send(1, [stored(2, 1, 4)], publish=False)  # missed by the subscriber
        await engine.send(2, [stored(3, 2, 8)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 3)

    router, subscriber = asyncio.run(_scenario(True, steps))
    assert subscriber.problems["gap"] == 1 and router.stats.resets[Reset.EVENTS_LOST] == 0


def test_a_gap_without_replay_drops_the_backends_picture():
    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(0, [stored(1, None, 0)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 1)
        await engine.send(3, [stored(9, None, 50)])
        await _until(lambda: router.stats.resets[Reset.EVENTS_LOST] == 1)

    router, _ = asyncio.run(_scenario(False, steps))
    assert sum(router.index.entries_by_backend().values()) == 1


def test_a_gap_wider_than_any_replay_buffer_is_lost_at_once_not_replayed():
    """An engine that jumps its sequence far ahead (a bug, or a hostile one) must not hold the
    feed in a replay that never ends: the gap is taken as lost, and the feed goes on."""

    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(0, [stored(1, None, 0)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 1)
        await engine.send(2**62, [stored(9, None, 50)])
        await _until(lambda: router.stats.resets[Reset.EVENTS_LOST] == 1)
        await engine.send(2**62 + 1, [stored(10, 9, 54)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 2)
        assert engine.replays == 0  # not asked: no engine keeps that many batches

    _, subscriber = asyncio.run(_scenario(True, steps))
    assert subscriber.problems["lost"] == 1


def test_a_subscription_that_fails_drops_what_its_events_said():
    """A consumer that dies (here: applying a batch raised) cannot tell what was removed meanwhile:
    the backend's event-fed picture goes, and the feed is discovered again."""

    async def steps(engine: Engine, router: Router, subscriber: EventSubscriber, backend: str) -> None:
        await engine.send(0, [stored(1, None, 0)])
        await _until(lambda: router.index.entries_by_backend().get(backend) == 1)
        applied = subscriber._apply

        def fails_once(*args: object) -> None:
            subscriber._apply = applied  # type: ignore[method-assign]
            raise RuntimeError("a bug in applying it")

        subscriber._apply = fails_once  # type: ignore[method-assign]
        await engine.send(1, [stored(2, 1, 4)])
        await _until(lambda: router.stats.resets[Reset.EVENTS_LOST] == 1)

    _, subscriber = asyncio.run(_scenario(False, steps))
    assert subscriber.problems["subscription_failed"] == 1


def test_only_publishers_on_the_backends_own_host_are_followed():
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": ""}
    found, status = sources({"0": {**config, "endpoint": "tcp://*:5557"}}, "10.0.0.1:8000")
    assert [s.endpoint for s in found] == ["tcp://10.0.0.1:5557"] and status.startswith("subscribed")
    found, status = sources({"0": {**config, "endpoint": "tcp://evil.example:5557"}}, "10.0.0.1:8000")
    assert not found and "not one the engine binds" in status
    for connecting in ("tcp://0.0.0.0:5557", "tcp://:5557"):  # vLLM connects out to these, binds nothing
        found, status = sources({"0": {**config, "endpoint": connecting}}, "10.0.0.1:8000")
        assert not found and "not one the engine binds" in status
    assert sources({}, "10.0.0.1:8000")[0] == [] and sources(["x"], "h:1")[0] == []
    assert sources({"0": {**config, "publisher": "null", "endpoint": "tcp://*:1"}}, "h:1")[0] == []


def _publisher_and_reader() -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.Socket[bytes]]:
    """A PUB socket on loopback and a plain SUB socket (as `_consume` reads) subscribed to it."""
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub: zmq.Socket[bytes] = zmq.Socket(context, zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return context, pub, sub


def test_batches_are_read_in_bursts_and_a_quiet_socket_is_woken_by_the_next_one():
    """The reader drains what is queued (in order, `BURST_MAX` at a time), waits its gap
    after a burst, and on a quiet socket sleeps until ZMQ has news: each batch sent after a quiet
    spell is still read (no lost wake-up), and a reader cancelled while waiting leaves the loop
    watching nothing."""

    async def scenario() -> tuple[list[int], int]:
        context, pub, sub = _publisher_and_reader()
        seen: list[int] = []

        async def read() -> None:
            async for frames in subscriber_module._bursts(sub, lambda: 0.02):
                seen.append(int.from_bytes(frames[1], "big"))

        reader = asyncio.create_task(read())
        sequence = 0
        while not seen:  # a PUB drops what it sends before the subscription reaches it
            await pub.send_multipart(message(sequence, []))
            sequence += 1
            await asyncio.sleep(0.01)
        await _until(lambda: seen[-1] == sequence - 1)
        first = sequence
        for _ in range(subscriber_module.BURST_MAX + 44):  # more than one burst, queued at once
            await pub.send_multipart(message(sequence, []))
            sequence += 1
        await _until(lambda: seen[-1] == sequence - 1)
        for _ in range(3):  # quiet spells, each ended by one batch
            await asyncio.sleep(0.1)
            await pub.send_multipart(message(sequence, []))
            sequence += 1
            await _until(lambda last=sequence - 1: seen[-1] == last)
        await asyncio.sleep(0.05)  # the reader is waiting for news again
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        watched = asyncio.get_running_loop().remove_reader(sub.getsockopt(zmq.FD))
        sub.close(linger=0)
        context.destroy(linger=0)
        return seen[seen.index(first) :], int(watched)

    seen, watched = asyncio.run(scenario())
    assert seen == list(range(seen[0], seen[0] + len(seen))) and len(seen) == subscriber_module.BURST_MAX + 44 + 3
    assert watched == 0  # the cancelled reader stopped watching its descriptor


class _CountingSelector(selectors.DefaultSelector):
    """Counts the times the event loop waited for something: its wake-ups."""

    waits = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout > 0:
            self.waits += 1
        return super().select(timeout)


def _wakeups(interval_s: float, gap_s: float, seconds: float) -> tuple[int, int]:
    """The event loop's wake-ups and the batches read while a publisher in another thread sends one
    every `interval_s` to a reader whose gap is `gap_s`."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub: zmq.Socket[bytes] = zmq.Socket(context, zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()
    read: list[int] = []

    def publish() -> None:
        sequence = 0
        while not stop.is_set():
            pub.send_multipart(message(sequence, []))
            sequence += 1
            time.sleep(interval_s)

    selector = _CountingSelector()

    async def scenario() -> tuple[int, int]:
        async def reader() -> None:
            async for _frames in subscriber_module._bursts(sub, lambda: gap_s):
                read.append(1)

        task = asyncio.create_task(reader())
        await until(lambda: len(read) > 2, timeout_s=5.0)  # subscribed, batches flowing
        waits, batches = selector.waits, len(read)
        await asyncio.sleep(seconds)
        waits, batches = selector.waits - waits, len(read) - batches
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return waits, batches

    publisher = threading.Thread(target=publish)
    publisher.start()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.close()
        stop.set()
        publisher.join()
        sub.close(linger=0)
        pub.close(linger=0)
        context.term()


def test_the_reader_wakes_once_a_batch_when_they_are_sparse_and_once_a_gap_when_dense():
    """An engine publishes a batch a step. Steps further apart than the gap (vLLM-CPU's, some 85 ms)
    cost one wake-up each, not a timer's and then the descriptor's; steps closer together than
    the gap (a GPU's) cost one wake-up a gap however fast they come."""
    waits, batches = _wakeups(0.15, 0.02, 1.5)
    assert batches >= 3 and waits <= batches + 2  # (the test's own sleep is one)
    waits, batches = _wakeups(0.005, 0.1, 1.5)
    assert batches >= 30 and waits <= 1.5 / 0.1 + 3


def test_the_gap_is_a_floor_also_after_a_burst_the_caller_made_long():
    """Batches closer together than the gap wait for it, also when the caller's handling of a
    batch (a replay) outlasts `BURST_S`, which ends the burst early."""

    async def scenario() -> float:
        context, pub, sub = _publisher_and_reader()
        seen: list[tuple[int, float]] = []
        loop = asyncio.get_running_loop()

        async def read() -> None:
            async for frames in subscriber_module._bursts(sub, lambda: 0.3):
                seen.append((int.from_bytes(frames[1], "big"), loop.time()))
                if seen[-1][0] >= 1000:
                    time.sleep(2 * subscriber_module.BURST_S)  # a slow batch: the burst is cut after it

        reader = asyncio.create_task(read())
        try:
            sequence = 0
            while not seen:  # a PUB drops what it sends before the subscription reaches it
                await pub.send_multipart(message(sequence, []))
                sequence += 1
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            await pub.send_multipart(message(1000, []))
            await _until(lambda: seen[-1][0] == 1000)
            await asyncio.sleep(0.05)
            await pub.send_multipart(message(1001, []))
            await _until(lambda: seen[-1][0] == 1001)
            return seen[-1][1] - seen[-2][1]
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            sub.close(linger=0)
            context.destroy(linger=0)

    assert asyncio.run(scenario()) >= 0.29


def test_approximate_mode_reads_a_backends_next_batches_a_gap_later():
    """Approximate mode uses the events for the engines' progress and clears, which can wait
    `kv_events_read_gap_s`; precise mode's picture is the events, so it reads them as they come
    (its prediction on real vLLM: tests/test_vllm_events.py)."""
    router = Router(Settings())
    subscriber = EventSubscriber(router, BackendPool([], router.remove_backend, 1), read_gap_s=0.25)
    assert not router.mode.precise and subscriber._gap() == 0.25
    assert subscriber._context.get(zmq.MAX_SOCKETS) >= 16_384  # ZMQ's own default, 1,023: a fleet of 1,000 backends
    subscriber._context.destroy(linger=0)


def test_a_backend_names_each_publisher_once_and_no_more_than_a_server_runs():
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv" * 1000}
    answer = {str(i): {**config, "endpoint": f"tcp://*:{5000 + i % 40}"} for i in range(20_000)}
    found, _ = sources(answer, "10.0.0.1:8000")
    assert len(found) == subscriber_module.MAX_SOURCES and len({s.endpoint for s in found}) == len(found)
    assert all(len(s.topic) <= 256 for s in found)
    twice = {"0": {**config, "endpoint": "tcp://*:1"}, "1": {**config, "endpoint": "tcp://10.0.0.1:1"}}
    assert len(sources(twice, "10.0.0.1:8000")[0]) == 1  # the same publisher, named two ways


def test_a_burst_whose_batches_take_long_to_apply_gives_the_loop_its_turns():
    """Reading and applying batches holds the loop for at most BURST_S before it gets a turn,
    however many are queued: a callback scheduled meanwhile runs after a batch or two, not after
    BURST_MAX of them."""

    async def scenario() -> list[int]:
        context, pub, sub = _publisher_and_reader()
        seen: list[int] = []
        turns: list[int] = []  # how many batches were applied when the loop's other work ran
        try:
            while not seen:  # a PUB drops what it sends before the subscription reaches it
                await pub.send_multipart(message(0, []))
                await asyncio.sleep(0.01)
                with contextlib.suppress(zmq.Again):
                    sub.recv_multipart(zmq.NOBLOCK)
                    seen.append(0)
            for sequence in range(1, 41):
                await pub.send_multipart(message(sequence, []))
            await asyncio.sleep(0.2)  # all queued at the reader

            async def read() -> None:
                async for frames in subscriber_module._bursts(sub, lambda: 0.0):
                    seen.append(int.from_bytes(frames[1], "big"))
                    time.sleep(0.003)  # a slow apply, holding the loop
                    if seen[-1] == 40:
                        return

            def other_work() -> None:
                turns.append(len(seen))
                if len(seen) < 41:
                    asyncio.get_running_loop().call_soon(other_work)

            asyncio.get_running_loop().call_soon(other_work)
            await asyncio.wait_for(read(), 5.0)
            return turns
        finally:
            sub.close(linger=0)
            context.destroy(linger=0)

    turns = asyncio.run(scenario())
    gaps = [b - a for a, b in itertools.pairwise(turns)]
    assert gaps and max(gaps) <= 3, turns  # 40 batches of 3 ms: a turn every 5 ms or so


def test_a_backend_that_left_during_a_replay_is_not_reset():
    """A replay outlasting its backend ended in a reset of nothing, counted as a reset all the same."""
    router = Router(Settings())
    pool = BackendPool([Backend("127.0.0.1:1")], router.remove_backend, 1)
    subscriber = EventSubscriber(router, pool)
    try:
        before = dict(router.stats.resets)
        subscriber._lost("127.0.0.2:1", Reset.SEQUENCE_RESTART)  # not in the pool
        assert dict(router.stats.resets) == before
        subscriber._lost("127.0.0.1:1", Reset.SEQUENCE_RESTART)
        assert dict(router.stats.resets) != before
    finally:
        subscriber._context.destroy(linger=0)


def test_a_message_of_many_frames_is_refused_having_copied_only_its_first_few():
    """ZMQ bounds each frame, not a message's count of them: a publisher's message of 200 frames
    (of 4 KiB here; of 1 MiB, 200 MiB got through) reaches the reader whole; only its first MAX_FRAMES
    are copied, and it decodes to nothing (refused), while the batch after it is read as usual."""

    async def scenario() -> list[list[bytes]]:
        context, pub, sub = _publisher_and_reader()
        received: list[list[bytes]] = []
        try:
            huge = [b"kv", *[b"x" * 4096] * 200]

            def seen(size: int) -> bool:
                return any(len(frames) == size for frames in received)

            # a PUB drops what it sends before the subscription reaches it: until both kinds came
            while not (seen(subscriber_module.MAX_FRAMES) and seen(3)):
                await pub.send_multipart(huge)
                await pub.send_multipart(message(1, []))
                await asyncio.sleep(0.01)
                with contextlib.suppress(zmq.Again):
                    while True:
                        received.append(subscriber_module._receive(sub))
        finally:
            sub.close(linger=0)
            pub.close(linger=0)
            context.destroy(linger=0)
        return received

    received = asyncio.run(scenario())
    assert {len(frames) for frames in received} <= {3, subscriber_module.MAX_FRAMES}
    huge = [frames for frames in received if len(frames) == subscriber_module.MAX_FRAMES]
    assert huge and all(sum(map(len, frames)) < 4 * 4096 for frames in huge)
    with pytest.raises(EventError):
        decode(huge[0])
    assert any(len(frames) == 3 and int.from_bytes(frames[1], "big") == 1 for frames in received)
