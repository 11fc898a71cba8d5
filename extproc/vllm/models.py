"""vLLM's /v1/models -> the LoRA adapters a server lists: the entries with a parent model (the base
model's own entry has none). Bounded by the core's adapter book; malformed pages list nothing, and
so does a page of more entries than the book keeps twice over: parsing costs the event loop about
a microsecond a JSON value, and 4 MiB of them held it for 40 ms (a count of the page's objects and
commas, which bounds its values, costs it a tenth of that)."""

from __future__ import annotations

from typing import Any

import orjson

from extproc.core.adapters import MAX_LISTED

MAX_PAGE_BYTES = 4 << 20  # a listing larger than this is not read
MAX_ENTRIES = 2 * MAX_LISTED  # of a listing read (each with its permission object: vLLM 0.32)
MAX_COMMAS = 24 * MAX_ENTRIES  # a vLLM 0.32 entry has some 20 values


def listed_adapters(page: bytes) -> list[str] | None:
    """The adapters in a /v1/models page, or None when it is not one."""
    if len(page) > MAX_PAGE_BYTES or page.count(b"{") > 2 * MAX_ENTRIES + 1 or page.count(b",") > MAX_COMMAS:
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
