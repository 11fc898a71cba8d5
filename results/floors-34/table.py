"""The floors table from `kvroute-dev bench floors` JSON lines: per case and transport, the median
over rounds of latency p50, Envoy's and the router's CPU per request (µs), and what the routing
call adds to Envoy alone ("none"). python results/floors-34/table.py FILE"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.startswith("{")]
by = defaultdict(list)
for row in rows:
    by[row["body_bytes"] // 1000, row["concurrency"], row["transport"]].append(row)
transports = list(dict.fromkeys(r["transport"] for r in rows))


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


print(
    "| body, concurrency | transport | p50 ms | added p50 ms | Envoy CPU µs/req | router CPU µs/req"
    " | both, added to Envoy alone |"
)
print("|---|---|---|---|---|---|---|")
for size, concurrency in dict.fromkeys((k[0], k[1]) for k in by):
    base = by[size, concurrency, "none"]
    base_p50 = median(r["p50_ms"] for r in base)
    base_cpu = median(r["envoy_cpu_us"] for r in base)
    for transport in transports:
        group = by[size, concurrency, transport]
        p50 = median(r["p50_ms"] for r in group)
        envoy = median(r["envoy_cpu_us"] for r in group)
        router = median(r["router_cpu_us"] for r in group)
        added = envoy + (router or 0) - base_cpu
        print(
            f"| {size} KB, {concurrency} | {transport} | {p50:.2f} | {p50 - base_p50:+.2f} | {envoy:.0f} | "
            f"{'-' if router is None else f'{router:.0f}'} | {'-' if transport == 'none' else f'{added:.0f}'} |"
        )
