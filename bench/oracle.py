"""The oracle: the prompt-cache hit rate an ideal router reaches with the fleet's total cache.

An ideal router makes the fleet behave as one cache of the combined capacity: every request
finds every cached block of its prefix. We replay the slice through one LRU of that capacity,
sequentially (in-flight overlap can only lower real hit rates), counting as the backends do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bench import sim
from bench.trace import BLOCK_TOKENS, TraceRequest


def _replay(prompts: Iterable[tuple[int, Sequence[int]]], block_tokens: int, capacity_blocks: int) -> float:
    cache = sim.PrefixCache(capacity_blocks)
    hits = queries = 0
    for length, hashes in prompts:
        hits += cache.match(hashes, (length - 1) // block_tokens) * block_tokens
        queries += length
        cache.insert(hashes)
    return hits / queries if queries else 0.0


def simulated(bodies: Iterable[dict], block_size: int, capacity_blocks: int) -> float:
    """In the simulator's own units: its template, tokenizer and block size."""
    return _replay((sim.prompt_blocks(body, block_size) for body in bodies), block_size, capacity_blocks)


def from_trace(requests: Sequence[TraceRequest], capacity_blocks: int) -> float:
    """In the trace's units (512-token hash-id blocks), for backends we cannot replay offline."""

    def prompts() -> Iterable[tuple[int, list[tuple[int, ...]]]]:
        for request in requests:
            yield request.input_tokens, [request.hash_ids[: i + 1] for i in range(len(request.hash_ids))]

    return _replay(prompts(), BLOCK_TOKENS, capacity_blocks)
