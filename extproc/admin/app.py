"""Admin HTTP port: metrics, probes, state, and query/notify for gateways other than Envoy."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.core.errors import InvalidRequest
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.kube.follower import PolicyFollower
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class Admin:
    """The aiohttp application; `ready` is flipped by the service once gRPC is serving."""

    def __init__(
        self,
        router: Router,
        pool: BackendPool,
        metrics: Metrics,
        follower: PolicyFollower | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._follower = follower
        self._clock = clock
        self.serving = False

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/debug/state", self.state)
        app.router.add_post("/v1/query", self.query)
        app.router.add_post("/v1/notify", self.notify)
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
        if self._follower is not None and not self._follower.connected:
            warnings.append(f"policy watch down ({self._follower.last_error}); routing with the last known backends")
        body = {"ready": not problems, "problems": problems, "warnings": warnings}
        return _json(body, 503 if problems else 200)

    async def state(self, _request: web.Request) -> web.Response:
        settings = self._router.settings
        return _json(
            {
                **self._router.state(),
                "backends": [
                    {"address": b.address, "healthy": b.healthy, "models": sorted(b.models)}
                    for b in self._pool.backends
                ],
                "settings": {name: getattr(settings, name) for name in settings.docs() if name != "hash_key"},
                "policy": None
                if self._follower is None
                else {
                    "name": f"{self._follower.namespace}/{self._follower.name}",
                    "connected": self._follower.connected,
                    "generation": self._follower.generation,
                    "last_error": self._follower.last_error,
                },
            }
        )

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], PromptRequest]:
        """{"body": <request object or JSON text>, "headers": {...}} -> parsed request, or a 400."""
        try:
            payload = orjson.loads(await request.read())
            if not isinstance(payload, dict) or "body" not in payload:
                raise InvalidRequest('expected {"body": ..., "headers": {...}}')
            headers = {str(k).lower(): str(v) for k, v in (payload.get("headers") or {}).items()}
            body = payload["body"]
            raw = body.encode() if isinstance(body, str) else body
            return payload, parse_request(raw, headers, self._router.settings.session_headers)
        except (orjson.JSONDecodeError, InvalidRequest, AttributeError) as exc:
            self._metrics.errors.labels("invalid_request").inc()
            raise web.HTTPBadRequest(
                text=orjson.dumps({"error": str(exc)}).decode(), content_type="application/json"
            ) from None

    async def query(self, request: web.Request) -> web.Response:
        """Decide without reserving: the caller routes, then reports success via /v1/notify."""
        _, parsed = await self._read(request)
        decision = self._router.query(parsed, self._pool.backends, self._clock(), reserve=False)
        self._metrics.decisions.labels(decision.label.value).inc()
        return _json(decision.explain())

    async def notify(self, request: web.Request) -> web.Response:
        """{"body", "headers", "backend"}: that known backend now holds this prompt."""
        payload, parsed = await self._read(request)
        backend = payload.get("backend")
        if not isinstance(backend, str) or not self._pool.is_known(backend):
            return _json({"error": f"unknown backend {backend!r}"}, 400)
        self._router.notify(parsed, backend, self._clock())
        self._metrics.learned.inc()
        return _json({"backend": backend, "learned_blocks": len(self._router.chain_of(parsed))})
