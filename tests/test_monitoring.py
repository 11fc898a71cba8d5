"""The chart's dashboard and alerts, checked against the real thing: promtool checks the rules
file; a real Prometheus (built from its Go module on first use, bench/harness/prometheus/build)
scrapes two ext_proc replicas sharing through Redis, behind a real Envoy, while traffic runs
through flow control; every dashboard query then parses and returns series, every alert's
expression parses and reads metrics that exist, and one alert fires for real when a backend goes
down."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from bench.harness.observability import Prometheus, prometheus_binaries
from bench.harness.stack import Stack
from bench.harness.store import PASSWORD, RedisServer
from tests.e2e import eventually, post
from tools import dashboard

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "charts" / "kvroute" / "files" / "alerts.yaml"
JOB = "kvroute-extproc"
# Slow simulated servers: a request holds its backend for about a second, so flow control holds
# the others (max one request per backend), dispatching some in time and letting others expire.
SLOW_SIM = ("--step-s", "0.01", "--max-num-seqs", "1")
FLOW = ("--max-backend-requests", "1", "--queue-ttl-s", "0.8")


def test_the_dashboard_is_what_its_declaration_renders():
    assert (ROOT / "charts" / "kvroute" / "files" / "dashboard.json").read_bytes() == dashboard.rendered()


@pytest.mark.observability
def test_promtool_accepts_the_alert_rules():
    result = subprocess.run(
        [str(prometheus_binaries() / "promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(group["rules"]) for group in yaml.safe_load(ALERTS.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout


def _operator_rules() -> list[dict]:
    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "kvroute-operator"]
    return group["rules"]


def test_the_operator_alerts_and_panel_read_what_the_operator_serves():
    """Every kvroute_operator_* metric the operator's alerts and dashboard panel name is one the
    operator's real collector serves (a renamed count would leave them reading nothing)."""
    from prometheus_client import generate_latest

    from controller.audit import Auditor
    from controller.metrics import registry
    from controller.reconciler import Reconciler
    from controller.reuse_reader import ReuseReader

    reconciler = Reconciler(lambda *_: None)
    reader = ReuseReader(reconciler, 30.0, lambda: None)
    page = generate_latest(registry(reconciler, reader, Auditor(reconciler, 60.0, lambda: None))).decode()
    served = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if not line.startswith("#")}
    named = {
        metric
        for text in [r["expr"] for r in _operator_rules()] + dashboard.queries(dashboard.OPERATOR_JOB)
        for metric in re.findall(r"\bkvroute_operator_[a-z_]+", text)
    }
    assert len(named) >= 3 and named <= served, named - served


