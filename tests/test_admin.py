"""The admin port: probes, metrics, state, and query/notify for other gateways."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from extproc.admin.app import Admin
from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
TOKEN = "control-token-for-tests"
BODY = {"model": "m", "messages": [{"role": "system", "content": "s" * 4000}, {"role": "user", "content": "q"}]}


def run(scenario: Callable[[TestClient, Admin, Router], Awaitable[None]]) -> None:
    async def main() -> None:
        router = Router(Settings(hash_key=b"k" * 16, decision_headers=True))
        pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=1)
        admin = Admin(router, pool, Metrics(router, pool), clock=lambda: 5.0)
        control = TestClient(TestServer(admin.control_app(TOKEN)), headers={"authorization": f"Bearer {TOKEN}"})
        async with control as client, TestClient(TestServer(admin.monitoring_app())) as monitoring:
            client.monitoring = monitoring
            await scenario(client, admin, router)

    asyncio.run(main())


async def _json(response: Any) -> Any:
    return orjson.loads(await response.read())


async def _post(client: TestClient, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
    response = await client.post(path, data=orjson.dumps(payload))
    return response.status, await _json(response)


def test_a_lease_reserves_learns_and_releases_exactly_once():
    async def scenario(client: TestClient, _admin: Admin, router: Router) -> None:
        status, first = await _post(client, "/v1/query", {"body": BODY})
        assert status == 200 and first["decision"] == "least_loaded" and first["total_blocks"] == 7
        chosen, lease = first["backend"], first["lease"]
        assert router.loads.snapshot()[chosen] == (7, 1)  # the query reserved its prefill and a slot
        status, notified = await _post(client, "/v1/notify", {"lease": lease, "backend": chosen, "status": 200})
        assert status == 200 and notified["learned"] is True
        assert notified["headers"]["x-kvroute-prefix"] == "0/7"
        assert router.loads.snapshot()[chosen] == (0, 1)  # prefill done, still in flight
        assert (await _post(client, "/v1/release", {"lease": lease}))[0] == 200
        assert router.loads.snapshot()[chosen] == (0, 0)
        assert (await _post(client, "/v1/release", {"lease": lease}))[0] == 404  # exactly once
        _, again = await _post(client, "/v1/query", {"body": orjson.dumps(BODY).decode(), "dry_run": True})
        assert (again["decision"], again["backend"], again["matched_blocks"]) == ("prefix_match", chosen, 7)
        assert "lease" not in again and router.loads.snapshot()[chosen] == (0, 0)
        assert sum(router.stats.decisions.values()) == 1  # the dry run is not a decision

    run(scenario)


def test_failed_responses_teach_nothing_and_unclaimed_leases_expire():
    async def scenario(client: TestClient, admin: Admin, router: Router) -> None:
        _, first = await _post(client, "/v1/query", {"body": BODY})
        _, notified = await _post(
            client, "/v1/notify", {"lease": first["lease"], "backend": first["backend"], "status": 503}
        )
        assert notified["learned"] is False and router.state().index_entries == 0
        _, second = await _post(client, "/v1/query", {"body": BODY})
        assert len(admin.leases) == 2
        assert admin.leases.expire(5.0 + 301) == 2  # past lease_ttl_s: the gateway never came back
        assert all(load == (0, 0) for load in router.loads.snapshot().values())
        assert (await _post(client, "/v1/notify", {"lease": second["lease"], "backend": A}))[0] == 404

    run(scenario)


def test_session_header_in_query_is_honoured():
    async def scenario(client: TestClient, _admin: Admin, _router: Router) -> None:
        payload = {"body": BODY, "headers": {"X-Session-Id": "s1"}, "backend": A}
        assert (await _post(client, "/v1/notify", payload))[1]["learned_blocks"] == 7  # no lease: learn directly
        other = {**BODY, "messages": [{"role": "user", "content": "different"}]}
        decided = await _json(
            await client.post("/v1/query", data=orjson.dumps({"body": other, "headers": {"x-session-id": "s1"}}))
        )
        assert (decided["decision"], decided["backend"]) == ("session_match", A)

    run(scenario)


def test_bad_requests_and_unknown_backends_are_400(monkeypatch):
    from extproc.core import request

    monkeypatch.setattr(request, "MAX_JSON_CONTAINERS", 1000)
    body = {"model": "m", "messages": [{"role": "user", "content": [[]] * 1500}]}
    nested, as_text = orjson.dumps({"body": body}), orjson.dumps({"body": orjson.dumps(body).decode()})

    async def scenario(client: TestClient, _admin: Admin, _router: Router) -> None:
        for data in (b"not json", b"[]", orjson.dumps({"nobody": 1}), orjson.dumps({"body": {"messages": 3}})):
            assert (await client.post("/v1/query", data=data)).status == 400
        for data in (nested, as_text):  # too many arrays to decode: refused before, envelope or body
            response = await client.post("/v1/query", data=data)
            assert response.status == 400 and "arrays and objects" in await response.text()
        unknown = await client.post("/v1/notify", data=orjson.dumps({"body": BODY, "backend": "203.0.113.1:80"}))
        assert unknown.status == 400
        lease = (await _post(client, "/v1/query", {"body": BODY}))[1]["lease"]
        for status in (True, 0, 1000, "200"):  # not a status code (a bool passed as 1 before)
            assert (await _post(client, "/v1/notify", {"lease": lease, "backend": A, "status": status}))[0] == 400
        for release in ({}, {"lease": None}, {"lease": 7}):  # no lease named: 400, not "no such lease"
            assert (await _post(client, "/v1/release", release))[0] == 400
        assert (await _post(client, "/v1/release", {"lease": lease}))[0] == 200
        metrics = (await (await client.monitoring.get("/metrics")).read()).decode()
        assert 'kvroute_errors_total{kind="invalid_request"} 13.0' in metrics

    run(scenario)


def test_probes_state_and_metrics():
    async def scenario(client: TestClient, admin: Admin, router: Router) -> None:
        monitoring = client.monitoring
        assert (await monitoring.get("/healthz")).status == 200
        assert (await monitoring.get("/readyz")).status == 503  # gRPC not serving yet
        admin.serving = True
        assert (await monitoring.get("/readyz")).status == 200
        router.loads.reserve(A, 3)
        state = await _json(await client.get("/debug/state"))
        own = {"reserved_blocks": 3, "active": 1, "peer_reserved_blocks": 0, "peer_active": 0}
        own |= {"footprint_blocks": 0, "peer_footprint_blocks": 0}
        assert state["load"] == {A: {**own, "engine_requests": 0, "engine_kv_usage": 0.0}}
        assert "hash_key" not in state["settings"] and state["settings"]["block_size"] == 512
        metrics = (await (await monitoring.get("/metrics")).read()).decode()
        assert f'kvroute_backend_reserved_blocks{{backend="{A}"}} 3.0' in metrics
        assert f'kvroute_backend_healthy{{backend="{B}"}} 1.0' in metrics
        assert f'kvroute_backend_prediction_trust{{backend="{A}"}} 1.0' in metrics
        router.trust.values[A] = 0.25  # as learned from A's engine (tests/test_trust.py)
        metrics = (await (await monitoring.get("/metrics")).read()).decode()
        assert f'kvroute_backend_prediction_trust{{backend="{A}"}} 0.25' in metrics
        assert (await _json(await client.get("/debug/state")))["prediction_trust"] == {A: 0.25}
        assert "kvroute_balance_gate_factor 1.0" in metrics and "kvroute_prefix_homes 0.0" in metrics
        for _ in range(100):
            router.pressure.returned(100, 50)  # conversations find half their context evicted
        router.homes.place(7, A)
        metrics = (await (await monitoring.get("/metrics")).read()).decode()
        assert "kvroute_cache_pressure 0.49" in metrics and "kvroute_balance_gate_factor 16.0" in metrics
        assert "kvroute_prefix_homes 1.0" in metrics
        state = await _json(await client.get("/debug/state"))
        assert state["prefix_homes"] == 1 and state["gate_factor"] == 16.0

    run(scenario)


def test_the_control_port_needs_the_token_and_the_monitoring_port_controls_nothing():
    async def scenario(client: TestClient, _admin: Admin, router: Router) -> None:
        payload = orjson.dumps({"body": BODY})
        refused = ("", "Bearer wrong", TOKEN, f"Basic {TOKEN}", f"Bearer{TOKEN}", f"Bearer  {TOKEN}")
        for headers in ({"authorization": value} for value in refused):
            response = await client.post("/v1/query", data=payload, headers=headers)
            assert response.status == 401
            assert (await client.get("/debug/state", headers=headers)).status == 401
        assert router.stats.decisions[Label.LEAST_LOADED] == 0 and router.loads.snapshot() == {}
        for path in ("/v1/query", "/v1/notify", "/v1/release"):
            assert (await client.monitoring.post(path, data=payload)).status in (404, 405)
        assert (await client.monitoring.get("/debug/state")).status == 404
        # a token that is not UTF-8, sent as raw bytes: a counted 401 like any other, not a 500
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"GET /debug/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 401")
        writer.close()
        metrics = (await (await client.monitoring.get("/metrics")).read()).decode()
        assert 'kvroute_errors_total{kind="unauthorized"} 13.0' in metrics
        for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive (RFC 9110)
            assert (await client.get("/debug/state", headers={"authorization": f"{scheme} {TOKEN}"})).status == 200

    run(scenario)


def test_locations_dropped_for_the_memory_bound_are_counted():
    async def scenario(client: TestClient, admin: Admin, router: Router) -> None:
        router.reconfigure(replace(router.settings, index_memory_mib=0.005))  # a few locations
        for turn in range(8):
            body = {**BODY, "messages": [*BODY["messages"], {"role": "user", "content": f"{turn}" * 3000}]}
            router.learn(parse_request(orjson.dumps(body)), (A, B)[turn % 2], float(turn))
        state = router.state()
        assert state.index_shed > 0 and router.index.memory_bytes() <= 0.005 * 2**20
        metrics = (await (await client.monitoring.get("/metrics")).read()).decode()
        assert f"kvroute_index_shed_total {float(state.index_shed)}" in metrics

    run(scenario)


def test_metrics_are_written_out_off_the_event_loop(monkeypatch):
    """The samples are read on the loop, their text written in a worker thread (at 1,000 backends
    writing it held the loop about 10 ms a scrape)."""
    from extproc.admin import app

    writers: list[bool] = []

    def written(registry: Any) -> bytes:
        writers.append(threading.current_thread() is threading.main_thread())
        return generate_latest(registry)

    monkeypatch.setattr(app, "generate_latest", written)

    async def scenario(client: TestClient, _admin: Admin, router: Router) -> None:
        router.loads.reserve(A, 3)
        metrics = (await (await client.monitoring.get("/metrics")).read()).decode()
        assert f'kvroute_backend_reserved_blocks{{backend="{A}"}} 3.0' in metrics

    run(scenario)
    assert writers == [False]


def test_a_large_query_is_parsed_off_the_event_loop(monkeypatch):
    """A query's prompt above the router's slow-read size is parsed and hashed in a worker
    thread, as Envoy's requests are (a 59.5 MiB one had held the loop 588 ms); a small one where
    it is decided."""
    parsers: list[bool] = []
    parse = Router.parse

    def parsed(router: Router, body: Any, headers: dict[str, str]) -> Any:
        parsers.append(threading.current_thread() is threading.main_thread())
        return parse(router, body, headers)

    monkeypatch.setattr(Router, "parse", parsed)
    large = {**BODY, "messages": [{"role": "user", "content": "l" * (Router(Settings()).slow_read_bytes + 1)}]}

    async def scenario(client: TestClient, _admin: Admin, _router: Router) -> None:
        status, small = await _post(client, "/v1/query", {"body": BODY, "dry_run": True})
        assert status == 200 and small["total_blocks"] == 7
        status, answer = await _post(client, "/v1/query", {"body": orjson.dumps(large).decode(), "dry_run": True})
        assert status == 200 and answer["total_blocks"] > 7

    run(scenario)
    assert parsers == [True, False]
