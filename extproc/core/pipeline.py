"""The decision pipeline: candidates → inputs → each candidate's cost, term by term → admission →
the pick rules in order → the cheapest. Assembled here, once: a new rule is a unit in rules.py (or a
module of its own) and a line in `assemble`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from extproc.core import rules
from extproc.core.adapters import MAX_NAME, AdapterBook
from extproc.core.backends import Backend
from extproc.core.decision import CandidateCost, Decision, DecisionInputs, Label
from extproc.core.pairs import disaggregated
from extproc.core.request import PromptRequest
from extproc.core.rules import Admission, CandidateFilter, CostTerm, PickRule, Standing

_COST = attrgetter("cost")
_MATCHED = attrgetter("matched")


MEMO_MODELS = 64  # model names whose candidates are kept per backend set (clients name the model)


class CandidateMemo:
    """The filters' answer per model for one backend set, kept while the pool hands over the same
    tuple (it makes a new one when the set or its health changes): a large fleet's decision then
    does not check every backend's model and role again. Only answers that depend on nothing but
    the backends and the model are kept (no LoRA adapter named), and whether the set has prefill
    backends."""

    __slots__ = ("_backends", "_by_model", "_disaggregated")

    def __init__(self) -> None:
        self._backends: tuple[Backend, ...] | None = None
        self._by_model: dict[str, tuple[list[str], dict[str, int]]] = {}
        self._disaggregated: bool | None = None

    def get(self, backends: tuple[Backend, ...], model: str) -> tuple[list[str], dict[str, int]] | None:
        return self._by_model.get(model) if self._holds(backends) else None

    def disaggregated(self, backends: Sequence[Backend]) -> bool:
        """`pairs.disaggregated`, once per backend set handed over as a tuple."""
        if not isinstance(backends, tuple):
            return disaggregated(backends)
        if not self._holds(backends) or self._disaggregated is None:
            self._disaggregated = disaggregated(backends)
        return self._disaggregated

    def _holds(self, backends: tuple[Backend, ...]) -> bool:
        """Whether the answers kept are this set's; if not, start keeping this set's."""
        if backends is self._backends:
            return True
        self._backends = backends  # held, so its id cannot be reused while it is the key
        self._by_model = {}
        self._disaggregated = None
        return False

    def put(self, model: str, candidates: list[str]) -> tuple[list[str], dict[str, int]]:
        entry = (candidates, {c: i for i, c in enumerate(candidates)})
        if len(model) > MAX_NAME:  # a client's name of any length up to the body's: not kept
            return entry
        if len(self._by_model) >= MEMO_MODELS:
            self._by_model.clear()
        self._by_model[model] = entry
        return entry


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The stages of a decision, in order."""

    filters: Sequence[CandidateFilter]
    terms: Sequence[CostTerm]
    admission: Sequence[tuple[Admission, Label]]  # each step, and the label of a request it leaves nowhere
    rules: Sequence[PickRule]
    memo: CandidateMemo = field(default_factory=CandidateMemo)

    def candidates(self, request: PromptRequest, backends: Sequence[Backend]) -> list[str]:
        """The addresses that may serve the request, in the pool's order."""
        for keep in self.filters:
            backends = keep(request, backends)
        return [b.address for b in backends]

    def kept_candidates(
        self, request: PromptRequest, backends: tuple[Backend, ...]
    ) -> tuple[list[str], dict[str, int]]:
        """`candidates` for a request naming no LoRA adapter, from the memo where it has them, with
        each one's position (for the pool's order)."""
        found = self.memo.get(backends, request.model)
        return found if found is not None else self.memo.put(request.model, self.candidates(request, backends))

    def decide(self, inputs: DecisionInputs) -> Decision:
        """Choose among the candidates. NO_CANDIDATES with none; the admission step's own label
        (SHED, SHED_SLO) when it leaves none."""
        total = inputs.total_blocks
        returning = _returning(inputs)
        if not inputs.candidates:
            return Decision(Label.NO_CANDIDATES, None, None, 0, total, inputs.bootstrap, [], returning=returning)
        costs = self._costs(inputs)
        room = costs
        for admit, refusal in self.admission:
            room = admit(inputs, room)
            if not room:
                return Decision(refusal, None, None, 0, total, inputs.bootstrap, costs, returning=returning)
        ranked = sorted(room, key=_COST)
        bound = inputs.session_backend
        session = None
        least = room[0].load
        idle = False
        for candidate in room:  # one pass: the session's backend among the admitted, the lowest load, an idle one
            if candidate.backend == bound:
                session = candidate
            if candidate.load < least:
                least = candidate.load
            if candidate.active == 0 and candidate.load == 0:
                idle = True
        session_full = session is None and bound is not None and any(c.backend == bound for c in costs)
        best_prefix = max(map(_MATCHED, costs))
        standing = Standing(inputs, room, ranked, least, idle, best_prefix, session, session_full)
        for rule in self.rules:
            picked = rule(standing)
            if picked is not None:
                break
        else:
            picked = rules.cheapest(standing)
        chosen, label = picked
        second = next((c.backend for c in ranked if c is not chosen), None)
        backend = chosen.backend
        return Decision(
            label, backend, second, chosen.matched, total, inputs.bootstrap, costs, inputs.held(backend), returning
        )

    def _costs(self, inputs: DecisionInputs) -> list[CandidateCost]:
        churn = inputs.churn
        busiest = max(churn.values(), default=0.0) or 1.0
        active_cost = inputs.settings.active_request_cost
        now = inputs.now
        total = inputs.total_blocks
        matched = inputs.matched
        load_of = inputs.loads.get
        costs: list[CandidateCost] = []
        for backend in inputs.candidates:
            load = load_of(backend)
            active = load.requests(now)
            held = matched.get(backend, 0)
            costs.append(
                CandidateCost(
                    backend,
                    held,
                    total - held,
                    load.reserved_blocks,
                    active,
                    load.cost(active_cost, active),
                    churn.get(backend, 0.0) / busiest,
                    0.0,
                )
            )
        for term in self.terms:
            term(inputs, costs)
        return costs


def _returning(inputs: DecisionInputs) -> tuple[int, int] | None:
    """A returning conversation: what its last prompt put on its backend, what the picture shows."""
    backend = inputs.session_backend
    if backend is None or not inputs.session_blocks:
        return None
    return inputs.session_blocks, inputs.held(backend)


def assemble(adapters: AdapterBook) -> Pipeline:
    """kvroute's decision, stage by stage, with the fleet's LoRA adapters as the engines report them."""
    affinity = rules.AdapterAffinity(adapters)
    return Pipeline(
        filters=(affinity.serving, affinity.listing),
        terms=(rules.prefill_cost, rules.load_cost, affinity.cost, rules.kv_room),
        admission=((rules.backend_limit, Label.SHED), (rules.ttft_objective, Label.SHED_SLO)),
        rules=(rules.context_elsewhere, rules.session_binding, rules.prefix_stickiness, rules.prefix_home),
    )
