"""What flow control costs a fleet with room: kvroute's router CPU per request with flow control on
(the default) and off, side by side in one `kvroute-dev bench floors` run (each case through both
stacks in turn, three rounds). Usage: python table.py RUN.jsonl ON_TRANSPORT OFF_TRANSPORT"""

import collections
import json
import statistics
import sys
from pathlib import Path

path, on_name, off_name = sys.argv[1:4]
rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
by = collections.defaultdict(list)
for row in rows:
    by[(row["body_bytes"], row["concurrency"], row["transport"])].append(row["router_cpu_us"])
print("| body, concurrency | router CPU µs, on (rounds) | off (rounds) | on / off, medians |")
print("|---|---|---|---|")
for size, concurrency in sorted({(k[0], k[1]) for k in by}):
    on, off = by[(size, concurrency, on_name)], by[(size, concurrency, off_name)]
    ratio = statistics.median(on) / statistics.median(off)
    cells = ", ".join(f"{v:,.0f}" for v in on), ", ".join(f"{v:,.0f}" for v in off)
    print(f"| {round(size / 1000)} KB, {concurrency} | {cells[0]} | {cells[1]} | {ratio:.2f} |")
