"""Medians (and fastest) of decide_p50_us per case, before and after, from commands.sh's runs."""

import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
runs: dict[tuple[str, int, int], list[float]] = {}
for path in sorted(here.glob("*.jsonl")):
    side = path.name.split(".")[0]
    for line in path.read_text().splitlines():
        row = json.loads(line)
        runs.setdefault((side, row["body_bytes"], row["index_entries"] // 1000), []).append(row["decide_p50_us"])
print("| body bytes | index entries (k) | before median (fastest) µs | after median (fastest) µs | change |")
print("|---|---|---|---|---|")
for _, body, entries in sorted(k for k in runs if k[0] == "before"):
    b, a = runs["before", body, entries], runs["after", body, entries]
    change = statistics.median(a) / statistics.median(b) - 1
    print(
        f"| {body} | {entries} | {statistics.median(b):.1f} ({min(b):.1f}) | "
        f"{statistics.median(a):.1f} ({min(a):.1f}) | {change:+.1%} |"
    )
