"""Decision: pick a backend by session, cached prefix and load, and say why.

Cost of sending a request to backend b, in blocks of prefill:
    novel_b * (1 + eviction_cost_weight * churn_b) + w * (reserved_b + active_request_cost * active_b)
where novel_b is the part of the prompt b has not cached, churn_b how fast b's cache has been
turning over lately relative to the busiest candidate (0 to 1: new blocks there evict useful
ones sooner), active_b the backend's in-flight requests (kvroute's own, or the engine's running +
waiting count when that is higher and fresh), and w is 1 for follow-ups and
`new_session_load_weight` for bootstrap requests (placing one places its whole conversation).
So a cached prefix wins until its backend is busier than the prefill it saves, and new prompts
spread the fleet's cache evenly instead of overfilling one backend.

Two bindings win outright unless their backend is past both balance gates: a session's, and
that of a backend already holding at least `prefix_stick_ratio` of the prompt. Moving such a
request would not only recompute its prefix but copy the conversation into a second cache,
which under cache pressure evicts someone else's. Where several backends hold as much of it, the
prompt head's home (homes.py) is that backend while the caches hold what returning conversations
need (`home_ties`): otherwise one copy made while the home was busy would draw half of the head's
new conversations into a second cache for good. Where caches are starved that copy spreads them,
which pays more, so the cheaper holder is taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from extproc.core.load import LoadTracker, Reservation
from extproc.core.settings import Settings


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


@dataclass(slots=True)
class Decision:
    """The outcome of one query: the backend, a second choice for retries, and why."""

    label: Label
    backend: str | None
    second: str | None
    matched_blocks: int
    total_blocks: int
    bootstrap: bool
    candidates: list[CandidateCost]
    reservation: Reservation | None = None
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
                }
                for c in self.candidates
            ],
        }


def overloaded(load: float, least: float, settings: Settings, factor: float = 1.0) -> bool:
    """Past both gates, each widened by `factor`: busier than the least loaded by an absolute
    amount and by a ratio."""
    return load - least > factor * settings.balance_abs_gate and load > factor * settings.balance_rel_gate * least


def decide(
    candidates: Sequence[str],
    matched: Mapping[str, int],
    churn: Mapping[str, float],
    total_blocks: int,
    loads: LoadTracker,
    session_backend: str | None,
    bootstrap: bool,
    settings: Settings,
    turn: int,
    now: float,
    home: str | None = None,
    gate_factor: float = 1.0,
    home_ties: bool = True,
) -> Decision:
    """Choose among candidates. `turn` rotates ties so identical requests do not herd. `home`:
    where the prompt's head was first placed (homes.py), taken when no candidate holds any of it
    and preferred among those holding the most of it.
    `gate_factor`: how much the balance gates are widened under cache pressure (pressure.py).
    `home_ties`: the home wins among backends holding as much of the prompt (off when starved).

    FALLBACK is never chosen here: Router.fallback gives it to requests it could not read.
    """
    if not candidates:
        return Decision(Label.NO_CANDIDATES, None, None, 0, total_blocks, bootstrap, [])
    weight = settings.new_session_load_weight if bootstrap else 1.0
    costs: list[CandidateCost] = []
    busiest = max(churn.values(), default=0.0) or 1.0
    for backend in candidates:
        load = loads.get(backend)
        busy = load.cost(settings.active_request_cost, now)
        held = matched.get(backend, 0)
        novel = total_blocks - held
        turnover = churn.get(backend, 0.0) / busiest
        cost = novel * (1 + settings.eviction_cost_weight * turnover) + weight * busy
        costs.append(
            CandidateCost(backend, held, novel, load.reserved_blocks, load.requests(now), busy, turnover, cost)
        )
    limit = settings.max_backend_requests
    room = [c for c in costs if c.active < limit] if limit else costs  # a backend at the limit takes no more
    if not room:
        return Decision(Label.SHED, None, None, 0, total_blocks, bootstrap, costs)
    ranked = sorted(room, key=lambda c: c.cost)
    least = min(c.load for c in room)
    best_prefix = max(c.matched for c in costs)

    session = next((c for c in room if c.backend == session_backend), None)
    session_full = session is None and any(c.backend == session_backend for c in costs)
    homed = next((c for c in room if c.backend == home), None)
    holder = max(room, key=lambda c: c.matched)
    if home_ties and homed is not None and homed.matched >= holder.matched:
        holder = homed  # a copy made while the home was busy must not draw the head's next prompts away
    sticky = total_blocks > 0 and holder.matched >= settings.prefix_stick_ratio * total_blocks
    if session is not None and not overloaded(session.load, least, settings, gate_factor):
        chosen, label = session, Label.SESSION_MATCH
    elif session is None and not session_full and sticky and not overloaded(holder.load, least, settings, gate_factor):
        chosen, label = holder, Label.PREFIX_MATCH
    elif (
        session is None
        and not session_full
        and best_prefix == 0
        and homed is not None
        and not overloaded(homed.load, least, settings, gate_factor)
    ):
        chosen, label = homed, Label.PREFIX_HOME
    else:
        tied = [c for c in ranked if c.cost <= ranked[0].cost]
        chosen = tied[turn % len(tied)]
        if session_full or (session is not None and chosen is not session):
            label = Label.LOAD_OVERRIDE
        elif best_prefix == 0:
            label = Label.LEAST_LOADED
        elif chosen.matched == best_prefix:
            label = Label.PREFIX_MATCH
        else:
            label = Label.LOAD_OVERRIDE
    second = next((c.backend for c in ranked if c is not chosen), None)
    return Decision(label, chosen.backend, second, chosen.matched, total_blocks, bootstrap, costs)
