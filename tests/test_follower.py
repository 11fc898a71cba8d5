"""The ext_proc follows a KVRoutingPolicy: fed real watch-event objects, and through its
list/watch loop against a stand-in for the Kubernetes API (no API server runs here)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

import orjson
import pytest
from aiohttp import web
from kubernetes_asyncio import client

from controller import logic
from extproc.core.backends import Backend
from extproc.core.policy import routing_changes
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.kube import watching
from extproc.kube.follower import PolicyFollower, backends_from_status
from extproc.runtime.pool import BackendPool
from tests.k8s_objects import pod, policy

BASE = Settings(hash_key=b"k" * 16)


def published(*pods: dict[str, Any], generation: int = 1, **spec: Any) -> dict[str, Any]:
    """A policy as the API returns it after the operator wrote its status."""
    body = policy(generation=generation, **spec)
    body["metadata"]["resourceVersion"] = str(generation)
    body["status"] = logic.desired_status(body, [logic.pod_summary(p) for p in pods], "2026-11-29T10:00:00Z")
    return body


def make() -> tuple[Router, BackendPool, PolicyFollower]:
    router = Router(BASE)
    pool = BackendPool([], router.remove_backend, unhealthy_after=1)
    return router, pool, PolicyFollower("llm", "default", BASE, router, pool)


def test_status_backends_become_the_pool():
    _router, pool, follower = make()
    follower.apply("ADDED", published(pod("a", "10.1.0.1"), pod("b", "10.1.0.2", ready=False)))
    assert [b.address for b in pool.backends] == ["10.1.0.1:8000"]
    follower.apply("MODIFIED", published(pod("a", "10.1.0.1"), pod("b", "10.1.0.2"), generation=2))
    assert [b.address for b in pool.backends] == ["10.1.0.1:8000", "10.1.0.2:8000"]
    assert follower.state.generation == 2


def test_a_backend_that_leaves_is_dropped_at_once():
    router, pool, follower = make()
    follower.apply("ADDED", published(pod("a", "10.1.0.1"), pod("b", "10.1.0.2")))
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]})
    decision = router.begin(request, pool.backends, 0).decision
    router.learn(request, decision.backend, 0)
    follower.apply(
        "MODIFIED",
        published(
            *(
                p
                for p in (pod("a", "10.1.0.1"), pod("b", "10.1.0.2"))
                if p["status"]["podIP"] != decision.backend.split(":")[0]
            )
        ),
    )
    assert router.state().index_entries == 0
    assert decision.backend not in router.loads.snapshot()
    assert decision.backend not in [b.address for b in pool.backends]


def test_settings_change_live_and_the_key_never_comes_from_the_policy():
    router, _pool, follower = make()
    routing = {"blockSize": 256, "locationTTLSeconds": 30, "capacityBlocks": "auto", "sessionHeaders": ["X-Conv"]}
    follower.apply("ADDED", published(pod("a"), routing=routing))
    assert router.settings.block_size == 256 and router.settings.location_ttl_s == 30
    assert router.settings.capacity_auto is True and router.settings.session_headers == ("x-conv",)
    assert router.settings.hash_key == BASE.hash_key
    follower.apply("MODIFIED", published(pod("a"), routing={"capacityBlocks": 500}, generation=2))
    assert router.settings.capacity_blocks == 500 and router.settings.capacity_auto is False
    assert router.settings.block_size == BASE.block_size


def test_invalid_routing_keeps_the_last_settings_and_still_follows_the_backends():
    """The API server takes values the settings refuse (the CRD cannot say every bound): the
    settings stay as they were, said in /readyz until a good spec comes, and the backends still
    follow the status, or a rolling update of the fleet would leave kvroute routing to none."""
    router, pool, follower = make()
    follower.apply("ADDED", published(pod("a")))
    follower.apply("MODIFIED", published(pod("a"), pod("b", "10.1.0.2"), routing={"blockSize": 12}, generation=2))
    assert router.settings == BASE and len(pool.backends) == 2
    assert "block_size" in follower.state.problems[0] and follower.state.last_error is None
    follower.apply("MODIFIED", published(pod("b", "10.1.0.2"), routing={"blockSize": 256}, generation=3))
    assert router.settings.block_size == 256 and len(pool.backends) == 1 and follower.state.problems == []


def test_a_backend_entry_this_process_cannot_use_leaves_out_only_itself():
    status = {
        "backends": [{"ip": "10.1.0.1", "port": 70000, "ready": True}, {"ip": "10.1.0.2", "port": 8000, "ready": True}]
    }
    backends, refused = backends_from_status(status)
    assert [b.address for b in backends] == ["10.1.0.2:8000"] and refused[0].startswith("10.1.0.1:70000")
    _, pool, follower = make()
    body = published(pod("a"))
    body["status"] = status
    follower.apply("ADDED", body)
    assert [b.address for b in pool.backends] == ["10.1.0.2:8000"] and "70000" in follower.state.problems[0]


def test_unknown_routing_fields_are_reported_and_the_known_ones_applied():
    router, _, follower = make()
    follower.apply("ADDED", published(pod("a"), routing={"blocksize": 256, "prefixStickRatio": 0.7}))
    assert follower.state.unknown_fields == ["blocksize"]
    assert router.settings.prefix_stick_ratio == 0.7 and router.settings.block_size == BASE.block_size


def test_deleted_policy_leaves_nothing_to_route_to_and_says_so():
    """Nothing of the deleted policy stays: its pool, its refusals and ignored fields (/readyz
    went on showing them, and never said the policy was gone)."""
    _, pool, follower = make()
    policy = published(pod("a"), routing={"blockSize": 7, "noSuchField": 1})
    policy["spec"]["poolRef"] = {"name": "pool-a"}
    follower.apply("ADDED", policy)
    assert follower.pool == "pool-a" and follower.state.problems
    follower.apply("DELETED", policy)
    assert pool.backends == () and follower.pool is None and follower.state.unknown_fields == []
    assert follower.state.problems == [
        "the policy does not exist (deleted or not yet created): no backends to route to"
    ]
    follower.apply("ADDED", published(pod("a")))
    assert follower.state.problems == [] and len(pool.backends) == 1


def test_ipv6_and_models():
    assert backends_from_status(
        {"backends": [{"pod": "a", "ip": "fd00::5", "port": 8000, "ready": True, "models": ["llama"]}]}
    ) == ([Backend("[fd00::5]:8000", frozenset({"llama"}))], [])
    assert routing_changes(None) == ({}, [])


class FakeApi:
    """Serves list and watch of one namespace's KVRoutingPolicies, as the API server does."""

    def __init__(self, initial: dict[str, Any]) -> None:
        self.items = [initial]
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.lists = 0
        self.answering = asyncio.Event()  # cleared: a list is accepted and not answered until set
        self.answering.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.query.get("fieldSelector") == "metadata.name=default"
        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists += 1
            await self.answering.wait()
            return web.json_response(
                {
                    "kind": "KVRoutingPolicyList",
                    "apiVersion": "kvroute.io/v1alpha1",
                    "metadata": {"resourceVersion": "1"},
                    "items": self.items,
                }
            )
        response = web.StreamResponse()
        await response.prepare(request)
        while True:
            event = await self.events.get()
            if event.get("close"):
                return response
            await response.write(orjson.dumps(event) + b"\n")


