"""The prefill leg of a split request, sent by the ext_proc itself to the prefill backend.

kvroute already holds the request's body when it decides, so it runs the leg directly instead of
through a proxy beside the decode pods (llm-d's sidecar): one HTTP request from the ext_proc to
the prefill server, the client's path and body with one output token and a remote decode asked
for (`handoff.prefill_body`), then the decode leg is the client's own request, sent on by the
gateway with the parameters the prefill returned. The gateway still sees one request and one
destination. A leg that fails, times out or returns no usable parameters yields None and a
reason: the request is then served whole on its decode backend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import aiohttp
import orjson

from extproc.core import handoff
from extproc.core.objectives import ENGINE_PRIORITY_HEADER
from extproc.runtime.replies import read_within

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 1 << 20  # a one-token answer with its parameters is a few KB
FORWARDED = ("authorization", "x-request-id", "traceparent", "tracestate", ENGINE_PRIORITY_HEADER)


class LegFailure(StrEnum):
    """Why a prefill leg gave no parameters (the request is served whole)."""

    STATUS = "status"  # the prefill server answered, not 2xx
    TIMEOUT = "timeout"
    CONNECT = "connect"  # no connection, or it broke
    PARAMETERS = "parameters"  # 2xx without usable kv_transfer_params


class PrefillLegs:
    """One client session for every prefill leg of this process."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def run(
        self, backend: str, path: str, body: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, dict[str, Any] | None, LegFailure | None]:
        """(HTTP status or 0, the decode leg's parameters, why there are none). `timeout_s`: the
        whole leg, the prefill server's queue included (the policy's, so it can change live)."""
        if self._session is None:
            # no pool limit of its own (aiohttp's default is 100 connections for the process): legs
            # past it would wait here, unseen by the prefill cost, and time out; the legs in flight
            # are bounded by the requests in flight
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
        sent = {"content-type": "application/json", **{k: headers[k] for k in FORWARDED if k in headers}}
        host = backend.rpartition(":")[0].strip("[]")
        try:
            async with self._session.post(
                f"http://{backend}{path}",
                data=handoff.prefill_body(body),
                headers=sent,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                if not 200 <= r.status < 300:
                    return r.status, None, LegFailure.STATUS
                raw = await read_within(r.content, MAX_RESPONSE_BYTES + 1)
        except TimeoutError:
            return 0, None, LegFailure.TIMEOUT
        except aiohttp.ClientError:
            return 0, None, LegFailure.CONNECT
        try:
            parameters = None if len(raw) > MAX_RESPONSE_BYTES else handoff.decode_parameters(orjson.loads(raw), host)
        except orjson.JSONDecodeError:
            parameters = None
        return r.status, parameters, None if parameters is not None else LegFailure.PARAMETERS

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
