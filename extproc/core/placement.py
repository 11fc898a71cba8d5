"""Placing LoRA adapters on servers, by demand, without thrashing (`adapter_sources`).

Routing alone (rules.AdapterAffinity) can only use the adapters where they are. Placement moves
them: only the adapters the policy names (each with the path servers load it from), never a name
a client sent. Each round (`plan`):
- an adapter a request asked for (`wanted`) that no server lists is loaded on the best server;
- an adapter whose requests in flight per holder reach `adapter_scale_out_requests` is loaded on
  one more server (beyond `adapter_max_backends`: its load calls for it);
- a holder where the adapter went unused for `adapter_idle_s` (or, beyond `adapter_max_backends`,
  for `adapter_min_resident_s`) is unloaded, never the last one, the way a balance move's old copy
  is (below): out of the candidates, sibling replicas told, unloaded once drained. Unused is what
  this replica saw; a sibling may still be sending requests there, which an unload at once would
  have turned into the engine's 404;
- hysteresis: a server keeps an adapter placement loaded there for `adapter_min_resident_s`, and
  does not get back one it just unloaded for as long, so load and unload never chase each other;
- balance (`_balance`): adapters are placed on their first requests, before their popularity is
  known, and one server can end up drawing most of the demand. When the server whose adapters draw
  the most demand draws BALANCE_GAP of the fleet's more than the one drawing least, one adapter
  moves from the first to the second: the one that evens them best alone, by at least half that
  gap; if none does, the first of a swap that does (one moved back the other way next: two
  popular adapters together on one server may be evened only so). It is loaded there, then no
  longer routed to on the first (`AdapterBook.leave`; sibling replicas are told: `moving_off`),
  and unloaded there once its requests in flight have ended, DRAIN_GRACE_S later at the earliest
  (called off, the copy routed to again, if they have not been seen to end within DRAIN_LIMIT_S).
  One move at a time, at most one per BALANCE_EVERY_S, only on BALANCE_MIN_DEMAND requests' worth
  of demand, and an adapter moved is not moved again for `adapter_min_resident_s`. An adapter
  just placed may move: where it went first was chosen before its demand was known.
The best server for a load: the one whose adapters draw the least demand (requests naming them,
decayed with a half-life of `DEMAND_HALF_LIFE_S`), then whose slots are least taken by adapters in
use, then the least busy: placing adapters by slots alone put the popular ones together (measured
on vLLM-CPU: one server took 70 % of the requests, throughput fell to 0.79-0.91x). At most one
move per adapter is in flight; a failed move is not retried on that server for
`adapter_min_resident_s`, and the request is routed as without placement. With
sibling replicas, one at a time makes an adapter's moves (the runtime claims it in the store).

Pure: the runtime (extproc/runtime/placer.py) carries the moves out and reports them `done`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from extproc.core.adapters import AdapterBook
from extproc.core.load import LoadTracker
from extproc.core.settings import Settings

_NEVER = float("-inf")
ADAPTER_WAIT_S = 10.0  # a request waits this long at most for placement to load its adapter
DEMAND_HALF_LIFE_S = 60.0  # an adapter's demand: requests naming it, halved every minute
BALANCE_GAP = 0.1  # a move evens servers whose drawn demand differs by this share of the fleet's
BALANCE_MIN_DEMAND = 16.0  # ... once the fleet's demand (decayed requests) says this much
BALANCE_EVERY_S = 5.0  # at most one such move this often
DRAIN_GRACE_S = 2.0  # a copy moved off takes no new requests this long before it may be unloaded
DRAIN_LIMIT_S = 600.0  # ... and is routed to again if its requests have not been seen to end by then
UNLOAD_TRIES = 3  # a move whose old copy fails to unload this often is given up (both copies stay)


class Move(NamedTuple):
    """Load (or unload) `adapter` on `backend`, from `path`."""

    load: bool
    backend: str
    adapter: str
    path: str


class _Round(NamedTuple):
    """What one planning round looks at."""

    settings: Settings
    book: AdapterBook
    loads: LoadTracker
    backends: Sequence[str]
    now: float


class AdapterPlacement:
    """Placement's memory: when each (server, adapter) was loaded, unloaded, last used, and what
    requests are waiting for."""

    __slots__ = (
        "_balanced_at",
        "_changed_at",
        "_demand",
        "_failed_at",
        "_left_at",
        "_moved_at",
        "_moving",
        "_names",
        "_pending",
        "_unload_failures",
        "_used_at",
        "_wanted",
        "counts",
    )

    def __init__(self) -> None:
        self._changed_at: dict[tuple[str, str], float] = {}  # placement loaded or unloaded it there
        self._failed_at: dict[tuple[str, str], float] = {}
        self._used_at: dict[tuple[str, str], float] = {}
        self._pending: set[str] = set()  # adapters with a move in flight
        self._wanted: dict[str, float] = {}  # placed adapters -> when a request last named it
        self._demand: dict[str, tuple[float, float]] = {}  # placed adapters -> (decayed requests, as of)
        self._names: tuple[tuple[tuple[str, str], ...], frozenset[str]] = ((), frozenset())  # sources, their names
        self._moving: dict[str, str] = {}  # adapter -> the server balance moves it off
        self._moved_at: dict[str, float] = {}  # adapter -> when balance last moved it
        # adapter -> when its old copy stopped taking requests, and the server its new copy is on
        self._left_at: dict[str, tuple[float, str]] = {}
        self._unload_failures: dict[str, int] = {}  # adapter -> failed unloads of its old copy
        self._balanced_at = _NEVER
        self.counts: Counter[tuple[str, str]] = Counter()  # (load|unload, ok|failed|called_off) -> moves

    def wanted(self, settings: Settings, adapter: str, now: float) -> bool:
        """A request names `adapter`: True if placement may load it (the policy names it); its
        demand counts one more."""
        if adapter not in self._placed(settings):
            return False
        self._wanted[adapter] = now
        self._demand[adapter] = (self.demand(adapter, now) + 1.0, now)
        return True

    def _placed(self, settings: Settings) -> frozenset[str]:
        """The names of the adapters the policy places, worked out once per policy."""
        sources, names = self._names
        if sources is not settings.adapter_sources:
            sources, names = settings.adapter_sources, frozenset(name for name, _ in settings.adapter_sources)
            self._names = (sources, names)
        return names

    def demand(self, adapter: str, now: float) -> float:
        """Requests that named `adapter` lately, each counting half as much a half-life later."""
        value, at = self._demand.get(adapter, (0.0, now))
        return value * math.exp2(-(now - at) / DEMAND_HALF_LIFE_S) if value else 0.0

    def plan(
        self, settings: Settings, book: AdapterBook, loads: LoadTracker, backends: Sequence[str], now: float
    ) -> list[Move]:
        """This round's moves, at most one per adapter."""
        names = self._placed(settings)
        for gone in [a for a in self._demand if a not in names]:  # no longer the policy's to place
            del self._demand[gone]
            self._moved_at.pop(gone, None)
        for adapter in [a for a, origin in self._moving.items() if a not in names or origin not in backends]:
            self._stay(book, adapter)
        moves: list[Move] = []
        planned: dict[str, float] = {}  # backend -> demand of the adapters this round loads there
        round_ = _Round(settings, book, loads, backends, now)
        for adapter, path in settings.adapter_sources:
            if adapter in self._pending:
                continue
            if adapter in self._moving and self._crowded(round_, adapter):  # a spike while a copy
                self._stay(book, adapter)  # goes: it serves again instead
            if adapter in self._moving:
                move = self._move_off(round_, adapter, path)
            else:
                move = self._move(round_, adapter, path, planned)
            if move is not None:
                self._pending.add(adapter)
                moves.append(move)
                if move.load:  # the next load of this round sees it there
                    planned[move.backend] = planned.get(move.backend, 0.0) + self.demand(adapter, now)
        if not moves and not self._pending and not self._moving and now - self._balanced_at >= BALANCE_EVERY_S:
            move = self._balance(round_)
            if move is not None:
                self._pending.add(move.adapter)
                self._balanced_at = now
                moves.append(move)
        return moves

    def pending(self, adapter: str) -> bool:
        """A move of `adapter` is being carried out."""
        return adapter in self._pending

    def skip(self, move: Move) -> None:
        """Another replica acts for this adapter (or balances) now: the move is not made here."""
        self._pending.discard(move.adapter)
        if self.balancing(move):
            del self._moving[move.adapter]

    def balancing(self, move: Move) -> bool:
        """`move` is a balance move's load (one replica balances at a time: the runtime claims it)."""
        return move.load and move.adapter in self._moving and move.adapter not in self._left_at

    def done(self, move: Move, ok: bool, now: float) -> None:
        """The runtime carried `move` out (or failed to)."""
        self._pending.discard(move.adapter)
        key = (move.backend, move.adapter)
        outcome = ("load" if move.load else "unload", "ok" if ok else "failed")
        self.counts[outcome] += 1
        if ok:
            self._changed_at[key] = now
            self._used_at[key] = now
            if move.load:
                self._wanted.pop(move.adapter, None)
        else:
            self._failed_at[key] = now
            if move.load and self._moving.get(move.adapter) is not None:  # the move's load failed: it stays
                del self._moving[move.adapter]
        if not move.load and self._moving.get(move.adapter) == move.backend:
            if ok:  # moved
                self._end_move(move.adapter)
            else:
                self._unload_failures[move.adapter] = self._unload_failures.get(move.adapter, 0) + 1

    def _end_move(self, adapter: str) -> str:
        """Forget a move of `adapter` (done or called off); returns the server it was moving off."""
        self._left_at.pop(adapter, None)
        self._unload_failures.pop(adapter, None)
        return self._moving.pop(adapter)

    def _stay(self, book: AdapterBook, adapter: str) -> None:
        """Call a move of `adapter` off: the copy it was taking off serves again (both copies stay)."""
        book.leave(self._end_move(adapter), adapter, False)

    def moving_off(self) -> dict[str, tuple[str, str]]:
        """Adapter -> (the server its copy is being taken off, by a balance move or as idle; a
        server that keeps it), once that copy takes no new requests here: sibling replicas are told
        before it goes."""
        return {adapter: (self._moving[adapter], target) for adapter, (_, target) in self._left_at.items()}

    def keep(self, backends: set[str]) -> None:
        """Forget what placement remembers of servers that left the pool (pod IPs come and go)."""
        for table in (self._changed_at, self._failed_at, self._used_at):
            for key in [k for k in table if k[0] not in backends]:
                del table[key]

    def _move_off(self, round_: _Round, adapter: str, path: str) -> Move | None:
        """A copy's retirement (a balance move's second half, or an idle copy's unload): another
        server lists the adapter, so this one takes no new requests for it, and unloads it once
        those in flight there have ended."""
        settings, book, loads, backends, now = round_
        origin = self._moving[adapter]
        target = next((b for b in backends if b != origin and book.lists(b, adapter)), None)
        left_at = self._left_at.get(adapter, (now, ""))[0]
        if (
            target is None
            or self._unload_failures.get(adapter, 0) >= UNLOAD_TRIES
            or now - left_at > DRAIN_LIMIT_S  # a count that never ends would block every balance move
        ):
            self._stay(book, adapter)
            self.counts[("unload", "called_off")] += 1
            return None
        if adapter not in self._left_at:  # sibling replicas hear of it (`moving_off`) before the unload
            book.leave(origin, adapter)
            self._left_at[adapter] = (now, target)
        if now - left_at < DRAIN_GRACE_S:
            return None
        if loads.get(origin).adapters.get(adapter, 0) or book.runs(origin, adapter, now):
            return None
        if not loads.get(origin).engine_fresh(now):  # siblings' requests there show only in a fresh sample
            return None
        if now - self._failed_at.get((origin, adapter), _NEVER) < settings.adapter_min_resident_s:
            return None
        return Move(False, origin, adapter, path)

    def _balance(self, round_: _Round) -> Move | None:
        """The load that evens the demand the servers draw, if they are BALANCE_GAP apart (module
        docstring); its origin is recorded in `_moving`."""
        settings, book, _, backends, now = round_
        if len(backends) < 2 or book.any_leaving():  # a move (perhaps a sibling's) is under way
            return None
        demand = {a: self.demand(a, now) for a, _ in settings.adapter_sources}
        total = sum(demand.values())
        if total < BALANCE_MIN_DEMAND:
            return None
        holders = {a: [b for b in backends if book.lists(b, a)] for a in demand}
        drawn = dict.fromkeys(backends, 0.0)
        for adapter, held in holders.items():
            for backend in held:
                drawn[backend] += demand[adapter] / len(held)
        heavy, light = max(backends, key=drawn.__getitem__), min(backends, key=drawn.__getitem__)
        gap = drawn[heavy] - drawn[light]
        if gap <= BALANCE_GAP * total:
            return None

        def movable(adapter: str, origin: str, target: str) -> bool:
            """On `origin` only (of the two), not moved lately, not just unloaded from `target` nor
            failed to load there."""
            held = holders[adapter]
            if origin not in held or target in held or now - self._moved_at.get(adapter, _NEVER) < hold:
                return False
            left = self._changed_at.get((target, adapter), _NEVER)
            return now - max(left, self._failed_at.get((target, adapter), _NEVER)) >= hold

        hold = settings.adapter_min_resident_s
        share = {a: demand[a] / len(held) for a, held in holders.items() if held}
        out = [a for a in share if movable(a, heavy, light)]
        back = [share[a] for a in share if movable(a, light, heavy)]  # a second move the other way
        best: tuple[float, str] | None = None
        for pairs in ([0.0], back):  # one move that does it alone, else the first of a swap
            for adapter in out:
                after = min(abs(gap - 2 * share[adapter] + 2 * other) for other in pairs)
                if after <= gap / 2 and (best is None or after < best[0]):
                    best = (after, adapter)
            if best is not None:
                break
        if best is None:
            return None
        adapter = best[1]
        self._moving[adapter] = heavy
        self._moved_at[adapter] = now
        return Move(True, light, adapter, dict(settings.adapter_sources)[adapter])

    def _move(self, round_: _Round, adapter: str, path: str, planned: dict[str, float]) -> Move | None:
        settings, book, loads, backends, now = round_
        hold = settings.adapter_min_resident_s
        holders = [b for b in backends if book.lists(b, adapter)]
        in_flight = 0
        for backend in holders:
            requests = loads.get(backend).adapters.get(adapter, 0)
            in_flight += requests
            key = (backend, adapter)
            if requests or book.runs(backend, adapter, now) or key not in self._used_at:
                self._used_at[key] = now
        if not holders:
            if any(book.has(b, adapter) for b in backends):  # only a copy being moved off: it serves
                return None
            asked = self._wanted.get(adapter, _NEVER)
            if now - asked > settings.adapter_idle_s:
                return None
            target = self._best(book, loads, backends, adapter, now, hold, planned, recent_ok=True)
            return None if target is None else Move(True, target, adapter, path)
        if in_flight / len(holders) >= settings.adapter_scale_out_requests:
            others = [b for b in backends if b not in holders]
            target = self._best(book, loads, others, adapter, now, hold, planned, recent_ok=False)
            return None if target is None else Move(True, target, adapter, path)
        if len(holders) == 1:
            return None
        if len(holders) > settings.adapter_max_backends and (
            in_flight / (len(holders) - 1) <= settings.adapter_scale_out_requests / 2
        ):  # the spike is over: one copy fewer carries it under half the scale-out mark (hysteresis)
            settled = [b for b in holders if now - self._changed_at.get((b, adapter), _NEVER) >= hold]
            if settled:  # the least busy of the copies loaded long enough ago goes, drained first
                self._moving[adapter] = min(settled, key=lambda b: loads.get(b).adapters.get(adapter, 0))
                return self._move_off(round_, adapter, path)
        idle_for = settings.adapter_idle_s if len(holders) <= settings.adapter_max_backends else hold
        idle = [
            b
            for b in holders
            if now - self._used_at[(b, adapter)] >= idle_for
            and now - self._changed_at.get((b, adapter), _NEVER) >= hold
        ]
        if not idle:
            return None
        origin = max(idle, key=lambda b: (book.slot_share(b, loads.get(b), now), loads.get(b).requests(now)))
        self._moving[adapter] = origin  # retired as a balance move's old copy is: a sibling may still send there
        return self._move_off(round_, adapter, path)

    def _crowded(self, round_: _Round, adapter: str) -> bool:
        """The copies of `adapter` that take requests carry as many as call for one more (or none
        does): a copy being moved off had better serve on."""
        _, book, loads, backends, _ = round_
        holders = [b for b in backends if book.lists(b, adapter)]
        in_flight = sum(loads.get(b).adapters.get(adapter, 0) for b in holders)
        return not holders or in_flight / len(holders) >= round_.settings.adapter_scale_out_requests

    def _best(
        self,
        book: AdapterBook,
        loads: LoadTracker,
        backends: Sequence[str],
        adapter: str,
        now: float,
        hold: float,
        planned: dict[str, float],
        recent_ok: bool,
    ) -> str | None:
        """Where to load `adapter`: least demand for the adapters there (and those this round
        loads there: `planned`), then slots least taken, then least busy; not where a move of it
        failed lately, nor (unless no server has it) where it was just unloaded."""
        best: tuple[float, float, int, str] | None = None
        for backend in backends:
            key = (backend, adapter)
            if now - self._failed_at.get(key, _NEVER) < hold:
                continue
            if not recent_ok and now - self._changed_at.get(key, _NEVER) < hold:
                continue
            load = loads.get(backend)
            drawn = planned.get(backend, 0.0)
            drawn += sum(self.demand(a, now) for a in self._demand if a != adapter and book.lists(backend, a))
            rank = (drawn, book.slot_share(backend, load, now), load.requests(now), backend)
            if best is None or rank < best:
                best = rank
        return None if best is None else best[3]
