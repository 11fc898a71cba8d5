"""Replicas that route as one, through Redis streams.

Each replica appends what it learns and binds to one stream (`<group>:events`, capped, with a
TTL) and its in-flight load per backend to another (`<group>:load`), and reads both. Lookups stay
in process: a replica applies its siblings' entries to its own picture as they arrive (one XREAD
round trip, a millisecond on a LAN), so two replicas disagree only for that long. A replica that
starts, or comes back after the store was away, first replays the events stream (the last
`max_events` entries, each applied at its age by the store's clock) and then follows it. Load is
a vector per replica, sent when it changes (at most every `load_period_s`) and at least every
`heartbeat_s`; a replica not heard from for `peer_max_age_s` counts for nothing. The vector also
carries the CBR bytes the replica has sent each backend, so every replica learns the fleet's
bytes per token from all the traffic the engines count, not its own share of it.

The store going away never stops routing: writes are dropped and counted, the link says so in
/readyz, and it reconnects with backoff. Entries are applied only for backends in this replica's
pool, chains and digests are bounded, and anything malformed is counted and skipped, so the
store can teach nothing a routed request could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import msgpack
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import KeyT, StreamIdT

from extproc.core.adapters import valid_name
from extproc.core.backends import Backend
from extproc.core.chain import HASH_MASK
from extproc.core.load import NO_LOAD, LoadVector, PeerLoads
from extproc.core.router import Router
from extproc.core.settings import MAX_FLOW_ID, MAX_QUEUE_FLOWS
from extproc.replicas.served import SiblingsServed
from extproc.runtime.config import read_token
from extproc.runtime.pool import BackendPool
from extproc.runtime.stopping import stop_asked

# The client is made with decode_responses=False, so a stream's entries come as bytes (redis-py
# types its replies as any reply).
_Entries = list[tuple[bytes, dict[bytes, bytes]]]
# One backend's entry of a replica's load vector on the wire: reserved blocks, requests in flight,
# CBR bytes sent ever, footprint blocks. The footprint came later: a replica of before it sends three
# (read as a footprint of 0) and counts a vector of four as bad, so during a rolling update it does
# not see the newer replicas' load (the engines' own counts still do) until it is replaced. Counts
# a later replica may add after these four are not read, so such an update keeps every replica's
# load counted.
WireLoad = tuple[int, int, int, int]
log = logging.getLogger("kvroute.replicas")

LEARNED, BOUND, LOAD, FLOWS = "l", "s", "L", "F"
# A LoRA adapter placement is moving off a backend to another (placement.py's balance): siblings
# count the new copy and stop routing new requests to the old one before it is unloaded. The mover
# says it again every 10 s while the move lasts; a word is applied only while LEAVING_FRESH_S old
# (a replay at start must not mark a copy loaded again since), and a sibling forgets it
# LEAVING_FRESH_S after it last heard it (a move called off, or its mover gone).
ADAPTER_LEAVING = "A"
LEAVING_FRESH_S = 30.0
MAX_LEAVING = 4096  # marks kept from siblings' words
# The backends whose load changed since a replica's last load message; its whole vector (LOAD)
# still goes out every heartbeat. A replica of before this message counts it as bad and keeps
# up from the whole vectors alone.
LOAD_DELTA = "D"
# A backlog of siblings' entries (a replica starting, its replay, or a burst) is read READ_BATCH at a time and
# applied between the requests this replica routes, a slice at a time: APPLY_SLICE entries, or
# fewer when their chains reach APPLY_BLOCKS blocks. A whole batch of 1,000 chains of 32 blocks held
# the event loop some 40 ms (`kvroute-dev bench replica-lag --ingest`); into full pictures a chain
# costs some 3 us a block, so 32 agent prompts' chains of 940 blocks held it about 100 ms before
# the blocks counted (results/stalls-34).
READ_BATCH = 256
APPLY_SLICE = 32
APPLY_BLOCKS = 512
ENTRY_WORK = APPLY_BLOCKS // APPLY_SLICE  # what an entry that is not a chain counts for in a slice
MAX_CHAIN = 1 << 16  # blocks in one shared chain (a 4M-token prompt at 64 bytes a block)
DIGEST_BYTES = 16
# What one sibling's entry may be and declare before it is decoded: the largest is a chain of
# MAX_CHAIN hashes (9 bytes each) or a load vector over a large fleet; MessagePack decoded can
# take 70 times its bytes (2.9 MiB of empty maps took 230 MiB and 0.2 s of the loop).
MAX_ENTRY_BYTES = 1 << 20
ENTRY_LIMITS = {
    "max_str_len": 4096,
    "max_bin_len": 64,
    "max_ext_len": 0,
    "max_array_len": MAX_CHAIN,
    "max_map_len": MAX_CHAIN,
}
OUTBOX = 10_000  # messages waiting for the store; beyond it the oldest are dropped
FLOW_DIGEST = "#"  # a flow name on the wire: this, then its keyed digest
MAX_BANDS = 64  # a sibling's flow shares with more bands, or more flows a band than any replica tracks, are refused
ENDS_TTL_MS = 60_000  # a replica's inbox of request ends lives this long after the last one sent to it
MAX_COUNT = 1 << 31  # a sibling's reserved blocks or requests on one backend past this is not a count
MAX_SENT = 1 << 62  # nor bytes sent to one backend past this
FLOWS_PERIOD_S = 0.1  # flow shares are sent on change at most this often (they change with every dispatch)


def _adapter_move(payload: object) -> bool:
    """An ADAPTER_LEAVING payload: (adapter name, backend address)."""
    return (
        isinstance(payload, tuple)
        and len(payload) == 2
        and isinstance(payload[0], str)
        and valid_name(payload[0])
        and isinstance(payload[1], str)
    )


def _load_vector(payload: Any, known: Callable[[str], bool]) -> dict[str, WireLoad]:
    """A sibling's load vector (backend -> reserved blocks, active requests, bytes sent, footprint
    blocks; a replica of before the footprint sends the first three, read as a footprint of 0; a
    later one's further counts are not read), checked, bounded and kept to this replica's backends
    (so no table grows by what a writer invents); ValueError otherwise."""
    vector: dict[str, WireLoad] = {}
    for backend, counts in payload.items():
        if not isinstance(counts, tuple | list) or len(counts) < 3:
            raise ValueError("load vector")
        reserved, active, sent, footprint = (*counts, 0) if len(counts) == 3 else counts[:4]
        ints = all(type(v) is int for v in (reserved, active, sent, footprint))
        counts_ok = 0 <= reserved < MAX_COUNT and 0 <= active < MAX_COUNT and 0 <= footprint < MAX_COUNT
        if not (ints and counts_ok and 0 <= sent < MAX_SENT):
            raise ValueError("load vector")
        if isinstance(backend, str) and known(backend):
            vector[backend] = (reserved, active, sent, footprint)
    return vector


def _wire(load: LoadVector, sent: int) -> WireLoad:
    """One backend's entry of this replica's load vector, in the order siblings read it."""
    reserved, active, footprint = load
    return reserved, active, sent, footprint


def _is_hash(value: object) -> bool:
    """A block hash as this replica makes them (60 bits): the index keeps nothing else."""
    return type(value) is int and 0 <= value <= HASH_MASK


class FlowShares(Protocol):
    """Flow control's queue as its siblings see it (extproc/core/flow.py FlowQueue)."""

    def shares(self) -> tuple[dict[int, dict[str, float]], int]: ...

    def heads(self) -> dict[int, float]: ...

    def flow_names(self) -> Iterator[str]: ...

    def set_peers(
        self, attained: Mapping[int, Mapping[str, float]], held: int, heads: Mapping[int, float] | None = None
    ) -> None: ...


