"""Cache turnover per backend: blocks newly placed there lately, decayed exponentially.

A backend whose cache turns over fast evicts useful prefixes sooner, so the decision charges new
prompts more there (eviction_cost_weight). Measured from what the index reports as new on each
learn, so it works with any index.
"""

from __future__ import annotations

from collections.abc import Iterable


class ChurnMeter:
    """Decayed count of new blocks per backend, with a configurable half-life."""

    __slots__ = ("_counts", "half_life_s")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # backend -> (decayed new blocks, as of)

    def add(self, backend: str, blocks: int, now: float) -> None:
        self._counts[backend] = (self.rate(backend, now) + blocks, now)

    def rate(self, backend: str, now: float) -> float:
        value, since = self._counts.get(backend, (0.0, now))
        return float(value * 0.5 ** (max(0.0, now - since) / self.half_life_s))

    def rates(self, backends: Iterable[str], now: float) -> dict[str, float]:
        """`rate` of each backend, at once (one per candidate per decision)."""
        counts = self._counts
        half_life = self.half_life_s
        rates: dict[str, float] = {}
        for backend in backends:
            count = counts.get(backend)
            rates[backend] = 0.0 if count is None else float(count[0] * 0.5 ** (max(0.0, now - count[1]) / half_life))
        return rates

    def remove_backend(self, backend: str) -> None:
        self._counts.pop(backend, None)
