"""`python -m tools.dashboard`: writes kvroute's Grafana dashboard (charts/kvroute/files/dashboard.json,
shipped by the chart in a ConfigMap for Grafana's sidecar) from the panels declared here, once.
tests/test_monitoring.py fails if the file differs from what this renders, and runs every panel's
queries against a real Prometheus scraping a running stack.

Every query reads the ext_proc's own metrics (job="kvroute-extproc", as the chart's PodMonitor
labels them), but the last panel's, which reads the operator's (job="kvroute-controller", the
chart's second PodMonitor). Per-backend series are taken once per backend over the replicas (max or min), fleet
sums over replicas, except what the engines count (delivered reuse), which every replica reports
alike: once per backend.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import orjson

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "charts" / "kvroute" / "files" / "dashboard.json"
JOB = 'job="kvroute-extproc"'
OPERATOR_JOB = 'job="kvroute-controller"'
RATE = "[$__rate_interval]"


def _rate(metric: str, by: str = "", selector: str = "", job: str = JOB) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{job}{selector}}}{RATE}))"


class Panel(NamedTuple):
    title: str
    description: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)


ROUTED, AVAILABLE, PROMPT = (
    _rate("kvroute_reuse_routed_tokens_total"),
    _rate("kvroute_reuse_available_tokens_total"),
    _rate("kvroute_prompt_tokens_total"),
)
DELIVERED = f"sum (max by (backend) (rate(kvroute_reuse_delivered_tokens_total{{{JOB}}}{RATE})))"

PANELS = (
    Panel(
        "Decisions",
        "Routing decisions per second, by why the backend was chosen (x-kvroute-decision).",
        "reqps",
        ((_rate("kvroute_decisions_total", "decision"), "{{decision}}"),),
    ),
    Panel(
        "Prefix reuse: available, routed, delivered",
        "Share of served prompt tokens: the longest prefix any candidate held (available), the "
        "prefix on the backend chosen (routed) and what the engines found cached (delivered; they "
        "count every client's requests).",
        "percentunit",
        (
            (f"{AVAILABLE} / {PROMPT}", "available"),
            (f"{ROUTED} / {PROMPT}", "routed"),
            (f"{DELIVERED} / {PROMPT}", "delivered"),
        ),
    ),
    Panel(
        "Routing efficiency and prediction accuracy",
        "routed / available: how much of the reuse the traffic allowed routing captured. delivered "
        "/ routed: how far the engines confirm kvroute's picture (below 1: it expected evicted "
        "blocks; above: other traffic shares the caches).",
        "percentunit",
        ((f"{ROUTED} / {AVAILABLE}", "routing efficiency"), (f"{DELIVERED} / {ROUTED}", "prediction accuracy")),
    ),
    Panel(
        "Prediction trust by backend",
        "How far kvroute trusts its picture of each backend's cache (1: the engine confirms it).",
        "percentunit",
        ((f"min by (backend) (kvroute_backend_prediction_trust{{{JOB}}})", "{{backend}}"),),
    ),
    Panel(
        "Time to first token: prediction error",
        "Mean absolute error of kvroute's TTFT predictions (SLO admission), from KV events.",
        "s",
        (
            (
                f"{_rate('kvroute_ttft_prediction_error_seconds_total')} / {_rate('kvroute_ttft_predictions_total')}",
                "mean error",
            ),
        ),
    ),
    Panel(
        "Requests in flight by backend",
        "Requests kvroute's replicas have in flight on each backend.",
        "short",
        ((f"sum by (backend) (kvroute_backend_active_requests{{{JOB}}})", "{{backend}}"),),
    ),
    Panel(
        "Prefill reserved by backend",
        "Prompt blocks kvroute's replicas expect each backend still to compute.",
        "short",
        ((f"sum by (backend) (kvroute_backend_reserved_blocks{{{JOB}}})", "{{backend}}"),),
    ),
    Panel(
        "Backends healthy",
        "1 while a backend answers its health probes (for every replica).",
        "short",
        ((f"min by (backend) (kvroute_backend_healthy{{{JOB}}})", "{{backend}}"),),
    ),
    Panel(
        "Engine feeds",
        "Seconds since each healthy backend's metrics were last read; failed scrapes and KV event problems per second.",
        "s",
        (
            (f"max by (backend) (kvroute_engine_sample_age_seconds{{{JOB}}})", "age {{backend}}"),
            (_rate("kvroute_engine_scrape_failures_total"), "scrape failures/s"),
            (_rate("kvroute_engine_event_problems_total", "kind"), "event {{kind}}/s"),
        ),
    ),
    Panel(
        "Replica sharing",
        "Replicas connected to the replica store, siblings each hears from, and how old the "
        "siblings' learning is when applied.",
        "short",
        (
            (f"sum (kvroute_replica_store_connected{{{JOB}}})", "connected"),
            (f"max (kvroute_replica_peers{{{JOB}}})", "peers"),
            (f"max (kvroute_replica_lag_seconds{{{JOB}}})", "lag (s)"),
        ),
    ),
    Panel(
        "Flow control: held and refused",
        "Requests held by flow control, and requests refused per second (shed at the backend "
        "limit or by SLO admission, or dropped from the queue).",
        "short",
        (
            (f"sum by (priority) (kvroute_queue_requests{{{JOB}}})", "held, priority {{priority}}"),
            (_rate("kvroute_decisions_total", "decision", ',decision=~"shed|shed_slo"'), "{{decision}}/s"),
            (
                _rate("kvroute_queue_outcomes_total", "outcome", ',outcome=~"expired|evicted|band_full|queue_full"'),
                "{{outcome}}/s",
            ),
        ),
    ),
    Panel(
        "Latency kvroute adds",
        "Time from a request's body to its decision (p50, p99), and time held by flow control (p99).",
        "s",
        (
            (
                f"histogram_quantile(0.5, sum by (le) (rate(kvroute_decision_seconds_bucket{{{JOB}}}{RATE})))",
                "decision p50",
            ),
            (
                f"histogram_quantile(0.99, sum by (le) (rate(kvroute_decision_seconds_bucket{{{JOB}}}{RATE})))",
                "decision p99",
            ),
            (
                f"histogram_quantile(0.99, sum by (le) (rate(kvroute_queue_wait_seconds_bucket{{{JOB}}}{RATE})))",
                "queue wait p99",
            ),
        ),
    ),
    Panel(
        "Operator",
        "Policy statuses the operator writes per second (each publishes a policy's ready backends), "
        "failures it logged and went on from, by what failed, and pods claiming a policy from a "
        "namespace whose ext_procs it does not read.",
        "short",
        (
            (_rate("kvroute_operator_status_patches_total", job=OPERATOR_JOB), "statuses written/s"),
            (_rate("kvroute_operator_errors_total", "kind", job=OPERATOR_JOB), "{{kind}} failures/s"),
            (f"max (kvroute_operator_untrusted_extproc_claims{{{OPERATOR_JOB}}})", "untrusted claims"),
        ),
    ),
)


def queries(job: str = JOB) -> list[str]:
    """Every panel's PromQL reading this job's metrics, with Grafana's `$__rate_interval` left in."""
    return [expr for panel in PANELS for expr, _ in panel.queries if job in expr]


def render() -> dict[str, Any]:
    """The dashboard as Grafana imports it: a datasource variable, two panels a row."""
    panels = []
    for index, panel in enumerate(PANELS):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + n),
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for n, (expr, legend) in enumerate(panel.queries)
                ],
            }
        )
    return {
        "uid": "kvroute",
        "title": "kvroute",
        "description": "KV-cache-aware routing: decisions, prefix reuse won and lost, load, feeds, flow control.",
        "tags": ["kvroute", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            ]
        },
        "panels": panels,
    }


def rendered() -> bytes:
    return orjson.dumps(render(), option=orjson.OPT_INDENT_2) + b"\n"


def main() -> None:
    DASHBOARD.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD.write_bytes(rendered())
    sys.stdout.write(f"wrote {DASHBOARD.relative_to(ROOT)}\n")


if __name__ == "__main__":
    main()
