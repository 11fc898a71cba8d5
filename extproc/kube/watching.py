"""Following a Kubernetes list as a watch, the one way every follower here does it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio import watch

WATCH_S = 300  # the API server ends a watch after this; the follower then lists again
SILENT_S = 330  # a watch that goes silent longer (a dead connection) is redone


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
        _request_timeout=SILENT_S,
        **selectors,
    ) as stream:
        async for event in stream:
            if event["type"] == "ERROR":
                raise RuntimeError(f"watch error: {event['object']}")
            apply(event["type"], event["object"])
