"""`kvroute-dev bench compare` smoke run: every router over simulated backends, numbers consistent.

Installs vllm-router and sglang-router from PyPI on first use (bench/harness/venvs.py: outside the clone).
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import orjson
import pytest

from bench.experiments.compare import CompareOptions, run
from bench.harness import peers
from bench.harness.peers import ROUTERS
from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.replay import Pacing
from bench.harness.stack import dev_command
from extproc.core.decision import Label

pytestmark = [pytest.mark.peers, pytest.mark.envoy]

TRACE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace_head.jsonl"
AGENTS = Path(__file__).resolve().parent / "data" / "agents" / "agent-tune-head.jsonl"
FAST_SIM = ("--token-s", "0.000002", "--step-s", "0.001", "--max-num-seqs", "16")


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
            extproc_replicas=2,  # kvroute's two replicas share through a Redis; kvroute-unshared's do not
        )
    )
    assert set(results["routers"]) == set(ROUTERS) - {"kvroute-precise"}  # kvroute-authz runs replicas too
    assert results["extproc_replicas"] == 2
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
        assert row["router_cpu_s"] > 0, name  # the router's own processes, counted while it served
        assert row["exited"] == [], name  # none of them died while it ran
        if name.startswith("kvroute"):  # its own account: what was on offer, what it took
            parts = row["router_cpu_by_process_s"]  # which of its stack's processes took the CPU
            assert (
                set(parts) == {"envoy", "extproc", "extproc1"} and sum(parts.values()) <= row["router_cpu_s"] + 0.02
            ), name
            assert 0 <= row["reuse_routed"] <= row["reuse_available"] <= 1, name
        else:
            assert "reuse_routed" not in row, name
    saved = orjson.loads((tmp_path / "results.json").read_bytes())
    assert saved["oracle_hit_rate"] == oracle and set(saved["routers"]) == set(results["routers"])
    for plot in ("ttft.png", "hit_rate.png", "load.png", "summary.md"):
        assert (tmp_path / plot).stat().st_size > 0
    records = {name: orjson.loads((tmp_path / "records" / f"{name}.json").read_bytes()) for name in results["routers"]}
    assert len(records["kvroute"]) == limit
    decisions = {r["decision"].removeprefix("queued,") for r in records["kvroute"]}  # held by flow control first
    assert decisions <= {label.value for label in Label}  # why, per request
    assert {r["decision"] for r in records["envoy-round-robin"]} == {None}


def test_other_traffic_reaches_the_first_backend_beside_the_routers(tmp_path: Path):
    """`--other-traffic`: the engines serve requests no router sent, on the first backend only; the
    routers' own requests are all accounted for and their own hit rate leaves the others out."""
    limit = 60
    results = run(
        CompareOptions(
            trace=TRACE,
            limit=limit,
            out=tmp_path,
            backends=2,
            routers=("kvroute",),
            pacing=Pacing(speedup=5.0),
            max_output_tokens=4,
            sim_args=FAST_SIM,
            other_traffic_tokens=2000,
        )
    )
    row = results["routers"]["kvroute"]
    records = orjson.loads((tmp_path / "records" / "kvroute.json").read_bytes())
    own = {b: sum(1 for r in records if r["backend"] == b) for b in row["requests_per_backend"]}
    served = row["requests_per_backend"]
    assert row["ok"] == limit and results["other_traffic_tokens"] == 2000
    assert row["other_traffic"]["served"] > 0 and row["other_traffic"]["failed"] == 0
    backends = list(served)
    assert served[backends[0]] > own[backends[0]] and served[backends[1]] == own[backends[1]]


SYNTHETIC = TRACE.with_name("synthetic_trace_head.jsonl")


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


def test_real_agent_sessions_through_kvroute_and_sglang_router_with_their_losses(tmp_path: Path):
    """The real-agent configuration in small: sessions with their ids, closed loop, prompts capped.
    `bench losses` reads both routers' records as the trace's sessions: every request a turn, one
    first turn per session, and kvroute's turns placed on named backends."""
    from bench.experiments.losses import report
    from bench.workloads.trace import chains, read

    results = run(
        CompareOptions(
            trace=AGENTS,
            limit=96,
            out=tmp_path,
            capacity_ratio=0.5,
            backends=2,
            routers=("kvroute", "sglang-router-cache_aware"),
            pacing=Pacing(concurrency=8),
            max_output_tokens=2,
            max_input_tokens=4096,
            sim_args=FAST_SIM,
        )
    )
    for name, row in results["routers"].items():
        assert row["errors"] == 0, name
        assert 0 < row["hit_rate"] <= row["bound_hit_rate"], name
    losses = report(tmp_path, AGENTS, "sglang-router-cache_aware")
    sessions = len(chains(read(AGENTS, 96)))
    for name, figures in losses.items():
        assert figures["requests"] == 96, name
        firsts = sum(figures["first_turns_by_label"].values())
        assert firsts + figures["followups"] == 96, name
        assert firsts == sessions, name
    ours = losses["kvroute"]
    assert set(ours["first_turns_by_label"]) <= {label.value for label in Label}  # kvroute says why
    assert ours["returning"] + ours["moved"] == ours["followups"]  # every follow-up's backend is known
    assert sum(v["live_max"] for k, v in ours["by_backend"].items() if k != "imbalance") > 0


