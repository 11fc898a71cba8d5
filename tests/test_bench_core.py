"""`kvroute-dev bench core` runs end to end and reports the promised fields (figures are not judged here)."""

from __future__ import annotations

import orjson

from bench.cli import main
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
