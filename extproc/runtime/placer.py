"""Carry out LoRA adapter placement (extproc/core/placement.py) on the servers: vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (servers started with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). A round every `interval_s`, and one at once when a request
waits for an adapter no server lists (`ensure`). A server that already has the adapter (vLLM's
400 "already been loaded") or no longer has it (404 on unload) counts as done: another replica got
there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.core.placement import AdapterPlacement, Move
from extproc.core.router import Router
from extproc.runtime.pool import BackendPool
from extproc.runtime.replies import read_within
from extproc.runtime.stopping import stop_asked

log = logging.getLogger(__name__)

MOVE_TIMEOUT_S = 30.0  # a load reads the adapter from the server's disk
MAX_REPLY_BYTES = 4096  # of a load's or unload's answer: its status decides, its text is only logged
PLACEMENT_INTERVAL_S = 1.0
CLAIM_S = 5.0  # one replica makes an adapter's moves this long (its siblings see them by then)
BALANCE_CLAIM_S = 60.0  # one replica balances this long: a whole move (load, drain, unload) and the next
RETELL_S = 10.0  # siblings are told again this often while a move lasts (their word expires: redis_link)


class AdapterPlacer:
    """Runs placement rounds against the pool's healthy servers."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        clock: Callable[[], float] = time.monotonic,
        claim: Callable[[str, float], Awaitable[bool]] | None = None,
        tell_leaving: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """`claim`: with sibling replicas, whether this one may move an adapter now (the replica
        store's claim, held `CLAIM_S`): one replica's load decision, not one per replica.
        `tell_leaving(old, adapter, new)`: siblings stop routing an adapter to a copy being moved off
        (and hear of its new one)."""
        self.placement = AdapterPlacement()
        self._claim = claim
        self._tell_leaving = tell_leaving
        self._told: dict[str, tuple[str, str, float]] = {}  # adapter -> (old, new copy) siblings were told of, when
        self._router = router
        self._pool = pool
        self._clock = clock
        self._wake = asyncio.Event()
        self._round_done = asyncio.Event()
        self.rounds = 0  # rounds begun
        self._elsewhere: set[str] = set()  # adapters whose move a sibling replica claimed this round

    @property
    def enabled(self) -> bool:
        return bool(self._router.settings.adapter_sources)

    async def ensure(self, adapter: str, timeout_s: float) -> bool:
        """Before routing a request for `adapter`: if the policy places it and no server lists it,
        ask for it and wait (at most `timeout_s`) until one does. True if a server lists it now.
        A round begun after the ask that loads it nowhere (its load failed, or no server may take
        it yet) and leaves no move of it in flight, here or claimed by a sibling, ends the wait at
        once: nothing is coming, and the request goes on as to a server that loads it itself."""
        router = self._router

        def listed() -> bool:  # a copy being moved off counts: it serves until the new one is known
            return any(router.adapters.has(b.address, adapter) for b in self._pool.backends if b.healthy)

        if not self.placement.wanted(router.settings, adapter, self._clock()):  # (its demand counted)
            return listed()
        if listed():
            return True
        deadline = self._clock() + timeout_s
        asked_after = self.rounds
        while not listed():
            left = deadline - self._clock()
            if left <= 0:
                return False
            self._round_done.clear()
            # A round begun after the ask, at once; then, a move being under way (here or a
            # sibling's), at the rounds' own pace: woken each time, a sibling's claim made rounds
            # run back to back (68,000 in 2 s, each a claim in the store).
            if self.rounds <= asked_after:
                self._wake.set()
            try:
                async with asyncio.timeout(left):
                    await self._round_done.wait()
            except TimeoutError:
                return False
            if (
                self.rounds > asked_after
                and not listed()
                and not self.placement.pending(adapter)
                and adapter not in self._elsewhere
            ):
                return False
        return True

    async def run(self, interval_s: float) -> None:
        """Rounds until cancelled; survives any error (logged, counted by the moves' outcomes)."""
        timeout = aiohttp.ClientTimeout(total=MOVE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop_asked():  # (a claim's Redis command can swallow the cancel: stopping.py)
                try:
                    await self.round(session)
                except Exception:
                    log.exception("adapter placement round failed; placement goes on")
                self._round_done.set()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # a round every interval, or at once when woken
                    async with asyncio.timeout(interval_s):
                        await self._wake.wait()

    async def round(self, session: aiohttp.ClientSession) -> None:
        router = self._router
        self.rounds += 1
        self._elsewhere = set()
        if not router.settings.adapter_sources:
            return
        self.placement.keep({b.address for b in self._pool.backends})
        backends = [b.address for b in self._pool.backends if b.healthy]
        planned = self.placement.plan(router.settings, router.adapters, router.loads, backends, self._clock())
        unreported = set(planned)
        try:
            self._tell(self._clock())
            moves = []
            for move in planned:
                balancing = self.placement.balancing(move)
                name, hold = ("balance", BALANCE_CLAIM_S) if balancing else (move.adapter, CLAIM_S)
                if self._claim is None or await self._claim(f"placement:{name}", hold):
                    moves.append(move)
                else:
                    self.placement.skip(move)
                    unreported.discard(move)
                    self._elsewhere.add(move.adapter)
                if stop_asked():
                    raise asyncio.CancelledError
            results = await asyncio.gather(*(self._carry_out(session, move) for move in moves))
            now = self._clock()
            for move, ok in zip(moves, results, strict=True):
                if ok and self._pool.is_known(move.backend):
                    router.adapters.listed_now(move.backend, move.adapter, move.load)
                self.placement.done(move, ok, now)
                unreported.discard(move)
        finally:  # a move planned is reported whatever ended the round: one left pending is never planned again
            for move in unreported:
                self.placement.done(move, False, self._clock())

    def _tell(self, now: float) -> None:
        """Tell siblings of each copy a balance move has stopped routing to, and again every
        RETELL_S while the move lasts."""
        told: dict[str, tuple[str, str, float]] = {}
        for adapter, (old, new) in self.placement.moving_off().items():
            before = self._told.get(adapter)
            if before is not None and before[:2] == (old, new) and now - before[2] < RETELL_S:
                told[adapter] = before
                continue
            if self._tell_leaving is not None:
                self._tell_leaving(old, adapter, new)
            told[adapter] = (old, new, now)
        self._told = told

    async def _carry_out(self, session: aiohttp.ClientSession, move: Move) -> bool:
        """One load or unload; whether the engine did it (or had). A load is sent only from a path
        the policy lists now: one dropped while the round claimed its moves is not loaded."""
        if move.load and (move.adapter, move.path) not in self._router.settings.adapter_sources:
            return False
        path = "/v1/load_lora_adapter" if move.load else "/v1/unload_lora_adapter"
        body = {"lora_name": move.adapter, "lora_path": move.path} if move.load else {"lora_name": move.adapter}
        try:
            async with session.post(f"http://{move.backend}{path}", json=body) as response:
                text = (await read_within(response.content, MAX_REPLY_BYTES)).decode(errors="replace")
                if response.status == 200:
                    return True
                if move.load and response.status == 400 and "already" in text:
                    return True
                if not move.load and response.status == 404:
                    return True
                log.warning(
                    "%s of adapter %s on %s: HTTP %d %s", path, move.adapter, move.backend, response.status, text[:200]
                )
                return False
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("%s of adapter %s on %s failed: %s", path, move.adapter, move.backend, error)
            return False


class PlacementCollector(Collector):
    """kvroute_adapter_placements_total{action, outcome}: the moves placement carried out."""

    def __init__(self, placement: AdapterPlacement) -> None:
        self._placement = placement

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvroute_adapter_placements",
            "LoRA adapter loads and unloads placement made, by outcome",
            labels=["action", "outcome"],
        )
        for (action, outcome), count in sorted(self._placement.counts.items()):
            family.add_metric([action, outcome], count)
        yield family
