"""Three ext_proc replicas behind a real Envoy (which spreads its ext_proc streams over them round
robin), sharing one picture through a real Redis, in front of simulated vLLM backends."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from bench.harness.stack import Stack
from bench.harness.store import PASSWORD, RedisServer
from bench.workload import text
from tests.e2e import eventually, get, metric, post

pytestmark = pytest.mark.envoy

RNG = random.Random(11)
SYSTEM = text(RNG, 6000)
REPLICAS = 3


def sharing(tmp_path, redis_server, **layout: str) -> Stack:
    """Three replicas sharing through the test's Redis, in front of four simulated backends."""
    return Stack(
        tmp_path / "stack",
        sims=4,
        extproc_replicas=REPLICAS,
        replica_store=redis_server.url,
        replica_store_password=PASSWORD,
        **layout,
    )


@pytest.fixture
def stack(tmp_path, redis_server):
    with sharing(tmp_path, redis_server) as running:
        eventually(lambda: all(connected(running, r) for r in range(REPLICAS)), message="replicas share")
        yield running


def connected(stack: Stack, replica: int) -> bool:
    return stack.debug_state(replica)["replicas"]["connected"]


def chat(messages: list[dict]) -> dict:
    return {"model": "sim-model", "messages": messages, "max_tokens": 8}


def decisions(stack: Stack, replica: int) -> float:
    return sum(
        metric(f"http://127.0.0.1:{stack.admin_ports[replica]}", f'kvroute_decisions_total{{decision="{label}"}}')
        for label in ("session_match", "prefix_match", "least_loaded", "load_override")
    )


def everywhere(stack: Stack, check: Callable[[dict], bool], message: str) -> None:
    eventually(lambda: all(check(stack.debug_state(r)) for r in range(REPLICAS)), message=message)


def test_conversation_and_shared_prefix_across_replicas(stack: Stack):
    history = [{"role": "system", "content": SYSTEM}]
    served, labels = set(), []
    for turn in range(6):
        history.append({"role": "user", "content": f"turn {turn}: " + text(RNG, 400)})
        status, headers, body = post(stack.url, chat(history), {"x-session-id": "conv"})
        assert status == 200
        served.add(headers["x-kvroute-backend"])
        labels.append(headers["x-kvroute-decision"])
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        everywhere(stack, lambda state: state["sessions"] == 1, "every replica knows the session")
    assert len(served) == 1 and labels[1:] == ["session_match"] * 5
    assert sum(decisions(stack, r) > 0 for r in range(REPLICAS)) >= 2  # turns were decided by several replicas
    # Another conversation with the same long system prompt, whichever replica decides it.
    for question in range(REPLICAS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"new {question}"}]
        status, headers, _ = post(stack.url, chat(messages))
        assert status == 200
        assert (headers["x-kvroute-decision"], headers["x-kvroute-backend"]) == ("prefix_match", served.pop())
        served.add(headers["x-kvroute-backend"])


def load(stack: Stack, requests: int, during: Callable[[], None]) -> list[int]:
    """`requests` single-turn requests from 8 clients, calling `during` once a quarter have been sent."""

    def one(i: int) -> int:
        if i == requests // 4:
            during()
        messages = [{"role": "system", "content": SYSTEM[: 2000 + 40 * (i % 20)]}, {"role": "user", "content": str(i)}]
        return post(stack.url, chat(messages), {"x-session-id": f"load-{i % 16}"})[0]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(requests)))


def test_killing_a_replica_or_the_store_under_load_loses_no_request(stack: Stack, redis_server: RedisServer):
    statuses = load(stack, 120, lambda: stack.stop_process("extproc2", signal.SIGKILL))
    assert statuses == [200] * 120
    statuses = load(stack, 120, redis_server.stop)
    assert statuses == [200] * 120
    for replica in range(2):
        assert not connected(stack, replica)
        ready = get(f"http://127.0.0.1:{stack.admin_ports[replica]}", "/readyz")
        assert ready[0] == 200 and any("replica store" in w for w in orjson.loads(ready[2])["warnings"])
    redis_server.start()
    eventually(lambda: all(connected(stack, r) for r in range(2)), timeout_s=30, message="replicas reconnect")
    statuses = load(stack, 60, lambda: None)
    assert statuses == [200] * 60
    # Every reservation, own and seen from siblings, returns to zero when the load ends.
    idle = lambda state: all(  # noqa: E731
        (b["reserved_blocks"], b["active"], b["footprint_blocks"]) == (0, 0, 0)
        and (b["peer_reserved_blocks"], b["peer_active"], b["peer_footprint_blocks"]) == (0, 0, 0)
        for b in state["load"].values()
    )
    eventually(lambda: all(idle(stack.debug_state(r)) for r in range(2)), message="reservations back to zero")


@pytest.mark.slow
def test_the_ext_authz_transport_ends_each_request_on_the_replica_that_decided_it(tmp_path, redis_server):
    """The faster transport with replicas: Envoy asks the check calls round robin, but streams its
    access log to whichever replica that stream reached; an entry for a sibling's request goes to
    it through the store. Every request is routed, and once all have ended no replica holds any
    load or open exchange, and entries were forwarded."""
    with sharing(tmp_path, redis_server, transport="ext_authz") as stack:
        eventually(lambda: all(connected(stack, r) for r in range(REPLICAS)), message="replicas share")
        for i in range(12):
            status, headers, _ = post(stack.url, chat([{"role": "user", "content": f"question {i}"}]))
            assert status == 200 and headers.get("x-kvroute-decision"), headers
        assert all(decisions(stack, r) >= 1 for r in range(REPLICAS))  # each replica decided some

        def settled(state: dict) -> bool:
            idle = all(load["active"] == 0 and load["reserved_blocks"] == 0 for load in state["load"].values())
            return idle and state["authz"]["open_exchanges"] == 0

        everywhere(stack, settled, "every request ended on the replica that decided it")
        forwarded = sum(stack.debug_state(r)["authz"]["forwarded_ends"] for r in range(REPLICAS))
        assert forwarded >= 1
        unknown = 'kvroute_errors_total{kind="unknown_exchange"}'
        assert sum(metric(f"http://127.0.0.1:{stack.admin_ports[r]}", unknown) for r in range(REPLICAS)) == 0