Shares = tuple[dict[int, dict[str, float]], int, dict[int, float]]  # attained by band and flow, held, heads


def _flow_shares(payload: Any) -> Shares:
    """A sibling's (attained by band and flow, held, heads by band) checked and bounded;
    ValueError otherwise. A sibling of the version before heads sends none."""
    attained, held, *rest = payload
    heads = rest[0] if rest else ()
    if not isinstance(held, int) or held < 0 or len(attained) > MAX_BANDS or len(heads) > MAX_BANDS:
        raise ValueError("flow shares")
    turns: dict[int, float] = {}
    for band, value in heads:
        if type(band) is not int or not 0 <= float(value) < 1e18:
            raise ValueError("flow shares")
        turns[band] = float(value)
    out: dict[int, dict[str, float]] = {}
    for band, flows in attained:
        if type(band) is not int or len(flows) > MAX_QUEUE_FLOWS:
            raise ValueError("flow shares")
        out[band] = {}
        for flow, value in flows.items():
            if not isinstance(flow, str) or len(flow) > MAX_FLOW_ID or not 0 <= float(value) < 1e18:
                raise ValueError("flow shares")
            out[band][flow] = float(value)
    return out, held, turns


class HashKeyMismatch(Exception):
    """This replica's hash key differs from the group's: its chains and digests mean nothing there."""


