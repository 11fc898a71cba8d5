"""Where prefix reuse was won or lost: of the reuse the traffic allowed, how much routing captured,
and how much the engines delivered.

Three sums of prompt tokens, over the requests a backend started answering with a 2xx:
- available: the longest prefix any candidate held, by kvroute's picture (as the decision weighed it);
- routed: the prefix on the backend that served it (what `x-kvroute-cached-tokens` reported);
- delivered: what the engines found cached, from their own prefix-cache counters
  (`vllm:prefix_cache_hits_total`, read with the load scrape), per backend.

And per request where the adapter reads the response body (full-duplex response bodies): the
engine's own count of that request's cached tokens (`usage.prompt_tokens_details.cached_tokens`,
reported), beside what kvroute's picture showed for it (reported_routed). Their ratio is the
picture's accuracy over kvroute's own requests alone: other clients' traffic and sibling
replicas, which the engines' counters include, do not enter it.

`routed / available` is routing's efficiency (1: every request went where the most was cached),
`delivered / routed` the picture's accuracy (below 1: kvroute expected blocks the engine had
evicted; above: other traffic, or sibling replicas, put blocks there too). The engines count every
client's requests, so delivered is a backend's whole traffic: with several replicas, take it
once per backend (`max by (backend)`), not summed over replicas. Tokens in approximate mode are
estimated from blocks (the learned bytes per token). A request split for disaggregated serving
counts once, as its decode leg was decided.
"""

from __future__ import annotations

from extproc.core.decision import Decision

DEPARTED = "departed"  # the sums of backends that left the pool, as one


class ReuseAttribution:
    """The three sums, kept as counters."""

    __slots__ = ("_hits", "available", "delivered", "prompt", "reported", "reported_routed", "routed")

    def __init__(self) -> None:
        self.prompt = 0.0  # tokens of the served prompts
        self.available = 0.0
        self.routed: dict[str, float] = {}  # backend -> tokens
        self.delivered: dict[str, float] = {}  # backend -> tokens the engine found cached
        self._hits: dict[str, float] = {}  # backend -> the engine's counter at its last sample
        self.reported: dict[str, float] = {}  # backend -> tokens its responses reported cached
        self.reported_routed: dict[str, float] = {}  # backend -> the picture's tokens for those requests

    def served(self, decision: Decision, backend: str, matched_blocks: int, block_tokens: float) -> None:
        """A 2xx from `backend`, which held `matched_blocks` of the prompt by the decision's picture."""
        best = max((c.matched for c in decision.candidates), default=0)
        self.prompt += decision.total_blocks * block_tokens
        self.available += max(best, matched_blocks) * block_tokens
        self.routed[backend] = self.routed.get(backend, 0.0) + matched_blocks * block_tokens

    def responded(self, backend: str, engine_tokens: int, routed_tokens: float) -> None:
        """A response from `backend` said `engine_tokens` of its prompt were cached; kvroute's
        picture had shown `routed_tokens`."""
        self.reported[backend] = self.reported.get(backend, 0.0) + engine_tokens
        self.reported_routed[backend] = self.reported_routed.get(backend, 0.0) + routed_tokens

    def engine(self, backend: str, hits: float) -> None:
        """The engine's cumulative prefix-cache hits (tokens) from one sample; a counter that went
        back (a restart) starts over from its new value."""
        before = self._hits.get(backend)
        self._hits[backend] = hits
        if before is not None and hits >= before:
            self.delivered[backend] = self.delivered.get(backend, 0.0) + hits - before

    def forget(self, backend: str) -> None:
        """The backend left the pool: its counter's next value starts over, and its sums go into
        DEPARTED's (they are counters: their totals must not go back, and a table keyed by every
        backend a rollout ever replaced would grow for good)."""
        self._hits.pop(backend, None)
        for sums in (self.routed, self.delivered, self.reported, self.reported_routed):
            tokens = sums.pop(backend, None)
            if tokens:
                sums[DEPARTED] = sums.get(DEPARTED, 0.0) + tokens

    def state(self) -> dict[str, float | None]:
        """The sums and the ratios, for /debug/state (None before anything was served)."""
        routed, delivered = sum(self.routed.values()), sum(self.delivered.values())
        reported, reported_routed = sum(self.reported.values()), sum(self.reported_routed.values())
        return {
            "prompt_tokens": round(self.prompt),
            "available_tokens": round(self.available),
            "routed_tokens": round(routed),
            "delivered_tokens": round(delivered),
            "reported_tokens": round(reported),
            "reported_routed_tokens": round(reported_routed),
            "routing_efficiency": round(routed / self.available, 4) if self.available else None,
            "prediction_accuracy": round(delivered / routed, 4) if routed else None,
            "reported_accuracy": round(reported / reported_routed, 4) if reported_routed else None,
        }
