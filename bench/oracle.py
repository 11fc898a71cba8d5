"""The oracle: the prompt-cache hit rate an ideal router reaches with the fleet's total cache.

An ideal router makes the fleet behave as one cache of the combined capacity: every request
finds every cached block of its prefix. We replay the slice through one LRU of that capacity,
sequentially (in-flight overlap can only lower real hit rates), counting as the backends do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bench import sim


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


def from_token_ids(prompts: Iterable[Sequence[int]], block_tokens: int, capacity_blocks: int) -> float:
    """From prompts already tokenized by the backends (vLLM's /tokenize), in their block size."""

    def blocks(tokens: Sequence[int]) -> tuple[int, list[int]]:
        parent = 0
        hashes = []
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            parent = hash((parent, tuple(tokens[start : start + block_tokens])))
            hashes.append(parent)
        return len(tokens), hashes

    return _replay((blocks(tokens) for tokens in prompts), block_tokens, capacity_blocks)
