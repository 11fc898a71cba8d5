"""Only Envoy may steer routing: ext_proc calls must carry the shared token as gRPC metadata.

A call without it could forge a response start (dropping a backend or teaching it any prompt)
or hold reservations forever, so it is refused with UNAUTHENTICATED before any handler runs,
and counted. gRPC health checks stay open: they reveal nothing and change nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_OPEN_PREFIX = "/grpc.health.v1.Health/"


async def _refuse(_request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "ext_proc requires the shared token")


_REFUSE: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(_refuse)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets through calls whose `authorization` metadata is `Bearer <token>`."""

    def __init__(self, token: str, on_refused: Callable[[], None]) -> None:
        if not token:
            raise ValueError("an empty token would let anyone in")
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        details = handler_call_details
        if details.method.startswith(_OPEN_PREFIX):
            return await continuation(details)
        given = next((value for key, value in details.invocation_metadata or () if key == "authorization"), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        self._on_refused()
        return _REFUSE