class RedisLink:
    """A router's link to its sibling replicas through one Redis (or Valkey) server."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        client: Redis,
        group: str,
        *,
        max_events: int = 200_000,
        ttl_s: float = 3600.0,
        load_period_s: float = 0.02,
        heartbeat_s: float = 0.5,
        peer_max_age_s: float = 1.5,
        clock: Callable[[], float] = time.monotonic,
        flows: FlowShares | None = None,
    ) -> None:
        """`flows`: flow control's queue, whose fairness and bound the replicas then hold together."""
        self.replica = os.urandom(8).hex()
        # The ext_authz transport's request ends (access-log entries), sent to the replica that
        # decided each: Envoy streams them to whichever replica its log stream reached.
        self._ends_prefix = f"{group}:ends:"  # + a replica: its inbox
        self._ends_key = self._ends_prefix + self.replica
        self._ends_out: deque[tuple[str, bytes]] = deque()
        self._ends_from = b"0-0"  # the last end read, across reconnections
        # The last siblings' entry applied, across reconnections: a reconnection replays only what
        # it missed (from the start, siblings' chains and bindings this replica had since dropped,
        # for a backend that restarted, came back, and the whole stream was applied again)
        self._events_from: bytes | None = None
        # Flow names (tenants) go to the store as digests under the hash key, as sessions do; the
        # siblings' accounts stay by digest, read back as the names of the flows known here (the
        # same key, the same digest) as flow control is handed them
        self._flow_digests: dict[str, str] = {}  # name -> digest
        self.on_end: Callable[[bytes], None] | None = None
        self._router = router
        self._pool = pool
        self._client = client
        self._events_key = f"{group}:events"
        self._load_key = f"{group}:load"
        self._key_check_key = f"{group}:key-check"
        self._claim_prefix = f"{group}:claim:"
        self._max_events = max_events
        self._ttl_ms = int(ttl_s * 1000)
        self._load_period_s = load_period_s
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._leaving: dict[tuple[str, str], float] = {}  # (backend, adapter) a sibling moves off -> heard
        self._outbox: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._peers = PeerLoads(peer_max_age_s)
        self._peer_sent: dict[tuple[str, str], int] = {}  # (replica, backend) -> bytes it last reported
        self._peers_for: tuple[Backend, ...] | None = None  # the pool the peers' load was last handed over for
        self._flows = flows
        # replica -> (when heard, its held requests, its heads by band); what it served: `_served`
        self._peer_flows: dict[str, tuple[float, int, dict[int, float]]] = {}
        self._served = SiblingsServed()  # what they served each flow, kept while they are unheard
        self.connected = False
        # replaying the stream at (re)connection: what this replica learns meanwhile waits in the
        # outbox for the writer, which starts after the replay (the replay yields to requests)
        self._replaying = False
        self.problem = "connecting"  # why not connected, for /readyz
        kinds = ("sent", "applied", "dropped", "bad", "store_errors", "ends_forwarded", "ends_dropped")
        self.counts = dict.fromkeys(kinds, 0)
        self.lag_s = 0.0  # how old the last sibling learning or binding was when applied here

    # Router hooks: called on the hot path, never wait.
    def learned(self, backend: str, chain: Sequence[int]) -> None:
        self._send(msgpack.packb((LEARNED, self.replica, backend, chain)))

    def bound(self, session: bytes, backend: str) -> None:
        self._send(msgpack.packb((BOUND, self.replica, backend, session)))

    def adapter_leaving(self, backend: str, adapter: str, target: str) -> None:
        """Placement on this replica moves `adapter` off `backend` to `target`: siblings stop sending
        it to `backend` and count it on `target`."""
        self._send(msgpack.packb((ADAPTER_LEAVING, self.replica, backend, (adapter, target))))

    def forward_end(self, replica: str, entry: bytes) -> bool:
        """Send a request's end to the sibling that decided it; False with the store away (the
        sibling's sweep then releases that request's load)."""
        if not self.connected or replica == self.replica or len(self._ends_out) >= OUTBOX:
            return False
        self._ends_out.append((replica, entry))
        self._wake.set()
        return True

    def _send(self, message: bytes) -> None:
        if not self.connected and not self._replaying:
            self.counts["dropped"] += 1  # the store is away: siblings learn it from their own traffic
            return
        if len(self._outbox) >= OUTBOX:
            self._outbox.popleft()
            self.counts["dropped"] += 1
        self._outbox.append(message)
        self._wake.set()

    async def claim(self, name: str, ttl_s: float) -> bool:
        """One replica acts for `name` for `ttl_s` (adapter placement's moves): True for this one
        if none else holds it. With the store away each replica acts alone, as without siblings."""
        key = self._claim_prefix + name
        try:
            if await self._client.set(key, self.replica, nx=True, px=int(ttl_s * 1000)):
                return True
            holder = await self._client.get(key)
        except (RedisError, OSError):
            return True
        if isinstance(holder, bytes):
            holder = holder.decode(errors="replace")
        return holder is None or holder == self.replica

    # Status for /readyz, /debug/state and /metrics.
    @property
    def peers(self) -> int:
        """Sibling replicas heard from lately."""
        return len(self._peers)

    def warnings(self) -> list[str]:
        if self.connected:
            return []
        return [f"replica store: {self.problem}; routing on this replica's own picture"]

    def state(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "connected": self.connected,
            "problem": None if self.connected else self.problem,
            "peers": self.peers,
            **self.counts,
        }

    async def run(self) -> None:
        """Connect, replay, follow and publish until cancelled; reconnect with backoff on errors."""
        backoff = 0.25
        try:
            while not stop_asked():
                try:
                    await self._session()
                except (RedisError, OSError, HashKeyMismatch) as error:
                    self.counts["store_errors"] += 1
                    if self.connected or self.problem == "connecting":
                        log.warning("replica store: %s; routing on the local picture", error or type(error).__name__)
                        backoff = 0.25  # it was working: try again soon
                    self.problem = str(error) or type(error).__name__
                    self.connected = False
                    self.counts["dropped"] += len(self._outbox)
                    self._outbox.clear()
                    self._peers = PeerLoads(self._peers.max_age_s)  # their load is no longer known
                    self._router.loads.set_peers({})
                    self._peer_flows.clear()
                    self._forget_leaving(self._clock())  # (marks no sibling can renew now still age out)
                    if self._flows is not None:  # each replica keeps its own share and bound until the
                        # store is back, beside what the siblings had served (no flow jumps the others)
                        self._flows.set_peers(self._peer_served(self._clock()), 0)
                    with contextlib.suppress(RedisError, OSError):
                        await self._client.connection_pool.disconnect()  # no stale connection outlives a loss
                    await asyncio.sleep(backoff * random.uniform(0.5, 1.5))  # replicas that lost it together
                    backoff = min(5.0, backoff * 2)  # do not all come back at once
                else:
                    return
        finally:
            await self._goodbye()

    async def _session(self) -> None:
        client = self._client
        await client.ping()
        await self._check_key()
        seconds, micros = await client.time()
        offset = self._clock() - (seconds + micros / 1e6)  # store clock -> this process's clock
        self._replaying = True
        try:
            events_from = await self._replay(offset)
        finally:
            self._replaying = False
        last_load = cast(_Entries, await client.xrevrange(self._load_key, count=1))  # (after the replay: none
        load_from = last_load[0][0] if last_load else b"0-0"  # of the loads it took seconds to pass is stale)
        if stop_asked():  # a cancel redis-py swallowed during the setup: start nothing that would outlive it
            raise asyncio.CancelledError
        self.connected = True
        log.info("replica %s following %s", self.replica, self._events_key)
        tasks = [
            asyncio.create_task(self._follow(events_from, load_from, offset)),
            asyncio.create_task(self._write()),
            asyncio.create_task(self._publish_load()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check_key(self) -> None:
        """Every replica of a group must hash with the same key; the store holds a keyed digest of a
        constant (never the key), set by the first replica."""
        key = self._router.settings.hash_key
        check = hashlib.blake2b(b"kvroute replica group", key=key, digest_size=16).hexdigest().encode()
        await self._client.set(self._key_check_key, check, nx=True, px=self._ttl_ms)
        if await self._client.get(self._key_check_key) != check:
            raise HashKeyMismatch("this replica's hash_key differs from its group's; not sharing")
        await self._client.pexpire(self._key_check_key, self._ttl_ms)

    async def _replay(self, offset: float) -> bytes:
        """Apply the stream as it stands (a snapshot of what siblings learned and bound), or on a
        reconnection what was added since the last entry applied; return the id to follow from."""
        work = 0
        while True:
            after = b"-" if self._events_from is None else b"(" + self._events_from
            entries = cast(_Entries, await self._client.xrange(self._events_key, min=after, count=READ_BATCH))
            for entry_id, fields in entries:
                work += self._apply(entry_id, fields, offset)
                self._events_from = entry_id
                if work >= APPLY_BLOCKS:
                    work = 0
                    await asyncio.sleep(0)  # a long stream must not hold the requests being routed
            if len(entries) < READ_BATCH:
                return self._events_from or b"0-0"

    async def _follow(self, events_from: bytes, load_from: bytes, offset: float) -> None:
        ids: dict[KeyT, StreamIdT] = {
            self._events_key: events_from,
            self._load_key: load_from,
            self._ends_key: self._ends_from,
        }
        while not stop_asked():
            replies = cast(list[tuple[bytes, _Entries]], await self._client.xread(ids, count=READ_BATCH, block=1000))
            work = 0
            for stream, entries in replies:
                key = stream.decode() if isinstance(stream, bytes) else stream
                for entry_id, fields in entries:
                    if key == self._ends_key:
                        self._ended(fields)
                        self._ends_from = entry_id
                        work += ENTRY_WORK
                    else:
                        work += self._apply(entry_id, fields, offset)
                        if key == self._events_key:
                            self._events_from = entry_id
                    ids[key] = entry_id
                    if work >= APPLY_BLOCKS:
                        work = 0
                        await asyncio.sleep(0)  # a backlog must not hold the requests being routed
            self._apply_peer_loads(self._clock())
            if self._leaving:
                self._forget_leaving(self._clock())

    def _places(self, adapter: str, target: str) -> bool:
        """A sibling's move names an adapter placement may move (the policy lists its source: a
        sibling places no other) to a backend of this replica's pool; no other word is applied, so
        no writer to the store can fill the table of known adapter names."""
        sources = self._router.settings.adapter_sources
        return self._pool.is_known(target) and any(name == adapter for name, _ in sources)

    def _adapter_leaving(self, backend: str, adapter: str, target: str, now: float) -> None:
        """A sibling moves `adapter` off `backend` to `target` (its word, applied)."""
        key = (backend, adapter)
        if key not in self._leaving and len(self._leaving) >= MAX_LEAVING:
            return
        book = self._router.adapters
        if not book.has(target, adapter):
            book.listed_now(target, adapter, True)
        book.leave(backend, adapter)
        self._leaving[key] = now

    def _forget_leaving(self, now: float) -> None:
        """Siblings' words not said again for LEAVING_FRESH_S: the copy is routed to again (it is
        unloaded by then, or the move was called off)."""
        for key in [k for k, heard in self._leaving.items() if now - heard >= LEAVING_FRESH_S]:
            del self._leaving[key]
            self._router.adapters.leave(*key, False)

    def _peer_bytes(self, replica: str, sent: dict[str, int]) -> None:
        """Add what a sibling sent each known backend since its last report (the first report, or a
        total that went back because the sibling restarted, only sets the baseline)."""
        if len(self._peer_sent) > 16 * max(256, len(self._pool.backends)):  # replicas come and go: forget them
            self._peer_sent.clear()
        for backend, total in sent.items():
            before = self._peer_sent.get((replica, backend))
            self._peer_sent[(replica, backend)] = total
            if before is not None and total > before and self._pool.is_known(backend):
                self._router.bytes_per_token.add(backend, total - before)

    def _apply_peer_loads(self, now: float) -> None:
        """The siblings heard from lately, summed per backend of this replica's pool, into its loads
        (and their flow shares into flow control's queue)."""
        backends = self._pool.backends
        if backends is not self._peers_for:  # the pool changed: hand everything over again
            self._peers_for = backends
            self._peers.changes(now)
            totals = self._peers.totals(now)
            self._router.loads.set_peers({b: load for b, load in totals.items() if self._pool.is_known(b)})
        else:
            changed = self._peers.changes(now)
            if changed:
                self._router.loads.update_peers({b: load for b, load in changed.items() if self._pool.is_known(b)})
        if self._flows is None:
            return
        for replica in [r for r, (seen, _, _) in self._peer_flows.items() if now - seen > self._peers.max_age_s]:
            del self._peer_flows[replica]
        held = 0
        heads: dict[int, float] = {}
        for _, count, turns in self._peer_flows.values():
            held += count
            for band, value in turns.items():
                heads[band] = min(value, heads.get(band, value))
        self._flows.set_peers(self._peer_served(now), held, heads)

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes], offset: float) -> int:
        """Apply one sibling's entry; returns its work in blocks (a chain's length; an entry of
        another kind counts as a small chain's), for the slices between the loop's turns."""
        work = ENTRY_WORK
        try:
            message = fields[b"m"]
            if len(message) > MAX_ENTRY_BYTES:
                raise ValueError("an entry too large")
            kind, replica, backend, payload = msgpack.unpackb(message, use_list=False, **ENTRY_LIMITS)
            if replica == self.replica:
                return work
            if kind == FLOWS:
                attained, held, heads = _flow_shares(payload)
                heard = self._clock()
                self._peer_flows[replica] = (heard, held, heads)
                self._served.heard(replica, attained, heard)
                return work
            if kind in (LOAD, LOAD_DELTA):
                vector = _load_vector(payload, self._pool.is_known)
                loads = {b: (r, a, f) for b, (r, a, _, f) in vector.items()}
                if kind == LOAD:
                    self._peers.update(replica, loads, self._clock())
                elif not self._peers.merge(replica, loads, self._clock()):
                    return work  # its whole vector comes within a heartbeat
                self._peer_bytes(replica, {b: s for b, (_, _, s, _) in vector.items()})
                return work
            if not self._pool.is_known(backend):
                return work  # a backend this replica does not route to (yet): nothing to apply
            when = int(entry_id.split(b"-")[0]) / 1000 + offset
            now = self._clock()
            if kind == LEARNED and len(payload) <= MAX_CHAIN and all(_is_hash(h) for h in payload):
                self._router.peer_learned(payload, backend, min(when, now))
                work = max(work, len(payload))
            elif kind == BOUND and isinstance(payload, bytes) and len(payload) == DIGEST_BYTES:
                self._router.peer_bound(payload, backend, min(when, now))
            elif kind == ADAPTER_LEAVING and _adapter_move(payload) and self._places(payload[0], payload[1]):
                if now - when < LEAVING_FRESH_S:
                    self._adapter_leaving(backend, payload[0], payload[1], now)
            else:
                raise ValueError(kind)
            self.counts["applied"] += 1
            self.lag_s = max(0.0, now - when)
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, msgpack.UnpackException) as error:
            bad = self.counts["bad"] = self.counts["bad"] + 1
            if bad & (bad - 1) == 0:  # the 1st, 2nd, 4th...: a stream of them cannot flood the log
                log.warning("replica store: a sibling's entry not applied (%s; %d so far)", type(error).__name__, bad)
        return work

    def _ended(self, fields: dict[bytes, bytes]) -> None:
        """A request this replica decided ended, as a sibling's access-log stream reported it."""
        entry = fields.get(b"e")
        if entry is None or self.on_end is None:
            self.counts["bad"] += 1
            return
        try:
            self.on_end(entry)
        except Exception:  # one entry must not end the link (its follow loop would stop with it)
            self.counts["bad"] += 1
            log.exception("a sibling's request end could not be applied")

    async def _write(self) -> None:
        while not stop_asked():
            await self._wake.wait()
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        """Send what is queued: learning and bindings to the shared stream, request ends to the
        siblings that decided them."""
        batch = list(self._outbox)
        self._outbox.clear()
        ends = list(self._ends_out)
        self._ends_out.clear()
        if batch or ends:
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for message in batch:
                        pipe.xadd(self._events_key, {"m": message}, maxlen=self._max_events, approximate=True)
                    if batch:
                        pipe.pexpire(self._events_key, self._ttl_ms)
                    for replica, entry in ends:
                        key = self._ends_prefix + replica
                        pipe.xadd(key, {"e": entry}, maxlen=OUTBOX, approximate=True)
                        pipe.pexpire(key, ENDS_TTL_MS)  # a sibling that went away: its key goes too
                    await pipe.execute()
            except BaseException:  # the store failed them: lost, and said so (the ends' owners sweep them)
                self.counts["dropped"] += len(batch)
                self.counts["ends_dropped"] += len(ends)
                raise
        self.counts["sent"] += len(batch)
        self.counts["ends_forwarded"] += len(ends)

    async def _publish_load(self) -> None:
        """This replica's load vector: on change, at most every load_period_s; at least every
        heartbeat_s, so siblings know it is alive."""
        sent: dict[str, WireLoad] | None = None
        sent_at = float("-inf")
        flows_sent: Shares | None = None
        flows_at = float("-inf")
        while not stop_asked():
            now = self._clock()
            vector = self._vector()
            beat = now - sent_at >= self._heartbeat_s
            shares = None
            if self._flows is not None and (beat or now - flows_at >= FLOWS_PERIOD_S):
                attained, held = self._flows.shares()
                wire = {band: {self._digest(f): v for f, v in flows.items()} for band, flows in attained.items()}
                shares = (wire, held, self._flows.heads())
                if shares == flows_sent and not beat:
                    shares = None
            if vector != sent or shares is not None or beat:
                if sent is not None and not beat and sent.keys() <= vector.keys():
                    # only what changed: a large fleet's vector is mostly the same each time
                    await self._add_load(LOAD_DELTA, {b: v for b, v in vector.items() if sent.get(b) != v}, shares)
                else:
                    await self._add_load(LOAD, vector, shares)
                    sent_at = now
                sent = vector
                if shares is not None:
                    flows_sent, flows_at = shares, now
                self._apply_peer_loads(now)
            await asyncio.sleep(self._load_period_s)

    def _digest(self, flow: str) -> str:
        """A flow's name on the wire: its keyed digest (cached; the cache is emptied once it
        outgrows what flow control can track)."""
        digest = self._flow_digests.get(flow)
        if digest is None:
            if len(self._flow_digests) >= 4 * MAX_QUEUE_FLOWS:
                self._flow_digests.clear()
            key = self._router.settings.hash_key
            digest = FLOW_DIGEST + hashlib.blake2b(flow.encode(), key=key, digest_size=8).hexdigest()
            self._flow_digests[flow] = digest
        return digest

    def _peer_served(self, now: float) -> dict[int, dict[str, float]]:
        """What the siblings served each flow, by band, its digest read back as the name of a flow
        flow control knows (one it does not know stays a digest: nothing here asks for it)."""
        assert self._flows is not None
        names = {self._digest(flow): flow for flow in self._flows.flow_names()}
        totals = self._served.totals(now)
        return {band: {names.get(d, d): v for d, v in flows.items()} for band, flows in totals.items()}

    def _vector(self) -> dict[str, WireLoad]:
        """backend -> (reserved blocks, active requests, CBR bytes sent ever, footprint blocks) of
        this replica, for every backend of its pool from the start, so siblings' baselines start at
        zero."""
        loads = self._router.loads.published()
        sent = self._router.bytes_per_token.sent
        backends = {b.address for b in self._pool.backends} | loads.keys()
        return {b: _wire(loads.get(b, NO_LOAD), sent.get(b, 0)) for b in backends}

    async def _add_load(self, kind: str, vector: dict[str, WireLoad], shares: Shares | None = None) -> None:
        message = msgpack.packb((kind, self.replica, "", vector))
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.xadd(self._load_key, {"m": message}, maxlen=1000, approximate=True)
            if shares is not None:
                attained, held, heads = shares  # bands as pairs: msgpack map keys are text
                flows = msgpack.packb((FLOWS, self.replica, "", (list(attained.items()), held, list(heads.items()))))
                pipe.xadd(self._load_key, {"m": flows}, maxlen=1000, approximate=True)
            pipe.pexpire(self._load_key, self._ttl_ms)
            pipe.pexpire(self._key_check_key, self._ttl_ms)  # the group's key lives as long as a replica does
            await pipe.execute()

    async def _goodbye(self) -> None:
        """On a clean stop, what is still queued (above all the ends of siblings' requests, which
        they would otherwise count in flight until their sweep), then an empty load vector:
        siblings drop this replica's load at once."""
        if self.connected:
            self.connected = False
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._flush()
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._add_load(LOAD, {})


