"""What one router tells its sibling replicas, so that several route as one.

The router stays the only place that decides; a replica link (an adapter, such as the Redis one)
is told, without waiting, what this router learned and bound, and hands the siblings' news back
through `Router.peer_learned` / `Router.peer_bound` and `LoadTracker.set_peers`. Lookups never
leave the process. Only keyed digests are shared: chain hashes and session digests under the
replicas' common hash key, never prompt text or session ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ReplicaLink(Protocol):
    """Where a router sends what its siblings should know. Called on the hot path: must not block."""

    def learned(self, backend: str, chain: Sequence[int]) -> None:
        """The backend now holds these blocks (approximate mode)."""
        ...

    def bound(self, session: bytes, backend: str) -> None:
        """The session (by digest) is now bound to the backend."""
        ...