@pytest.mark.parametrize("scenario", ["watch", "api_down", "list_hangs"])
def test_list_watch_loop(scenario, monkeypatch):
    """`list_hangs`: a list accepted and never answered (a half-open connection looks the same)
    times out and says so, where it held the follower for good, reported as connected."""
    monkeypatch.setattr(watching, "RETRY_S", 0.1)
    monkeypatch.setattr(watching, "CALL_TIMEOUT", (1.0, 0.5))

    async def main() -> None:
        _router, pool, follower = make()
        api = FakeApi(published(pod("a", "10.1.0.1")))
        app = web.Application()
        app.router.add_get("/apis/kvroute.io/v1alpha1/namespaces/llm/kvroutingpolicies", api.handle)
        runner = web.AppRunner(app, shutdown_timeout=1.0)  # an open watch must not hold the shutdown
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
        task = asyncio.create_task(follower.run(configuration))

        async def until(check) -> None:
            for _ in range(200):
                if check():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("not reached")

        try:
            await until(lambda: follower.state.connected and len(pool.backends) == 1)
            if scenario == "watch":
                await api.events.put(
                    {"type": "MODIFIED", "object": published(pod("a", "10.1.0.1"), pod("b", "10.1.0.2"), generation=2)}
                )
                await until(lambda: len(pool.backends) == 2)
                api.items = [published(pod("c", "10.1.0.3"), generation=3)]
                await api.events.put({"close": True})  # the watch ends: the follower lists again
                await until(lambda: [b.address for b in pool.backends] == ["10.1.0.3:8000"])
            elif scenario == "list_hangs":
                api.answering.clear()
                await api.events.put({"close": True})  # the watch ends; the next list is never answered
                await until(lambda: not follower.state.connected)
                assert api.lists == 2 and "TimeoutError" in (follower.state.last_error or "")
                assert [b.address for b in pool.backends] == ["10.1.0.1:8000"]  # the last known set
                api.items = [published(pod("b", "10.1.0.2"), generation=2)]
                api.answering.set()  # the API server answers again: the follower lists and follows
                await until(lambda: follower.state.connected and pool.backends[0].address == "10.1.0.2:8000")
            else:
                known = copy.deepcopy(pool.backends)
                await runner.cleanup()  # the API server goes away
                await api.events.put({"close": True})
                await until(lambda: not follower.state.connected)
                assert pool.backends == known  # still routing with the last known set
                assert follower.state.last_error
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            api.answering.set()
            await api.events.put({"close": True})  # end any open watch so the server can stop
            await runner.cleanup()

    asyncio.run(main())


