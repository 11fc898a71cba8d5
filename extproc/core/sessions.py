"""Exact sessions: a client conversation pinned to the backend that holds its cache.

Keys come from explicit client identifiers only; per-request ids (x-request-id, x-trace-id)
never name a session. Keys live in their own table, never in the prefix index, so
`session-1` and `session-12` cannot collide. Identifiers longer than MAX_ID_CHARS are not
sessions, and the table stores only a keyed 16-byte digest of each key: a client cannot make
kvroute hold its identifiers verbatim, nor forge another's binding without the key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.core.objectives import bounded_id
from extproc.core.settings import SESSION_HEADERS

USER_HEADER = "x-user-id"
MAX_ID_CHARS = 512
# Expired bindings one bind drops at most: after a quiet spell longer than the TTL, the first bind
# found them all expired and dropped them at once (20 ms for 100,000).
EXPIRE_SLICE = 1024
# A backend holding more than 1/LISTED_SHARE of the bindings loses them by a pass over the table in
# its order, which is cheaper than their listing's random order: at 100,000 bindings over two
# backends, 16-20 ms against 33-38 for a reset (results/stalls-34/session_resets.py).
LISTED_SHARE = 4

# What a binding knows of the session's last prompt there: its blocks and its last block's hash
# (the hash names the whole prefix through it: chain.py). (0, 0): not known here, e.g. bound by
# another replica, or as the request was sent and before it was served.
Context = tuple[int, int]
NO_CONTEXT: Context = (0, 0)


def context_of(chain: Sequence[int]) -> Context:
    return (len(chain), chain[-1]) if chain else NO_CONTEXT


def continued(context: Context, chain: Sequence[int]) -> int:
    """Blocks of the session's last prompt that this chain continues: all of them, or 0 where it
    does not (or the last prompt is not known). Only then does what its backend still shows of
    them say how much of the conversation's context was evicted there; a session whose prompts do
    not extend each other is still kept on its backend, but says nothing of its cache."""
    blocks, last = context
    return blocks if 0 < blocks <= len(chain) and chain[blocks - 1] == last else 0


def _text(value: Any) -> str | None:
    """A usable identifier: a non-empty string of at most MAX_ID_CHARS, or an integer (not a bool)."""
    if isinstance(value, str):
        return value if 0 < len(value) <= MAX_ID_CHARS else None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def derive_session_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    session_headers: tuple[str, ...] = SESSION_HEADERS,
    tenant_header: str = "",
) -> str | None:
    """The session a request belongs to, by precedence: conversation ids, then user ids; scoped
    by the tenant header's value when one is configured, so tenants' ids never meet.

    Header names are expected in lower case (as Envoy sends them).
    """
    key = _unscoped_key(headers, body, session_headers)
    if key is None or not tenant_header:
        return key
    tenant = headers.get(tenant_header)
    return f"{bounded_id(tenant, MAX_ID_CHARS) if isinstance(tenant, str) else ''}\0{key}"


def _unscoped_key(headers: Mapping[str, str], body: Mapping[str, Any], session_headers: tuple[str, ...]) -> str | None:
    """Each source read only when the ones before it named nothing (this runs per request)."""
    for name in session_headers:
        key = _text(headers.get(name))
        if key is not None:
            return "session:" + key
    params = body.get("session_params")
    key = _text(params.get("session_id")) if isinstance(params, Mapping) else None
    if key is None:
        key = _text(body.get("session_id"))
    if key is not None:
        return "session:" + key
    for value in (body.get("user"), body.get("user_id"), headers.get(USER_HEADER)):
        key = _text(value)
        if key is not None:
            return "user:" + key
    return None


_Binding = tuple[str, float, int, int]  # backend, last access, the Context flat


class SessionTable:
    """digest(session key) -> (backend, last access, its last prompt's Context there), with a TTL
    and LRU capacity.

    Each backend's bindings are also listed by backend, so a backend that leaves or whose cache is
    reset loses its own bindings in a pass over them alone: a pass over the whole table took 15 ms
    a backend at 100,000 bindings, which a fleet restarting or clearing its caches pays once per
    backend."""

    __slots__ = ("_bindings", "_by_backend", "_capacity", "_key", "_ttl")

    def __init__(self, ttl_s: float, capacity: int, key: bytes) -> None:
        self._ttl = ttl_s
        self._capacity = capacity
        self._key = key
        self._bindings: OrderedDict[bytes, _Binding] = OrderedDict()
        self._by_backend: dict[str, set[bytes]] = {}  # the digests bound to each backend

    def _digest(self, session_key: str) -> bytes:
        return hashlib.blake2b(session_key.encode("utf-8", "surrogatepass"), key=self._key, digest_size=16).digest()

    def __len__(self) -> int:
        return len(self._bindings)

    def configure(self, ttl_s: float, capacity: int, key: bytes) -> None:
        """Apply new limits live; bindings beyond the new capacity go, oldest first. A new key
        makes every stored digest unreachable, so the table starts afresh."""
        if key != self._key:
            self._key = key
            self._bindings.clear()
            self._by_backend.clear()
        self._ttl = ttl_s
        self._capacity = capacity
        self._trim()

    def get(self, session_key: str, now: float) -> str | None:
        """The bound backend, or None if unbound or expired (an expired binding is dropped)."""
        binding = self.binding(session_key, now)
        return None if binding is None else binding[0]

    def binding(self, session_key: str, now: float) -> tuple[str, Context] | None:
        """The bound backend and the Context of the session's last prompt there, or None if unbound
        or expired (then dropped)."""
        key = self._digest(session_key)
        binding = self._bindings.get(key)
        if binding is None:
            return None
        if binding[1] < now - self._ttl:
            self._drop(key)
            return None
        return binding[0], (binding[2], binding[3])

    def bind(self, session_key: str, backend: str, now: float, context: Context = NO_CONTEXT) -> bytes:
        """Bind (or refresh) a session; returns its digest, the only form it is shared in."""
        key = self._digest(session_key)
        self.bind_digest(key, backend, now, context)
        return key

    def bind_digest(self, key: bytes, backend: str, now: float, context: Context = NO_CONTEXT) -> None:
        """Bind by digest: what another replica shared (same hash key, so the same digest). A binding
        older than the one held changes nothing (a sibling's snapshot may be replayed late)."""
        held = self._bindings.get(key)
        if held is not None:
            if held[1] > now:
                return
            if held[0] != backend:
                self._unlist(key, held[0])
        self._bindings[key] = (backend, now, context[0], context[1])
        self._bindings.move_to_end(key)
        listed = self._by_backend.get(backend)
        if listed is None:
            self._by_backend[backend] = {key}
        else:
            listed.add(key)
        self._trim()
        self._expire(now)

    def forget(self, session_key: str) -> bool:
        key = self._digest(session_key)
        if key not in self._bindings:
            return False
        self._drop(key)
        return True

    def leave(self, backend: str) -> None:
        """A backend left: its bindings go."""
        self.remove_backend(backend)

    def remove_backend(self, backend: str, before: float = float("inf")) -> int:
        """Drop the bindings to a backend whose cache was reset (emptied after `before`: the
        bindings used since may already point at its new content); return how many."""
        listed = self._by_backend.get(backend)
        if not listed:
            return 0
        bindings = self._bindings
        if len(listed) * LISTED_SHARE > len(bindings):  # most of the table: a pass in its order is cheaper
            gone = [key for key, held in bindings.items() if held[0] == backend and held[1] <= before]
        else:
            gone = [key for key in listed if bindings[key][1] <= before]
        for key in gone:
            del bindings[key]
        if len(gone) == len(listed):
            del self._by_backend[backend]
        else:
            listed.difference_update(gone)
        return len(gone)

    def _drop(self, key: bytes) -> None:
        self._unlist(key, self._bindings.pop(key)[0])

    def _unlist(self, key: bytes, backend: str) -> None:
        listed = self._by_backend[backend]
        listed.discard(key)
        if not listed:
            del self._by_backend[backend]

    def _trim(self) -> None:
        """Past capacity, the least recently bound go."""
        while len(self._bindings) > self._capacity:
            key, held = self._bindings.popitem(last=False)
            self._unlist(key, held[0])

    def _expire(self, now: float) -> None:
        """Bindings are in last-use order, so expired ones sit at the front. At most EXPIRE_SLICE
        go per call: the next bind goes on (an expired binding is never answered meanwhile)."""
        cutoff = now - self._ttl
        for _ in range(EXPIRE_SLICE):
            if not self._bindings:
                return
            key, held = next(iter(self._bindings.items()))
            if held[1] >= cutoff:
                return
            self._drop(key)
