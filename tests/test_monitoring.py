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
    assert f"SUCCESS: {len(yaml.safe_load(ALERTS.read_text())['groups'][0]['rules'])} rules found" in result.stdout


@pytest.fixture
def watched(tmp_path: Path):
    """Two replicas (shared through Redis) over two simulated servers, each its own process, and a
    Prometheus scraping the replicas with the alerts loaded, their `for` cut to a second."""
    rules = yaml.safe_load(ALERTS.read_text())
    for rule in rules["groups"][0]["rules"]:
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

    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    for rule in rules:
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
