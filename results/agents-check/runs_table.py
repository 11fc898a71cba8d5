"""Every side-by-side vLLM-CPU run on the check set (arrival order, ratio 0.5) whose folder name
matches the pattern: hit rate / TTFT p50 ms per router, and each kvroute layout's difference from
sglang-router in the same run. `python results/agents-check/runs_table.py [GLOB]`."""

import glob
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
COLUMNS = ["kvroute-authz", "kvroute", "kvroute-precise", "sglang-router-cache_aware"]
pattern = sys.argv[1] if len(sys.argv) > 1 else "vllm-arrival-r0.5-2026-12-0[678]-*"
diffs: dict[str, list[float]] = {c: [] for c in COLUMNS[:3]}
faster: dict[str, list[bool]] = {c: [] for c in COLUMNS[:3]}
print("| run | commit | " + " | ".join(COLUMNS) + " |")
print("|---|---|" + "---|" * len(COLUMNS))
for folder in sorted(glob.glob(str(HERE / pattern))):
    if not (Path(folder) / "results.json").exists():
        continue  # a run still going
    routers = json.loads((Path(folder) / "results.json").read_text())["routers"]
    rows = routers if isinstance(routers, dict) else {r["router"]: r for r in routers}
    rows = {name: row for name, row in rows.items() if not row.get("exited") and not row.get("errors")}  # void: out
    commands = (Path(folder) / "commands.txt").read_text() if (Path(folder) / "commands.txt").exists() else ""
    commit = (re.findall(r"\bat ([0-9a-f]{7})\b", commands) or ["-"])[0]
    cells = []
    for name in COLUMNS:
        row = rows.get(name)
        cells.append("-" if row is None else f"{row['hit_rate']:.3f} / {row['ttft_p50_ms']:,.0f}")
    reference = rows.get(COLUMNS[3])
    for name in COLUMNS[:3]:
        if reference is not None and name in rows:
            diffs[name].append(rows[name]["hit_rate"] - reference["hit_rate"])
            faster[name].append(rows[name]["ttft_p50_ms"] < reference["ttft_p50_ms"])
    print(f"| {Path(folder).name.split('r0.5-')[1]} | {commit} | " + " | ".join(cells) + " |")
print()
for name in COLUMNS[:3]:
    d = diffs[name]
    if d:
        print(
            f"{name}: {len(d)} runs beside sglang-router, hit rate minus its: mean {statistics.mean(d):+.3f}, "
            f"range {min(d):+.3f} to {max(d):+.3f}, ahead by 0.01 or more in {sum(x >= 0.01 for x in d)}; "
            f"TTFT p50 lower in {sum(faster[name])}"
        )
