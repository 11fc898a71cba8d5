"""Per-backend load: reserved prefill work and in-flight requests, with leak-proof release.

A reservation is taken in the same step as the decision. Its handle releases the prefill part
when the prefill is known done and the whole of it when the request ends, however it ends; every
release is idempotent. A streamed response starts before its prefill, so a reservation may instead
wait for the engine's own progress: the blocks its KV events report stored drain the backend's
waiting reservations oldest first (`BackendLoad.progress`). A backend that leaves takes its
counters with it: late releases from its handles land on the detached counters and cannot
disturb a backend re-added later.

With several replicas, each backend's load also counts the other replicas' reservations, requests
and footprints as they last published them (`PeerLoads`), so a backend made busy through one
replica is busy for all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from extproc.core.footprint import Chain, InFlightBlocks

# An engine sample older than this no longer says anything about the backend's load.
ENGINE_SAMPLE_MAX_AGE_S = 2.0
# Reservations waiting for engine progress are compacted (ended ones dropped) past this many.
PROGRESS_COMPACT_AT = 256

# One backend's load as a replica publishes it: (reserved prefill blocks, requests in flight,
# footprint blocks), the counts `BackendLoad` keeps of its own requests.
LoadVector = tuple[int, int, int]
NO_LOAD: LoadVector = (0, 0, 0)


class BackendLoad:
    """Load counters of one backend: kvroute's own reservations, which it knows at once, and the
    engine's own request counts, which are late by a scrape but also see every other client."""

    __slots__ = (
        "_credit",
        "active",
        "adapters",
        "awaiting",
        "engine_at",
        "engine_kv_usage",
        "engine_requests",
        "engine_running",
        "peer_active",
        "peer_footprint",
        "peer_reserved",
        "prompts",
        "reserved_blocks",
        "settled_at",
    )

    def __init__(self) -> None:
        self.reserved_blocks = 0
        self.active = 0
        self.adapters: dict[str, int] = {}  # kvroute's own requests in flight, by LoRA adapter (adapters.py)
        self.peer_reserved = 0  # the other replicas' reservations on this backend, as last published
        self.peer_active = 0
        self.peer_footprint = 0
        self.engine_requests = 0  # running + waiting at the engine's last sample
        self.engine_running = 0  # running at the engine's last sample
        self.engine_kv_usage = 0.0  # share of its KV blocks that running requests pin (for operators)
        self.engine_at = float("-inf")
        # The whole prompts of kvroute's own requests in flight here, waiting ones too: the KV cache
        # they take as they run, which no sample shows before they start
        self.prompts = InFlightBlocks()
        self.awaiting: deque[Reservation] = deque()  # prefill drained by engine progress, oldest first
        self._credit = 0.0  # progress of less than one block, kept for the next report
        # The latest moment kvroute learned a request here that has since ended: the engine ran
        # it, so a cache clear it reports later happened after that moment.
        self.settled_at = float("-inf")

    @property
    def footprint(self) -> int:
        """Distinct blocks the prompts of kvroute's own requests in flight here take."""
        return self.prompts.blocks

    def await_progress(self, reservation: Reservation) -> None:
        """Hold this reservation's prefill until the engine reports that much work stored."""
        awaiting = self.awaiting
        awaiting.append(reservation)
        if len(awaiting) > PROGRESS_COMPACT_AT + 2 * self.active:  # ended ones behind a live head
            self.awaiting = deque(r for r in awaiting if r.pending)

    def progress(self, blocks: float, done: list[Reservation]) -> None:
        """The engine stored this many blocks (in the reservations' units): prefill done, credited
        to the oldest waiting reservations; those it completes are appended to `done`. Progress
        beyond what waits is the engine's other work (decode, requests kvroute did not route) and
        is not kept for later ones."""
        credit = self._credit + blocks
        awaiting = self.awaiting
        while awaiting and (not awaiting[0].pending or credit >= 1):
            head = awaiting[0]
            taken = min(head.pending, int(credit))
            if taken:
                head.drain(taken)
                if not head.pending:
                    done.append(head)
            credit -= taken
            if not head.pending:
                awaiting.popleft()
        self._credit = credit if awaiting else 0.0

    def release_awaiting(self) -> None:
        """The engine's progress can no longer be followed: release every waiting prefill now."""
        while self.awaiting:
            self.awaiting.popleft().release_prefill()
        self._credit = 0.0

    def report(self, running: int, waiting: int, kv_usage: float, now: float) -> None:
        """The engine's own counts, from its /metrics."""
        self.engine_running = max(0, running)
        self.engine_requests = self.engine_running + max(0, waiting)
        self.engine_kv_usage = kv_usage
        self.engine_at = now

    def requests(self, now: float) -> int:
        """In-flight requests: kvroute's own (every replica's), or the engine's count when that is
        higher and fresh (someone else is sending it work, or kvroute released a request the engine
        still queues)."""
        routed = self.active + self.peer_active
        if now - self.engine_at <= ENGINE_SAMPLE_MAX_AGE_S:
            return max(routed, self.engine_requests)
        return routed

    def engine_fresh(self, now: float) -> bool:
        """The engine's last sample still says something about its load."""
        return now - self.engine_at <= ENGINE_SAMPLE_MAX_AGE_S

    def waiting(self, now: float) -> int | None:
        """Requests waiting at the engine now: in flight beyond what it ran at its last sample, so
        what kvroute sent since counts at once (None: no fresh sample)."""
        if not self.engine_fresh(now):
            return None
        return max(0, self.requests(now) - self.engine_running)

    def cost(self, active_request_cost: float, requests: int) -> float:
        """Load in blocks of prefill: queued prefill plus the worth of each of its `requests` in
        flight (`requests(now)`, which the caller has already read)."""
        return self.reserved_blocks + self.peer_reserved + active_request_cost * requests


