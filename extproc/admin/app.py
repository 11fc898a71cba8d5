"""The HTTP adapter, on two ports: monitoring (/metrics, /healthz, /readyz: read-only, open) and
control (state and the request lifecycle for gateways other than Envoy: bearer token, off unless
configured). Control endpoints:

    GET  /debug/state                                   -> index, sessions, load, backends, settings
    POST /v1/query    {"body", "headers"?, "dry_run"?}  -> the decision, and a lease holding its load
    POST /v1/notify   {"lease", "backend", "status"?}   -> the response started there (learn on 2xx)
    POST /v1/release  {"lease"}                         -> the request ended: its load is released
Leases end by themselves `lease_ttl_s` after they were opened. A dry run reserves nothing and is
not counted as a decision. `/v1/notify` with {"body", "headers"?, "backend"} and no lease teaches
the index directly (a gateway that routed on its own).

A process serving several policies (`Admin.serve_also`) answers for each: a body goes to the
policy its model chooses, a lease is found in whichever policy holds it, /debug/state lists every
policy's state under its name, and /readyz is ready while any policy has a routable backend.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from extproc.core.errors import InvalidRequest
from extproc.core.exchange import Exchange, ResponseStart
from extproc.core.leases import LeaseTable
from extproc.core.request import PromptRequest, load_json
from extproc.core.router import Router
from extproc.runtime.metrics import Metrics
from extproc.runtime.policy_state import PolicyState
from extproc.runtime.pool import BackendPool


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


# A policy's name, router, pool, watch, and its details and warnings (see Admin.__init__).
PolicyParts = tuple[str, Router, BackendPool, PolicyState | None, Callable[[], dict[str, Any]], Callable[[], list[str]]]


@dataclass(slots=True)
class ServedPolicy:
    """One policy as the HTTP adapter answers for it: its routing state and its open leases."""

    name: str
    router: Router
    pool: BackendPool
    policy: PolicyState | None
    leases: LeaseTable
    details: Callable[[], dict[str, Any]]
    warnings: Callable[[], list[str]]


class _Collected:
    """Metric families already read, for `generate_latest` to write out (off the loop)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class Admin:
    """The aiohttp application; `serving` is set by the service once gRPC serves, so /readyz waits for it."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        metrics: Metrics,
        policy: PolicyState | None = None,
        clock: Callable[[], float] = time.monotonic,
        lease_ttl_s: float = 300.0,
        details: Callable[[], dict[str, Any]] = dict,
        warnings: Callable[[], list[str]] = list,
        name: str = "default",
    ) -> None:
        """`details` adds to /debug/state and `warnings` to /readyz (the engine feeds' view)."""
        self._metrics = metrics
        self._registry = metrics.registry
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s
        self._served = [ServedPolicy(name, router, pool, policy, LeaseTable(lease_ttl_s), details, warnings)]
        self._owner: Callable[[str], Router] | None = None
        self.serving = False

    @property
    def leases(self) -> LeaseTable:
        """The first policy's open leases."""
        return self._served[0].leases

    def serve_also(
        self,
        policies: list[PolicyParts],
        owner: Callable[[str], Router],
        registry: CollectorRegistry,
    ) -> None:
        """More policies in this process: `owner` names the router deciding a model's requests,
        `registry` exposes every policy's metrics (labelled by policy)."""
        ttl = self._lease_ttl_s
        self._served += [ServedPolicy(n, r, p, s, LeaseTable(ttl), d, w) for n, r, p, s, d, w in policies]
        self._owner = owner
        self._registry = registry

    def _for_model(self, model: str) -> ServedPolicy:
        if self._owner is None:
            return self._served[0]
        router = self._owner(model)
        return next(served for served in self._served if served.router is router)

    def _lease(self, lease_id: str) -> tuple[ServedPolicy, Exchange] | None:
        for served in self._served:
            exchange = served.leases.get(lease_id)
            if exchange is not None:
                return served, exchange
        return None

    def monitoring_app(self) -> web.Application:
        """The admin port: read-only, unauthenticated, for probes and scrapers."""
        app = web.Application(client_max_size=1024)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    def control_app(self, token: str) -> web.Application:
        """The control port: the lifecycle API and state, each request with `Authorization:
        Bearer <token>`; anything else gets a 401 and is counted."""
        if not token:
            raise ValueError("the control API needs a token")
        expected = token.encode()

        @web.middleware
        async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
            # (aiohttp keeps a header's undecodable bytes as surrogates: encoded back as they came;
            # the scheme's name is case-insensitive, RFC 9110)
            given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
            scheme, _, credentials = given.partition(b" ")
            if not hmac.compare_digest(credentials, expected) or scheme.lower() != b"bearer":
                self._metrics.errors.labels("unauthorized").inc()
                return _json({"error": "unauthorized"}, 401)
            return await handler(request)

        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[authenticate])
        app.router.add_get("/debug/state", self.state)
        app.router.add_post("/v1/query", self.query)
        app.router.add_post("/v1/notify", self.notify)
        app.router.add_post("/v1/release", self.release)
        return app

    async def metrics(self, _request: web.Request) -> web.Response:
        """The samples are read on the event loop (the collectors read the router's tables) and
        written out as text in a worker thread: at 1,000 backends the text of some 4,000 samples
        held the loop about 10 ms a scrape (docs/benchmarks.md, event-loop stalls)."""
        collected = _Collected(list(self._registry.collect()))
        body = await asyncio.to_thread(generate_latest, collected)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, _request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.Response:
        """Ready when gRPC serves and at least one backend is routable (with several policies,
        in any: one model's empty pool must not take the others' router out of service). A lost
        policy watch is reported but keeps readiness: routing on the last known backends beats
        failing open."""
        problems = []
        if not self.serving:
            problems.append("gRPC server not serving")
        several = len(self._served) > 1
        empty = [served.name for served in self._served if served.pool.healthy_count() == 0]
        if len(empty) == len(self._served):
            problems.append("no healthy backend")
        warnings = [f"policy {name}: no healthy backend" for name in empty] if several and problems == [] else []
        for served in self._served:
            prefix = f"policy {served.name}: " if several else ""
            warnings += [prefix + warning for warning in _warnings(served)]
        body = {"ready": not problems, "problems": problems, "warnings": warnings}
        return _json(body, 503 if problems else 200)

    async def state(self, _request: web.Request) -> web.Response:
        if len(self._served) == 1:
            return _json(_state(self._served[0]))
        return _json({"policies": {served.name: _state(served) for served in self._served}})

    def _bad_request(self, message: str) -> web.HTTPBadRequest:
        self._metrics.errors.labels("invalid_request").inc()
        return web.HTTPBadRequest(text=orjson.dumps({"error": message}).decode(), content_type="application/json")

    async def _payload(self, request: web.Request) -> dict[str, Any]:
        """The JSON object posted, or a 400; expired leases are ended first, every policy's (a
        full table of another policy's expired leases answered 503 until the sweep)."""
        now = self._clock()
        for served in self._served:
            served.leases.expire(now)
        try:
            payload = load_json(await request.read())
        except InvalidRequest as exc:
            raise self._bad_request(str(exc)) from None
        if not isinstance(payload, dict):
            raise self._bad_request("expected a JSON object")
        return payload

    async def _prompt(self, request: web.Request, payload: dict[str, Any]) -> tuple[ServedPolicy, PromptRequest]:
        """{"body": <request object or JSON text>, "headers": {...}} -> the policy serving its
        model and the request as it parses it, or a 400. A large one is parsed and hashed in a
        worker thread, as Envoy's requests are (a 59.5 MiB query held the loop 588 ms)."""
        try:
            if "body" not in payload:
                raise InvalidRequest('expected {"body": ..., "headers": {...}}')
            headers = {str(k).lower(): str(v) for k, v in (payload.get("headers") or {}).items()}
            body = payload["body"]
            loaded = load_json(body) if isinstance(body, str) else body
            model = loaded.get("model") if isinstance(loaded, dict) else None
            served = self._for_model(model if isinstance(model, str) else "")
            if len(await request.read()) > served.router.slow_read_bytes:  # (read once: aiohttp keeps it)
                return served, await asyncio.to_thread(served.router.parse, loaded, headers)
            return served, served.router.parse(loaded, headers)
        except (InvalidRequest, AttributeError) as exc:
            raise self._bad_request(str(exc)) from None

    async def query(self, request: web.Request) -> web.Response:
        """Decide; unless a dry run, reserve the load and hold it under a lease."""
        payload = await self._payload(request)
        served, parsed = await self._prompt(request, payload)
        router, backends = served.router, served.pool.backends
        if payload.get("dry_run"):
            return _json(router.query(parsed, backends, self._clock()).explain())
        if served.leases.full():
            return _json({"error": "too many open leases; release or let them expire"}, 503)
        exchange = router.begin(parsed, backends, self._clock())
        answer = exchange.decision.explain()
        if exchange.decision.backend is None:
            exchange.end()
        else:
            answer["lease"] = served.leases.open(exchange, self._clock())
        return _json(answer)

    async def notify(self, request: web.Request) -> web.Response:
        """The response started on `backend` (a known one of the request's policy): 2xx teaches the index."""
        payload = await self._payload(request)
        backend = payload.get("backend")
        if "lease" not in payload:
            served, parsed = await self._prompt(request, payload)
            if not isinstance(backend, str) or not served.pool.is_known(backend):
                return _json({"error": f"unknown backend {backend!r}"}, 400)
            learned = served.router.learn(parsed, backend, self._clock())
            return _json({"backend": backend, "learned_blocks": learned})
        found = self._lease(str(payload["lease"]))
        if not isinstance(backend, str) or not any(s.pool.is_known(backend) for s in self._served):
            return _json({"error": f"unknown backend {backend!r}"}, 400)
        if found is None:
            return _json({"error": "no such lease (released or expired)"}, 404)
        served, exchange = found
        if not served.pool.is_known(backend):
            return _json({"error": f"unknown backend {backend!r}"}, 400)
        status = payload.get("status", 200)
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise self._bad_request("status must be an HTTP status code (100-599)")
        outcome = served.router.response_started(
            exchange, ResponseStart(upstream=backend, known=True, status=status, from_upstream=True), self._clock()
        )
        return _json({"backend": outcome.served, "learned": outcome.learned, "headers": dict(outcome.headers)})

    async def release(self, request: web.Request) -> web.Response:
        """The request ended: release its load (idempotent: a second release is a 404)."""
        payload = await self._payload(request)
        lease = payload.get("lease")
        if not isinstance(lease, str):
            raise self._bad_request('expected {"lease": "<id>"}')
        if not any(served.leases.close(lease) is not None for served in self._served):
            return _json({"error": "no such lease (released or expired)"}, 404)
        return _json({"released": True})

    async def expire_forever(self, interval_s: float) -> None:
        """End leases whose gateway never came back, even when no API call arrives."""
        while True:
            await asyncio.sleep(interval_s)
            for served in self._served:
                served.leases.expire(self._clock())


