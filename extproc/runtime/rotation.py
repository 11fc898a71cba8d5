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
    """Round-robin slices of a sequence that may change between rounds."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def take(self, items: Sequence[T], per_round: int) -> list[T]:
        """The next `per_round` items (all of them, in order, when there are no more)."""
        count = len(items)
        if count <= per_round:
            return list(items)
        start = self._next % count
        self._next = start + per_round
        return [*items[start : start + per_round], *items[: max(0, start + per_round - count)]]


def per_round(rate_per_s: float, interval_s: float) -> int:
    """Visits one round may make at `rate_per_s` (at least one)."""
    return max(1, int(rate_per_s * interval_s))
