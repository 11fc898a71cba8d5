"""Decision values: what a decision reads (`DecisionInputs`), what it weighed per candidate
(`CandidateCost`), what it chose and why (`Decision`, `Label`). The stages that turn one into the
other are in pipeline.py, the rules themselves in rules.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from extproc.core.adapters import Affinity
from extproc.core.load import LoadTracker
from extproc.core.settings import Settings
from extproc.core.ttft import TTFTModel


class Label(StrEnum):
    """Why a backend was chosen; exported as `x-kvroute-decision` and a metric label."""

    SESSION_MATCH = "session_match"
    PREFIX_MATCH = "prefix_match"
    PREFIX_HOME = "prefix_home"  # no cache shows the prompt's head: sent where that head was first placed
    LEAST_LOADED = "least_loaded"
    LOAD_OVERRIDE = "load_override"
    NO_CANDIDATES = "no_candidates"
    FALLBACK = "fallback"
    SHED = "shed"  # every candidate at max_backend_requests: answered 429, routed nowhere
    # a sheddable request no candidate is predicted to serve within its TTFT objective: 429
    SHED_SLO = "shed_slo"
    # the prefill leg of a request split between a prefill and a decode backend (pairs.py): the
    # request's own label says why its decode backend was chosen
    PREFILL = "prefill"
    # the cheapest candidate, cheapest because its LoRA adapter is running there or a slot is free
    # (adapters.py): without that term another one would have been chosen
    ADAPTER_AFFINITY = "adapter_affinity"
    # the cheapest candidate, cheapest because the others' engines lack KV room for the prompt
    # (rules.kv_room): without that term another one would have been chosen
    KV_ROOM = "kv_room"


_NO_CHURN: Mapping[str, float] = MappingProxyType({})


class DecisionInputs(NamedTuple):
    """Everything one decision reads, gathered once by the router: every rule reads from here.
    Immutable; a named tuple, so that making one per request costs a tuple (a frozen dataclass
    cost five times as much: `kvroute-dev bench core`). Build it by keyword."""

    candidates: Sequence[str]  # backends that may serve the request (healthy, serving its model)
    matched: Mapping[str, int]  # leading blocks each holds, as decisions weigh them (after trust)
    total_blocks: int  # blocks in the request's chain
    loads: LoadTracker
    settings: Settings
    now: float
    turn: int = 0  # rotates ties, so identical requests do not herd
    churn: Mapping[str, float] = _NO_CHURN  # recent cache turnover per candidate
    picture: Mapping[str, int] | None = None  # the picture before trust (None: as `matched`)
    session_backend: str | None = None  # where the request's session is bound
    # blocks the session's last prompt put there, which this prompt continues (0: it does not, or
    # that prompt is not known here: sessions.continued)
    session_blocks: int = 0
    bootstrap: bool = False  # a conversation's first request (or one kvroute cannot chain)
    home: str | None = None  # where the prompt's head was first placed (homes.py)
    gate_factor: float = 1.0  # how much the balance gates are widened under cache pressure (pressure.py)
    block_tokens: float = 0.0  # tokens per block of the chain (saturation_prefill_tokens reads it)
    home_ties: bool = True  # the home wins among backends holding as much of the prompt
    ttft_objective_s: float | None = None  # the request's TTFT objective, if it has one
    sheddable: bool = False  # it may be refused rather than served late
    ttft: TTFTModel | None = None  # each backend's predicted time to first token (ttft.py)
    adapter: str | None = None  # the LoRA adapter the request names, if an engine has reported it
    # blocks each candidate's KV cache has free of the requests in flight there, where its size is
    # reported (rules.kv_room); None: KV room not weighed (kv_room_everywhere off, a fleet that does
    # not split)
    kv_room: Mapping[str, float] | None = None

    def held(self, backend: str) -> int:
        """Blocks the picture (before trust) shows on the backend."""
        return (self.matched if self.picture is None else self.picture).get(backend, 0)


@dataclass(slots=True)
class CandidateCost:
    """One candidate's terms in the decision, for explanations and debugging."""

    backend: str
    matched: int
    novel: int
    reserved: int
    active: int  # in-flight requests: kvroute's own or the engine's count (BackendLoad.requests)
    load: float
    churn: float
    cost: float
    adapter: Affinity | None = None  # how it stands for the request's LoRA adapter (None: no adapter)
    prefill_cost: float = 0.0  # each term's share of `cost`: the prefill it would compute,
    load_cost: float = 0.0  # the work waiting there,
    adapter_cost: float = 0.0  # its LoRA adapter's slot,
    kv_room_cost: float = 0.0  # and its engine's KV room


class Decision(NamedTuple):
    """The outcome of one query: the backend, a second choice for retries, and why. Immutable
    (a named tuple: one is made per request)."""

    label: Label
    backend: str | None
    second: str | None
    matched_blocks: int
    total_blocks: int
    bootstrap: bool
    candidates: list[CandidateCost]
    picture_blocks: int = 0  # what kvroute's picture held on the chosen backend, before trust (trust.py)
    # A returning conversation: blocks its last prompt put on its backend, and how many of them the
    # picture still shows there (pressure.py)
    returning: tuple[int, int] | None = None

    def explain(self) -> dict[str, Any]:
        """A JSON-ready account of the decision."""
        return {
            "decision": self.label.value,
            "backend": self.backend,
            "second": self.second,
            "matched_blocks": self.matched_blocks,
            "total_blocks": self.total_blocks,
            "bootstrap": self.bootstrap,
            "candidates": [
                {
                    "backend": c.backend,
                    "matched": c.matched,
                    "novel": c.novel,
                    "reserved": c.reserved,
                    "active": c.active,
                    "load": c.load,
                    "churn": round(c.churn, 4),
                    "cost": c.cost,
                    "prefill_cost": round(c.prefill_cost, 4),
                    "load_cost": round(c.load_cost, 4),
                    **({} if c.adapter is None else {"adapter": c.adapter.value, "adapter_cost": c.adapter_cost}),
                    **({"kv_room_cost": round(c.kv_room_cost, 4)} if c.kv_room_cost else {}),
                }
                for c in self.candidates
            ],
        }


def overloaded(load: float, least: float, settings: Settings, factor: float = 1.0) -> bool:
    """Past both gates, each widened by `factor`: busier than the least loaded by an absolute
    amount and by a ratio."""
    return load - least > factor * settings.balance_abs_gate and load > factor * settings.balance_rel_gate * least
