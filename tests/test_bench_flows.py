"""`kvroute-dev bench flows`: its figures from records, and a smoke run of each shape over simulated backends."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from bench.experiments import flows
from bench.harness import peers
from bench.harness.replay import Record


def _sent(flow: str, at: float, done: float, status: int = 200, ttft: float | None = 10.0) -> flows.Sent:
    record = Record(0, status, ttft, 1.0, 100, 40, "b", output_tokens=8)
    return flows.Sent("p", flow, at, done, record)


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_takes_all():
    assert flows.jain([5.0, 5.0, 5.0]) == 1.0
    assert flows.jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3, abs=1e-4)
    assert flows.jain([0.0, 0.0]) is None


def test_flow_figures_count_latency_by_sending_and_tokens_by_finishing_in_the_window():
    sent = [
        _sent("a", 1.0, 1.8, ttft=999.0),  # sent before the window: not in its latency, finished before: no tokens
        _sent("a", 4.0, 12.0, ttft=20.0),  # sent in it, finished after: latency only
        _sent("a", 1.5, 6.0, ttft=5.0),  # sent before, finished in it: tokens only
        _sent("a", 5.0, 6.0, status=429, ttft=None),
        _sent("a", 6.0, 7.0, status=0, ttft=None),
        flows.Sent("p", "a", 7.0, 12.0, Record(0, 0, None, 0.0, 0, 0, None, flows.UNFINISHED)),
    ]
    figures = flows.flow_figures(sent, (2.0, 12.0))
    assert figures["sent"] == 4
    assert figures["statuses"] == {"200": 1, "429": 1, "lost": 1, "unfinished": 1}
    assert figures["ttft_p50_ms"] == figures["ttft_p90_ms"] == 20.0
    assert figures["served_tokens_per_s"] == (100 - 40 + 8) / 10  # uncached prompt plus output


def test_backlogged_verdict_divides_by_weight():
    options = flows.FlowsOptions(shape="backlogged", out=Path(), weights=(("a", 2.0),))
    figures = {"backlogged": {"a": {"served_tokens_per_s": 200.0}, "b": {"served_tokens_per_s": 100.0}}}
    verdict = flows.verdict(options, figures)
    assert verdict["jain_weighted"] == 1.0 and verdict["shares"] == {"a": 0.667, "b": 0.333}


def test_a_router_may_name_its_own_kvroute_flags():
    assert peers.router_spec("kvroute") == ("kvroute", ())
    assert peers.router_spec("kvroute:--max-backend-requests=4,--saturation-waiting=2") == (
        "kvroute",
        ("--max-backend-requests=4", "--saturation-waiting=2"),
    )
    assert peers.parse_routers("kvroute:--a=1,--b=2,sglang-router-cache_aware, kvroute") == (
        "kvroute:--a=1,--b=2",
        "sglang-router-cache_aware",
        "kvroute",
    )


def test_the_flags_parse_flows_and_weights():
    assert flows.parse_counts("a:18, b:6") == (("a", 18), ("b", 6))
    assert flows.parse_weights("a=2,b=0.5") == (("a", 2.0), ("b", 0.5))
    assert flows.kvroute_args(flows.FlowsOptions("backlogged", Path(), weights=(("a", 2.0),)))[-2:] == (
        "--flow-weights",
        "a=2",
    )


def _smoke(tmp_path: Path, shape: str, routers: tuple[str, ...]) -> flows.FlowsOptions:
    """A short run of a shape over simulated backends."""
    return flows.FlowsOptions(
        shape=shape,
        out=tmp_path,
        routers=routers,
        prompt_tokens=256,
        output_tokens=4,
        phase_s=3.0,
        warmup_s=1.0,
        steady_rate=4.0,
        flood_clients=8,
        flows=(("a", 6), ("b", 2)),
        sim_args=("--max-num-seqs", "2", "--step-s", "0.002"),
    )


@pytest.mark.bench
@pytest.mark.envoy
@pytest.mark.parametrize("shape", flows.SHAPES)
def test_every_shape_runs_and_answers_every_request(tmp_path: Path, shape: str):
    options = _smoke(tmp_path, shape, ("kvroute", "kvroute-no-flow-control"))
    results = flows.run(options)
    assert set(results["routers"]) == {"kvroute", "kvroute-no-flow-control"}
    for name, row in results["routers"].items():
        assert row["exited"] == [], name
        for phase in flows.phases(options):
            for load in phase.loads:
                figures = row["phases"][phase.name][load.flow]
                assert figures["sent"] > 0, (name, phase.name, load.flow)
                # answered, never lost: a 200, a 429 from flow control, or still running when the phase ended
                assert set(figures["statuses"]) <= {"200", "429", "unfinished"}, (name, phase.name, figures)
                assert figures["served_tokens_per_s"] > 0, (name, phase.name, load.flow)
            used = row["cpu"][phase.name]  # the router's CPU over the phase, Envoy's and the ext_proc's apart
            assert used["router_cpu_s"] > 0 and set(used["by_process_s"]) == {"envoy", "extproc"}, used
            assert 0 < sum(used["by_process_s"].values()) <= used["router_cpu_s"] + 0.05 and used["per_request_ms"] > 0
            assert used["engines_cpu_s"] > 0 and used["engine_preemptions_per_s"] >= 0, used  # the simulator's
    saved = orjson.loads((tmp_path / "results.json").read_bytes())
    assert saved["shape"] == shape and (tmp_path / "summary.md").read_text().count("| kvroute") >= 2
    lines = (tmp_path / "records.jsonl").read_bytes().splitlines()
    assert {orjson.loads(line)["router"] for line in lines} == set(results["routers"])


@pytest.mark.bench
def test_with_no_router_the_clients_send_to_the_backends_in_turn(tmp_path: Path):
    """The proxy-less baseline: no router process, every backend served about as often."""
    results = flows.run(_smoke(tmp_path, "priority", (flows.NO_ROUTER,)))
    row = results["routers"][flows.NO_ROUTER]
    assert row["exited"] == [] and row["cpu"]["overload"]["router_cpu_s"] == 0
    records = [orjson.loads(line) for line in (tmp_path / "records.jsonl").read_bytes().splitlines()]
    served = Counter(record["backend"] for record in records if record["status"] == 200)
    assert len(served) == 2 and None not in served, served
    assert min(served.values()) >= 0.4 * sum(served.values()), served


def test_a_stacks_envoy_waits_longer_than_its_ext_proc_holds_requests(tmp_path: Path):
    from bench.harness.stack import Stack
    from extproc.core.placement import ADAPTER_WAIT_S
    from extproc.envoy.bootstrap import MESSAGE_TIMEOUT_MS, message_timeout_ms

    assert message_timeout_ms(Stack(tmp_path).routing()) == MESSAGE_TIMEOUT_MS
    assert Stack(tmp_path, extproc_args=("--queue-ttl-s=600",)).routing().queue_ttl_s == 600
    held = Stack(
        tmp_path, extproc_args=("--flow-control", "true", "--queue-ttl-s", "90", "--pd-prefill-timeout-s", "7")
    )
    assert message_timeout_ms(held.routing()) == (90 + ADAPTER_WAIT_S + 7 + 5) * 1000
