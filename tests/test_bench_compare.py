"""`kvroute-dev bench compare` smoke run: every router over simulated backends, numbers consistent.

Installs vllm-router and sglang-router from PyPI on first use (bench/venvs.py: outside the clone).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.compare import CompareOptions, run
from bench.peers import ROUTERS
from bench.replay import Pacing

pytestmark = [pytest.mark.peers, pytest.mark.envoy]

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
FAST_SIM = ("--prefill-s-per-token", "0.000002", "--decode-s-per-token", "0.001", "--max-num-seqs", "16")


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake traces sit beside the checkout")
def test_compare_smoke_all_routers(tmp_path: Path):
    limit = 300
    results = run(
        CompareOptions(
            trace=TRACE,
            limit=limit,
            out=tmp_path,
            capacity_ratio=1.0,
            backends=3,
            pacing=Pacing(speedup=40.0),
            max_output_tokens=4,
            sim_args=FAST_SIM,
        )
    )
    assert set(results["routers"]) == set(ROUTERS) - {"kvroute-precise"}
    assert "real vLLM" in results["skipped"]["kvroute-precise"]  # simulated backends have no tokenizer or events
    oracle = results["oracle_hit_rate"]
    assert 0 < oracle < 1
    for name, row in results["routers"].items():
        assert row["requests"] == limit and row["errors"] == 0, name
        assert sum(row["requests_per_backend"].values()) == row["ok"] == limit, name  # every request accounted for
        # No router beats Belady's MIN on the order its own requests were sent.
        assert 0 <= row["hit_rate"] <= row["bound_hit_rate"], name
        assert row["hit_rate_usage"] == pytest.approx(row["hit_rate"], abs=0.01), name
        assert row["ttft_p50_ms"] is not None and row["load_max_over_mean"] >= 1.0
    saved = orjson.loads((tmp_path / "results.json").read_bytes())
    assert saved["oracle_hit_rate"] == oracle and set(saved["routers"]) == set(results["routers"])
    for plot in ("ttft.png", "hit_rate.png", "load.png", "summary.md"):
        assert (tmp_path / plot).stat().st_size > 0
    assert len(orjson.loads((tmp_path / "records" / "kvroute.json").read_bytes())) == limit


SYNTHETIC = TRACE.with_name("synthetic_trace.jsonl")


@pytest.mark.skipif(not SYNTHETIC.exists(), reason="the shared Mooncake traces sit beside the checkout")
@pytest.mark.parametrize("ratio", [0.25, 0.6])
def test_no_router_beats_the_bound_on_multi_turn_chains(tmp_path: Path, ratio: float):
    """The synthetic trace's multi-turn chains, closed loop, two cache sizes: under the bound."""
    results = run(
        CompareOptions(
            trace=SYNTHETIC,
            limit=160,
            out=tmp_path,
            capacity_ratio=ratio,
            backends=2,
            routers=("kvroute", "sglang-router-cache_aware", "envoy-round-robin"),
            pacing=Pacing(concurrency=8),
            max_output_tokens=2,
            max_input_tokens=8192,
            sim_args=FAST_SIM,
        )
    )
    for name, row in results["routers"].items():
        assert row["errors"] == 0, name
        assert 0 < row["hit_rate"] <= row["bound_hit_rate"], name
