"""A large fleet's decision weighs a shortlist (shortlist.py): the prompt's holders, the session's
and home backend, and a window moving round the fleet; small fleets weigh everyone as before
(their decisions are pinned by tests/test_bench_decisions.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
from test_router import make_router, ok

from bench.experiments import decisions
from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.pipeline import MEMO_MODELS
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.core.shortlist import SHORTLIST_WINDOW, shortlist

FLEET = [Backend(f"10.1.0.{i}:8000") for i in range(40)]  # above the default shortlist_above (32)
AGENTS = Path(__file__).resolve().parent / "data" / "agents" / "agent-tune-head.jsonl"


def test_the_window_wraps_round_the_fleet_and_the_pools_order_is_kept():
    names = [f"b{i}" for i in range(40)]
    picked = shortlist(names, {"b20", "b3"}, turn=30)
    assert picked == ["b0", "b1", "b2", "b3", "b4", "b5", "b20", *names[30:]]
    assert len(shortlist(names, set(), turn=7)) == SHORTLIST_WINDOW


def served(router: Router, request: PromptRequest, backends: list[Backend], now: float) -> str:
    exchange = router.begin(request, backends, now)
    backend = exchange.decision.backend
    assert backend is not None
    router.response_started(exchange, ok(backend), now)
    exchange.end()
    return backend


def new_prompt(index: int, session: str | None = None) -> PromptRequest:
    body = {"model": "m", "messages": [{"role": "system", "content": f"agent {index} " * 300}]}
    body["messages"].append({"role": "user", "content": "go"})
    return parse_request(body, {"x-session-id": session} if session else {})


@pytest.mark.parametrize("mode", decisions.MODES)
def test_a_prefix_held_outside_the_window_is_still_found(mode):
    """Learned there by a sibling replica (approximate) or reported by its engine (precise): no
    decision of this replica put it there, so no home or session points at it; only the index's
    holders of the first block do."""
    router = make_router()
    far = FLEET[37].address
    body = {"model": "m", "messages": [{"role": "system", "content": "shared tools " * 400}]}
    body["messages"].append({"role": "user", "content": "go"})
    if mode == "precise":
        router.use_precise(decisions._Tokenizer())
        engine = decisions.EngineCache(decisions.BlockPool(1000))
        sample = decisions.EngineSample(0, 0, 0.0, 1.0, 128_000, decisions.ENGINE_BLOCK_TOKENS)
        router.engine_sample(far, sample, 0.0)
        tokens = decisions.prompt_tokens(body) or []
        router.engine_events(far, engine.serve(tokens)[2])
    else:
        router.peer_learned(router.chain_of(parse_request(body)), far, 0.0)
    exchange = router.begin(router.parse(orjson.dumps(body), {}), FLEET, 1.0)
    assert (exchange.decision.backend, exchange.decision.label) == (far, Label.PREFIX_MATCH)
    assert len(exchange.decision.candidates) <= SHORTLIST_WINDOW + 1  # the window and the holder
    exchange.end()


def test_a_conversation_bound_outside_the_window_stays_there():
    router = make_router()
    home = served(router, new_prompt(1, "conv"), [FLEET[25]], 0.0)
    for turn in range(1, 4):
        assert served(router, new_prompt(1, "conv"), FLEET, float(turn)) == home


def test_new_prompts_on_an_idle_fleet_go_round_all_of_it():
    router = make_router()
    placed = Counter(served(router, new_prompt(i), FLEET, float(i)) for i in range(80))
    assert len(placed) == len(FLEET) and max(placed.values()) <= 3


class Siblings:
    """Replicas telling each other at once what they learn and bind (the replay's fan-out, lag 0)."""

    def __init__(self, routers: list[Router]) -> None:
        self.routers = routers
        self.sender: Router | None = None
        for router in routers:
            router.join(self, 0)  # the same offset: only what they hear keeps them apart

    def learned(self, backend: str, chain: Sequence[int]) -> None:
        for router in self.routers:
            if router is not self.sender:
                router.peer_learned(chain, backend, 0.0)

    def bound(self, session: bytes, backend: str) -> None:
        for router in self.routers:
            if router is not self.sender:
                router.peer_bound(session, backend, 0.0)


def test_replicas_taking_turns_spread_new_conversations_round_the_fleet_as_one_router_does():
    """Each replica's rotation counts its siblings' bindings too: without that, two replicas from
    the same offset send their conversations to the same backends in pairs."""
    fleet = FLEET[:8]  # below the shortlist: ties are rotated among all of them
    # no turnover cost: what a sibling learned there does not break the ties, only the rotation does
    siblings = Siblings([make_router(eviction_cost_weight=0), make_router(eviction_cost_weight=0)])
    placed = []
    for i in range(8):
        siblings.sender = siblings.routers[i % 2]
        placed.append(served(siblings.sender, new_prompt(i, f"conversation {i}"), fleet, float(i)))
    assert len(set(placed)) == len(fleet), placed


def test_at_or_below_the_threshold_every_candidate_is_weighed():
    router = make_router(shortlist_above=40)
    exchange = router.begin(new_prompt(1), FLEET, 0.0)
    assert len(exchange.decision.candidates) == len(FLEET)
    exchange.end()


@pytest.mark.parametrize("mode", decisions.MODES)
def test_the_agent_slice_on_forty_backends_finds_as_much_cached_as_the_full_scan(mode):
    """Replayed on forty engines' block pools (bench.experiments.decisions): the shortlist's hit
    rate against the full scan's (0.404 / 0.379 approximate, 0.397 / 0.385 precise today)."""
    full = decisions.engine_hit_rate(AGENTS, 160, mode, backends=40, shortlist_above=0)
    short = decisions.engine_hit_rate(AGENTS, 160, mode, backends=40)
    assert short >= full - 0.02


def test_the_candidates_are_kept_per_model_while_the_same_tuple_comes_back():
    router = make_router()
    fleet = (*FLEET[:3], Backend("10.1.1.1:8000", models=frozenset({"other"})))
    first = router.pipeline.kept_candidates(new_prompt(1), fleet)
    assert first[0] == [b.address for b in FLEET[:3]] and first[1][FLEET[2].address] == 2
    assert router.pipeline.kept_candidates(new_prompt(2), fleet) is first  # same tuple, same model
    other = parse_request({"model": "other", "messages": [{"role": "user", "content": "hi"}]})
    assert router.pipeline.kept_candidates(other, fleet)[0] == [b.address for b in fleet]
    down = (Backend(FLEET[0].address, healthy=False), *fleet[1:])  # the pool's next tuple
    assert router.pipeline.kept_candidates(new_prompt(3), down)[0] == [b.address for b in FLEET[1:3]]


def test_a_list_of_backends_is_filtered_afresh_each_time():
    router = make_router()
    backends = list(FLEET[:3])
    router.begin(new_prompt(1), backends, 0.0).end()
    backends[0] = Backend(FLEET[0].address, healthy=False)  # changed in place: nothing kept may stand
    exchange = router.begin(new_prompt(2), backends, 1.0)
    assert FLEET[0].address not in {c.backend for c in exchange.decision.candidates}
    exchange.end()


def test_client_chosen_model_names_cannot_grow_the_memo_without_bound():
    router = make_router()
    fleet = tuple(FLEET)
    for index in range(500):
        name = parse_request({"model": f"m{index}", "messages": [{"role": "user", "content": "hi"}]})
        router.pipeline.kept_candidates(name, fleet)
    assert len(router.pipeline.memo._by_model) <= MEMO_MODELS
    router.pipeline.memo._by_model.clear()
    for index in range(3):  # a name as long as a body may be is answered, never kept
        long = parse_request({"model": f"{index}" + "x" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]})
        assert router.pipeline.kept_candidates(long, fleet)[0] == [b.address for b in fleet]
    assert not router.pipeline.memo._by_model


