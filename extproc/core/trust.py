"""How far to trust the approximate picture of each backend's cache, learned from the engine.

kvroute predicts a request's cached prefix from what it routed (approximate mode); the engine
counts what it really found (`vllm:prefix_cache_hits_total` of `vllm:prefix_cache_queries_total`
tokens). When the picture is too hopeful for a backend (traffic kvroute did not route evicts its
blocks, its cache is smaller than configured), the engine's share of hits falls below kvroute's
predicted share for the requests it sent there, window after window. The trust of a backend is
that ratio, at most 1, and the decision weighs the prefix kvroute sees there by it, so a picture
the engine keeps contradicting stops pulling requests (and stops being reported as cached).

Both shares are of prompt size in their own units (CBR bytes for the prediction, tokens for the
engine), so the learned bytes per token does not enter. Sums decay per window, so about the last
ten windows count; a window closes once the engine has looked up `MIN_TOKENS` more tokens.
Reading the engines' counters costs nothing per request: they come with the load scrape.
"""

from __future__ import annotations

from collections.abc import Mapping

WEIGHT = 0.1  # decay of the sums per window
MIN_TOKENS = 8192  # a window over fewer looked-up tokens is noise
MIN_PREDICTED_SHARE = 0.05  # below this kvroute predicted too little for a ratio to mean anything


class PredictionTrust:
    """Per backend: decayed sums of kvroute's predictions and of the engine's hits, and the trust."""

    __slots__ = ("_counters", "_pending", "_sums", "values")

    def __init__(self) -> None:
        self._pending: dict[str, list[float]] = {}  # backend -> [predicted bytes, prompt bytes] this window
        self._counters: dict[str, tuple[float, float]] = {}  # backend -> engine (queries, hits) at the window start
        self._sums: dict[str, list[float]] = {}  # backend -> decayed [predicted, prompt, hits, queries]
        self.values: dict[str, float] = {}  # backend -> trust below 1 (absent: 1)

    def of(self, backend: str) -> float:
        return self.values.get(backend, 1.0)

    def apply(self, matched: Mapping[str, int]) -> Mapping[str, int]:
        """The matched blocks the decision should weigh: the picture's, times each backend's trust."""
        if not self.values:
            return matched
        return {backend: int(blocks * self.of(backend)) for backend, blocks in matched.items()}

    def routed(self, backend: str, predicted_bytes: int, prompt_bytes: int) -> None:
        """kvroute sent a request of `prompt_bytes` CBR bytes there, `predicted_bytes` of them
        predicted cached by its own picture (before any trust was applied)."""
        if backend in self._counters:
            pending = self._pending.setdefault(backend, [0.0, 0.0])
            pending[0] += predicted_bytes
            pending[1] += prompt_bytes

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
        predicted, prompt = self._pending.pop(backend, (0.0, 0.0))
        sums = self._sums.setdefault(backend, [0.0, 0.0, 0.0, 0.0])
        for index, value in enumerate((predicted, prompt, found, looked_up)):
            sums[index] = sums[index] * (1 - WEIGHT) + value
        predicted_share = sums[0] / sums[1] if sums[1] else 0.0
        if predicted_share < MIN_PREDICTED_SHARE:
            self.values.pop(backend, None)
            return
        trust = min(1.0, (sums[2] / sums[3]) / predicted_share)
        if trust < 1.0:
            self.values[backend] = trust
        else:
            self.values.pop(backend, None)

    def forget(self, backend: str) -> None:
        """The backend left or its cache was reset: what was learned of it no longer applies."""
        for table in (self._pending, self._counters, self._sums, self.values):
            table.pop(backend, None)
