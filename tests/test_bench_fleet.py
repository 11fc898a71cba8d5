"""`kvroute-dev bench fleet` runs end to end at a small size: several models' simulated backends
through Envoy and one ext_proc (one policy per model), then the routing core alone; and the
multi-model, multi-tenant workload it replays (figures are not judged here: docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.experiments import fleet
from bench.workloads import models

pytestmark = pytest.mark.bench


def test_the_workload_gives_each_model_and_level_its_own_sessions_and_blocks():
    names = fleet.model_names(2)
    first, second = models.generate(names, 5, tenants=3, seed=1), models.generate(names, 5, tenants=3, seed=2)
    assert [r.index for r in first] == list(range(len(first))) and {r.adapter for r in first} == set(names)
    assert {models.tenant_of(r) for r in first} == {"tenant-0", "tenant-1", "tenant-2"}
    assert len({r.session_id for r in first}) == 10
    own = [{h for r in level if r.adapter == names[0] for h in r.hash_ids[4:]} for level in (first, second)]
    other = {h for r in first if r.adapter == names[1] for h in r.hash_ids[4:]}
    assert own[0] and not own[0] & own[1] and not own[0] & other  # beyond the system prompt, nothing shared
    assert {r.hash_ids[:4] for r in first} & {r.hash_ids[:4] for r in second}  # the system prompts are


@pytest.mark.envoy
def test_a_small_fleet_through_envoy_and_through_the_core(tmp_path: Path):
    (row,) = fleet.through_envoy(8, 2, 6, 3, [4], tmp_path)
    assert row["ok"] == row["requests"] == 48 and row["failed"] == {} and row["hit_rate"] > 0.3
    assert row["extproc_cpu_us_per_request"] > 0 and row["requests_per_s"] > 0
    core = fleet.through_core(8, 2, 6, 3, window=4)
    assert core["requests"] == 48 and core["hit_rate"] > 0.3 and core["decisions_per_s_per_core"] > 0
