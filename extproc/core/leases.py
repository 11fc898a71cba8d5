"""Leases: request lifecycles held on behalf of gateways that talk to kvroute over HTTP.

`/v1/query` opens one (a decision with its load reservation) and returns its id; `/v1/notify`
reports the response start on it and `/v1/release` ends it. A gateway that never comes back
must not hold load forever, so a lease ends by itself `ttl_s` after it was opened. The table is
bounded: past `capacity` open leases, opening another is refused.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from extproc.core.exchange import Exchange


class LeaseTable:
    """Open leases by id, oldest first (so expiry pops from the front)."""

    __slots__ = ("_leases", "capacity", "ttl_s")

    def __init__(self, ttl_s: float, capacity: int = 65_536) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._leases: OrderedDict[str, tuple[Exchange, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    def full(self) -> bool:
        return len(self._leases) >= self.capacity

    def open(self, exchange: Exchange, now: float) -> str:
        """Hold the exchange under a new unguessable id until closed or expired."""
        lease_id = secrets.token_urlsafe(16)
        self._leases[lease_id] = (exchange, now + self.ttl_s)
        return lease_id

    def get(self, lease_id: str) -> Exchange | None:
        entry = self._leases.get(lease_id)
        return None if entry is None else entry[0]

    def close(self, lease_id: str) -> Exchange | None:
        """Remove the lease and end its exchange; the exchange, or None if no such lease is open."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return None
        entry[0].end()
        return entry[0]

    def expire(self, now: float) -> int:
        """End every lease past its deadline; return how many."""
        expired = 0
        while self._leases:
            lease_id, (exchange, deadline) = next(iter(self._leases.items()))
            if deadline > now:
                break
            del self._leases[lease_id]
            exchange.end()
            expired += 1
        return expired
