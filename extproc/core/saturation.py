"""Saturation: whether any candidate can take a request now, or flow control holds it.

A backend is saturated when requests wait at its engine (`saturation_waiting` or more: in flight
beyond what the engine ran at its last sample, so what kvroute sent since counts at once), when
running requests pin `saturation_kv_usage` of its KV cache, at `max_backend_requests`, or (when
set) with `saturation_prefill_tokens` of prompt still to prefill for what was sent to it. The
engine's figures count only while fresh; without them only kvroute's own limit applies. Sending a
request to a saturated engine only queues it where nothing can reorder it; held by kvroute, it
runs in its priority and flow's turn, on the backend chosen when it runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.core.load import BackendLoad, LoadTracker
from extproc.core.settings import Settings


def saturated(load: BackendLoad, settings: Settings, now: float, block_tokens: float = 0.0) -> bool:
    """This backend should take nothing more now. `block_tokens`: tokens per reserved block, for
    `saturation_prefill_tokens`."""
    limit = settings.max_backend_requests
    if limit and load.requests(now) >= limit:
        return True
    prefill = settings.saturation_prefill_tokens
    if prefill and (load.reserved_blocks + load.peer_reserved) * block_tokens >= prefill:
        return True
    waiting = load.waiting(now)
    if waiting is None:
        return False
    return waiting >= settings.saturation_waiting or load.engine_kv_usage >= settings.saturation_kv_usage


def has_room(
    loads: LoadTracker, candidates: Iterable[str], settings: Settings, now: float, block_tokens: float = 0.0
) -> bool:
    """Some candidate can take a request now."""
    return any(not saturated(loads.get(backend), settings, now, block_tokens) for backend in candidates)
