"""Precise index: which blocks each backend holds now, as its engine reports them.

Fed by KV cache events instead of by kvroute's own routing: `BlockStored` adds blocks (their keys
computed from the token ids the event carries, chained through the parent's key, so they equal
the keys of a request tokenized the same way), `BlockRemoved` takes them away, and a cleared,
restarted or lost event stream drops the backend's whole picture.

Routing teaches only what is on its way: the blocks of a request just sent to a backend are
*pending* there until the engine's events confirm them, or for PENDING_TTL_S. Lookups count them,
so concurrent requests with the same new prefix follow the first one instead of prefilling it
again elsewhere; `confirmed` does not, so a prediction of cached tokens stays exact.

Memory is bounded by the engines' own caches; a publisher that only ever stores (a bug or a
hostile pod) is capped at `max_blocks` per backend, past which its picture is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import takewhile

from extproc.core.adapters import valid_name
from extproc.core.chain import ROOT_KEY, TokenHasher, extra_digest
from extproc.core.engine import BlockRemoved, BlockStored

# Seconds a routed request's blocks count as on their way to a backend without the engine's
# confirmation: well beyond a prefill, short enough that a failed request's blocks soon stop counting.
PENDING_TTL_S = 10.0
MAX_LORA_NAMES = 1024  # LoRA adapter names remembered from events (a hostile publisher cannot grow it further)


class _Held:
    """One backend's blocks: engine hash -> kvroute key, kvroute key -> engine blocks holding it,
    and keys routed there but not yet confirmed (key -> deadline, oldest first)."""

    __slots__ = ("by_hash", "keys", "pending")

    def __init__(self) -> None:
        self.by_hash: dict[int, int] = {}
        self.keys: dict[int, int] = {}
        self.pending: OrderedDict[int, float] = OrderedDict()


class PreciseIndex:
    """LocationIndex fed by engine events. Not thread-safe: one event loop."""

    __slots__ = (
        "_backends",
        "_hasher",
        "block_size",
        "lora_names",
        "max_blocks",
        "orphans",
        "overflows",
        "size_mismatches",
    )

    def __init__(self, hasher: TokenHasher, max_blocks: int) -> None:
        self._hasher = hasher
        self._backends: dict[str, _Held] = {}
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # the engines' KV block size, from the first event
        self.orphans = 0  # stored blocks whose parent kvroute never saw (subscribed late, lost events)
        self.overflows = 0  # backends dropped for reporting more than max_blocks
        self.size_mismatches = 0  # events with another block size than the fleet's
        # LoRA adapters the engines reported blocks for: a request naming one is keyed by it
        self.lora_names: set[str] = set()

    @property
    def shed(self) -> int:
        """None: this picture mirrors what the engines report holding, so it is as large as their
        caches (each backend bounded by `max_blocks`); the process's bound is approximate mode's."""
        return 0

    def stored(self, backend: str, event: BlockStored) -> list[int]:
        """Add the event's blocks; returns the keys of those new there. Raises ValueError on a
        malformed event."""
        count = len(event.block_hashes)
        if event.block_size <= 0 or len(event.token_ids) != count * event.block_size:
            raise ValueError(f"BlockStored with {len(event.token_ids)} tokens for {count} blocks of {event.block_size}")
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            self.size_mismatches += 1
            return []
        held = self._backends.get(backend)
        if held is None:
            held = self._backends[backend] = _Held()
        name = event.lora_name
        if name is not None and len(self.lora_names) < MAX_LORA_NAMES and valid_name(name):
            self.lora_names.add(name)
        if event.parent_hash is None:
            parent = ROOT_KEY
        else:
            found = held.by_hash.get(event.parent_hash)
            if found is None:
                self.orphans += count
                return []
            parent = found
        size = event.block_size
        extras = event.extra_keys
        added: list[int] = []
        for index, engine_hash in enumerate(event.block_hashes):
            extra = extra_digest(extras[index] if index < len(extras) else None)
            parent = self._hasher.block(parent, event.token_ids[index * size : (index + 1) * size], extra)
            if engine_hash in held.by_hash:
                continue
            held.by_hash[engine_hash] = parent
            held.keys[parent] = held.keys.get(parent, 0) + 1
            held.pending.pop(parent, None)
            added.append(parent)
        if len(held.by_hash) > self.max_blocks:
            self.overflows += 1
            self.remove_backend(backend)
        return added

    def removed(self, backend: str, event: BlockRemoved) -> int:
        """Take the event's blocks away; returns how many were known."""
        held = self._backends.get(backend)
        if held is None:
            return 0
        removed = 0
        for engine_hash in event.block_hashes:
            key = held.by_hash.pop(engine_hash, None)
            if key is None:
                continue
            removed += 1
            refs = held.keys[key] - 1
            if refs:
                held.keys[key] = refs
            else:
                del held.keys[key]
        return removed

    def lookup(self, chain: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks each backend holds or has on its way (pending, not expired)."""
        matched: dict[str, int] = {}
        for backend in backends:
            held = self._backends.get(backend)
            count = 0
            if held is not None:
                keys, pending = held.keys, held.pending
                # the confirmed run in one C loop (a long prompt held on many candidates: 32 x 7,500
                # blocks took 8.3 ms as a Python loop), then pending blocks one by one
                count = len(list(takewhile(keys.__contains__, chain)))
                if pending:
                    for key in chain[count:]:
                        if key not in keys and pending.get(key, now) <= now:
                            break
                        count += 1
            matched[backend] = count
        return matched

    def holders(self, block: int, now: float) -> list[str]:
        """Backends holding the block or having it on its way: one look per backend (the engines'
        events name blocks by their own hashes, so no map by first block is kept here)."""
        return [
            backend
            for backend, held in self._backends.items()
            if block in held.keys or held.pending.get(block, now) > now
        ]

    def confirmed(self, chain: Sequence[int], backend: str) -> int:
        """Leading blocks the backend's engine said it holds: what a request there finds cached."""
        held = self._backends.get(backend)
        return 0 if held is None else len(list(takewhile(held.keys.__contains__, chain)))

    def learn(self, chain: Sequence[int], backend: str, now: float) -> int:
        """A request with this chain was just sent to the backend: its unconfirmed blocks are pending
        there until the engine's events confirm them or PENDING_TTL_S passes. Returns how many
        blocks are new there."""
        held = self._backends.get(backend)
        if held is None:
            held = self._backends[backend] = _Held()
        pending = held.pending
        while pending and next(iter(pending.values())) <= now:
            pending.popitem(last=False)
        deadline = now + PENDING_TTL_S
        added = 0
        for key in chain:
            if key in held.keys:
                continue
            if key not in pending:
                added += 1
            pending[key] = deadline
            pending.move_to_end(key)
        while len(pending) > self.max_blocks:
            pending.popitem(last=False)
        return added

    def remove_backend(self, backend: str) -> None:
        self._backends.pop(backend, None)

    def forget_before(self, backend: str, moment: float) -> None:
        """Everything goes: the engine's own events after the clear say what it holds again."""
        self.remove_backend(backend)

    def entries_by_backend(self) -> dict[str, int]:
        return {backend: len(held.by_hash) for backend, held in self._backends.items()}
