"""`kvroute-dev bench policies` runs end to end: the same two-model trace through one ext_proc
serving both models' policies and through one ext_proc per model (figures are not judged here:
docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.experiments import policies
from bench.workloads import models

pytestmark = pytest.mark.bench


def test_both_setups_serve_every_request_of_both_models(tmp_path: Path):
    requests = models.generate(policies.MODELS, sessions=6)
    assert {r.adapter for r in requests} == set(policies.MODELS) and len({r.session_id for r in requests}) == 12
    sim_args = ["--capacity-blocks", str(policies.capacity_blocks(requests, 2.0, 2))]
    rows = [policies.run_setup(setup, requests, tmp_path / setup, sim_args, 4) for setup in ("one", "two")]
    assert [(row["setup"], row["extprocs"], len(row["extproc_cpu_s"])) for row in rows] == [
        ("one", 1, 1),
        ("two", 2, 2),
    ]
    for row in rows:
        assert row["ok"] == row["requests"] == len(requests)
        assert all(row[f"hit_rate_{model}"] > 0.3 for model in policies.MODELS)  # each model's turns reuse
