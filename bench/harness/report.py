"""Compare results -> results.json, summary.md and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from bench.harness.plotting import pyplot

COLUMNS = (
    ("hit_rate", "hit rate"),
    ("hit_rate_usage", "hit rate, own requests"),
    ("reuse_available", "available (kvroute)"),
    ("reuse_routed", "routed (kvroute)"),
    ("routing_efficiency", "routing efficiency (routed / available)"),
    ("delivery_ratio", "delivered / routed"),
    ("bound_hit_rate", "MIN bound"),
    ("fraction_of_bound", "of bound"),
    ("fraction_of_lru", "of one LRU"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p90_ms", "TTFT p90 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("engine_ttft_mean_ms", "engines' own TTFT mean ms"),
    ("engine_queue_mean_ms", "of which queued ms"),
    ("engine_prefill_mean_ms", "of which scheduled ms"),
    ("engine_tokens_per_step", "tokens per step"),
    ("itl_p90_ms", "ITL p90 ms"),
    ("e2e_p50_ms", "E2E p50 ms"),
    ("engine_preemptions", "preemptions"),
    ("router_cpu_s", "router CPU s"),
    ("load_max_over_mean", "load max/mean"),
    ("prediction_mae_tokens", "prediction error (tokens)"),
    ("prediction_mae_fraction", "prediction error (share of prompt)"),
    ("errors", "errors"),
)


def table(results: dict[str, Any]) -> str:
    """The side-by-side markdown table."""
    lines = [
        f"one-LRU hit rate {results['oracle_hit_rate']:.4f}, Belady's MIN bound "
        f"{results['bound_hit_rate_trace_order']:.4f} in trace order (capacity ratio {results['capacity_ratio']}, "
        f"{results['backends']} backends, {results['requests']} requests of {results['trace']})",
        "",
        "| router | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for name, row in results["routers"].items():
        row = {**row, **_ratios(row)}
        lines.append(f"| {name} | " + " | ".join(_cell(row.get(key)) for key, _ in COLUMNS) + " |")
    void = [f"{name}: {', '.join(row['exited'])}" for name, row in results["routers"].items() if row.get("exited")]
    if void:
        lines += ["", "VOID (a process of the router exited during its run): " + "; ".join(void)]
    return "\n".join(lines)


def _ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """Where reuse was won or lost (kvroute's routers, which report available and routed): routing's
    efficiency, and what the engines delivered of what routing expected."""
    available, routed, delivered = row.get("reuse_available"), row.get("reuse_routed"), row.get("hit_rate")
    return {
        "routing_efficiency": routed / available if routed is not None and available else None,
        "delivery_ratio": delivered / routed if delivered is not None and routed else None,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.0f}"
    return str(value)


def write(results: dict[str, Any], records: dict[str, list[dict[str, Any]]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    (out / "records").mkdir(exist_ok=True)
    for name, rows in records.items():
        (out / "records" / f"{name}.json").write_bytes(orjson.dumps(rows))
    (out / "summary.md").write_text(table(results) + "\n")
    _plots(results, records, out)


def _plots(results: dict[str, Any], records: dict[str, list[dict[str, Any]]], out: Path) -> None:
    names = list(results["routers"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ttft = sorted(r["ttft_ms"] for r in records[name] if r["ttft_ms"] is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log", title="TTFT distribution")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    rates = [results["routers"][n].get("hit_rate") or 0 for n in names]
    ax.bar(range(len(names)), rates, label="delivered (the engines' hit rate)")
    for key, marker, label in (
        ("reuse_available", "^", "available (kvroute)"),
        ("reuse_routed", "o", "routed (kvroute)"),
    ):
        shown = [(i, results["routers"][n][key]) for i, n in enumerate(names) if results["routers"][n].get(key)]
        if shown:
            ax.scatter(
                [i for i, _ in shown], [v for _, v in shown], marker=marker, color="black", zorder=3, label=label
            )
    ax.axhline(results["oracle_hit_rate"], color="grey", linestyle=":", label="one LRU")
    ax.axhline(results["bound_hit_rate_trace_order"], color="black", linestyle="--", label="MIN bound (trace order)")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
    ax.set(ylabel="prompt-token cache hit rate", title="Cache hit rate (measured on the backends)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        per_backend = results["routers"][name]["requests_per_backend"]
        ax.bar([j + i * width for j in range(len(per_backend))], list(per_backend.values()), width, label=name)
    ax.set(xlabel="backend", ylabel="requests served", title="Load per backend")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)
    plt.close(fig)
