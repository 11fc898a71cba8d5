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
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.core.errors import InvalidRequest
from extproc.core.exchange import ResponseStart
from extproc.core.leases import LeaseTable
from extproc.core.request import PromptRequest
from extproc.core.router import Router
from extproc.runtime.metrics import Metrics
from extproc.runtime.policy_state import PolicyState
from extproc.runtime.pool import BackendPool


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


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
    ) -> None:
        """`details` adds to /debug/state and `warnings` to /readyz (the engine feeds' view)."""
        self._details = details
        self._warnings = warnings
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._policy = policy
        self._clock = clock
        self.leases = LeaseTable(lease_ttl_s)
        self.serving = False

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
        expected = f"Bearer {token}".encode()

        @web.middleware
        async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
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
        return web.Response(body=generate_latest(self._metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, _request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.Response:
        """Ready when gRPC serves and at least one backend is routable. A lost policy watch is
        reported but keeps readiness: routing on the last known backends beats failing open."""
        problems = []
        if not self.serving:
            problems.append("gRPC server not serving")
        if self._pool.healthy_count() == 0:
            problems.append("no healthy backend")
        warnings = []
        if self._policy is not None and not self._policy.connected:
            warnings.append(f"policy watch down ({self._policy.last_error}); routing with the last known backends")
        if self._pool.last_probe_error is not None:
            warnings.append(f"backend probes failing ({self._pool.last_probe_error}); health may be stale")
        if self._policy is not None and self._policy.unknown_fields:
            warnings.append(f"policy spec.routing fields ignored: {', '.join(self._policy.unknown_fields)}")
        warnings.extend(self._warnings())
        body = {"ready": not problems, "problems": problems, "warnings": warnings}
        return _json(body, 503 if problems else 200)

    async def state(self, _request: web.Request) -> web.Response:
        settings = self._router.settings
        return _json(
            {
                **self._router.state().as_json(),
                **self._details(),
                "backends": [
                    {"address": b.address, "healthy": b.healthy, "models": sorted(b.models)}
                    for b in self._pool.backends
                ],
                "settings": {f.name: getattr(settings, f.name) for f in fields(settings) if not f.metadata["secret"]},
                "open_leases": len(self.leases),
                "policy": None
                if self._policy is None
                else {
                    "name": self._policy.name,
                    "connected": self._policy.connected,
                    "generation": self._policy.generation,
                    "last_error": self._policy.last_error,
                    "unknown_fields": self._policy.unknown_fields,
                },
            }
        )

    def _bad_request(self, message: str) -> web.HTTPBadRequest:
        self._metrics.errors.labels("invalid_request").inc()
        return web.HTTPBadRequest(text=orjson.dumps({"error": message}).decode(), content_type="application/json")

    async def _payload(self, request: web.Request) -> dict[str, Any]:
        """The JSON object posted, or a 400; expired leases are ended first."""
        self.leases.expire(self._clock())
        try:
            payload = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise self._bad_request(str(exc)) from None
        if not isinstance(payload, dict):
            raise self._bad_request("expected a JSON object")
        return payload

    def _prompt(self, payload: dict[str, Any]) -> PromptRequest:
        """{"body": <request object or JSON text>, "headers": {...}} -> parsed request, or a 400."""
        try:
            if "body" not in payload:
                raise InvalidRequest('expected {"body": ..., "headers": {...}}')
            headers = {str(k).lower(): str(v) for k, v in (payload.get("headers") or {}).items()}
            body = payload["body"]
            raw = body.encode() if isinstance(body, str) else body
            return self._router.parse(raw, headers)
        except (InvalidRequest, AttributeError) as exc:
            raise self._bad_request(str(exc)) from None

    async def query(self, request: web.Request) -> web.Response:
        """Decide; unless a dry run, reserve the load and hold it under a lease."""
        payload = await self._payload(request)
        parsed = self._prompt(payload)
        if payload.get("dry_run"):
            return _json(self._router.query(parsed, self._pool.backends, self._clock()).explain())
        if self.leases.full():
            return _json({"error": "too many open leases; release or let them expire"}, 503)
        exchange = self._router.begin(parsed, self._pool.backends, self._clock())
        answer = exchange.decision.explain()
        if exchange.decision.backend is None:
            exchange.end()
        else:
            answer["lease"] = self.leases.open(exchange, self._clock())
        return _json(answer)

    async def notify(self, request: web.Request) -> web.Response:
        """The response started on `backend` (a known one): 2xx teaches the index."""
        payload = await self._payload(request)
        backend = payload.get("backend")
        if not isinstance(backend, str) or not self._pool.is_known(backend):
            return _json({"error": f"unknown backend {backend!r}"}, 400)
        if "lease" not in payload:
            learned = self._router.learn(self._prompt(payload), backend, self._clock())
            return _json({"backend": backend, "learned_blocks": learned})
        exchange = self.leases.get(str(payload["lease"]))
        if exchange is None:
            return _json({"error": "no such lease (released or expired)"}, 404)
        status = payload.get("status", 200)
        if not isinstance(status, int):
            raise self._bad_request("status must be an integer")
        outcome = self._router.response_started(
            exchange, ResponseStart(upstream=backend, known=True, status=status, from_upstream=True), self._clock()
        )
        return _json({"backend": outcome.served, "learned": outcome.learned, "headers": dict(outcome.headers)})

    async def release(self, request: web.Request) -> web.Response:
        """The request ended: release its load (idempotent: a second release is a 404)."""
        payload = await self._payload(request)
        if self.leases.close(str(payload.get("lease"))) is None:
            return _json({"error": "no such lease (released or expired)"}, 404)
        return _json({"released": True})

    async def expire_forever(self, interval_s: float) -> None:
        """End leases whose gateway never came back, even when no API call arrives."""
        while True:
            await asyncio.sleep(interval_s)
            self.leases.expire(self._clock())
