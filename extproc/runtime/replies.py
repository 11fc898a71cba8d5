"""An engine's HTTP answer read to its end within a bound, for aiohttp's client.

`StreamReader.read(n)` alone returns what has come so far, so an answer that arrives in several
TCP reads parses cut short; `text()` and `read()` hold whatever size the engine sends."""

from __future__ import annotations

import aiohttp


async def read_within(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body to its end, or its first `limit` bytes (a caller tells the two apart by asking for
    one byte more than it accepts)."""
    body = bytearray()
    while len(body) < limit:
        chunk = await content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)