class Reservation:
    """The load one routed request puts on its backend, until released."""

    __slots__ = (
        "_active_held",
        "_load",
        "adapter",
        "backend",
        "blocks",
        "chain",
        "in_flight",
        "learned_at",
        "pending",
        "predicted_s",
        "sent_at",
        "work",
    )

    def __init__(
        self, backend: str, load: BackendLoad, blocks: int, adapter: str | None = None, chain: Chain | None = None
    ) -> None:
        self.backend = backend
        self.chain = chain  # its whole prompt's blocks, in the backend's footprint while in flight
        self.adapter = adapter  # the LoRA adapter it runs, counted in flight with it
        self.blocks = blocks
        self.pending = blocks  # prefill blocks still reserved
        self.learned_at: float | None = None  # when kvroute learned the backend took it
        # For the time to first token (ttft.py): when it was sent, the prefill blocks it found
        # ahead plus its own, the requests in flight there then, and the seconds predicted then
        # (None: no prediction).
        self.sent_at = 0.0
        self.work = blocks
        self.in_flight = 0
        self.predicted_s: float | None = None
        self._load = load
        self._active_held = True
        load.reserved_blocks += blocks
        load.active += 1
        if chain:
            load.prompts.add(chain)
        if adapter is not None:
            load.adapters[adapter] = load.adapters.get(adapter, 0) + 1

    def drain(self, blocks: int) -> None:
        """The engine did this much of the prefill (at most what is still pending)."""
        blocks = min(blocks, self.pending)
        self.pending -= blocks
        self._load.reserved_blocks -= blocks

    def release_prefill(self) -> None:
        """Its prefill is done (or can no longer be followed). Safe to call any number of times."""
        self.drain(self.pending)

    def prefill_again(self) -> bool:
        """Its prefill, released when a prefill server was to compute it, is its backend's own
        again: the hand-off failed, and the request is served whole there. Once, while in flight;
        whether it was reserved again."""
        if self._active_held and not self.pending and self.blocks:
            self.pending = self.blocks
            self._load.reserved_blocks += self.blocks
            return True
        return False

    def finish(self) -> None:
        """The request ended (completed, failed or abandoned). Safe to call any number of times."""
        self.release_prefill()
        if self._active_held:
            self._active_held = False
            load = self._load
            load.active -= 1
            if self.chain:
                load.prompts.remove(self.chain)
            adapter = self.adapter
            if adapter is not None:
                left = load.adapters[adapter] - 1
                if left:
                    load.adapters[adapter] = left
                else:
                    del load.adapters[adapter]
            if self.learned_at is not None and self.learned_at > load.settled_at:
                load.settled_at = self.learned_at

    @property
    def finished(self) -> bool:
        return not self._active_held


