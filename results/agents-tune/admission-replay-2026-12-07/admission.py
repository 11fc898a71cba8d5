"""Issue 28, a lead not built: hold a conversation's first turn while the contexts of the live
conversations already fill the caches, in the timed closed-loop replay of `bench placement`
(`bench/experiments/placement.py`: 16 clients, each sending the earliest turn whose conversation is
idle; two engines as vLLM's block pool and first-come queue; model seconds, not vLLM-CPU's).

A conversation is live while it has turns left and its last one ended within `window` seconds; its
context is its last prompt's blocks. A first turn is held (it keeps its client busy) while the live
contexts and its own prompt would take more than `share` of both caches together, for at most
`max_wait` seconds. Latency is a turn's time from its client's send to its end, holds included.

Run from the checkout: .venv/bin/python results/agents-tune/admission-replay-2026-12-07/admission.py TRACE
"""

from __future__ import annotations

import heapq
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.experiments import placement as P
from bench.experiments.decisions import ENGINE_BLOCK_TOKENS, QueuedEngines, ReplayedRequest

SEEDS = range(4)


def replay(workload: P.Workload, placement: P.Placement, seed: int, share: float, window: float, max_wait: float):
    jitter = random.Random(seed)
    engines = QueuedEngines(workload.fleet, workload.blocks, True, None)
    room = workload.blocks * len(workload.fleet)
    turns = workload.conversations
    ready = [(arrival[0], g) for g, arrival in enumerate(workload.arrivals)]
    heapq.heapify(ready)
    position = [0] * len(turns)
    inflight: list[P._Sent] = []
    held: list[tuple[float, int]] = []
    last_end: dict[int, tuple[float, int]] = {}
    sent_at: dict[int, float] = {}
    latency: list[float] = []
    holds: list[float] = []
    now = 0.0

    def crowded(g: int) -> bool:
        live = sum(b for c, (t, b) in last_end.items() if now - t <= window and position[c] < len(turns[c]))
        return live + len(turns[g][0].hashes) > share * room

    def send(g: int) -> None:
        backend, exchange = placement.place(turns[g][position[g]], now, engines)
        sent = P._Sent(ReplayedRequest(exchange, backend, turns[g][position[g]].tokens), g)
        engines.arrive(sent.request)
        inflight.append(sent)

    while ready or inflight or held:
        for since, g in list(held):
            if not crowded(g) or now - since >= max_wait or not inflight:
                held.remove((since, g))
                holds.append(now - since)
                send(g)
        while ready and len(inflight) + len(held) < 16:
            _, g = heapq.heappop(ready)
            sent_at[g] = now
            if position[g] == 0 and max_wait > 0 and inflight and crowded(g):
                held.append((now, g))
            else:
                send(g)
        if not inflight:
            continue
        now += P._advance(inflight, engines, jitter, 2500.0, 0.05)
        for sent in [s for s in inflight if s.left is not None and s.left <= 1e-9]:
            inflight.remove(sent)
            if sent.request.exchange is not None:
                sent.request.exchange.end()
            engines.end(sent.request)
            g = sent.conversation
            latency.append(now - sent_at[g])
            last_end[g] = (now, len(turns[g][position[g]].hashes))
            position[g] += 1
            if position[g] < len(turns[g]):
                heapq.heappush(ready, (workload.arrivals[g][position[g]], g))
    prompt = sum(len(t.tokens) for ts in turns for t in ts)
    cuts = statistics.quantiles(latency, n=100)
    return (
        engines.cached_blocks * ENGINE_BLOCK_TOKENS / prompt,
        cuts[49],
        cuts[89],
        cuts[98],
        now,
        len(holds),
        statistics.fmean(holds) if holds else 0.0,
    )


workload = P.load(Path(sys.argv[1]))
fleet, blocks = workload.fleet, workload.blocks
print(f"{Path(sys.argv[1]).name}: means over seeds {list(SEEDS)}")
print("placement, hold: hit rate / latency p50, p90, p99 s / wall s / first turns held, mean hold s")
for name, make in (
    ("kvroute", lambda: P.KvroutePlacement(fleet, blocks)),
    ("sglang-router rule", lambda: P.SglangRule(fleet)),
):
    for share, window, max_wait in ((0, 0, 0), (0.7, 120, 60), (0.8, 120, 30), (0.8, 120, 120), (0.9, 120, 60)):
        runs = [replay(workload, make(), seed, share, window, max_wait) for seed in SEEDS]
        hit, p50, p90, p99, wall, count, hold = (statistics.fmean(r[i] for r in runs) for i in range(7))
        what = "none" if not max_wait else f"share {share}, window {window} s, at most {max_wait} s"
        print(
            f"{name}, {what}: {hit:.3f} / {p50:.1f}, {p90:.1f}, {p99:.1f} / {wall:.0f} / {count:.0f}, {hold:.1f}",
            flush=True,
        )
