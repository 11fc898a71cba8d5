"""`kvroute-dev bench core` runs end to end and reports the promised fields (figures are not judged here)."""

from __future__ import annotations

import orjson

from bench.cli import main
from bench.experiments import core
from bench.experiments.core import Case, run_case


def test_run_case_reports_every_field():
    result = run_case(Case(body_bytes=20_000, index_entries=5_000, iterations=5), block_size=512)
    assert {"body_bytes", "index_entries", "decide_p50_us", "decide_p99_us", "bytes_per_entry"} <= set(result)
    assert result["index_entries"] >= 5_000
    assert result["blocks"] == result["body_bytes"] // 512 or result["blocks"] > 0
    assert result["label"] == "prefix_match"  # the benchmark measures follow-ups that hit the index


def test_cli_prints_json_lines(capsys, monkeypatch):
    monkeypatch.setattr("bench.experiments.core.cases", lambda quick: [Case(8_000, 1_000, 3)])
    main(["bench", "core", "--quick"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and orjson.loads(lines[0])["body_bytes"] > 7_000


def test_the_fleet_scale_case_fills_every_backend_and_routes_both_kinds():
    """`bench core --backends`: 4,096 blocks per backend, a new prompt goes least loaded, the
    follow-up to the backend holding its conversation."""
    result = core.run_scale(8, iterations=5)
    assert result["backends"] == 8 and result["index_entries"] == 8 * core.SCALE_BLOCKS_PER_BACKEND
    assert result["new_label"] == "least_loaded" and result["followup_label"] == "prefix_match"
    assert 0 < result["new_8kb_p50_us"] <= result["new_8kb_p99_us"] and result["bytes_per_entry"] > 0
