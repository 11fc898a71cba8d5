"""Following a Kubernetes list as a watch, the one way every follower here does it."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import watch

from extproc.core import policy as contract

# The API server ends a watch after WATCH_S, and the follower lists again; one not ended by
# WATCH_S_LIMIT is redone (a half-open connection: a NAT or a load balancer dropped it). A limit
# on silence instead would cut every quiet watch: the API server sent no bookmark to a quiet
# policy's watch in 90 s (Kubernetes 1.37), so the whole watch is what is limited, and kept short.
WATCH_S = 60
WATCH_S_LIMIT = 90
CALL_TIMEOUT = contract.CALL_TIMEOUT  # every other call's limits (the contract's, the operator's too)
RETRY_S = 2.0  # the wait before listing again after a failure, doubled while failures go on,
RETRY_MAX_S = 30.0  # up to this (with jitter: replicas and policies do not list in step)


class Backoff:
    """How long a follower waits before it lists again: RETRY_S after one failure, doubling
    while they go on; a list that succeeds starts it over. A cycle that listed and watched (the
    watch ended, as it does every WATCH_S) lists again at once, unless it lasted under RETRY_S: a
    proxy that ends every watch at once must not turn the follower into a loop of lists."""

    def __init__(self) -> None:
        self._wait = RETRY_S

    def listed(self) -> None:
        self._wait = RETRY_S

    def failed(self) -> float:
        wait = self._wait * random.uniform(0.8, 1.2)
        self._wait = min(RETRY_MAX_S, self._wait * 2)
        return wait

    @staticmethod
    def after_watch(lasted_s: float) -> float:
        return max(0.0, RETRY_S - lasted_s)


async def follow(
    list_call: Callable[..., Any],
    args: tuple[Any, ...],
    resource_version: str,
    apply: Callable[[str, Mapping[str, Any]], None],
    **selectors: str,
) -> None:
    """Apply each event of the list's watch from `resource_version` until the watch ends; raises
    RuntimeError on an ERROR event (an expired version: the caller lists again)."""
    async with watch.Watch().stream(
        list_call,
        *args,
        resource_version=resource_version,
        timeout_seconds=WATCH_S,
        _request_timeout=aiohttp.ClientTimeout(total=WATCH_S_LIMIT, sock_connect=CALL_TIMEOUT[0]),
        **selectors,
    ) as stream:
        async for event in stream:
            if event["type"] == "ERROR":
                raise RuntimeError(f"watch error: {event['object']}")
            apply(event["type"], event["object"])
