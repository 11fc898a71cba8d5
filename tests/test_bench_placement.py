"""`bench placement`: the timed closed loop that judges where conversations are placed."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from bench.experiments import placement
from bench.experiments.decisions import ENGINE_BLOCK_TOKENS, QueuedEngines, ReplayedRequest
from bench.simulator.sim import block_hashes
from extproc.core.backends import Backend

AGENTS = Path(__file__).resolve().parent / "data" / "agents" / "agent-tune-head.jsonl"
ONE = (Backend("10.0.0.0:8000"),)


def _turn(session: str, first_token: int, blocks: int) -> placement.Turn:
    tokens = list(range(first_token, first_token + blocks * ENGINE_BLOCK_TOKENS))
    return placement.Turn(session, {}, tokens, block_hashes(tokens, ENGINE_BLOCK_TOKENS))


def _two_conversations(second_turn_of_a_at: float) -> placement.Workload:
    """Conversations a and b of two turns each, the same two-block prompt every turn, on one
    engine that holds one of them; b arrives at 1, a's second turn at `second_turn_of_a_at`."""
    a, b = _turn("a", 0, 2), _turn("b", 10_000, 2)
    return placement.Workload([[a, a], [b, b]], [[0.0, second_turn_of_a_at], [1.0, 3.0]], 2, ONE)


def test_one_client_sends_the_earliest_ready_turn_and_the_engine_keeps_what_it_can():
    """One client, an engine holding one conversation: a's second turn, ready before b's first,
    goes first and finds a's prompt (then b's two turns: one miss, one hit): half the prompt
    cached. Arriving after b's first turn, it finds b there instead, and so does b's second."""
    served_in_turn, _ = placement.replay(_two_conversations(0.5), placement.FixedPlacement(ONE, {}), clients=1)
    assert served_in_turn == 0.5
    interleaved, _ = placement.replay(_two_conversations(2.0), placement.FixedPlacement(ONE, {}), clients=1)
    assert interleaved == 0.0


def test_an_engine_shares_its_compute_among_its_running_requests():
    """Two requests running on one engine, needing 1 s and 3 s of it alone: the short one ends
    after 2 s (it had half the engine), the long one has 2 s of work left."""
    engines = QueuedEngines(ONE, 100, True, None)
    short, long = (placement._Sent(ReplayedRequest(None, ONE[0].address, list(range(128))), g) for g in (0, 1))
    for sent, work in ((short, 1.0), (long, 3.0)):
        engines.arrive(sent.request)
        sent.left = work
    assert placement._advance([short, long], engines, random.Random(0), 2500.0, 0.05) == 2.0
    assert short.left == 0.0 and long.left == 2.0


def test_the_agent_slice_replays_the_same_for_the_same_seed_and_the_search_finds_more():
    """Deterministic per seed for kvroute and sglang-router's rule; the hindsight search, started
    from where kvroute placed each conversation, ends with a higher mean than its start."""
    workload = placement.load(AGENTS, 120)
    fleet, blocks = workload.fleet, workload.blocks
    kvroute, first = placement.replay(workload, placement.KvroutePlacement(fleet, blocks), seed=3)
    assert (kvroute, first) == placement.replay(workload, placement.KvroutePlacement(fleet, blocks), seed=3)
    assert 0.1 < kvroute < 1.0 and set(first) == set(workload.sessions)
    rule = placement.replay(workload, placement.SglangRule(fleet), seed=3)[0]
    assert rule == placement.replay(workload, placement.SglangRule(fleet), seed=3)[0] and 0.1 < rule < 1.0
    start = {session: [b.address for b in fleet].index(backend) for session, backend in first.items()}
    before, _ = placement.mean_hit_rate(workload, lambda: placement.FixedPlacement(fleet, start), [3])
    after, found = placement.search(workload, start, [3], sweeps=1)
    assert after > before and found != start


def test_kvroute_learns_a_turn_as_it_is_sent_or_at_its_end_as_over_ext_authz():
    """`learn_at`: send learns the prompt with the decision; end only binds the session and makes
    room then (`Router.sent`), and learns the prompt when the turn ends, as the access log tells."""
    workload = placement.load(AGENTS, 4)
    turn = workload.conversations[0][0]
    engines = QueuedEngines(workload.fleet, workload.blocks, True, None)
    for learn_at, learned_at_once in (("send", True), ("end", False)):
        kvroute = placement.KvroutePlacement(workload.fleet, workload.blocks, learn_at)
        router = kvroute.router
        request = router.parse(orjson.dumps(turn.body), {"x-session-id": turn.session})
        backend, exchange = kvroute.place(turn, 0.0, engines)
        held = router.index.lookup(router.chain_of(request), [backend], 0.5).get(backend, 0)
        assert (held > 0) is learned_at_once, learn_at
        assert router.sessions.get(request.session_key, 0.5) == backend
        kvroute.ended(ReplayedRequest(exchange, backend, turn.tokens), 1.0)
        assert router.index.lookup(router.chain_of(request), [backend], 1.5).get(backend, 0) > 0
    with pytest.raises(ValueError):
        placement.KvroutePlacement(workload.fleet, workload.blocks, "start")
