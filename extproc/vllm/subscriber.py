"""Subscribe to every backend's KV cache events (ZMQ PUB), following the backend set live.

Each backend says where it publishes (`GET /kv_event_sources`); kvroute connects a SUB socket to
that port on the backend's own address, never to another host. Sequence numbers are checked per
publisher: a number that goes back means a new publisher (the engine restarted), a jump means
missed batches, fetched from the engine's replay socket where it has one and otherwise reported
as lost, since that backend's picture is then unknown. Malformed messages are counted and logged
once per backend and kind; nothing a publisher sends can stop the subscriber or routing.

An engine publishes a batch per step, so a busy fleet sends tens of batches a second per backend.
They are read in bursts from a plain socket the event loop watches, and in approximate mode the
next burst is read `read_gap_s` later at the earliest: on a machine whose cores the engines keep
busy, each wake-up costs the process far more than its batches (docs/benchmarks.md, "Where the
stack's CPU goes on vLLM-CPU"). Precise mode reads them as they come. Idle, nothing wakes it, and
the first batch after a quiet spell is read at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

from extproc.core.exchange import Reset
from extproc.core.router import Router
from extproc.runtime.pool import BackendPool
from extproc.runtime.replies import read_within
from extproc.vllm.events import MAX_BATCH_BYTES, EventBatch, EventError, decode

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
# A gap wider than an engine's replay buffer (vLLM keeps 10,000 batches by default) cannot be
# replayed: it is treated as lost at once. And a replay ends within REPLAY_TOTAL_S however its
# engine answers (each reply within the per-reply timeout is not enough: one that never ends).
MAX_REPLAY_BATCHES = 10_000
REPLAY_TOTAL_S = 30.0
MAX_SOCKETS = 16_384  # a SUB socket per publisher (per backend and data-parallel rank) and replays
# Batches read and applied in one go before the loop's other work gets a turn: at most this many,
# and for at most BURST_S (256 batches of 60 KB held the loop for 1.5 s without the time bound).
BURST_MAX = 256
BURST_S = 0.005
# Batches ZMQ queues for a socket not read meanwhile: some 20 s of an engine's steps (a replay may
# take the reader away for that long). ZMQ bounds each frame (MAXMSGSIZE), not a message's count
# of frames, and hands a message over whole: one of many frames is held by libzmq until read, but
# only its first MAX_FRAMES are copied into Python (`_receive`), the rest dropped uncopied.
QUEUED_BATCHES = 2_000
MAX_FRAMES = 4  # a batch is three frames (topic, sequence, payload), a replayed one four: more is none
# What a backend's /kv_event_sources may say: its answer read up to this many bytes, and at most
# this many distinct publishers taken (one per data-parallel rank the server runs).
MAX_SOURCES_BYTES = 64 * 1024
MAX_SOURCES = 16
_ENDPOINT = re.compile(r"^tcp://(\[[^\]]*\]|[^:/]*):(\d{1,5})$")
# The endpoints vLLM binds on every address (vllm/distributed/kv_events.py `_is_bind_endpoint`: a
# `*` or a `::`). It connects out to any other, tcp://0.0.0.0:PORT included, so kvroute connecting
# there reads nothing: such a publisher is refused with its reason in /readyz, where it read
# "subscribed" and no event ever came.
_ANY_HOST = {"*", "[::]", "::"}


@dataclass(frozen=True, slots=True)
class Source:
    """One publisher of a backend (one per data-parallel rank)."""

    endpoint: str
    replay: str | None
    topic: bytes


def _host(backend: str) -> str:
    return backend.rsplit(":", 1)[0]


def _connectable(endpoint: object, backend: str) -> str | None:
    """The address to connect to for a publisher endpoint the engine binds, on the backend's own host."""
    if not isinstance(endpoint, str):
        return None
    match = _ENDPOINT.match(endpoint)
    if match is None:
        return None
    host, port = match.groups()
    if host in _ANY_HOST or host == _host(backend):
        return f"tcp://{_host(backend)}:{port}"
    return None


def sources(answer: object, backend: str) -> tuple[list[Source], str]:
    """The publishers in a `/kv_event_sources` answer that kvroute can subscribe to, and a status line."""
    if not isinstance(answer, dict) or not answer:
        return [], "no KV event publisher (start vLLM with --kv-events-config)"
    found: list[Source] = []
    refused: list[str] = []
    for config in answer.values():
        if len(found) >= MAX_SOURCES:
            break
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
            continue
        endpoint = _connectable(config.get("endpoint"), backend)
        if endpoint is None:
            refused.append(str(config.get("endpoint"))[:100])
            continue
        replay = _connectable(config.get("replay_endpoint"), backend)
        source = Source(endpoint, replay, str(config.get("topic") or "")[:256].encode())
        if all(s.endpoint != endpoint for s in found):  # one socket per publisher, named once or not
            found.append(source)
    if found:
        return found, "subscribed " + ", ".join(s.endpoint for s in found)
    if refused:
        return [], f"publisher endpoint {refused[0]} is not one the engine binds on its own host"
    return [], "no KV event publisher (start vLLM with --kv-events-config)"