class LoadTracker:
    """Load of every known backend."""

    __slots__ = ("_loads",)

    def __init__(self) -> None:
        self._loads: dict[str, BackendLoad] = {}

    def known(self, backend: str) -> BackendLoad | None:
        """The backend's load if it has any here (never made: looking must not bring back one that left)."""
        return self._loads.get(backend)

    def get(self, backend: str) -> BackendLoad:
        load = self._loads.get(backend)
        if load is None:
            load = self._loads[backend] = BackendLoad()
        return load

    def reserve(self, backend: str, blocks: int, adapter: str | None = None, chain: Chain | None = None) -> Reservation:
        """`blocks` of prefill to come; `chain`: the whole prompt's blocks, for the footprint."""
        return Reservation(backend, self.get(backend), blocks, adapter, chain)

    def remove_backend(self, backend: str) -> None:
        """Detach the backend's counters; handles still held release into the detached ones."""
        self._loads.pop(backend, None)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """backend -> (reserved blocks, this replica's own active requests)."""
        return {backend: (load.reserved_blocks, load.active) for backend, load in self._loads.items()}

    def published(self) -> dict[str, LoadVector]:
        """backend -> this replica's own load as its siblings count it (`PeerLoads`)."""
        return {backend: (load.reserved_blocks, load.active, load.footprint) for backend, load in self._loads.items()}

    def update_peers(self, changed: Mapping[str, LoadVector]) -> None:
        """The other replicas' summed load on these backends changed (`PeerLoads.changes`)."""
        for backend, vector in changed.items():
            load = self.get(backend)
            load.peer_reserved, load.peer_active, load.peer_footprint = vector

    def set_peers(self, totals: Mapping[str, LoadVector]) -> None:
        """The other replicas' load per backend, replacing the last."""
        for backend, load in self._loads.items():
            load.peer_reserved, load.peer_active, load.peer_footprint = totals.get(backend, NO_LOAD)
        for backend in totals.keys() - self._loads.keys():
            load = self.get(backend)
            load.peer_reserved, load.peer_active, load.peer_footprint = totals[backend]


class PeerLoads:
    """Each other replica's last published load vector. A replica not heard from for `max_age_s`
    counts for nothing: it stopped, or lost the store, and its requests are no longer kvroute's to
    count (the engines' own counts still see them).

    A replica publishes its whole vector at least every heartbeat and, in between, only the
    backends whose load changed (`merge`); the sums per backend are kept as they change, and
    `changes` hands over only the backends whose sum moved, so a fleet of many backends costs each
    message what it names, not the whole fleet (issue 35)."""

    __slots__ = ("_changed", "_sums", "_vectors", "max_age_s")

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._vectors: dict[str, tuple[float, dict[str, LoadVector]]] = {}
        self._sums: dict[str, LoadVector] = {}  # backend -> summed over the vectors held
        self._changed: set[str] = set()

    def _set(self, vector: dict[str, LoadVector], backend: str, value: LoadVector | None) -> None:
        """One replica's entry for a backend becomes `value` (None: gone); the sum follows."""
        old = vector.get(backend, NO_LOAD)
        new = NO_LOAD if value is None else value
        if value is None:
            vector.pop(backend, None)
        else:
            vector[backend] = value
        if old != new:
            held = self._sums.get(backend, NO_LOAD)
            total = (held[0] - old[0] + new[0], held[1] - old[1] + new[1], held[2] - old[2] + new[2])
            if total == NO_LOAD:  # (a backend no sibling loads any more leaves the table)
                self._sums.pop(backend, None)
            else:
                self._sums[backend] = total
            self._changed.add(backend)

    def update(self, replica: str, vector: dict[str, LoadVector], now: float) -> None:
        """A replica's whole vector, replacing what was held of it."""
        held = self._vectors[replica][1] if replica in self._vectors else {}
        for backend in held.keys() - vector.keys():
            self._set(held, backend, None)
        for backend, value in vector.items():
            self._set(held, backend, value)
        self._vectors[replica] = (now, held)

    def merge(self, replica: str, delta: dict[str, LoadVector], now: float) -> bool:
        """The backends whose load changed at a replica since its last message; False (ignored)
        when no whole vector of it is held yet (it comes within a heartbeat)."""
        entry = self._vectors.get(replica)
        if entry is None:
            return False
        held = entry[1]
        for backend, value in delta.items():
            self._set(held, backend, value)
        self._vectors[replica] = (now, held)
        return True

    def _expire(self, now: float) -> None:
        for replica in [r for r, (seen, _) in self._vectors.items() if now - seen > self.max_age_s]:
            held = self._vectors.pop(replica)[1]
            for backend in list(held):
                self._set(held, backend, None)

    def changes(self, now: float) -> dict[str, LoadVector]:
        """backend -> summed load, for the backends whose sum moved since the last call (a replica
        gone quiet takes its load away)."""
        self._expire(now)
        changed = {backend: self._sums.get(backend, NO_LOAD) for backend in self._changed}
        self._changed.clear()
        return changed

    def totals(self, now: float) -> dict[str, LoadVector]:
        """backend -> summed load of the replicas heard from lately."""
        self._expire(now)
        totals: dict[str, LoadVector] = {}
        for _, vector in self._vectors.values():
            for backend in vector:
                totals[backend] = self._sums.get(backend, NO_LOAD)
        return totals

    def __len__(self) -> int:
        return len(self._vectors)