def _warnings(served: ServedPolicy) -> list[str]:
    """A policy's readiness warnings: its watch, its probes, its feeds'."""
    policy, pool = served.policy, served.pool
    warnings = []
    if policy is not None and not policy.connected:
        warnings.append(f"policy watch down ({policy.last_error}); routing with the last known backends")
    if pool.last_probe_error is not None:
        warnings.append(f"backend probes failing ({pool.last_probe_error}); health may be stale")
    if policy is not None and policy.unknown_fields:
        warnings.append(f"policy spec.routing fields ignored: {', '.join(policy.unknown_fields)}")
    if policy is not None:
        warnings += [f"policy: {problem}" for problem in policy.problems[:8]]
    return warnings + served.warnings()


def _state(served: ServedPolicy) -> dict[str, Any]:
    """A policy's /debug/state."""
    router, policy = served.router, served.policy
    settings = router.settings
    return {
        **router.state().as_json(),
        **served.details(),
        "backends": [
            {"address": b.address, "healthy": b.healthy, "models": sorted(b.models)} for b in served.pool.backends
        ],
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings) if not f.metadata["secret"]},
        "open_leases": len(served.leases),
        "policy": None
        if policy is None
        else {
            "name": policy.name,
            "connected": policy.connected,
            "generation": policy.generation,
            "last_error": policy.last_error,
            "unknown_fields": policy.unknown_fields,
            "problems": policy.problems,
        },
    }