def test_goodput_is_the_highest_load_within_the_slo_without_errors():
    from bench.experiments.sweep import goodput

    points = {
        1.0: {"errors": 0, "ttft_p90_ms": 100.0},
        2.0: {"errors": 0, "ttft_p90_ms": 180.0},
        4.0: {"errors": 1, "ttft_p90_ms": 150.0},  # within the SLO, but it lost a request
        8.0: {"errors": 0, "ttft_p90_ms": 900.0},
    }
    assert goodput(points, 200.0) == 2.0
    assert goodput(points, 50.0) is None


def test_a_closed_loop_sweep_refuses_more_clients_than_the_trace_has_sessions():
    from bench.experiments.sweep import check_concurrencies

    check_concurrencies((16.0, 248.0), sessions=248)  # every client can hold a session
    with pytest.raises(ValueError, match="320 is more than the trace's 248 sessions"):
        check_concurrencies((16.0, 248.0, 320.0), sessions=248)


def test_sweep_runs_every_router_at_every_load(tmp_path):
    from bench.experiments.sweep import options_from, run
    from bench.workloads import skew

    trace = tmp_path / "skew.jsonl"
    skew.write(trace)  # generated here: the test needs no shared trace
    compare = CompareOptions(
        trace=trace, limit=40, out=tmp_path / "out", backends=2, capacity_ratio=0.5, max_output_tokens=4,
        sim_args=FAST_SIM, routers=("kvroute", "envoy-round-robin", "kvroute-precise"),
    )  # fmt: skip
    results = run(options_from(compare, "4,1", closed_loop=True, slo_p90_ms=10_000))
    assert results["loads"] == [1.0, 4.0] and set(results["skipped"]) == {"kvroute-precise"}
    for name in ("kvroute", "envoy-round-robin"):
        assert set(results["routers"][name]) == {"1", "4"}
        for row in results["routers"][name].values():
            assert row["ok"] == 40 and 0 <= row["hit_rate"] <= row["bound_hit_rate"]
        assert results["goodput"][name] == 4.0  # a generous SLO: the heaviest load is good
    for name in ("summary.md", "ttft_vs_load.png", "hit_rate_vs_load.png", "results.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_sglang_router_is_started_with_every_worker_registered(tmp_path: Path):
    """sglang-router serves once its first worker is registered; a run started then would send its
    first sessions to that worker alone. Here the second backend comes up 3 s after the router:
    peers.start returns only once /workers lists both as healthy."""
    ports = [free_port(), free_port()]
    sims = [spawn(dev_command("sim", "--port", str(ports[0])), tmp_path / "sim0.log")]
    late = threading.Timer(
        3.0, lambda: sims.append(spawn(dev_command("sim", "--port", str(ports[1])), tmp_path / "sim1.log"))
    )
    try:
        wait_http(f"http://127.0.0.1:{ports[0]}/health")
        backends = [f"127.0.0.1:{p}" for p in ports]
        late.start()
        router = peers.start("sglang-router-cache_aware", backends, tmp_path / "router")
        try:
            with urllib.request.urlopen(router.url + "/workers", timeout=5) as response:
                workers = orjson.loads(response.read())["workers"]
            assert {w["url"] for w in workers if w["is_healthy"]} == {f"http://{b}" for b in backends}
        finally:
            router.stop()
    finally:
        late.cancel()
        late.join()
        for process in sims:
            stop(process)


def test_a_run_s_fleet_layout_comes_from_its_routers_and_only_one_layout_per_run():
    assert peers.fleet_roles(["kvroute", "sglang-router-cache_aware"], 2) == ()  # aggregated, no connector
    assert peers.fleet_roles(["kvroute", "kvroute-pd:--pd-threshold-tokens=512"], 3) == ("prefill", "decode", "decode")
    assert peers.fleet_roles(["kvroute-pd-flex"], 2) == ("both", "both")
    with pytest.raises(ValueError, match="kvroute-pd and kvroute-pd-flex need fleets of their own"):
        peers.fleet_roles(["kvroute-pd", "kvroute-pd-flex"], 2)


def test_placement_starts_on_servers_that_list_no_adapter_and_the_next_router_finds_them_all(tmp_path: Path):
    """kvroute-placement's run begins with no server listing an adapter and loads each where its
    requests go (counted); the router after it starts on servers that list every adapter again,
    so none of its requests is refused for an unknown model."""
    from bench.workloads import adapters
    from bench.workloads.trace import read

    trace = tmp_path / "adapters.jsonl"
    adapters.main([str(trace), "--adapters", "4", "--requests", "48", "--system-blocks", "1", "--seed", "3"])
    results = run(
        CompareOptions(
            trace=trace,
            limit=48,
            out=tmp_path / "out",
            backends=2,
            routers=("kvroute-placement", "kvroute"),
            pacing=Pacing(concurrency=4),
            max_output_tokens=4,
            sim_args=FAST_SIM,
        )
    )
    placing, after = results["routers"]["kvroute-placement"], results["routers"]["kvroute"]
    assert placing["ok"] == after["ok"] == 48 and placing["errors"] == after["errors"] == 0
    assert placing["adapter_placement_loads"] >= 4  # every adapter loaded somewhere, at least once
    assert "adapter_placement_loads" not in after  # the others place nothing
    adapter_of = {r.index: r.adapter for r in read(trace, 48)}
    records = orjson.loads((tmp_path / "out" / "records" / "kvroute-placement.json").read_bytes())
    held: dict[str | None, set[str]] = {}
    for record in records:
        held.setdefault(adapter_of[record["index"]], set()).add(record["backend"])
    # one server each: the load never called for more
    assert held and all(len(servers) == 1 for servers in held.values())
