"""Issue 28: how far apart one LRU cache and Belady's MIN are on the agent sets, and what kind of
knowledge closes the gap. One cache as large as the fleet's (capacity ratio 0.5), requests in file
order, no timing, no placement: only the eviction order differs. vLLM frees a finished request's
blocks tail first, so each request's blocks are re-queued with its head most recent.

- lru: one LRU cache (what every router's engines do; placement can at best split it well).
- lru, slice ends known: after a session's last request *in this 480-request slice* its blocks are
  evicted first. Most sessions have 8 turns and the slice cuts them (its turns per session are
  printed), so this knowledge is the slice's, not something a router could learn.
- protected: sessions protected first come, first served while their last prompts fit in `share`
  of the cache, protection lapsing after `lapse` requests without a turn; unprotected blocks are
  evicted first. A router could only approximate this (re-sending a protected context to keep it
  recent in vLLM's LRU), at the cost of those requests.
- min: Belady's MIN over the same order (the bound).

Run from the checkout: .venv/bin/python results/agents-tune/eviction-order-2026-12-06/eviction.py TRACE
"""

from __future__ import annotations

import heapq
import sys
from collections import Counter, OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.simulator.sim import block_hashes, prompt_tokens
from bench.workloads import trace
from bench.workloads.prompts import PromptBuilder

requests = trace.read(Path(sys.argv[1]), 480, 12000)
builder = PromptBuilder("sim-model", 4.0, 16)
chains = [block_hashes(prompt_tokens(builder.body(r)) or [], 128) for r in requests]
sessions = [r.session_id for r in requests]
cap = len({h for c in chains for h in c}) // 2
total = sum(len(c) for c in chains)
last_in_slice = {s: i for i, s in enumerate(sessions)}


def lru(slice_ends_known: bool = False) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i, chain in enumerate(chains):
        hits += sum(h in cache for h in chain)
        for h in reversed(chain):
            cache[h] = None
            cache.move_to_end(h)
        if slice_ends_known and last_in_slice[sessions[i]] == i:
            for h in chain:
                cache.move_to_end(h, last=False)
        while len(cache) > cap:
            cache.popitem(last=False)
    return hits / total


def protected(share: float, lapse: int) -> float:
    guests: OrderedDict[int, None] = OrderedDict()
    kept: OrderedDict[int, None] = OrderedDict()
    held: dict[str | None, tuple[int, int]] = {}  # protected session -> (last request, its blocks)
    hits = 0
    for i, chain in enumerate(chains):
        session = sessions[i]
        for other, (last, _) in list(held.items()):
            if i - last > lapse:
                del held[other]
        if session not in held and sum(n for _, n in held.values()) + len(chain) <= share * cap:
            held[session] = (i, len(chain))
        if session in held:
            held[session] = (i, len(chain))
        hits += sum(h in guests or h in kept for h in chain)
        target = kept if session in held else guests
        for h in reversed(chain):
            guests.pop(h, None)
            kept.pop(h, None)
            target[h] = None
        while len(guests) + len(kept) > cap:
            (guests if guests else kept).popitem(last=False)
    return hits / total


def belady() -> float:
    never = 1 << 60
    following: dict[int, int] = {}
    next_use = [[never] * len(c) for c in chains]
    for i in range(len(chains) - 1, -1, -1):
        for j, h in enumerate(chains[i]):
            next_use[i][j] = following.get(h, never)
        for h in chains[i]:
            following[h] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, chain in enumerate(chains):
        for j, h in enumerate(chain):
            hits += h in cache
            cache[h] = next_use[i][j]
            heapq.heappush(heap, (-next_use[i][j], h))
        while len(cache) > cap:
            negative, h = heapq.heappop(heap)
            if cache.get(h) == -negative:
                del cache[h]
    return hits / total


turns = Counter(Counter(sessions).values())
print(f"{len(requests)} requests, {len(set(sessions))} sessions, cache {cap} blocks")
print("turns per session in the slice:", dict(sorted(turns.items())))
print(f"lru {lru():.3f}")
print(f"lru, slice ends known {lru(True):.3f}")
for share in (0.7, 0.8, 0.9):
    print(f"protected {share}:", " ".join(f"lapse {n}: {protected(share, n):.3f}" for n in (50, 100, 200, 400)))
print(f"min {belady():.3f}")