class EventSubscriber:
    """One task per known backend, each following that backend's publishers."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        discovery_interval_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        read_gap_s: float = 0.02,
    ) -> None:
        """`read_gap_s`: after a burst of a backend's batches, its next are read this much later."""
        self._router = router
        self._read_gap_s = read_gap_s
        self._clock = clock  # the router's clock: when each batch arrived bounds when a clear happened
        self._pool = pool
        self._discovery_interval_s = discovery_interval_s
        self._replay_timeout_s = replay_timeout_s
        self._context = zmq.asyncio.Context()
        self._context.set(zmq.MAX_SOCKETS, MAX_SOCKETS)  # ZMQ's default, 1,023, is fewer than a large fleet's
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._logged: set[tuple[str, str]] = set()
        self.status: dict[str, str] = {}
        self.problems: Counter[str] = Counter()  # by kind (kvroute_engine_event_problems lists them)

    def _problem(self, backend: str, kind: str, detail: str, count: int = 1) -> None:
        """Count a problem; log it the first time per backend and kind."""
        self.problems[kind] += count
        if (backend, kind) not in self._logged:
            self._logged.add((backend, kind))
            log.warning("KV events from %s: %s (%s); logged once, counted in metrics", backend, kind, detail)

    async def run(self, follow_interval_s: float = 1.0) -> None:
        """Follow the pool's backend set until cancelled; then close every socket."""
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while True:
                    known = {b.address for b in self._pool.backends}
                    for backend in self._tasks.keys() - known:
                        self._tasks.pop(backend).cancel()
                        self.status.pop(backend, None)
                        self._logged = {logged for logged in self._logged if logged[0] != backend}
                    for backend in known - self._tasks.keys():
                        self._tasks[backend] = asyncio.create_task(self._follow(session, backend))
                    await asyncio.sleep(follow_interval_s)
        finally:
            for task in self._tasks.values():
                task.cancel()
            for task in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._tasks.clear()
            self._context.destroy(linger=0)

    async def _follow(self, session: aiohttp.ClientSession, backend: str) -> None:
        while True:
            try:
                async with session.get(f"http://{backend}/kv_event_sources") as response:
                    page = await read_within(response.content, MAX_SOURCES_BYTES + 1) if response.status == 200 else b""
                    answer = orjson.loads(page) if page and len(page) <= MAX_SOURCES_BYTES else None
                found, self.status[backend] = sources(answer, backend)
            except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
                found, self.status[backend] = [], f"discovery failed: {type(exc).__name__}"
            if found:
                # A consumer only ends on an error it cannot handle; then discover again.
                results = await asyncio.gather(*(self._consume(backend, s) for s in found), return_exceptions=True)
                for result in results:
                    if isinstance(result, Exception):
                        self.status[backend] = f"subscription failed: {type(result).__name__}: {result}"
                        self._problem(backend, "subscription_failed", str(result))
                        self._lost(backend, Reset.EVENTS_LOST)  # what came meanwhile (removals too) is not known
            await asyncio.sleep(self._discovery_interval_s)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        """A plain socket, bounded (`_limit`): read without waiting (`_receive`), woken by `_news`."""
        sock: zmq.Socket[bytes] = zmq.Socket(self._context, kind)
        _limit(sock)
        return sock

    def _lost(self, backend: str, reason: Reset) -> None:
        """The backend's events can no longer be followed: its picture is reset, unless it left
        meanwhile (a replay lasts up to its timeout), which would count a reset of nothing."""
        if self._pool.is_known(backend):
            self._router.events_lost(backend, reason)

    async def _consume(self, backend: str, source: Source) -> None:
        sock = self._socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic)
        sock.connect(source.endpoint)
        last: int | None = None
        previous = self._clock()  # what this publisher sends next happened after this moment
        try:
            async for frames in _bursts(sock, self._gap):
                arrived = self._clock()  # when read: at or after it came, so clears keep no less
                batch = self._decode(backend, frames)
                if batch is None:
                    continue
                if last is not None and batch.sequence <= last:
                    self._problem(backend, "restart", f"sequence {batch.sequence} after {last}")
                    self._lost(backend, Reset.SEQUENCE_RESTART)
                elif last is not None and batch.sequence > last + 1:
                    self._problem(backend, "gap", f"{batch.sequence - last - 1} batches missed")
                    if not await self._replay(backend, source, last + 1, batch.sequence, previous):
                        self._problem(backend, "lost", "could not replay the missed batches")
                        self._lost(backend, Reset.EVENTS_LOST)
                self._apply(backend, batch, previous)
                last, previous = batch.sequence, arrived
        finally:
            sock.close(linger=0)

    def _gap(self) -> float:
        """Precise mode's picture is made of the events: read as they come. Approximate mode uses
        them for the engines' progress and clears, which can wait `read_gap_s`."""
        return 0.0 if self._router.mode.precise else self._read_gap_s

    def _decode(self, backend: str, frames: list[bytes]) -> EventBatch | None:
        try:
            batch = decode(frames)
        except EventError as exc:
            self._problem(backend, "bad_message", str(exc))
            return None
        if batch.unknown:
            self._problem(backend, "unknown_event", "an event type this version does not know", batch.unknown)
        if batch.malformed:
            self._problem(backend, "malformed_event", "an event that is not what its type says", batch.malformed)
        if batch.other_tier:  # (an offloading connector's: not what serves a prefix from the GPU)
            self.problems["other_tier"] += batch.other_tier
        return batch

    def _apply(self, backend: str, batch: EventBatch, previous: float) -> None:
        if self._pool.is_known(backend):
            self._router.engine_events(backend, batch.events, previous, self._clock())

    async def _replay(self, backend: str, source: Source, start: int, until: int, previous: float) -> bool:
        """Fetch and apply batches start..until-1 from the replay socket; True if all came. They
        were published after the last batch that arrived live, at `previous`."""
        if source.replay is None or until - start > MAX_REPLAY_BATCHES:
            return False
        sock = self._socket(zmq.DEALER)
        sock.connect(source.replay)
        expected = start
        loop = asyncio.get_running_loop()
        fd = int(sock.getsockopt(zmq.FD))
        deadline = loop.time() + REPLAY_TOTAL_S
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            while True:
                try:
                    frames = _receive(sock)
                except zmq.Again:
                    async with asyncio.timeout_at(min(deadline, loop.time() + self._replay_timeout_s)):
                        await _news(loop, sock, fd)
                    continue
                if len(frames) == 4 and frames[2] == END_SEQ:
                    return expected >= until
                batch = self._decode(backend, frames[1:])
                if batch is None or batch.sequence < expected or batch.sequence >= until:
                    continue
                if batch.sequence > expected:
                    return False  # the engine's buffer no longer holds what was missed
                self._apply(backend, batch, previous)
                expected += 1
        except (TimeoutError, zmq.ZMQError) as exc:
            self._problem(backend, "replay_failed", f"{type(exc).__name__}: {exc}")
            return False
        finally:
            sock.close(linger=0)