def test_readyz_and_metrics_report_a_lost_watch():
    from aiohttp.test_utils import TestClient, TestServer

    from extproc.admin.app import Admin
    from extproc.runtime.metrics import Metrics

    async def main() -> None:
        router, pool, follower = make()
        follower.apply("ADDED", published(pod("a", "10.1.0.1")))
        follower.state.last_error = "ClientConnectorError: API server unreachable"
        admin = Admin(router, pool, Metrics(router, pool, follower.state), follower.state)
        admin.serving = True
        control = TestClient(TestServer(admin.control_app("t")), headers={"authorization": "Bearer t"})
        async with TestClient(TestServer(admin.monitoring_app())) as http, control:
            ready = await http.get("/readyz")
            body = await ready.json()
            assert ready.status == 200 and "last known backends" in body["warnings"][0]
            text = await (await http.get("/metrics")).text()
            assert "kvroute_policy_connected 0.0" in text
            state = await (await control.get("/debug/state")).json()
            assert state["policy"]["connected"] is False and state["policy"]["name"] == "llm/default"

    asyncio.run(main())


def test_failures_back_off_and_a_quick_watch_end_waits_before_listing_again():
    """An outage is not met by every policy of every replica listing every RETRY_S, and a proxy
    that ends each watch at once does not make the follower list in a loop."""
    backoff = watching.Backoff()
    waits = [backoff.failed() for _ in range(6)]
    assert 0.8 * watching.RETRY_S <= waits[0] <= 1.2 * watching.RETRY_S
    assert waits[1] > waits[0] and 0.8 * watching.RETRY_MAX_S <= waits[-1] <= 1.2 * watching.RETRY_MAX_S
    backoff.listed()
    assert backoff.failed() <= 1.2 * watching.RETRY_S
    assert backoff.after_watch(0.0) == watching.RETRY_S and backoff.after_watch(watching.WATCH_S) == 0.0
