"""How far to trust the approximate picture of each backend's cache, learned from the engine.

kvroute predicts a request's cached prefix from what it routed (approximate mode), in tokens as
`x-kvroute-cached-tokens` reports it; the engine counts the tokens it really found
(`vllm:prefix_cache_hits_total`). When the picture is too hopeful for a backend (traffic kvroute
did not route evicts its blocks, its cache is smaller than configured), the engine finds fewer
tokens than kvroute predicted for the requests it sent there, window after window. The trust of
a backend is that ratio; the decision weighs the prefix kvroute sees there by it, so a picture
the engine keeps contradicting stops pulling requests (and stops being reported as cached).

Windows do not line up exactly with what was sent (kvroute predicts when it routes, the engine
counts when it schedules), so a ratio of at least `AGREEMENT` counts as agreement (trust 1);
other clients' hits can only raise the engine's count, so they never lower the trust. Sums decay
per window, so about the last ten windows count; a window closes once the engine has looked up
`MIN_TOKENS` more tokens, and nothing is concluded before the sums hold `EVIDENCE` windows
(a cold start's first windows count predictions whose hits land in the next one). Reading the
engines' counters costs nothing per request: they come with the load scrape.
"""

from __future__ import annotations

from collections.abc import Mapping

WEIGHT = 0.1  # decay of the sums per window
MIN_TOKENS = 65536  # a window over fewer looked-up tokens is noise (requests of 10k tokens are common)
MIN_PREDICTED_SHARE = 0.05  # of the looked-up tokens: below this a ratio means nothing
AGREEMENT = 0.9  # the engine found at least this share of the predicted tokens: the picture holds
EVIDENCE = 4  # windows a backend's sums must hold before their ratio is acted on


class PredictionTrust:
    """Per backend: decayed sums of kvroute's predictions and of the engine's hits, and the trust."""

    __slots__ = ("_counters", "_pending", "_sums", "values")

    def __init__(self) -> None:
        self._pending: dict[str, float] = {}  # backend -> tokens predicted cached this window
        self._counters: dict[str, tuple[float, float]] = {}  # backend -> engine (queries, hits) at the window start
        self._sums: dict[str, list[float]] = {}  # backend -> decayed [predicted, hits, looked up], windows
        self.values: dict[str, float] = {}  # backend -> trust below 1 (absent: 1)

    def of(self, backend: str) -> float:
        return self.values.get(backend, 1.0)

    def apply(self, matched: Mapping[str, int]) -> Mapping[str, int]:
        """The matched blocks the decision should weigh: the picture's, times each backend's trust."""
        if not self.values:
            return matched
        return {backend: int(blocks * self.of(backend)) for backend, blocks in matched.items()}

    def routed(self, backend: str, predicted_tokens: float) -> None:
        """kvroute sent a request there that its own picture (before any trust) predicted to find
        so many tokens cached."""
        if backend in self._counters:
            self._pending[backend] = self._pending.get(backend, 0.0) + predicted_tokens

    def engine(self, backend: str, queries: float, hits: float) -> None:
        """The engine's prefix-cache counters (tokens looked up, tokens found), from one sample."""
        before = self._counters.get(backend)
        if before is None or queries < before[0] or hits < before[1]:  # first sample, or a restart
            self._counters[backend] = (queries, hits)
            self._pending.pop(backend, None)
            return
        looked_up, found = queries - before[0], hits - before[1]
        if looked_up < MIN_TOKENS:
            return
        self._counters[backend] = (queries, hits)
        sums = self._sums.setdefault(backend, [0.0, 0.0, 0.0, 0.0])
        for index, value in enumerate((self._pending.pop(backend, 0.0), found, looked_up)):
            sums[index] = sums[index] * (1 - WEIGHT) + value
        sums[3] += 1
        predicted, found, looked_up, count = sums
        enough = count >= EVIDENCE and predicted >= MIN_PREDICTED_SHARE * looked_up
        trust = found / predicted if enough else 1.0
        if trust < AGREEMENT:
            self.values[backend] = trust
        else:
            self.values.pop(backend, None)

    def forget(self, backend: str) -> None:
        """The backend left or its cache was reset: what was learned of it no longer applies."""
        for table in (self._pending, self._counters, self._sums, self.values):
            table.pop(backend, None)
