"""LoRA adapters: which backend has a request's adapter at hand, and what serving it there costs.

vLLM serves an adapter under its own model name. An engine holds at most `max_loras` adapters in
its slots at once: a request for another one waits until a slot frees (every request of an
adapter there has ended), then the adapter is swapped in, evicting one. So a request goes first
where its adapter is running, then where a slot is free, and last where it must wait and evict,
weighed with its cached prefix and the backend's load in the same cost (rules.py).

What each engine says: its adapters (`/v1/models`: those it can serve without a load), the
adapters of its running and waiting requests and its slot count (`vllm:lora_requests_info`),
late by a scrape. What kvroute knows at once: its own requests in flight there, by adapter
(load.py). A backend's running set is the union of the two.

Every name comes from an engine or a client, so every table here is bounded: names longer than
`MAX_NAME` or not shaped like a model id are ignored, at most `MAX_LISTED` per backend listing or
running set are kept. The fleet's adapter names are those some backend lists or runs now, and the
`MAX_KNOWN` last seen of those none holds any more (an adapter idle everywhere still gets its
affinity weighed); a request naming anything else is routed as a base-model request. So departed
backends or unloaded adapters cannot fill the table for good.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from extproc.core.load import ENGINE_SAMPLE_MAX_AGE_S, BackendLoad

MAX_NAME = 256
MAX_LISTED = 1024  # adapters kept per backend listing (and per running set)
MAX_KNOWN = 4096  # adapter names no backend holds now, remembered, the least recently held forgotten first
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class Affinity(StrEnum):
    """How a backend stands for a request's adapter, best first."""

    RUNNING = "adapter_running"  # a request of it runs or waits there: in a slot now
    FREE_SLOT = "adapter_free_slot"  # not in use there, but a slot is free to swap it in
    EVICT = "adapter_evict"  # every slot is held by other adapters: it waits, then evicts one


def valid_name(name: str) -> bool:
    """Shaped like a model id and of bounded length."""
    return len(name) <= MAX_NAME and _NAME.fullmatch(name) is not None


@dataclass(slots=True)
class EngineAdapters:
    """One backend's adapters as its engine last reported them."""

    listed: frozenset[str] | None = None  # what /v1/models lists (None: not said)
    leaving: frozenset[str] = frozenset()  # listed, but placement is moving them off (not routed to)
    running: frozenset[str] = frozenset()  # adapters of requests running or waiting there
    slots: int | None = None  # max_loras (None: not said)
    engine_at: float = float("-inf")  # when running/slots were sampled


