"""Issue 31's table rows: per class (long: over 1,000 prompt tokens; short) TTFT and ITL from a
run's records by nearest rank; the "all" columns from the run's summary.

    python results/pd-31/table.py conc2 decider-conc6 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROUTERS = ("kvroute-pd", "kvroute-pd-flex", "kvroute", "sglang-router-cache_aware")


def nearest(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{round(ordered[min(len(ordered) - 1, int(len(ordered) * q))]):,}" if ordered else "-"


def pair(values: list[float]) -> str:
    return f"{nearest(values, 0.5)} / {nearest(values, 0.9)}"


def rows(run: str) -> list[str]:
    results = json.loads((HERE / run / "results.json").read_text())
    clients = results["pacing"]["concurrency"]
    out = []
    for name in ROUTERS:
        if name not in results["routers"]:
            continue
        row = results["routers"][name]
        records = [r for r in json.loads((HERE / run / "records" / f"{name}.json").read_text()) if r["status"] == 200]
        long = [r for r in records if r["prompt_tokens"] > 1000]
        short = [r for r in records if r["prompt_tokens"] <= 1000]

        def ttft(group: list[dict]) -> list[float]:
            return [r["ttft_ms"] for r in group if r["ttft_ms"] is not None]

        def gaps(group: list[dict]) -> list[float]:
            return [gap for r in group for gap in r["token_gaps_ms"]]

        legs = sum(row["requests_per_backend"].values()) - len(records) if name.startswith("kvroute-pd") else "-"
        cells = [
            str(clients),
            name,
            f"{round(row['ttft_p50_ms']):,} / {round(row['ttft_p90_ms']):,}",
            pair(ttft(long)),
            pair(ttft(short)),
            f"{round(row['itl_p50_ms']):,} / {round(row['itl_p90_ms']):,}",
            f"{nearest(gaps(long), 0.9)} / {nearest(gaps(short), 0.9)}",
            f"{round(row['e2e_p50_ms']):,}",
            str(round(row["wall_s"])),
            str(row["router_cpu_s"]),
            str(legs),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    for run in sys.argv[1:]:
        print("\n".join(rows(run)))
