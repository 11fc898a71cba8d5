"""The priority shape's flood (flow a, 24 closed-loop clients on two vLLM-CPU servers) through
each router, as a share of sglang-router's in the same run: `python results/flows/flood_table.py`.
Runs whose phases ran with a kvroute flag on every router, or without sglang-router, are left out."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
PEER = "sglang-router-cache_aware"
RUNS = ("priority-cpu-run*", "priority-engine-run*", "flood-*")


def main() -> None:
    ratios: dict[str, list[float]] = {}
    print("| run | router | flood tokens/s | / sglang-router | engines' CPU s | engine preemptions/s |")
    print("|---|---|---|---|---|---|")
    for folder in sorted(p for pattern in RUNS for p in HERE.glob(pattern)):
        routers = json.loads((folder / "results.json").read_text())["routers"]
        if PEER not in routers:
            continue
        peer = routers[PEER]["phases"]["overload"]["a"]["served_tokens_per_s"]
        for name, row in routers.items():
            served = row["phases"]["overload"]["a"]["served_tokens_per_s"]
            used = row.get("cpu", {}).get("overload", {})
            engines = (used.get("engines_cpu_s", "-"), used.get("engine_preemptions_per_s", "-"))
            print(f"| {folder.name} | {name} | {served:,.0f} | {served / peer:.2f} | {engines[0]} | {engines[1]} |")
            if name != PEER:
                ratios.setdefault(name, []).append(served / peer)
    print()
    for name, values in sorted(ratios.items(), key=lambda item: -len(item[1])):
        print(
            f"{name}: {len(values)} runs, share of sglang-router's flood mean {statistics.mean(values):.2f}, "
            f"from {min(values):.2f} to {max(values):.2f}"
        )


if __name__ == "__main__":
    main()