@pytest.mark.observability  # promtool, built from its Go module on first use
def test_the_operator_alerts_fire_on_what_they_say_and_the_panel_computes(tmp_path: Path):
    """promtool's rule tests over series shaped as the operator serves them: a replica that stops
    answering scrapes, status writes that keep failing while reads recovered, an untrusted claim;
    each alert fires after its `for`, only for what failed, with its annotations rendered; and the
    dashboard's operator queries evaluate to what the series say."""
    job = 'job="kvroute-controller", instance="10.0.0.9:8080"'
    panel = dashboard.queries(dashboard.OPERATOR_JOB)
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f"up{{{job}}}", "values": "1 1 0x20"},
                    {"series": f'kvroute_operator_errors_total{{{job}, kind="status"}}', "values": "0+2x40"},
                    {"series": f'kvroute_operator_errors_total{{{job}, kind="reuse_read"}}', "values": "0 3 3x40"},
                    {"series": f"kvroute_operator_status_patches_total{{{job}}}", "values": "0+6x40"},
                    {"series": f"kvroute_operator_untrusted_extproc_claims{{{job}}}", "values": "0 2x40"},
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "KvrouteOperatorDown", "exp_alerts": []},
                    {
                        "eval_time": "8m",
                        "alertname": "KvrouteOperatorDown",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "kvroute-controller",
                                    "instance": "10.0.0.9:8080",
                                },
                                "exp_annotations": {
                                    "summary": "kvroute operator 10.0.0.9:8080 is not answering scrapes",
                                    "description": _rule("KvrouteOperatorDown")["annotations"]["description"],
                                },
                            }
                        ],
                    },
                    {"eval_time": "10m", "alertname": "KvrouteOperatorFailing", "exp_alerts": []},
                    {
                        "eval_time": "30m",  # the reads failed once, 28 minutes ago: gone from the rate
                        "alertname": "KvrouteOperatorFailing",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "kind": "status"},
                                "exp_annotations": {
                                    "summary": "the kvroute operator keeps failing to write policy statuses",
                                    "description": _rule("KvrouteOperatorFailing")["annotations"]["description"],
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "12m",
                        "alertname": "KvrouteUntrustedExtprocClaims",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "info"},
                                "exp_annotations": {
                                    "summary": "2 pods claim a kvroute policy from a namespace whose ext_procs "
                                    "are not read",
                                    "description": _rule("KvrouteUntrustedExtprocClaims")["annotations"]["description"],
                                },
                            }
                        ],
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": panel[0].replace("$__rate_interval", "5m"),
                        "eval_time": "20m",
                        "exp_samples": [{"labels": "{}", "value": 0.1}],
                    },
                    {
                        "expr": panel[1].replace("$__rate_interval", "5m"),
                        "eval_time": "20m",
                        "exp_samples": [
                            {"labels": '{kind="reuse_read"}', "value": 0},
                            {"labels": '{kind="status"}', "value": 2 / 60},
                        ],
                    },
                    {"expr": panel[2], "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 2}]},
                ],
            }
        ],
    }
    spec = tmp_path / "operator-alerts-test.yaml"
    spec.write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [str(prometheus_binaries() / "promtool"), "test", "rules", str(spec)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(panel) == 3


def _rule(name: str) -> dict:
    return next(r for r in _operator_rules() if r["alert"] == name)


@pytest.fixture
def watched(tmp_path: Path):
    """Two replicas (shared through Redis) over two simulated servers, each its own process, and a
    Prometheus scraping the replicas with the alerts loaded, their `for` cut to a second."""
    rules = yaml.safe_load(ALERTS.read_text())
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        rule["for"] = "1s"
    quick = tmp_path / "alerts.yaml"
    quick.write_text(yaml.safe_dump(rules))
    store = RedisServer(tmp_path).start()
    try:
        stack = Stack(
            tmp_path / "stack",
            sims=2,
            separate_sims=True,
            sim_args=SLOW_SIM,
            extproc_args=FLOW,
            extproc_replicas=2,
            replica_store=store.url,
            replica_store_password=PASSWORD,
        )
        with stack:
            targets = [f"127.0.0.1:{port}" for port in stack.admin_ports]
            with Prometheus(tmp_path / "prometheus", JOB, targets, quick) as prom:
                yield stack, prom
    finally:
        store.stop()


def traffic(stack: Stack) -> list[int]:
    """Sixteen requests, eight at a time, half of them repeating a prompt: statuses."""

    def one(i: int) -> int:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"question {i % 8} " + "context " * 300}],
            "max_tokens": 60,
        }
        return post(stack.url, body)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(16)))


@pytest.mark.observability  # a real Prometheus: built from its Go module on first use, not in the quick lane
def test_every_dashboard_query_and_alert_reads_live_series_and_an_alert_fires(watched):
    stack, prom = watched
    eventually(lambda: len(prom.query(f'up{{job="{JOB}"}} == 1')) == 2, 30, "both replicas scraped")
    statuses = traffic(stack)
    assert 200 in statuses and 429 in statuses  # served, and some expired while held
    for expr in dashboard.queries():  # (a rate has series once its input was scraped twice)
        live = expr.replace("$__rate_interval", "1m")
        eventually(lambda live=live: bool(prom.query(live)), 30, f"series from {live}")

    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "kvroute"]
    for rule in group["rules"]:  # (the operator's group reads the operator: the test above)
        prom.query(rule["expr"])  # parses (raises otherwise)
        for metric in set(re.findall(r"\b(?:kvroute_[a-z_]+|up)\b", rule["expr"])):
            assert prom.query(f'count({{__name__="{metric}", job="{JOB}"}})'), f"{rule['alert']}: no {metric}"
    assert not [a for a in prom.alerts() if a["state"] == "firing"]  # nothing wrong yet

    stack.stop_process("sim1")  # one backend goes away: its health probes fail on both replicas
    down = stack.backends[1]

    def fired() -> bool:
        return any(
            a["labels"]["alertname"] == "KvrouteNoRoutableBackend"
            and a["labels"].get("backend") == down
            and a["state"] == "firing"
            for a in prom.alerts()
        )

    eventually(fired, 60, "KvrouteNoRoutableBackend firing")