def _limit(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)  # a huge frame is dropped by ZMQ, unread
    sock.setsockopt(zmq.RCVHWM, QUEUED_BATCHES)


def _receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One queued message: its first MAX_FRAMES frames, the rest dropped without a copy (so a
    message of many frames is refused by `decode`, having cost no more than MAX_FRAMES of them).
    Raises zmq.Again when none is queued."""
    frames = [sock.recv(zmq.NOBLOCK)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(zmq.NOBLOCK, copy=False)  # (the rest of a message is there once its first is)
        if len(frames) < MAX_FRAMES:
            frames.append(frame.bytes)
    return frames


async def _bursts(sock: zmq.Socket[bytes], gap_s: Callable[[], float]) -> AsyncIterator[list[bytes]]:
    """Each message the socket receives, read without waiting while some are queued (at most
    `BURST_MAX`, or for `BURST_S` of reading and of what the caller does with them, before the
    loop gets a turn), and the next burst `gap_s()` after the last at the earliest. Once none is
    queued the reader waits for its file descriptor's news, so a batch that comes a gap or more
    after the last wakes the loop once (not a timer's wake-up and then the descriptor's: on a
    loaded machine each costs more than reading its batch). While news keeps coming within the
    gap, it sleeps the gap first and reads what queued meanwhile: one wake-up a gap however fast
    the engine publishes. Raises what the socket raises."""
    loop = asyncio.get_running_loop()
    fd = int(sock.getsockopt(zmq.FD))
    last = float("-inf")  # when the last pass that read something ended
    dense = False  # the last news came within the gap
    while True:
        read = 0
        until = loop.time() + BURST_S
        cut = False
        while read < BURST_MAX:
            try:
                frames = _receive(sock)
            except zmq.Again:
                break
            read += 1
            yield frames
            if loop.time() > until:
                cut = True
                break
        if read:
            last = loop.time()
        if cut or read == BURST_MAX:
            await asyncio.sleep(0)
        elif read and dense:
            await asyncio.sleep(gap_s())
        else:
            await _news(loop, sock, fd)
            wait = last + gap_s() - loop.time()
            dense = wait > 0
            if dense:
                await asyncio.sleep(wait)


async def _news(loop: asyncio.AbstractEventLoop, sock: zmq.Socket[bytes], fd: int) -> None:
    """Until a message may be queued. ZMQ's descriptor signals news, not messages: asking for the
    socket's events takes the news in (and clears the signal), so it is asked once watching."""
    news: asyncio.Future[None] = loop.create_future()

    def signalled() -> None:
        if not news.done():
            news.set_result(None)

    loop.add_reader(fd, signalled)
    try:
        if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            await news
    finally:
        loop.remove_reader(fd)
