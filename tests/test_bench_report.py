"""What a comparison reports about itself (bench/harness/report.py, peers.RunningRouter)."""

from __future__ import annotations

import subprocess
import sys

from bench.harness import report
from bench.harness.peers import RunningRouter


def test_a_router_process_that_exits_during_its_run_voids_its_figures():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    router = RunningRouter("a-peer", "http://127.0.0.1:1", processes=[process])
    assert router.exited() == [f"{sys.executable} (exit 3)"]
    row = {"hit_rate": 0.9, "exited": router.exited()}
    head = {"oracle_hit_rate": 0.5, "bound_hit_rate_trace_order": 0.7, "capacity_ratio": 0.5}
    results = {**head, "backends": 2, "requests": 10, "trace": "t", "routers": {"a-peer": row, "b": {}}}
    void = f"VOID (a process of the router exited during its run): a-peer: {sys.executable} (exit 3)"
    assert report.table(results).splitlines()[-1] == void


def test_where_reuse_was_won_or_lost_is_a_ratio_beside_each_kvroute_row():
    head = {"oracle_hit_rate": 0.5, "bound_hit_rate_trace_order": 0.7, "capacity_ratio": 0.5}
    kvroute = {"hit_rate": 0.45, "reuse_available": 0.6, "reuse_routed": 0.5}
    results = {**head, "backends": 2, "requests": 10, "trace": "t", "routers": {"kvroute": kvroute, "peer": {}}}
    lines = report.table(results).splitlines()
    titles = [cell.strip() for cell in lines[2].split("|")]
    cells = {
        name: [cell.strip() for cell in line.split("|")]
        for name, line in zip(["kvroute", "peer"], lines[4:], strict=True)
    }
    efficiency, delivery = titles.index("routing efficiency (routed / available)"), titles.index("delivered / routed")
    assert (cells["kvroute"][efficiency], cells["kvroute"][delivery]) == ("0.833", "0.900")
    assert (cells["peer"][efficiency], cells["peer"][delivery]) == ("-", "-")  # no picture to attribute
