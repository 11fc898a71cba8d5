"""`kvroute-dev bench latency` runs every case through both stacks (a smoke test: a handful of
requests, no timing asserted; one body mode, since the modes themselves are tested end to end in
tests/test_e2e_envoy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.experiments import latency

pytestmark = [pytest.mark.envoy, pytest.mark.bench]


def test_every_case_is_measured_through_both_stacks(tmp_path: Path):
    body_mode = "full_duplex"
    rows = latency.measure(4, tmp_path, body_mode)
    cases = [case for paced in latency.CASES.values() for case in paced]
    assert [(r["concurrency"], r["streamed_tokens"]) for r in rows] == [(c, t) for _, c, t in cases]
    for row in rows:
        assert row["body_mode"] == body_mode and row["extproc_cpu_us_per_request"] >= 0  # 10 ms ticks
        assert row["kvroute_rps"] > 0 and row["envoy_rps"] > 0


def test_a_split_requests_added_cost_is_measured_against_the_same_request_served_whole(tmp_path: Path):
    rows = latency.measure_split(4, tmp_path)
    assert [r["concurrency"] for r in rows] == [c for _, c in latency.SPLIT_CASES]
    # one client at a time: every request had its leg; sixteen: some find the prefill server queued
    # deeper than the decode server, and are served whole (pairs.cheapest_prefill)
    assert rows[0]["split_share"] == 1.0 and all(r["split_share"] > 0 for r in rows)
    assert all(r["whole_p50_ms"] > 0 and r["split_p50_ms"] > 0 for r in rows)
