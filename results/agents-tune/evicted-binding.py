"""Issue 28, tried and not kept (2026-12-04): a conversation whose context its backend no longer
holds (the session's candidate matches no block) is not held by its binding; it is placed as any
unbound prompt is. Replayed on the routing core over vLLM block pools in arrival order
(`engine_hit_rate`: the trace's own order, a closed loop of 16), tuning set first, then the
check set; share of prompt tokens cached at capacity ratios 0.2, 0.3, 0.5, 0.8.

    .venv/bin/python results/agents-tune/evicted-binding.py
"""

from __future__ import annotations

from pathlib import Path

from bench.experiments.decisions import engine_hit_rate
from extproc.core import rules

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "agents"
RATIOS = (0.2, 0.3, 0.5, 0.8)
bound = rules.session_binding


def unless_evicted(standing: rules.Standing) -> tuple[rules.CandidateCost, rules.Label] | None:
    session = standing.session
    return None if session is not None and session.matched == 0 else bound(standing)


for name in ("agent-tune.jsonl", "agent-check.jsonl"):
    for variant, rule in (("binding holds", bound), ("unless evicted", unless_evicted)):
        rules.session_binding = rule  # the pipeline is assembled per Router, after this
        for mode in ("approximate", "precise"):
            rates = [engine_hit_rate(TRACES / name, 480, mode, capacity_ratio=r) for r in RATIOS]
            print(name, variant, mode, " ".join(f"{r:.4f}" for r in rates), flush=True)
