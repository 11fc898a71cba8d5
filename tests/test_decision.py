"""The decision rule alone: candidates, matched blocks, churn and load in, backend and label out.

No parsing and no hashing: every input is given directly, so each gate and label is pinned down.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from extproc.core.adapters import AdapterBook
from extproc.core.decision import DecisionInputs, Label, overloaded
from extproc.core.load import LoadTracker
from extproc.core.pipeline import assemble
from extproc.core.settings import Settings

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
PIPELINE = assemble(AdapterBook())
# gates: abs 32, rel 1.5; active request = 4 blocks; stick at 0.5; a session moves once past the gates
# (the default also waits for its backend to be saturated: the last test)
SETTINGS = Settings(hash_key=bytes(16), session_moves="gates")


def loads(**active: int) -> LoadTracker:
    """In-flight requests per backend (a=2 puts two on A)."""
    tracker = LoadTracker()
    for name, count in active.items():
        for _ in range(count):
            tracker.reserve({"a": A, "b": B, "c": C}[name], 0)
    return tracker


def run(matched: dict[str, int] | None = None, total: int = 20, **kw: Any):
    args = {
        "candidates": [A, B, C],
        "matched": matched or {},
        "churn": {},
        "total_blocks": total,
        "loads": LoadTracker(),
        "session_backend": None,
        "bootstrap": False,
        "settings": SETTINGS,
        "turn": 0,
        "now": 0.0,
    }
    args.update(kw)
    return PIPELINE.decide(DecisionInputs(**args))


def test_no_candidates():
    decision = run(candidates=[])
    assert (decision.label, decision.backend, decision.second) == (Label.NO_CANDIDATES, None, None)


def test_nothing_cached_goes_least_loaded():
    decision = run(loads=loads(a=1, b=2))
    assert (decision.label, decision.backend) == (Label.LEAST_LOADED, C)


def test_session_wins_while_its_backend_is_within_the_gates():
    decision = run({A: 10, C: 20}, session_backend=A, loads=loads(a=8))  # A: 32 blocks of load, exactly at the abs gate
    assert (decision.label, decision.backend) == (Label.SESSION_MATCH, A)


def test_a_conversation_whose_backend_lost_its_context_follows_it_to_a_backend_holding_it():
    """Its backend shows under prefix_stick_ratio (0.5) of the prompt, another at least that: the
    conversation goes there rather than computing the prompt again where it was."""
    moved = run({A: 9, C: 10}, session_backend=A)
    assert (moved.label, moved.backend) == (Label.PREFIX_MATCH, C)
    still_held = run({A: 10, C: 20}, session_backend=A)  # half of it is still there: it stays
    assert (still_held.label, still_held.backend) == (Label.SESSION_MATCH, A)
    learned = {"session_backend": A, "session_blocks": 20}  # its last prompt was learned there
    releases = Settings(hash_key=bytes(16), session_moves="gates", release_evicted_sessions=True)
    nowhere = run({A: 0, C: 9}, settings=releases, **learned)  # no backend holds half of it: the cost decides
    assert (nowhere.label, nowhere.backend) == (Label.PREFIX_MATCH, C)
    least = run({A: 2, C: 2}, loads=loads(a=2), settings=releases, **learned)  # nothing holds it: the cheapest
    assert (least.label, least.backend) == (Label.LOAD_OVERRIDE, C)  # (within the gates, A would keep it)
    assert run({A: 0, C: 9}, **learned).backend == A  # with the rule off (the default) it stays
    unlearned = run({A: 0, C: 9}, session_backend=A, settings=releases)  # bound as it was sent, not learned yet
    assert (unlearned.label, unlearned.backend) == (Label.SESSION_MATCH, A)
    busy = run({C: 20}, session_backend=A, loads=loads(c=9))  # the holder is past both gates: it stays
    assert (busy.label, busy.backend) == (Label.SESSION_MATCH, A)
    off = Settings(hash_key=bytes(16), session_moves="gates", session_follows_context=False)
    sticky = run({C: 20}, session_backend=A, settings=off)
    assert (sticky.label, sticky.backend) == (Label.SESSION_MATCH, A)


def test_session_is_overridden_only_past_both_gates():
    past_both = run(session_backend=A, loads=loads(a=9))  # 36 > 0 + 32 and 36 > 1.5 * 0
    assert (past_both.label, past_both.backend) == (Label.LOAD_OVERRIDE, B)
    busy_everywhere = run(session_backend=A, loads=loads(a=30, b=20, c=20))  # 120 < 1.5 * 80: not overloaded
    assert (busy_everywhere.label, busy_everywhere.backend) == (Label.SESSION_MATCH, A)


def test_a_session_past_the_gates_whose_backend_is_still_the_cheapest_stays_as_a_session_match():
    """Past the gates the cost decides; if it keeps the conversation where it was, the label says so."""
    stayed = run({A: 40}, total=40, session_backend=A, loads=loads(a=9))  # 36 of load against 40 of prefill
    assert (stayed.label, stayed.backend) == (Label.SESSION_MATCH, A)


@pytest.mark.parametrize(
    ("load", "least", "expected"), [(33, 0, True), (32, 0, False), (100, 70, False), (106, 70, True)]
)
def test_overloaded_needs_both_the_absolute_and_the_relative_gate(load: float, least: float, expected: bool):
    assert overloaded(load, least, SETTINGS) is expected


def test_under_cache_pressure_the_gates_widen_for_sessions_and_heads():
    busy = {"b": 1, "c": 1}  # the least loaded at 4 blocks
    moved = run(session_backend=A, loads=loads(a=10, **busy))  # 40 > 4 + 32 and 40 > 1.5 * 4
    assert moved.label == Label.LOAD_OVERRIDE
    kept = run(session_backend=A, loads=loads(a=10, **busy), gate_factor=2.0)  # 36 < 2 * 32
    assert (kept.label, kept.backend) == (Label.SESSION_MATCH, A)
    homed = run(home=A, loads=loads(a=10, **busy), gate_factor=2.0)
    assert (homed.label, homed.backend) == (Label.PREFIX_HOME, A)
    assert run(session_backend=A, loads=loads(a=19, **busy), gate_factor=2.0).label == Label.LOAD_OVERRIDE  # 72 > 64


def test_with_a_candidate_idle_the_gates_do_not_widen():
    """However starved the caches look, a backend past the configured gates does not keep a
    conversation or a head while another does nothing: the cost decides."""
    for factor in (1.0, 2.0, 16.0):
        session = run(session_backend=A, loads=loads(a=9, b=1), gate_factor=factor)  # C idle
        assert (session.label, session.backend) == (Label.LOAD_OVERRIDE, C)
        head = run(home=A, loads=loads(a=9, b=1), gate_factor=factor)
        assert (head.label, head.backend) == (Label.LEAST_LOADED, C)
        held = run({A: 20}, loads=loads(a=9, b=1), gate_factor=factor)
        assert (held.label, held.backend) == (Label.LOAD_OVERRIDE, C)  # 36 of load against 20 blocks of prefill


def test_a_backend_with_requests_in_flight_is_not_idle_whatever_they_weigh():
    """With `active_request_cost` 0 a backend whose requests only decode weighs nothing, yet it is
    busy: the gates stay widened."""
    weightless = Settings(hash_key=bytes(16), session_moves="gates", active_request_cost=0)
    tracker = LoadTracker()
    tracker.reserve(A, 100)  # 100 blocks of prefill queued on the session's backend
    tracker.reserve(B, 0)
    tracker.reserve(C, 0)  # B and C: a request each, decoding
    kept = run(session_backend=A, loads=tracker, settings=weightless, gate_factor=16.0)
    assert (kept.label, kept.backend) == (Label.SESSION_MATCH, A)  # 100 < 16 * 32
    moved = run(session_backend=A, loads=tracker, settings=weightless, gate_factor=16.0, candidates=[A, B, C, D])
    assert moved.label == Label.LOAD_OVERRIDE and moved.backend in (B, C, D)  # D is idle: 100 > 32


def test_a_head_goes_home_only_while_nothing_holds_any_of_it_and_home_is_within_the_gates():
    assert run(home=B, loads=loads(b=2)).backend == B  # B is busier than A and C, yet within the gates
    assert run(home=B, loads=loads(b=2)).label == Label.PREFIX_HOME
    assert run(home=B, loads=loads(b=9)).label == Label.LEAST_LOADED  # past both gates: placed by load
    assert run({C: 2}, home=B).backend == C  # some of it is cached: the cache decides, not the home
    assert run(home="10.0.0.9:8000").label == Label.LEAST_LOADED  # a home that is not a candidate


def test_among_backends_holding_as_much_of_a_prompt_its_home_keeps_it():
    # A copy of B's head went to A while B was busy; B is no longer past the gates, A is idle.
    copied = {A: 12, B: 12}
    decision = run(copied, home=B, loads=loads(b=3))  # by cost alone A: 8 novel against B's 8 + 12
    assert (decision.label, decision.backend) == (Label.PREFIX_MATCH, B)
    assert run(copied, loads=loads(b=3)).backend == A  # no home known: the cheaper copy
    assert run(copied, home=B, loads=loads(b=9)).backend == A  # home past both gates: the copy serves
    assert run({A: 14, B: 12}, home=B).backend == A  # more of it elsewhere (a conversation): not the home
    assert run(copied, home=B, loads=loads(b=3), home_ties=False).backend == A  # starved: the cheaper copy
    # the cheaper copy whatever the candidates' order: here the busy one comes first
    assert run(copied, loads=loads(a=3)).backend == B
    assert run(copied, home=A, loads=loads(a=3), home_ties=False).backend == B


def test_a_backend_holding_half_the_prompt_keeps_it_against_a_cheaper_cost():
    # B holds 10 of 20 blocks (the stick ratio); A is idle, B carries 2 requests (8 blocks): by cost
    # alone A (20 novel) would lose to B (10 novel + 8 load) anyway, so make B dearer: 3 requests.
    decision = run({B: 10}, loads=loads(b=3))
    assert (decision.label, decision.backend) == (Label.PREFIX_MATCH, B)
    below = run({B: 9}, loads=loads(b=3))  # under the ratio, cost decides: 11 + 12 > 20
    assert below.backend != B and below.label == Label.LOAD_OVERRIDE


def test_stickiness_yields_past_the_balance_gates():
    decision = run({B: 15}, loads=loads(b=12))  # 48 blocks of load against 0
    assert decision.backend != B and decision.label == Label.LOAD_OVERRIDE


def test_prefix_match_by_cost_when_the_longest_holder_is_cheapest():
    decision = run({A: 4, B: 2}, total=20)  # below the stick ratio; fewest novel blocks wins
    assert (decision.label, decision.backend, decision.matched_blocks) == (Label.PREFIX_MATCH, A, 4)


def test_ties_rotate_with_the_turn_so_identical_requests_do_not_herd():
    picks = [run(turn=turn).backend for turn in range(6)]
    assert picks == [A, B, C, A, B, C]


def test_second_choice_is_the_next_cheapest_other_backend():
    decision = run({A: 20, B: 12}, total=20)
    assert (decision.backend, decision.second) == (A, B)


def test_bootstrap_requests_weigh_load_more():
    # B is busy by one request (4 blocks): a follow-up takes the 5 cached blocks there (15 + 4 < 20),
    # a bootstrap request, placing a whole conversation, pays the load twice (15 + 8 > 20).
    followup = run({B: 5}, loads=loads(b=1), bootstrap=False)
    bootstrap = run({B: 5}, loads=loads(b=1), bootstrap=True)
    assert followup.backend == B and bootstrap.backend != B


def test_new_prompts_avoid_the_backend_with_the_fastest_turnover():
    decision = run(churn={A: 100.0, B: 10.0, C: 0.0}, turn=0)
    costs = {c.backend: c.cost for c in decision.candidates}
    assert costs[A] == 20 * (1 + 3.0) and costs[B] == pytest.approx(20 * 1.3) and costs[C] == 20
    assert decision.backend == C


def test_explanation_carries_every_term():
    decision = run({A: 5}, loads=loads(a=1))
    explained = {c["backend"]: c for c in decision.explain()["candidates"]}
    assert explained[A] == {
        "backend": A, "matched": 5, "novel": 15, "reserved": 0, "active": 1, "load": 4.0, "churn": 0.0, "cost": 19.0,
        "prefill_cost": 15.0, "load_cost": 4.0,
    }  # fmt: skip


def test_requests_are_shed_only_when_every_candidate_is_at_the_limit():
    limited = Settings(hash_key=bytes(16), max_backend_requests=2)
    full = run({A: 20}, session_backend=A, loads=loads(a=2, b=2, c=2), settings=limited)
    assert (full.label, full.backend, full.second) == (Label.SHED, None, None)
    one_left = run({A: 20}, session_backend=A, loads=loads(a=2, b=2, c=1), settings=limited)
    assert (one_left.label, one_left.backend) == (Label.LOAD_OVERRIDE, C)  # not shed: C has room
    unlimited = run({A: 20}, session_backend=A, loads=loads(a=9, b=9, c=9))
    assert unlimited.backend == A  # 0: never shed


def test_by_default_a_conversation_leaves_only_a_saturated_backend():
    """Past both gates, A still starts the turn at once while it is not saturated: the conversation
    stays with its cached context. Once A is saturated too (here by its prefill backlog, 40 blocks
    of 128 tokens against saturationPrefillTokens 1,000), load moves it."""
    default = Settings(hash_key=bytes(16))  # session_moves "saturated"
    busy = LoadTracker()
    busy.reserve(A, 40)  # 40 blocks of prefill and one request in flight: 44 of load, past both gates
    unknown = run({A: 20}, session_backend=A, loads=busy, settings=default, block_tokens=128)
    assert unknown.backend != A  # no engine sample yet: saturation cannot be told, the gates decide
    busy.get(A).report(running=1, waiting=0, kv_usage=0.3, now=0.0)  # the engine runs it, nothing waits
    kept = run({A: 20}, session_backend=A, loads=busy, settings=default, block_tokens=128)
    assert (kept.label, kept.backend) == (Label.SESSION_MATCH, A)
    backlogged = Settings(hash_key=bytes(16), saturation_prefill_tokens=1_000)
    moved = run({A: 20}, session_backend=A, loads=busy, settings=backlogged, block_tokens=128)
    assert moved.backend != A and moved.label == Label.LOAD_OVERRIDE
    assert run({A: 20}, session_backend=A, loads=busy, block_tokens=128).backend != A  # "gates": past them is enough
    # a prompt bound nowhere but held on A is no session: the prefix rule's gates are unchanged
    assert run({A: 20}, loads=busy, settings=default).backend != A
    # "never": the saturated backend keeps it; at its request limit it is still moved
    never = Settings(hash_key=bytes(16), saturation_prefill_tokens=1_000, session_moves="never")
    stays = run({A: 20}, session_backend=A, loads=busy, settings=never, block_tokens=128)
    assert (stays.label, stays.backend) == (Label.SESSION_MATCH, A)
    full = dataclasses.replace(never, max_backend_requests=1)
    assert run({A: 20}, session_backend=A, loads=busy, settings=full, block_tokens=128).backend != A