class AdapterBook:
    """The fleet's adapters, per backend: what the engines report, bounded."""

    __slots__ = ("_backends", "_held", "_known")

    def __init__(self) -> None:
        self._backends: dict[str, EngineAdapters] = {}
        self._held: dict[str, int] = {}  # name -> how many backends' listings and running sets name it
        self._known: OrderedDict[str, None] = OrderedDict()  # names none holds now, least recently held first

    def _entry(self, backend: str) -> EngineAdapters:
        entry = self._backends.get(backend)
        if entry is None:
            entry = self._backends[backend] = EngineAdapters()
        return entry

    @staticmethod
    def _names(names: Iterable[str], limit: int) -> frozenset[str]:
        kept: set[str] = set()
        for name in names:
            if len(kept) >= limit:
                break
            if valid_name(name):
                kept.add(name)
        return frozenset(kept)

    def _recount(self, old: frozenset[str] | None, new: frozenset[str] | None) -> None:
        """A listing or running set replaced: the fleet's names follow (one its last holder drops
        is remembered among the `MAX_KNOWN` last)."""
        held, known = self._held, self._known
        for name in old or ():
            count = held[name] - 1
            if count:
                held[name] = count
            else:
                del held[name]
                known[name] = None
                if len(known) > MAX_KNOWN:
                    known.popitem(last=False)
        for name in new or ():
            count = held.get(name, 0)
            if not count:
                known.pop(name, None)
            held[name] = count + 1

    def listing(self, backend: str, adapters: Iterable[str]) -> None:
        """The adapters a backend lists (`/v1/models` entries with a parent model)."""
        entry = self._entry(backend)
        listed = self._names(adapters, MAX_LISTED)
        self._recount(entry.listed, listed)
        entry.listed = listed
        if entry.leaving:  # gone from the listing: moved off
            entry.leaving &= entry.listed

    def engine(self, backend: str, running: Iterable[str], slots: int | None, now: float) -> None:
        """The adapters of a backend's running and waiting requests, and its slot count."""
        entry = self._entry(backend)
        names = self._names(running, MAX_LISTED)
        self._recount(entry.running, names)
        entry.running = names
        entry.slots = slots if slots is None or slots > 0 else None
        entry.engine_at = now

    def lists(self, backend: str, adapter: str) -> bool:
        """The backend's listing names the adapter, and it is not being moved off (not said: no)."""
        entry = self._backends.get(backend)
        return (
            entry is not None and entry.listed is not None and adapter in entry.listed and adapter not in entry.leaving
        )

    def has(self, backend: str, adapter: str) -> bool:
        """The backend's listing names the adapter, moved off or not: it can serve it now."""
        entry = self._backends.get(backend)
        return entry is not None and entry.listed is not None and adapter in entry.listed

    def any_leaving(self) -> bool:
        """Some copy is being moved off (here or, told through the store, by a sibling replica)."""
        return any(entry.leaving for entry in self._backends.values())

    def listed_now(self, backend: str, adapter: str, present: bool) -> None:
        """A load (or unload) just done there: the listing says so before the next read of it."""
        entry = self._entry(backend)
        listed = entry.listed or frozenset()
        now = self._names([*listed, adapter], MAX_LISTED) if present else listed - {adapter}
        self._recount(entry.listed, now)
        entry.listed = now
        entry.leaving -= {adapter}

    def leave(self, backend: str, adapter: str, leaving: bool = True) -> None:
        """Placement moves `adapter` off `backend` (listed there): new requests no longer go there,
        those in flight end where they are, until it is unloaded (or `leaving` is False)."""
        entry = self._backends.get(backend)
        if entry is None or entry.listed is None or adapter not in entry.listed:
            return
        entry.leaving = entry.leaving | {adapter} if leaving else entry.leaving - {adapter}

    def runs(self, backend: str, adapter: str, now: float) -> bool:
        """The engine's fresh report has a request of the adapter running or waiting there."""
        return adapter in self._reported(self._backends.get(backend), now)

    def slot_share(self, backend: str, load: BackendLoad, now: float) -> float:
        """How full the backend's slots are with adapters in use (0 when it has not said)."""
        entry = self._backends.get(backend)
        if entry is None or entry.slots is None:
            return 0.0
        return len(load.adapters.keys() | self._reported(entry, now)) / entry.slots

    @staticmethod
    def _reported(entry: EngineAdapters | None, now: float) -> frozenset[str]:
        """The adapters an engine's report has running or waiting, while the report is fresh."""
        if entry is None or now - entry.engine_at > ENGINE_SAMPLE_MAX_AGE_S:
            return frozenset()
        return entry.running

    def remove_backend(self, backend: str) -> None:
        entry = self._backends.pop(backend, None)
        if entry is not None:
            self._recount(entry.listed, None)
            self._recount(entry.running, None)

    def adapter_of(self, model: str) -> str | None:
        """`model` if it names an adapter some engine lists or runs now, or did lately, else None
        (a base model)."""
        return model if model in self._held or model in self._known else None

    def listers(self, adapter: str, backends: Sequence[str]) -> list[str]:
        """Of `backends`, those that list `adapter` or have not said what they list; those moving it
        off only if no other one lists it (a move called off, or a new copy not heard of yet)."""
        listing: list[str] = []
        unsaid: list[str] = []
        leaving: list[str] = []
        for backend in backends:
            entry = self._backends.get(backend)
            if entry is None or entry.listed is None:
                unsaid.append(backend)
            elif adapter in entry.listed:
                (leaving if adapter in entry.leaving else listing).append(backend)
        return listing + unsaid if listing else unsaid + leaving

    def affinity(self, backend: str, load: BackendLoad, adapter: str, now: float) -> Affinity:
        """How `backend` stands for a request of `adapter` now: its engine's last report (while
        fresh) joined with kvroute's own requests in flight there."""
        entry = self._backends.get(backend)
        in_use = load.adapters.keys() | self._reported(entry, now)
        if adapter in in_use:
            return Affinity.RUNNING
        if entry is None or entry.slots is None:
            return Affinity.FREE_SLOT  # nothing said about its slots: assume room
        return Affinity.FREE_SLOT if len(in_use) < entry.slots else Affinity.EVICT

    def state(self) -> dict[str, dict[str, object]]:
        """For /debug/state."""
        return {
            backend: {
                "listed": None if e.listed is None else sorted(e.listed),
                "leaving": sorted(e.leaving),
                "running": sorted(e.running),
                "slots": e.slots,
            }
            for backend, e in self._backends.items()
        }