class ReplicaCollector(Collector):
    """Prometheus view of the link, read at scrape time."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link

    def collect(self) -> Iterator[Metric]:
        link = self._link
        yield GaugeMetricFamily(
            "kvroute_replica_store_connected", "1 while sharing with sibling replicas", value=float(link.connected)
        )
        yield GaugeMetricFamily("kvroute_replica_peers", "sibling replicas heard from lately", value=len(link._peers))
        yield GaugeMetricFamily(
            "kvroute_replica_lag_seconds",
            "how old the last learning or session binding from a sibling was when this replica applied it",
            value=link.lag_s,
        )
        messages = CounterMetricFamily(
            "kvroute_replica_messages",
            "replica link messages: sent, applied (from siblings), dropped (store away, outbox full or "
            "a failed write), bad (malformed, skipped), store_errors (connections lost or refused), "
            "ends_forwarded (request ends sent to the sibling that decided them), ends_dropped (lost in a "
            "failed write)",
            labels=["kind"],
        )
        for kind, count in link.counts.items():
            messages.add_metric([kind], count)
        yield messages


def connect(
    router: Router, pool: BackendPool, url: str, password_file: str, group: str, flows: FlowShares | None = None
) -> RedisLink:
    """A link to the store at `url` (redis:// or rediss:// for TLS), with the password from a file."""
    client = Redis.from_url(
        url,
        password=read_token(password_file) if password_file else None,
        socket_timeout=5.0,  # above XREAD's 1 s block: a store that stops answering is noticed
        socket_connect_timeout=2.0,
        health_check_interval=10,
    )
    return RedisLink(router, pool, client, group, ttl_s=router.settings.session_ttl_s, flows=flows)
