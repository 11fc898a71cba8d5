"""Placing LoRA adapters on servers, by demand, without thrashing (`adapter_sources`).

Routing alone (rules.AdapterAffinity) can only use the adapters where they are. Placement moves
them: only the adapters the policy names (each with the path servers load it from), never a name
a client sent. Each round (`plan`):
- an adapter a request asked for (`wanted`) that no server lists is loaded on the best server;
- an adapter whose requests in flight per holder reach `adapter_scale_out_requests` is loaded on
  one more server (beyond `adapter_max_backends`: its load calls for it);
- a holder where the adapter went unused for `adapter_idle_s` (or, beyond `adapter_max_backends`,
  for `adapter_min_resident_s`) is unloaded, never the last one;
- hysteresis: a server keeps an adapter placement loaded there for `adapter_min_resident_s`, and
  does not get back one it just unloaded for as long, so load and unload never chase each other.
The best server for a load: the one whose slots are least taken by adapters in use, then the
least busy. At most one move per adapter is in flight; a failed move is not retried on that
server for `adapter_min_resident_s`, and the request is routed as without placement. With
sibling replicas, one at a time makes an adapter's moves (the runtime claims it in the store).

Pure: the runtime (extproc/runtime/placer.py) carries the moves out and reports them `done`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from extproc.core.adapters import AdapterBook
from extproc.core.load import LoadTracker
from extproc.core.settings import Settings

_NEVER = float("-inf")
ADAPTER_WAIT_S = 10.0  # a request waits this long at most for placement to load its adapter


class Move(NamedTuple):
    """Load (or unload) `adapter` on `backend`, from `path`."""

    load: bool
    backend: str
    adapter: str
    path: str


class AdapterPlacement:
    """Placement's memory: when each (server, adapter) was loaded, unloaded, last used, and what
    requests are waiting for."""

    __slots__ = ("_changed_at", "_failed_at", "_pending", "_used_at", "_wanted", "counts")

    def __init__(self) -> None:
        self._changed_at: dict[tuple[str, str], float] = {}  # placement loaded or unloaded it there
        self._failed_at: dict[tuple[str, str], float] = {}
        self._used_at: dict[tuple[str, str], float] = {}
        self._pending: set[str] = set()  # adapters with a move in flight
        self._wanted: dict[str, float] = {}  # adapters requests asked for while no server listed them
        self.counts: dict[tuple[str, str], int] = {}  # (load|unload, ok|failed) -> moves

    def wanted(self, settings: Settings, adapter: str, now: float) -> bool:
        """A request names `adapter`: True if placement may load it (the policy names it)."""
        if adapter not in dict(settings.adapter_sources):
            return False
        self._wanted[adapter] = now
        return True

    def plan(
        self, settings: Settings, book: AdapterBook, loads: LoadTracker, backends: Sequence[str], now: float
    ) -> list[Move]:
        """This round's moves, at most one per adapter."""
        moves = []
        for adapter, path in settings.adapter_sources:
            if adapter in self._pending:
                continue
            move = self._move(settings, book, loads, backends, adapter, path, now)
            if move is not None:
                self._pending.add(adapter)
                moves.append(move)
        return moves

    def skip(self, move: Move) -> None:
        """Another replica acts for this adapter now: the move is not made here."""
        self._pending.discard(move.adapter)

    def done(self, move: Move, ok: bool, now: float) -> None:
        """The runtime carried `move` out (or failed to)."""
        self._pending.discard(move.adapter)
        key = (move.backend, move.adapter)
        outcome = ("load" if move.load else "unload", "ok" if ok else "failed")
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if ok:
            self._changed_at[key] = now
            self._used_at[key] = now
            if move.load:
                self._wanted.pop(move.adapter, None)
        else:
            self._failed_at[key] = now

    def keep(self, backends: set[str]) -> None:
        """Forget what placement remembers of servers that left the pool (pod IPs come and go)."""
        for table in (self._changed_at, self._failed_at, self._used_at):
            for key in [k for k in table if k[0] not in backends]:
                del table[key]

    def _move(
        self,
        settings: Settings,
        book: AdapterBook,
        loads: LoadTracker,
        backends: Sequence[str],
        adapter: str,
        path: str,
        now: float,
    ) -> Move | None:
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
            asked = self._wanted.get(adapter, _NEVER)
            if now - asked > settings.adapter_idle_s:
                return None
            target = self._best(book, loads, backends, adapter, now, hold, recent_ok=True)
            return None if target is None else Move(True, target, adapter, path)
        if in_flight / len(holders) >= settings.adapter_scale_out_requests:
            others = [b for b in backends if b not in holders]
            target = self._best(book, loads, others, adapter, now, hold, recent_ok=False)
            return None if target is None else Move(True, target, adapter, path)
        if len(holders) == 1:
            return None
        idle_for = settings.adapter_idle_s if len(holders) <= settings.adapter_max_backends else hold
        idle = [
            b
            for b in holders
            if now - self._used_at[(b, adapter)] >= idle_for
            and now - self._changed_at.get((b, adapter), _NEVER) >= hold
        ]
        if not idle:
            return None
        target = max(idle, key=lambda b: (book.slot_share(b, loads.get(b), now), loads.get(b).requests(now)))
        return Move(False, target, adapter, path)

    def _best(
        self,
        book: AdapterBook,
        loads: LoadTracker,
        backends: Sequence[str],
        adapter: str,
        now: float,
        hold: float,
        recent_ok: bool,
    ) -> str | None:
        """Where to load `adapter`: slots least taken, then least busy; not where a move of it
        failed lately, nor (unless no server has it) where it was just unloaded."""
        best: tuple[float, int, str] | None = None
        for backend in backends:
            key = (backend, adapter)
            if now - self._failed_at.get(key, _NEVER) < hold:
                continue
            if not recent_ok and now - self._changed_at.get(key, _NEVER) < hold:
                continue
            load = loads.get(backend)
            rank = (book.slot_share(backend, load, now), load.requests(now), backend)
            if best is None or rank < best:
                best = rank
        return None if best is None else best[2]
