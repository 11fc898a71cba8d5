"""What an ideal router could reach with the fleet's total cache, two ways.

An ideal router makes the fleet behave as one cache of the combined capacity. Requests are
replayed through one such cache, sequentially, counting as the backends do (a block counts only
if every block before it in the prompt hit, and the last prompt token is never served from cache):

- `lru`: the cache evicts least recently used blocks, as the backends do. Not an upper bound:
  LRU thrashes on cyclic access (sessions taking turns), which routers over several smaller
  caches can partly avoid.
- `bound`: Belady's MIN, which evicts the block whose next use is farthest away, knowing the
  future. No router over the same total cache can beat it on the same order of requests; every
  "fraction of bound" figure uses it, computed on the order in which the requests were sent.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from bench.simulator import sim
from bench.simulator.sim_engine import BlockPool

Prompt = tuple[int, Sequence[int]]  # prompt length in tokens, block hashes of its prefix
_NEVER = 1 << 62


def lru(prompts: Iterable[Prompt], block_tokens: int, capacity_blocks: int) -> float:
    """Hit rate of one cache of `capacity_blocks` run as vLLM's block pool (the simulator's), one
    request at a time: in effect an LRU that frees each prompt tail first."""
    cache = BlockPool(capacity_blocks)
    hits = queries = 0
    for length, hashes in prompts:
        hits += cache.match(hashes, (length - 1) // block_tokens) * block_tokens
        queries += length
        held = list(hashes[:capacity_blocks])
        cache.acquire(held, 0)
        cache.release(held, 0)
    return hits / queries if queries else 0.0


def bound(prompts: Sequence[Prompt], block_tokens: int, capacity_blocks: int) -> float:
    """Hit rate of one cache of `capacity_blocks` under Belady's MIN (prefix-hit semantics). The
    blocks of the request being served are pinned: they cannot make room for each other."""
    accesses = [block for _, hashes in prompts for block in hashes]
    next_use = [_NEVER] * len(accesses)
    seen: dict[int, int] = {}
    for position in range(len(accesses) - 1, -1, -1):
        next_use[position] = seen.get(accesses[position], _NEVER)
        seen[accesses[position]] = position
    cache: dict[int, int] = {}  # block -> position of its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), lazily invalidated
    position = hits = queries = 0
    for length, hashes in prompts:
        limit = (length - 1) // block_tokens
        pinned = set(hashes)
        matched, in_prefix = 0, True
        for index, block in enumerate(hashes):
            upcoming = next_use[position]
            position += 1
            if block in cache:
                matched += in_prefix and index < limit
            else:
                in_prefix = False
                if not _make_room(cache, farthest, pinned, capacity_blocks):
                    continue  # the request alone is larger than the cache
            cache[block] = upcoming
            heapq.heappush(farthest, (-upcoming, block))
        hits += matched * block_tokens
        queries += length
    return hits / queries if queries else 0.0


def _make_room(cache: dict[int, int], farthest: list[tuple[int, int]], pinned: set[int], capacity: int) -> bool:
    """Evict the unpinned block used farthest in the future until one more fits."""
    kept: list[tuple[int, int]] = []
    while len(cache) >= capacity and farthest:
        entry = heapq.heappop(farthest)
        block = entry[1]
        if cache.get(block) != -entry[0]:
            continue  # stale: the block was used again or evicted since
        if block in pinned:
            kept.append(entry)
            continue
        del cache[block]
    for entry in kept:
        heapq.heappush(farthest, entry)
    return len(cache) < capacity


def simulated_prompts(bodies: Iterable[dict], block_size: int, tokenizer: str = sim.DEFAULT_TOKENIZER) -> list[Prompt]:
    """Prompts in the simulator's own units: its template, tokenizer and block size."""
    return [sim.prompt_blocks(body, block_size, tokenizer) for body in bodies]


def token_prompts(prompts: Iterable[Sequence[int]], block_tokens: int) -> list[Prompt]:
    """Prompts already tokenized by the backends (vLLM's /tokenize), in their block size."""

    def blocks(tokens: Sequence[int]) -> Prompt:
        parent = 0
        hashes = []
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            parent = hash((parent, tuple(tokens[start : start + block_tokens])))
            hashes.append(parent)
        return len(tokens), hashes

    return [blocks(tokens) for tokens in prompts]
