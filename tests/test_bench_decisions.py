"""`bench decisions`, the routing-change detector: deterministic in both index modes, on the real
agent slice with its own session ids. The digests below are today's routing: a commit that means
to change routing updates them and says so; a refactor must leave them as they are."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from bench.experiments import decisions
from bench.workloads import skew

AGENTS = Path(__file__).resolve().parent / "data" / "agents" / "agent-tune-head.jsonl"
DIGESTS = {
    "approximate": "410386ab38f1fbb192cf8ae7a98383ba0e7a71f8feb0f652e66e07c0d34d929a",
    "precise": "71c4f3864df66227e20d60ca41749b2e80e9317f18f0683f37459fb8d4a927db",
}


@pytest.mark.parametrize("mode", decisions.MODES)
def test_the_agent_slice_routes_as_it_did_in_both_modes(mode, tmp_path):
    result = decisions.run(AGENTS, 160, tmp_path / "decisions.txt", mode)
    assert result["sessions"] == "trace" and result["requests"] == 160
    # 91 sessions, 69 returning turns: each finds its session where it left it, and its prefix
    # there (precise mode from the engines' events alone)
    assert result["labels"]["session_match"] == 69 and result["hit_rate"] > 0.2
    assert result["digest"] == DIGESTS[mode], (tmp_path / "decisions.txt").read_text()[:2000]


@pytest.mark.parametrize("mode", decisions.MODES)
def test_the_placement_replay_counts_what_the_engines_found_cached(mode):
    """`engine_hit_rate`: what two engines' block pools found cached when kvroute placed the agent
    slice. Deterministic; as good as one cache as large as both on this slice (kvroute keeps each
    conversation where its context is); far lower when the caches hold a tenth as much."""
    rate = decisions.engine_hit_rate(AGENTS, 160, mode)
    assert rate == decisions.engine_hit_rate(AGENTS, 160, mode)
    one_cache = decisions.engine_hit_rate(AGENTS, 160, mode, backends=1)
    assert rate > 0.2 and rate >= 0.95 * one_cache
    assert decisions.engine_hit_rate(AGENTS, 160, mode, capacity_ratio=0.05) < 0.5 * rate


@pytest.mark.slow
@pytest.mark.parametrize("mode", decisions.MODES)
def test_four_replicas_sharing_find_as_much_cached_as_one(mode):
    """The replay with four routers taking the requests in turn, telling each other what they
    learn and bind two requests late (as the Redis link does a round trip late): as good as one
    router; in approximate mode, replicas that do not share lose most of it."""
    one = decisions.engine_hit_rate(AGENTS, 160, mode, backends=4)
    shared = decisions.engine_hit_rate(AGENTS, 160, mode, backends=4, replicas=4, lag=2)
    assert shared >= 0.95 * one
    if mode == "approximate":
        assert decisions.engine_hit_rate(AGENTS, 160, mode, backends=4, replicas=4, lag=2, shared=False) < 0.5 * shared


@pytest.mark.slow
def test_a_conversation_whose_context_is_gone_is_placed_by_the_cost_in_the_replay():
    """`release_evicted_sessions`: a conversation whose backend no longer shows half its prompt is
    not held there (rules.session_binding). Replayed over the tuning slice's 480 requests on two
    engines holding half the working set, the engines find more cached with it than without."""
    with_rule = decisions.engine_hit_rate(AGENTS, 480, "approximate", release_evicted_sessions=True)
    without = decisions.engine_hit_rate(AGENTS, 480, "approximate", release_evicted_sessions=False)
    assert with_rule > without + 0.01


@pytest.mark.slow
def test_the_skewed_workload_replayed_with_engine_queues_keeps_its_contexts_with_kv_room(tmp_path):
    """`kv_room_everywhere`: with vLLM's queue in the replay, the skewed workload's long
    conversations (up to 27,000 tokens, engines of about 29,000) no longer wait on one engine
    while the running one evicts their contexts (on vLLM-CPU, 0.63-0.74 against 0.23-0.65 without
    the term: docs/benchmarks.md, "KV room in every fleet")."""
    trace = tmp_path / "skewed.jsonl"
    skew.write(trace, skew.SHAPES["skewed"])
    settings = {"capacity_ratio": 0.3, "max_input_tokens": None, "engine_queue": True}
    replay = functools.partial(decisions.engine_hit_rate, trace, 244, "approximate", **settings)
    assert replay(kv_room_everywhere=True) > replay(kv_room_everywhere=False) + 0.15
