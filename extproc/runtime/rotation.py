"""Which backends a periodic feed visits this round, when a fleet is too large to visit them all.

A scrape or a probe costs the ext_proc about the same whatever the fleet, so a fleet of a thousand
backends scraped every 0.25 s would cost thousands of requests a second. A feed is instead given a
rate (visits per second): each round visits at most rate x interval backends, continuing where the
last round stopped, so every backend is visited in turn and less often as the fleet grows. A fleet
within the rate is visited whole each round, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


class Rotation:
    """Round-robin slices of a sequence that may change between rounds: at most `per_round`
    items a round (all of them until `pace` gives it a rate)."""

    __slots__ = ("_next", "per_round")

    def __init__(self) -> None:
        self._next = 0
        self.per_round = 1 << 30

    def pace(self, rate_per_s: float, interval_s: float) -> None:
        """At most `rate_per_s` visits a second, in rounds `interval_s` apart (at least one a round)."""
        self.per_round = max(1, int(rate_per_s * interval_s))

    def take(self, items: Sequence[T]) -> list[T]:
        """The next `per_round` items (all of them, in order, when there are no more)."""
        count, per_round = len(items), self.per_round
        if count <= per_round:
            return list(items)
        start = self._next % count
        self._next = start + per_round
        return [*items[start : start + per_round], *items[: max(0, start + per_round - count)]]
