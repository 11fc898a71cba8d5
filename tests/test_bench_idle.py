"""`kvroute-dev bench idle` runs end to end: one simulator process serving several backends, an
ext_proc following them, its CPU read (figures are not judged here: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.experiments import idle

pytestmark = pytest.mark.bench


def test_the_idle_ext_procs_cpu_is_read_over_a_fleet_served_by_one_simulator():
    result = idle.run(3, seconds=1.0, warmup_s=0.5)
    assert result["backends"] == 3 and result["seconds"] >= 1.0
    # CPU over one second can round to 0 at this fleet size: only that it was read
    assert result["extproc_cores"] >= 0 and result["simulator_cores"] >= 0
