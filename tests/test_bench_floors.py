"""`kvroute-dev bench floors`: each constant-answer router really steers Envoy over its transport
(a router naming one backend gets every request there, so a transport Envoy ignored would show as
round robin), and every case is measured through every stack (a smoke run: no timing asserted)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.experiments import floors
from bench.experiments.latency import FAST_SIM, followups, send_all
from bench.harness.fleets import counter
from bench.harness.stack import Stack

pytestmark = [pytest.mark.envoy, pytest.mark.bench]

CONSTANT = [t for t in floors.TRANSPORTS if t != "none" and not t.startswith("kvroute")]


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory):
    with Stack(tmp_path_factory.mktemp("sims"), sims=3, sim_args=FAST_SIM, ext_proc=False) as plain:
        yield list(plain.backends)


def _served(backend: str) -> float:
    return counter(backend, "vllm:request_success_total")


@pytest.mark.parametrize("transport", CONSTANT)
def test_a_constant_router_steers_every_request_where_it_says(transport: str, backends, tmp_path: Path):
    chosen = backends[1]
    stack = floors.ConstantStack(
        tmp_path, backends=backends, envoy_edit=floors.envoy_edit(transport), constant=transport, answers=[chosen]
    )
    before = {b: _served(b) for b in backends}
    with stack:
        asyncio.run(send_all(stack.url, followups(8_000, 12), 4))  # raises on any status but 200
    served = {b: _served(b) - before[b] for b in backends}
    assert served == {b: 12.0 if b == chosen else 0.0 for b in backends}


def test_an_ext_proc_sent_only_the_body_cannot_steer(backends, tmp_path: Path):
    """Why the floors have no one-message ext_proc: with the request headers skipped, Envoy's
    router has picked a host before the body's reply names one (round robin here, Envoy 1.40)."""
    chosen = backends[1]
    stack = floors.ConstantStack(
        tmp_path,
        backends=backends,
        envoy_edit=floors.envoy_edit("ext_proc_body"),
        constant="ext_proc_body",
        answers=[chosen],
    )
    before = {b: _served(b) for b in backends}
    with stack:
        asyncio.run(send_all(stack.url, followups(8_000, 12), 1))
    served = {b: _served(b) - before[b] for b in backends}
    assert served == {b: 4.0 for b in backends}


def test_every_case_is_measured_through_every_stack(tmp_path: Path):
    rows = floors.measure(4, tmp_path)
    assert [(r["body_bytes"] > 80_000, r["concurrency"], r["transport"]) for r in rows] == [
        (size > 80_000, concurrency, transport) for size, concurrency in floors.CASES for transport in floors.TRANSPORTS
    ]
    for row in rows:
        assert row["rps"] > 0 and row["envoy_cpu_us"] >= 0  # 10 ms ticks: a handful of requests may read 0
        assert (row["router_cpu_us"] is None) == (row["transport"] == "none")
