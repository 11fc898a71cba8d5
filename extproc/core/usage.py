"""The engine's own count of a request's cached prompt tokens, read from its response as it
streams past: `usage.prompt_tokens_details.cached_tokens` (vLLM with
`--enable-prompt-tokens-details`; in a stream only when the client asked for usage).

The body is not parsed: the key is searched in each chunk, and across the seam with the chunk
before (key or number may be split there), so the cost is a byte search per chunk and memory
a few dozen bytes per response.
"""

from __future__ import annotations

import re

_VALUE = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})(?=[^\d])')
_SEAM = 48  # bytes kept from a chunk's end: the key, spaces and a number straddling the next


class CachedTokens:
    """Feed a response's body chunks in order; the first complete value found is the count."""

    __slots__ = ("_tail", "found")

    def __init__(self) -> None:
        self._tail = b""
        self.found: int | None = None

    def feed(self, chunk: bytes) -> int | None:
        """The count, the first time it is complete (a JSON body never ends with it: an object
        closes after it); None until then and after."""
        if self.found is not None:
            return None
        seam = self._tail + chunk[:_SEAM] if self._tail else b""
        for text in (seam, chunk):
            match = _VALUE.search(text)
            if match is not None:
                self.found = int(match.group(1))
                return self.found
        self._tail = chunk[-_SEAM:] if len(chunk) >= _SEAM else (self._tail + chunk)[-_SEAM:]
        return None
