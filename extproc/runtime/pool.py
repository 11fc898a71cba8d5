"""The backend set: which addresses may be routed to, and which of them are up.

Only addresses in this set are ever written into the destination header. A backend that fails
`unhealthy_after` health checks in a row leaves the routing core at once: index entries, session
bindings and reservations go with it. It comes back when it answers again. A single report of a
refused connection only makes a backend suspect: it is probed at once and dropped only if that
probe fails too, so one forged or transient report cannot wipe a backend. Until that probe answers
(a few milliseconds) a suspect takes no new requests while another backend is up: the next request
must not race the probe to the same dead address (a gateway whose cluster takes one address cannot
retry it elsewhere). A backend that accepts
the probe but answers slowly is busy, not down: it is dropped only after SLOW_FACTOR times as many
slow answers in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

from extproc.core.backends import Backend
from extproc.runtime.pages import PageClient
from extproc.runtime.rotation import Rotation

log = logging.getLogger(__name__)
HEALTH_PAGE_BYTES = 4096  # of a /health answer read (vLLM's is empty)

SLOW_FACTOR = 5
UP, DOWN, SLOW = "up", "down", "slow"


class BackendPool:
    """Known backends with their health, probed on `/health`."""

    def __init__(
        self,
        backends: Iterable[Backend],
        on_down: Callable[[str], None],
        unhealthy_after: int,
    ) -> None:
        self._on_down = on_down
        self._unhealthy_after = unhealthy_after
        self._backends: dict[str, Backend] = {}
        self._view: tuple[Backend, ...] | None = None  # `backends`, one tuple until the set changes
        self._failures: dict[str, int] = {}
        self._slow: dict[str, int] = {}
        self._suspects: set[str] = set()  # to probe at once
        self._unprobed: set[str] = set()  # suspects routed around until their probe answers
        self._rotation = Rotation()  # which backends a round probes, in a fleet past the rate
        self._wake = asyncio.Event()
        self.probe_errors = 0
        self.last_probe_error: str | None = None
        self.replace(backends)

    def replace(self, backends: Iterable[Backend]) -> None:
        """Adopt a new backend set; backends that left are dropped from routing at once."""
        incoming = {b.address: b for b in backends}
        for address in self._backends.keys() - incoming.keys():
            self._on_down(address)
            self._failures.pop(address, None)
            self._slow.pop(address, None)
            self._suspects.discard(address)
            self._unprobed.discard(address)
        self._backends = {
            address: replace(b, healthy=self._backends[address].healthy if address in self._backends else True)
            for address, b in incoming.items()
        }
        self._view = None

    @property
    def backends(self) -> tuple[Backend, ...]:
        """The same tuple while the set and its health are unchanged, so the routing core can keep
        what it derives from it (the candidates per model: pipeline.py)."""
        view = self._view
        if view is None:
            view = self._view = self._routable()
        return view

    def _routable(self) -> tuple[Backend, ...]:
        """The backends as routing sees them: a suspect not yet probed counts as down, unless no
        other backend is up (then it is still the best guess)."""
        members = self._backends.values()
        if self._unprobed and any(b.healthy and b.address not in self._unprobed for b in members):
            return tuple(replace(b, healthy=False) if b.address in self._unprobed else b for b in members)
        return tuple(members)

    def is_known(self, address: str) -> bool:
        return address in self._backends

    def routable(self, address: str) -> bool:
        """Known and healthy now."""
        backend = self._backends.get(address)
        return backend is not None and backend.healthy

    def canonical(self, address: str) -> str | None:
        """The pool's own string for a known address (so millions of bindings share one), or None."""
        backend = self._backends.get(address)
        return None if backend is None else backend.address

    def healthy_count(self) -> int:
        return sum(b.healthy for b in self._backends.values())

    def mark(self, address: str, up: bool, *, confirmed: bool = False) -> None:
        """Record one health observation; flip state after `unhealthy_after` failures (or one
        `confirmed` failure) or one success."""
        backend = self._backends.get(address)
        if backend is None:
            return
        if up:
            self._failures[address] = 0
            self._slow[address] = 0
            if not backend.healthy:
                log.info("backend %s is up again", address)
                self._backends[address] = replace(backend, healthy=True)
                self._view = None
            return
        self._failures[address] = self._failures.get(address, 0) + 1
        if backend.healthy and (confirmed or self._failures[address] >= self._unhealthy_after):
            log.warning("backend %s is down: dropping its locations, sessions and load", address)
            self._backends[address] = replace(backend, healthy=False)
            self._view = None
            self._on_down(address)

    def mark_suspect(self, address: str) -> None:
        """Envoy reported a refused connection: probe it now; drop it only if that probe fails."""
        if address in self._backends:
            self._suspects.add(address)
            if address not in self._unprobed:
                self._unprobed.add(address)
                self._view = None
            self._wake.set()

    def _observe(self, address: str, result: str, suspect: bool) -> None:
        """One probe's result: a failed probe of a suspect confirms it down at once."""
        if suspect and address in self._unprobed:
            self._unprobed.discard(address)
            self._view = None
        if address not in self._backends:  # it left while probed: nothing to keep of it
            return
        if result == UP:
            self.mark(address, True)
        elif result == DOWN:
            self.mark(address, False, confirmed=suspect)
        else:
            self._slow[address] = self._slow.get(address, 0) + 1
            if self._slow[address] >= SLOW_FACTOR * self._unhealthy_after:
                self._slow[address] = 0
                self.mark(address, False, confirmed=True)

    async def probe_forever(self, interval_s: float, timeout_s: float, probes_per_s: float = float("inf")) -> None:
        """GET /health on every backend each interval (at once for a suspect), concurrently; past
        `probes_per_s`, on the next slice of them each interval (rotation.py). Survives any error:
        logs, counts, goes on."""
        if probes_per_s != float("inf"):
            self._rotation.pace(probes_per_s, interval_s)
        client = PageClient(timeout_s)
        loop = asyncio.get_running_loop()
        due = loop.time()  # the next interval's round; rounds woken for suspects do not move it
        try:
            while True:
                client.keep_only(self._backends)
                self._wake.clear()  # (before the round: a suspect reported during it wakes the next)
                scheduled = loop.time() >= due  # else woken for suspects alone
                if scheduled:
                    due = loop.time() + interval_s
                try:
                    await self._probe_round(client, scheduled)
                    self.last_probe_error = None
                except Exception as exc:  # a bug or a surprise must not stop health checking
                    self.probe_errors += 1
                    self.last_probe_error = f"{type(exc).__name__}: {exc}"
                    log.exception("backend probe round failed; probing goes on")
                # asyncio.timeout_at, not wait_for: Python 3.11's wait_for swallows a cancel that
                # comes as the event is set (a suspect marked during shutdown), and the loop never
                # stops. Until the interval's own deadline: refused connections reported more often
                # than the interval had put the whole fleet's round off for good (a backend down
                # was never probed back up)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(due):
                        await self._wake.wait()
        finally:
            client.close()

    async def _probe_round(self, client: PageClient, scheduled: bool = True) -> None:
        """The suspects, and on the interval's round the next slice of every backend. A round
        woken for a suspect probes it alone: a round of the whole slice at each refused connection
        Envoy reported counted failures against every other backend meanwhile, dropping one after
        a blip of milliseconds."""
        suspects, self._suspects = self._suspects, set()
        backends = self._rotation.take(list(self._backends)) if scheduled else []
        backends += [address for address in suspects if address in self._backends and address not in backends]
        results = await asyncio.gather(*(self._probe(client, a) for a in backends))
        for address, result in zip(backends, results, strict=True):
            self._observe(address, result, address in suspects)

    @staticmethod
    async def _probe(client: PageClient, address: str) -> str:
        """UP on a 200, SLOW if it did not answer in time, else DOWN."""
        try:
            status, _ = await client.get(address, "/health", HEALTH_PAGE_BYTES)
        except TimeoutError:
            return SLOW
        except OSError:
            return DOWN
        return UP if status == 200 else DOWN