def test_a_request_the_shortlist_would_refuse_is_weighed_against_the_whole_fleet():
    """Every backend but the last is at its limit: the window may hold only busy ones, yet the
    request goes to the one with room rather than being refused."""
    router = make_router(max_backend_requests=1)
    fleet = tuple(FLEET)
    busy = [router.begin(new_prompt(100 + i), [backend], 0.0) for i, backend in enumerate(FLEET[:-1])]
    for turn in range(5):
        exchange = router.begin(new_prompt(turn), fleet, 1.0)
        assert exchange.decision.backend == FLEET[-1].address
        exchange.end()
    for exchange in busy:
        exchange.end()


def test_flow_controls_cost_of_a_request_is_the_same_from_the_holders_alone():
    shortlisted, scanned = make_router(), make_router(shortlist_above=0)
    fleet = tuple(FLEET)
    for router in (shortlisted, scanned):
        served(router, new_prompt(1, "conv"), [FLEET[30]], 0.0)
    assert shortlisted.cost_tokens(new_prompt(1), fleet, 1.0) == scanned.cost_tokens(new_prompt(1), fleet, 1.0)
    assert shortlisted.cost_tokens(new_prompt(1), fleet, 1.0) < shortlisted.cost_tokens(new_prompt(2), fleet, 1.0)
