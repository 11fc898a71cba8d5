"""Which prefill backend takes a request's prefill leg, if the request is split at all.

A request is decided as always among the backends that serve whole requests and decode legs
(roles decode and both): that backend decodes. It is split only when that pays: when at least
`pd_threshold_tokens` of its prompt are not cached there (a short or mostly cached prompt costs
less served whole than handed over), and a prefill backend (role prefill, or both but another
one) serves its model. Among those, the prefill goes where it costs least: the blocks it would
compute there plus the prefill already reserved there (every replica's), so a prefill backend
that holds the prompt's prefix wins until its queue is longer than the prefill it saves. And
the leg is run only if that costs no more than the decode backend prefilling the request itself
(its own prefill reserved there, this request's included): with its prefill backends queued
deeper than the decode backend, a request is served whole (Dynamo's conditional disaggregation
by prefill load; measured in docs/benchmarks.md: one prefill server for every long prompt of six
clients queued its legs past their timeout). In a flexible fleet (`pd_flexible`: every server a
KV connector in both roles) a backend of role both may prefill for another too, but only where
that costs strictly less: between equals a hand-off adds the transfer and gains nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from extproc.core.backends import Backend, Role
from extproc.core.load import LoadTracker

PREFILLS = frozenset({Role.PREFILL, Role.BOTH})


def disaggregated(backends: Iterable[Backend]) -> bool:
    """The fleet has prefill backends (every backend `both` is an ordinary, aggregated fleet)."""
    return any(b.role is Role.PREFILL for b in backends)


def prefill_candidates(backends: Sequence[Backend], model: str, decode: str, flexible: bool) -> list[Backend]:
    """Healthy backends that may prefill for a request of `model` decoded on `decode`; none in a
    fleet without prefill backends (`disaggregated`) unless it is `flexible`."""
    if not flexible and not disaggregated(backends):
        return []
    return [b for b in backends if b.role in PREFILLS and b.healthy and b.serves(model) and b.address != decode]


def splits(uncached_tokens: float, threshold_tokens: int) -> bool:
    """Whether a prompt with this much uncached where it decodes is worth handing over."""
    return threshold_tokens > 0 and uncached_tokens >= threshold_tokens


def cheapest_prefill(
    candidates: Sequence[Backend], matched: Mapping[str, int], total_blocks: int, loads: LoadTracker, decode: str
) -> tuple[str, int] | None:
    """(backend, blocks it holds) where the prefill costs least, blocks to compute plus blocks
    reserved ahead (ties to the first candidate), if no more than `decode`'s reserved prefill
    (the request's own included), strictly less for a backend of role both: else None, served
    whole."""
    best: tuple[int, Backend, int] | None = None
    for candidate in candidates:
        held = matched.get(candidate.address, 0)
        cost = (total_blocks - held) + _queued(loads, candidate.address)
        if best is None or cost < best[0]:
            best = (cost, candidate, held)
    if best is None:
        return None
    cost, chosen, held = best
    limit = _queued(loads, decode)
    if cost > limit or (cost == limit and chosen.role is Role.BOTH):
        return None
    return chosen.address, held


def _queued(loads: LoadTracker, backend: str) -> int:
    """Prefill blocks reserved on `backend` by every replica."""
    load = loads.get(backend)
    return load.reserved_blocks + load.peer_reserved
