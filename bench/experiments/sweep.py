"""`kvroute-dev bench sweep`: the same trace at several offered loads, every router, one fleet.

One operating point hides the curve platform engineers compare routers by: each router runs the
trace at every load (closed-loop concurrencies, or speedups of the trace's own arrival times),
cold caches each time. Reported per router and load: TTFT p50/p90, hit rate and its fraction of
the MIN bound; and goodput, the highest offered load at which TTFT p90 stays within the SLO with
no errors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.experiments.compare import (
    CompareOptions,
    describe,
    load_requests,
    prompt_builder,
    run_router,
    runnable,
    start_fleet,
)
from bench.harness.plotting import pyplot
from bench.harness.replay import Pacing
from bench.workloads.trace import chains


@dataclass(frozen=True, slots=True)
class SweepOptions:
    compare: CompareOptions  # trace, fleet and routers; its pacing is replaced by each load
    loads: tuple[float, ...]  # concurrencies (closed loop) or speedups, light to heavy
    closed_loop: bool
    slo_p90_ms: float


def _pacing(options: SweepOptions, load: float) -> Pacing:
    return Pacing(concurrency=int(load)) if options.closed_loop else Pacing(speedup=load)


def goodput(points: dict[float, dict[str, Any]], slo_p90_ms: float) -> float | None:
    """The highest load whose TTFT p90 is within the SLO with no errors (None: not even the lightest)."""
    good = [
        load
        for load, row in points.items()
        if not row["errors"] and row["ttft_p90_ms"] is not None and row["ttft_p90_ms"] <= slo_p90_ms
    ]
    return max(good, default=None)


def check_concurrencies(loads: tuple[float, ...], sessions: int) -> None:
    """A closed loop gives each client one session at a time, so a concurrency above the trace's
    sessions offers no more load than the session count: refuse it rather than plot a flat curve
    as if the routers had absorbed the extra load."""
    beyond = [load for load in loads if load > sessions]
    if beyond:
        raise ValueError(
            f"concurrency {beyond[0]:g} is more than the trace's {sessions} sessions, which is all a closed "
            f"loop can keep in flight: use loads up to {sessions}, or a trace with more sessions"
        )


def run(options: SweepOptions) -> dict[str, Any]:
    """Every router at every load; write results.json, summary.md and the two plots."""
    compare = options.compare
    requests = load_requests(compare)
    if options.closed_loop:
        check_concurrencies(options.loads, len(chains(requests)))
    out = compare.out
    fleet = start_fleet(compare, requests)
    curves: dict[str, dict[float, dict[str, Any]]] = {}
    try:
        builder = prompt_builder(fleet, compare)
        prompts = fleet.prompts(requests, builder)
        routers, skipped = runnable(compare, fleet)
        for load in options.loads:
            for name in routers:
                summary, _ = run_router(
                    fleet,
                    name,
                    requests,
                    builder,
                    _pacing(options, load),
                    prompts,
                    out / "logs" / f"{load:g}",
                    options.compare.extproc_replicas,
                    options.compare.other_traffic_tokens,
                )
                curves.setdefault(name, {})[load] = summary
    finally:
        fleet.stop()
    results = {
        **describe(compare, requests, fleet),
        "load": "concurrency" if options.closed_loop else "speedup",
        "loads": list(options.loads),
        "slo_ttft_p90_ms": options.slo_p90_ms,
        "goodput": {name: goodput(points, options.slo_p90_ms) for name, points in curves.items()},
        "routers": {name: {f"{load:g}": row for load, row in points.items()} for name, points in curves.items()},
        "skipped": skipped,
    }
    write(results, out)
    return results


def table(results: dict[str, Any]) -> str:
    """Per router and load: TTFT p50/p90, hit rate; then goodput."""
    loads = [f"{load:g}" for load in results["loads"]]
    lines = [
        f"{results['requests']} requests of {results['trace']}, {results['backends']} {results['backend_kind']} "
        f"backends, capacity ratio {results['capacity_ratio']}; load = {results['load']}; "
        f"goodput = highest load with TTFT p90 <= {results['slo_ttft_p90_ms']:g} ms and no errors",
        "",
        "| router | " + " | ".join(f"{results['load']} {x}: p50/p90 ms, hit" for x in loads) + " | goodput |",
        "|---" * (len(loads) + 2) + "|",
    ]
    for name, points in results["routers"].items():
        cells = []
        for load in loads:
            row = points[load]
            hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
            cells.append(f"{row['ttft_p50_ms']} / {row['ttft_p90_ms']}, {hit}")
        best = results["goodput"][name]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if best is None else f'{best:g}'} |")
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    (out / "summary.md").write_text(table(results) + "\n")
    loads = results["loads"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in results["routers"].items():
        rows = [points[f"{load:g}"] for load in loads]
        (line,) = ax.plot(loads, [r["ttft_p50_ms"] for r in rows], marker="o", label=f"{name} p50")
        ax.plot(loads, [r["ttft_p90_ms"] for r in rows], marker="x", linestyle="--", color=line.get_color())
    ax.axhline(results["slo_ttft_p90_ms"], color="black", linestyle=":", label="p90 SLO")
    ax.set(xlabel=f"offered load ({results['load']})", ylabel="TTFT ms (p50 solid, p90 dashed)", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_load.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in results["routers"].items():
        ax.plot(loads, [points[f"{load:g}"]["hit_rate"] or 0 for load in loads], marker="o", label=name)
    ax.set(xlabel=f"offered load ({results['load']})", ylabel="prompt-token cache hit rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hit_rate_vs_load.png", dpi=110)
    plt.close(fig)


def options_from(compare: CompareOptions, loads: str, closed_loop: bool, slo_p90_ms: float) -> SweepOptions:
    """From the CLI's comma-separated loads."""
    values = tuple(sorted(float(x) for x in loads.split(",") if x.strip()))
    if not values or any(v <= 0 for v in values):
        raise ValueError("loads must be positive numbers")
    return SweepOptions(replace(compare, pacing=Pacing()), values, closed_loop, slo_p90_ms)
