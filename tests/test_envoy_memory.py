"""Envoy's own memory: with its container's memory limit known (the chart passes it to `kvroute
envoy-config`), Envoy watches its heap against a share of it and, near that, answers new requests
503 at once instead of buffering their bodies (up to 32 MiB each) until it is OOM-killed with every
stream in flight. A real Envoy, a simulated backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.experiments.latency import FAST_SIM
from bench.harness.stack import Stack
from extproc.envoy.bootstrap import HEAP_SHARE, REFUSE_AT, SHRINK_AT, EnvoyLayout, bootstrap
from tests.e2e import envoy_stat, eventually, post

REFUSING = "overload.envoy.overload_actions.stop_accepting_requests.active"
REQUEST = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


def test_the_heap_is_watched_against_a_share_of_the_limit_only_when_the_limit_is_known():
    watched = bootstrap(EnvoyLayout(memory_limit_bytes=1 << 30))["overload_manager"]
    heap = watched["resource_monitors"][1]
    assert heap["name"] == "envoy.resource_monitors.fixed_heap"
    assert heap["typed_config"]["max_heap_size_bytes"] == int((1 << 30) * HEAP_SHARE)
    assert {a["name"]: a["triggers"][0]["threshold"]["value"] for a in watched["actions"]} == {
        "envoy.overload_actions.shrink_heap": SHRINK_AT,
        "envoy.overload_actions.stop_accepting_requests": REFUSE_AT,
    }
    unknown = bootstrap(EnvoyLayout())["overload_manager"]
    assert [m["name"] for m in unknown["resource_monitors"]] == [
        "envoy.resource_monitors.global_downstream_max_connections"
    ] and "actions" not in unknown


@pytest.mark.envoy
def test_envoy_past_its_share_of_the_limit_refuses_new_requests_and_below_it_serves(tmp_path: Path):
    """A 2 MiB limit is far below what Envoy's heap holds at start (some 6 MiB), so it is past
    its share at once; with 1 GiB the same request is served."""
    with Stack(
        tmp_path / "tight", sims=1, sim_args=FAST_SIM, ext_proc=False, envoy_memory_limit_bytes=2 << 20
    ) as tight:
        eventually(lambda: envoy_stat(tight, REFUSING) == 1, message="Envoy refusing")
        status, _, body = post(tight.url, REQUEST)
        assert status == 503 and b"overloaded" in body
    with Stack(
        tmp_path / "roomy", sims=1, sim_args=FAST_SIM, ext_proc=False, envoy_memory_limit_bytes=1 << 30
    ) as roomy:
        status, _, _ = post(roomy.url, REQUEST)
        assert status == 200 and envoy_stat(roomy, REFUSING) == 0
