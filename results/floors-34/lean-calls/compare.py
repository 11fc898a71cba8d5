"""Before (aiohttp serving the ext_authz calls, 54af11a) against after (extproc/envoy/calls.py):
kvroute over ext_authz, the router's and Envoy's CPU per request, medians of the alternated runs
of ab.sh. python results/floors-34/lean-calls/compare.py"""

import collections
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
runs: dict[tuple[tuple[int, int], str], list[dict]] = collections.defaultdict(list)
for path in sorted(HERE.glob("*-[0-9].jsonl")):
    tag = path.name.split("-")[0]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    for row in rows:
        if row["transport"] == "kvroute_authz":
            runs[(row["body_bytes"] // 1000, row["concurrency"]), tag].append(row)
print("| body, concurrency | router CPU µs, before → after | Envoy CPU µs | runs |")
print("|---|---|---|---|")
for case in sorted({case for case, _ in runs}):
    before, after = runs[case, "before"], runs[case, "after"]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print(
        f"| {case[0]} KB, {case[1]} | {med(before, 'router_cpu_us'):.0f} → {med(after, 'router_cpu_us'):.0f}"
        f" | {med(before, 'envoy_cpu_us'):.0f} → {med(after, 'envoy_cpu_us'):.0f} | {len(before)}, {len(after)} |"
    )
