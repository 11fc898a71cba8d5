"""Where kvroute's TTFT p50 is lost on the agentic workload (the five runs of 2026-12-05): each
router's TTFT split by how much of the prompt vLLM found cached, and the time between the client's
TTFT and the engines' own (the path through the router, the API server and the first chunk).
Usage: python results/vllm-agentic-r0.2-2026-12-05-ttft-split.py"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
for run in range(1, 6):
    folder = HERE / f"vllm-agentic-r0.2-2026-12-05-run{run}"
    summary = json.loads((folder / "results.json").read_text())["routers"]
    for name, figures in summary.items():
        rows = json.loads((folder / "records" / f"{name}.json").read_text())
        cached, uncached = [], []
        for row in rows:
            if row["ttft_ms"] is None or not row["prompt_tokens"]:
                continue
            share = (row["cached_tokens"] or 0) / row["prompt_tokens"]
            (cached if share >= 0.8 else uncached).append(row["ttft_ms"])
        gap = figures["ttft_mean_ms"] - figures["engine_ttft_mean_ms"]
        print(
            f"run {run} {name:26} >=0.8 cached: {len(cached):3d} p50 {statistics.median(cached):4.0f} ms; "
            f"less: {len(uncached):3d} p50 {statistics.median(uncached):4.0f} ms; "
            f"client - engine TTFT mean {gap:3.0f} ms"
        )
