"""Issue 28: how much any placement could gain over a plain one on the agent sets, measured with
foresight no router has. Two LRU caches, each half of one as large as the fleet's (capacity ratio
0.5), requests in file order, no timing: only where each request goes differs. A finished
request's blocks are re-queued head most recent, as vLLM frees them.

- round robin: a session's first request goes to the next cache in turn, its later ones follow it.
- prefix, then live balance (about what kvroute and sglang-router do): a first request goes where
  more of its prompt is cached, else to the cache with fewer sessions seen in the last 60 requests;
  later ones follow it.
- prefix, then oldest tail: as above, but without a match it goes where what it would push out was
  used longest ago (two LRUs acting as one).
- foresight, first request: each first request goes to whichever cache gives more hits over the
  next N requests (those placed by the plain rule), then its session stays.
- foresight, every request: each request may go either way by that test (a move when it differs).

Run from the checkout: .venv/bin/python results/agents-tune/placement-foresight-2026-12-07/foresight.py TRACE
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.experiments.placement import load

# the replay's workload (its prompts, blocks of 128 tokens), its turns back in the file's order
workload = load(Path(sys.argv[1]))
ordered = sorted((arrival, g, k) for g, arrivals in enumerate(workload.arrivals) for k, arrival in enumerate(arrivals))
chains = [workload.conversations[g][k].hashes for _, g, k in ordered]
sessions = [workload.conversations[g][k].session for _, g, k in ordered]
fleet = len({h for c in chains for h in c}) // 2
half = fleet // 2
total = sum(len(c) for c in chains)

Caches = list["OrderedDict[int, int]"]
Rule = Callable[[int, Caches, dict], int]


def serve(cache: OrderedDict[int, int], i: int, size: int) -> int:
    hits = sum(h in cache for h in chains[i])
    for h in reversed(chains[i]):
        cache[h] = i
        cache.move_to_end(h)
    while len(cache) > size:
        cache.popitem(last=False)
    return hits


def matched(cache: OrderedDict[int, int], chain: list[int]) -> int:
    n = 0
    for h in chain:
        if h not in cache:
            break
        n += 1
    return n


turn = Counter[str]()


def round_robin(i: int, caches: Caches, home: dict) -> int:
    turn["n"] += 1
    return turn["n"] % 2


def by_prefix(i: int, caches: Caches) -> int | None:
    m = [matched(c, chains[i]) for c in caches]
    return None if m[0] == m[1] else int(m[1] > m[0])


def plain(i: int, caches: Caches, home: dict) -> int:
    chosen = by_prefix(i, caches)
    if chosen is not None:
        return chosen
    live = Counter(home[s] for s in set(sessions[max(0, i - 60) : i]) if s in home)
    return int(live[1] < live[0])


def oldest_tail(i: int, caches: Caches, home: dict) -> int:
    chosen = by_prefix(i, caches)
    if chosen is not None:
        return chosen
    ages = []
    for c in caches:
        pushed = len(chains[i]) - (half - len(c))
        ages.append(-1 if pushed <= 0 else list(c.values())[min(pushed, len(c)) - 1])
    return int(ages[1] < ages[0])


def ahead(caches: Caches, home: dict, start: int, look: int) -> int:
    caches = [OrderedDict(c) for c in caches]
    home = dict(home)
    hits = 0
    for i in range(start, min(start + look, len(chains))):
        b = home.setdefault(sessions[i], plain(i, caches, home))
        hits += serve(caches[b], i, half)
    return hits


def foresight(look: int) -> Rule:
    def choose(i: int, caches: Caches, home: dict) -> int:
        scores = [ahead(caches, {**home, sessions[i]: b}, i, look) for b in (0, 1)]
        return int(scores[1] > scores[0])

    return choose


def run(rule: Rule, every_request: bool = False) -> tuple[float, int, int]:
    caches: Caches = [OrderedDict(), OrderedDict()]
    home: dict[str | None, int] = {}
    hits = moves = 0
    split = [0, 0]
    for i in range(len(chains)):
        s = sessions[i]
        b = home.get(s)
        if b is None or every_request:
            chosen = rule(i, caches, home)
            moves += b is not None and chosen != b
            b = home[s] = chosen
        split[b] += 1
        hits += serve(caches[b], i, half)
    return hits / total, moves, min(split)


one: OrderedDict[int, int] = OrderedDict()
lru = sum(serve(one, i, fleet) for i in range(len(chains))) / total
print(f"{len(chains)} requests; fleet {fleet} blocks, two caches of {half}; one LRU as large: {lru:.3f}")
print("placement: hit rate, moves, requests on the less used cache")
for name, rule, every in (
    ("round robin", round_robin, False),
    ("prefix, then live balance", plain, False),
    ("prefix, then oldest tail", oldest_tail, False),
    *((f"foresight of {n}, first request", foresight(n), False) for n in (40, 120, 240, 480)),
    *((f"foresight of {n}, every request", foresight(n), True) for n in (60, 120)),
):
    rate, moves, fewer = run(rule, every)
    print(f"{name}: {rate:.3f}, {moves}, {fewer}", flush=True)
