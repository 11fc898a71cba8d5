"""vLLM's /v1/models -> the LoRA adapters a server lists: the entries with a parent model (the base
model's own entry has none). Bounded by the core's adapter book; malformed pages list nothing."""

from __future__ import annotations

from typing import Any

import orjson

MAX_PAGE_BYTES = 4 << 20  # a listing larger than this is not read


def listed_adapters(page: bytes) -> list[str] | None:
    """The adapters in a /v1/models page, or None when it is not one."""
    if len(page) > MAX_PAGE_BYTES:
        return None
    try:
        payload: Any = orjson.loads(page)
    except orjson.JSONDecodeError:
        return None
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return None
    return [
        entry["id"]
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry.get("parent") is not None
    ]
