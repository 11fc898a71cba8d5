"""kvroute's spans reach a real trace collector: Jaeger all-in-one (built from its Go module on
first use, bench/harness/jaeger/build) receives them over OTLP/gRPC from an ext_proc behind a real
Envoy, configured only by the standard OTEL_* variables; the client's trace is continued, the
decision is on the span, and the backend receives the route span as its parent."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from bench.harness.observability import Jaeger
from bench.harness.stack import Stack
from tests.e2e import eventually, post

pytestmark = [pytest.mark.envoy, pytest.mark.observability]


@pytest.fixture
def traced(tmp_path: Path):
    with Jaeger(tmp_path / "jaeger") as jaeger:
        env = {**os.environ, **jaeger.exporter_env(), "OTEL_SERVICE_NAME": "kvroute-test"}
        with Stack(tmp_path / "stack", sims=2, extproc_env=env) as stack:
            yield jaeger, stack


def tags(span: dict) -> dict:
    return {tag["key"]: tag["value"] for tag in span["tags"]}


def test_a_request_s_route_span_reaches_the_collector_in_the_clients_trace(traced):
    jaeger, stack = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello " * 400}], "max_tokens": 4}
    status, headers, _ = post(stack.url, body, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert status == 200

    found: dict = {}

    def arrived() -> bool:
        trace = found["trace"] = jaeger.trace(trace_id)
        return trace is not None and any(s["operationName"] == "kvroute.route" for s in trace["spans"])

    eventually(arrived, timeout_s=30, message="the route span in Jaeger")
    trace = found["trace"]
    (span,) = [s for s in trace["spans"] if s["operationName"] == "kvroute.route"]
    assert [(r["refType"], r["spanID"]) for r in span["references"]] == [("CHILD_OF", client_span)]
    assert trace["processes"][span["processID"]]["serviceName"] == "kvroute-test"
    attributes = tags(span)
    served = headers["x-sim-backend"]
    assert attributes["kvroute.decision"] == headers["x-kvroute-decision"]
    assert attributes["kvroute.backend"] == attributes["kvroute.served"] == served
    assert attributes["http.response.status_code"] == 200
    assert attributes["kvroute.blocks.total"] > 0 and "kvroute.candidates.cost" in attributes
    # Envoy passed the route span's context on to the backend: its spans are the route span's children
    assert headers["x-sim-traceparent"] == f"00-{trace_id}-{span['spanID']}-01"
