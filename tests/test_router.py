"""Routing scenarios through the core API: query -> respond -> notify -> finish."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.workload import text
from extproc.core.backends import Backend
from extproc.core.decision import Decision, Label
from extproc.core.errors import InvalidRequest
from extproc.core.exchange import Exchange, ResponseStart
from extproc.core.modes import ApproximateMode
from extproc.core.pressure import MAX_GATE_FACTOR
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.core.sessions import NO_CONTEXT
from extproc.core.settings import Settings
from tests.strategies import json_values, messages, shaping

A, B, C, D = (f"10.0.0.{i}:8000" for i in range(1, 5))
FLEET = [Backend(x) for x in (A, B, C, D)]
RNG = random.Random(7)
SYSTEM = text(RNG, 6000)
TOOLS = [{"type": "function", "function": {"name": "search", "description": text(RNG, 1500)}}]


def make_router(**overrides: Any) -> Router:
    return Router(Settings(hash_key=b"test-key-16bytes", **overrides))


def chat(history: list[dict[str, Any]], session: str | None = None, user_text: str = "hello") -> PromptRequest:
    body = {"model": "m", "tools": TOOLS, "messages": [{"role": "system", "content": SYSTEM}, *history]}
    body["messages"].append({"role": "user", "content": user_text})
    return parse_request(body, {"x-session-id": session} if session else {})


def ok(backend: str) -> ResponseStart:
    """A 2xx response sent by a known backend."""
    return ResponseStart(upstream=backend, known=True, status=200, from_upstream=True)


def serve(router: Router, request: PromptRequest, now: float, backends: list[Backend] = FLEET) -> Decision:
    """A whole successful request through the lifecycle: begin, response started (learn), end."""
    exchange = router.begin(request, backends, now)
    decision = exchange.decision
    assert exchange.reservation is not None and decision.backend is not None
    assert router.response_started(exchange, ok(decision.backend), now).learned
    assert exchange.end()
    return decision


def occupy(router: Router, backend: str, requests: int) -> list:
    """In-flight requests on one backend, held until released by the caller."""
    return [router.loads.reserve(backend, 0) for _ in range(requests)]


def converse(router: Router, turns: int, session: str | None, start: float = 0.0) -> list[Decision]:
    history: list[dict[str, Any]] = []
    decisions = []
    for turn in range(turns):
        question = f"turn {turn}: " + text(RNG, 700)
        decisions.append(serve(router, chat(history, session, question), start + turn))
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": text(RNG, 900)}]
    return decisions


def test_ten_turn_conversation_stays_on_one_backend_by_session():
    router = make_router()
    decisions = converse(router, 10, "conv-1")
    assert len({d.backend for d in decisions}) == 1
    assert decisions[0].label == Label.LEAST_LOADED
    assert all(d.label == Label.SESSION_MATCH for d in decisions[1:])


def test_ten_turn_conversation_stays_on_one_backend_by_prefix_alone():
    router = make_router()
    decisions = converse(router, 10, None)
    assert len({d.backend for d in decisions}) == 1
    assert all(d.label == Label.PREFIX_MATCH for d in decisions[1:])
    assert all(d.matched_blocks > 0 for d in decisions[1:])


def test_new_session_sharing_system_prompt_goes_where_it_is_cached_unless_loaded():
    router = make_router()
    first = serve(router, chat([], "s1", "first question"), 0)
    second = serve(router, chat([], "s2", "another question"), 1)
    assert second.backend == first.backend
    assert second.label == Label.PREFIX_MATCH
    held = occupy(router, first.backend, 20)
    third = router.begin(chat([], "s3", "a third question"), FLEET, 2).decision
    assert third.backend != first.backend
    assert third.label == Label.LOAD_OVERRIDE
    for r in held:
        r.finish()


def busy_session(router: Router) -> tuple[str, list, list[dict[str, Any]]]:
    """A three-turn session "busy" whose backend then carries 30 more requests than the others:
    its backend, the held requests (release them) and a history for its next turn."""
    home = converse(router, 3, "busy")[0].backend
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    return home, occupy(router, home, 30), history


def test_imbalance_overrides_session_affinity():
    router = make_router(session_moves="gates")  # past the gates is enough (the default: and saturated)
    home, held, history = busy_session(router)
    moved = router.begin(chat(history, "busy", "next"), FLEET, 10).decision
    assert moved.backend != home
    assert moved.label == Label.LOAD_OVERRIDE
    assert moved.second is not None
    for r in held:
        r.finish()


def test_session_survives_moderate_load():
    router = make_router()
    home = converse(router, 2, "steady")[0].backend
    held = occupy(router, home, 3)
    again = router.begin(chat([], "steady", "more"), FLEET, 5).decision
    assert (again.backend, again.label) == (home, Label.SESSION_MATCH)
    for r in held:
        r.finish()


def test_unknown_session_falls_back_to_its_history_prefix():
    router = make_router()
    history: list[dict[str, Any]] = []
    for turn in range(3):
        q = f"q{turn}"
        home = serve(router, chat(history, "old-id", q), turn).backend
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": text(RNG, 2000)}]
    decision = router.begin(chat(history, "never-seen", "follow-up"), FLEET, 10).decision
    assert decision.backend == home
    assert decision.label == Label.PREFIX_MATCH
    assert not decision.bootstrap


def test_empty_history_goes_least_loaded():
    router = make_router()
    held = [*occupy(router, A, 2), *occupy(router, B, 1), *occupy(router, D, 1)]
    decision = router.begin(parse_request({"model": "m", "messages": []}), FLEET, 0).decision
    assert (decision.backend, decision.label) == (C, Label.LEAST_LOADED)
    assert decision.bootstrap and decision.total_blocks == 0
    for r in held:
        r.finish()


def test_identical_requests_do_not_herd():
    router = make_router()
    picks = Counter(router.query(chat([], None, "same"), FLEET, 0).backend for _ in range(8))
    assert set(picks) == {A, B, C, D}


def test_concurrent_identical_requests_share_the_head_in_flight_until_past_the_gates_then_spread():
    """Not learned yet, the first request's prompt counts as held where it is in flight (the
    engine computes it once): the next ones match it there and reserve no prefill for it, where
    they reserved all of it again (and over ext_authz made the picture evict room for it)."""
    router = make_router()
    decisions = [router.begin(chat([], None, "same"), FLEET, 0).decision for _ in range(8)]
    home = decisions[0].backend
    second = decisions[1]
    assert (second.backend, second.label, second.matched_blocks) == (home, Label.PREFIX_MATCH, second.total_blocks)
    assert router.loads.get(home).reserved_blocks == decisions[0].total_blocks  # the head's prefill, once
    assert all(d.backend == home for d in decisions if d.label == Label.PREFIX_MATCH)
    assert {d.backend for d in decisions} == {A, B, C, D}  # the request gates push the rest elsewhere


def test_a_head_no_cache_shows_any_more_goes_where_it_was_first_placed():
    router = make_router()
    home = serve(router, chat([], "s1", "first question"), 0).backend
    router.reset_backend(home, None)  # its cache turned over: the picture shows the head nowhere
    held = occupy(router, home, 2)  # busier than the rest, within the gates
    decision = router.begin(chat([], "s2", "another question"), FLEET, 1).decision
    assert (decision.backend, decision.label) == (home, Label.PREFIX_HOME)
    assert decision.matched_blocks == 0
    for r in held:
        r.finish()


def test_a_head_whose_home_left_is_placed_again_and_homed_there():
    router = make_router()
    first = serve(router, chat([], "s1", "first question"), 0).backend
    router.remove_backend(first)
    rest = [b for b in FLEET if b.address != first]
    second = serve(router, chat([], "s2", "second question"), 1, rest).backend
    assert second != first
    router.reset_backend(second, None)
    held = occupy(router, second, 2)
    again = router.begin(chat([], "s3", "third question"), rest, 2).decision
    assert (again.backend, again.label) == (second, Label.PREFIX_HOME)
    for r in held:
        r.finish()


def take_turns(router: Router, conversations: int, turns: int) -> None:
    """Conversations with prompts of their own (about 6 blocks, then 4 more a turn) taking turns on one backend."""
    histories = [[{"role": "system", "content": text(RNG, 3000)}] for _ in range(conversations)]
    for turn in range(turns):
        for number, history in enumerate(histories):
            history.append({"role": "user", "content": text(RNG, 1000)})
            body = {"model": "m", "messages": history}
            serve(router, parse_request(body, {"x-session-id": f"c{number}"}), turn, [Backend(A)])
            history.append({"role": "assistant", "content": text(RNG, 1000)})


def test_conversations_that_find_their_context_evicted_widen_the_balance_gates():
    starved = make_router(capacity_blocks=200)  # twelve conversations of 10-46 blocks: each evicts the others
    take_turns(starved, 12, 10)
    assert starved.pressure.lost > 0.5 and starved.pressure.gate_factor() == MAX_GATE_FACTOR
    roomy = make_router(capacity_blocks=200)  # two of them fit
    take_turns(roomy, 2, 10)
    assert roomy.pressure.lost == 0 and roomy.pressure.gate_factor() == 1.0


def test_under_pressure_a_conversation_stays_where_load_alone_would_move_it():
    router = make_router(session_moves="gates")
    home, held, history = busy_session(router)
    held += [r for b in FLEET if b.address != home for r in occupy(router, b.address, 1)]  # none idle
    for _ in range(40):
        router.pressure.returned(100, 40)  # conversations keep finding most of their context gone
    stayed = router.begin(chat(history, "busy", "next"), FLEET, 10).decision
    assert (stayed.backend, stayed.label) == (home, Label.SESSION_MATCH)
    assert router.state().gate_factor > 1
    off = Settings(hash_key=b"test-key-16bytes", session_moves="gates", cache_pressure_gates=False)
    router.reconfigure(off)  # operators can turn it off
    moved = router.query(chat(history, "busy", "next"), FLEET, 11)
    assert moved.backend != home and moved.label == Label.LOAD_OVERRIDE
    assert router.state().gate_factor == 1.0  # what the decisions apply (while none is idle), not the pressure
    for r in held:
        r.finish()


def test_removed_backend_is_never_chosen_again():
    router = make_router()
    home = converse(router, 3, "s")[0].backend
    router.remove_backend(home)
    assert router.state().index_entries_by_backend.get(home) is None
    rest = [b for b in FLEET if b.address != home]
    for i in range(200):
        exchange = router.begin(chat([], "s" if i % 2 else f"x{i}", f"q{i}"), rest, 20 + i)
        assert exchange.decision.backend != home and exchange.decision.second != home
        exchange.end()


def test_a_backend_back_at_the_same_address_is_bound_to_and_home_to_nothing_it_had():
    """A health flap (down, then up at the same address): the conversations and prompt heads it
    had before it left are placed again on merit, whatever is bound or placed there since."""
    router = make_router()
    home = converse(router, 3, "s")[0].backend
    head = router.chain_of(chat([], "s", "hello"))[0]
    assert router.homes.get(head) == home
    router.remove_backend(home)
    router.sessions.bind("session:other", home, 21)  # back, and bound to again
    router.homes.place(head + 1, home)
    assert router.sessions.get("session:s", 22) is None and router.homes.get(head) is None
    assert router.sessions.get("session:other", 22) == home and router.homes.get(head + 1) == home


def test_a_head_s_home_stays_while_it_is_only_absent_from_some_requests_candidates():
    """A failed probe, a gateway's subset hint or a request limit keeps the home out of a few
    requests' candidates: they go elsewhere, the head's home does not move with them."""
    router = make_router()
    home = converse(router, 1, "s")[0].backend
    head = router.chain_of(chat([], "s", "hello"))[0]
    others = [b for b in FLEET if b.address != home]
    exchange = router.begin(chat([], "t", "hello"), others, 5)
    assert exchange.decision.backend != home and router.homes.get(head) == home
    exchange.end()
    router.remove_backend(home)  # gone: the next placement is its new home
    placed = router.begin(chat([], "u", "hello"), others, 6).decision.backend
    assert router.homes.get(head) == placed


def test_a_binding_to_a_backend_that_stops_serving_the_model_is_passed_over_until_served_elsewhere():
    """Not forgotten by weighing it (a dry run, or a backend suspect for a moment, must not lose
    the conversation's place); the turn served elsewhere rebinds it there."""
    router = make_router()
    home = converse(router, 2, "s")[0].backend
    changed = [Backend(b.address, frozenset({"other"}) if b.address == home else frozenset()) for b in FLEET]
    assert router.query(chat([], "s", "again"), changed, 10).backend != home
    assert router.sessions.get("session:s", 10) == home  # the dry run changed nothing
    exchange = router.begin(chat([], "s", "again"), changed, 10)
    assert exchange.decision.backend not in (None, home)
    router.response_started(exchange, ok(exchange.decision.backend), 11)
    assert router.sessions.get("session:s", 11) == exchange.decision.backend


def test_no_candidates_when_nobody_serves_the_model():
    router = make_router()
    fleet = [Backend(A, frozenset({"other"})), Backend(B, healthy=False)]
    exchange = router.begin(chat([], None), fleet, 0)
    decision = exchange.decision
    assert (decision.label, decision.backend, exchange.reservation) == (Label.NO_CANDIDATES, None, None)


def test_explanation_lists_every_candidate_with_its_terms():
    router = make_router()
    serve(router, chat([], None, "warm"), 0)
    decision = router.begin(chat([], None, "warm"), FLEET, 1).decision
    explained = orjson.loads(orjson.dumps(decision.explain()))
    assert {c["backend"] for c in explained["candidates"]} == {A, B, C, D}
    chosen = next(c for c in explained["candidates"] if c["backend"] == decision.backend)
    assert chosen["matched"] == decision.matched_blocks == explained["total_blocks"]
    assert explained["decision"] == "prefix_match"


def test_random_lifecycles_leave_no_reservation_behind():
    """10,000 random decide / respond / finish / abort / backend-churn steps."""
    router = make_router(capacity_blocks=200)
    rng = random.Random(11)
    bodies = [chat([], f"s{i % 7}" if i % 3 else None, f"q{i % 13}") for i in range(40)]
    live: list[Exchange] = []
    for step in range(10_000):
        action = rng.random()
        if action < 0.4 or not live:
            live.append(router.begin(bodies[rng.randrange(len(bodies))], FLEET, step))
        elif action < 0.65:
            exchange = rng.choice(live)
            status = rng.choice((200, 200, 503))
            start = ResponseStart(exchange.decision.backend or "", known=True, status=status, from_upstream=True)
            router.response_started(exchange, start, step)
        elif action < 0.9:
            live.pop(rng.randrange(len(live))).end()  # completion, error or client abort: one path
        elif action < 0.95:
            exchange = rng.choice(live)
            exchange.end()
            assert not exchange.end()  # a second end of an already-ended request does nothing
        else:
            router.remove_backend(rng.choice(FLEET).address)
    for exchange in live:
        exchange.end()
    assert all(value == (0, 0) for value in router.loads.snapshot().values())


@given(st.one_of(json_values, st.fixed_dictionaries({"messages": st.lists(messages(), max_size=5)}), shaping))
def test_decision_path_never_raises_on_any_body(value):
    router = make_router(block_size=8)
    try:
        request = parse_request(orjson.dumps(value))
    except InvalidRequest:
        return
    exchange = router.begin(request, FLEET, 0)
    decision = exchange.decision
    assert decision.backend in {A, B, C, D} and exchange.reservation is not None
    exchange.end()
    router.learn(request, decision.backend, 0)


def test_fallback_goes_least_loaded_and_reserves():
    router = make_router()
    held = [*occupy(router, A, 1), *occupy(router, C, 1), *occupy(router, D, 1)]
    exchange = router.begin_unreadable([*FLEET[:3], Backend(D, healthy=False)], 0)
    assert (exchange.decision.label, exchange.decision.backend) == (Label.FALLBACK, B)
    assert router.loads.snapshot()[B] == (0, 1)
    exchange.end()
    for r in held:
        r.finish()
    assert router.begin_unreadable([Backend(A, healthy=False)], 0).decision.label == Label.NO_CANDIDATES


def test_reconfigure_keeps_the_index_unless_chains_change():
    router = make_router()
    serve(router, chat([], "s", "warm"), 0)
    entries = router.state().index_entries
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", location_ttl_s=30, session_ttl_s=5))
    assert router.state().index_entries == entries and router.settings.location_ttl_s == 30
    assert router.query(chat([], None, "warm"), FLEET, 1).label == Label.PREFIX_MATCH
    assert router.sessions.get("session:s", 10) is None  # the new session TTL applies at once
    in_flight = router.begin(chat([], None, "sent before the change"), FLEET, 2)
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", block_size=256))
    assert router.state().index_entries == 0
    assert isinstance(router.mode, ApproximateMode) and router.mode.hasher.block_size == 256
    backend = in_flight.decision.backend
    assert backend is not None and not router.response_started(in_flight, ok(backend), 3).learned
    assert router.state().index_entries == 0  # its chain of 512-byte blocks names nothing in the new picture
    in_flight.end()


def test_capacity_auto_sizes_each_backend_from_its_kv_cache():
    router = make_router(capacity_auto=True, capacity_blocks=1000)
    router.set_backend_capacity(A, kv_tokens=512)  # 512 tokens * 4 bytes / 512-byte blocks = 4 blocks
    serve(router, chat([], None, "big"), 0, [Backend(A)])
    serve(router, chat([], None, "big"), 0, [Backend(B)])
    assert router.index.entries_by_backend()[A] == 2  # one response teaches at most half
    assert router.index.entries_by_backend()[B] > 4
    fixed = make_router(capacity_blocks=1000, capacity_auto=False)
    fixed.set_backend_capacity(A, kv_tokens=512)
    serve(fixed, chat([], None, "big"), 0, [Backend(A)])
    assert fixed.index.entries_by_backend()[A] > 4


def test_new_prompts_avoid_the_backend_whose_cache_turns_over_fastest():
    router = make_router()
    for i in range(6):  # A has just taken in a lot of new prompt
        bulk = {"model": "m", "messages": [{"role": "user", "content": f"bulk {i} " + text(RNG, 3000)}]}
        router.learn(parse_request(bulk), A, 0)
    picks = Counter(router.query(chat([], None, f"fresh {i}"), FLEET, 1).backend for i in range(12))
    assert A not in picks
    explained = router.query(chat([], None, "fresh"), FLEET, 1).explain()
    assert {c["backend"]: c["churn"] for c in explained["candidates"]}[A] == 1.0


def test_settings_changes_keep_reported_capacities_right():
    router = make_router(capacity_blocks=1000)
    router.set_backend_capacity(A, kv_tokens=512)  # 4 blocks while capacity_auto holds
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", capacity_blocks=1000, churn_half_life_s=5))
    serve(router, chat([], None, "big"), 0, [Backend(A)])
    assert router.index.entries_by_backend()[A] == 2  # half of 4: one response's share
    added = router.learn(chat([], None, "small"), B, 0)
    assert router.churn.rate(B, 5) == pytest.approx(added / 2)  # the new half-life applies at once
    router.remove_backend(A)  # down, then back: its reported size still holds
    serve(router, chat([], None, "big"), 1, [Backend(A)])
    assert router.index.entries_by_backend()[A] == 2
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", capacity_blocks=1000, capacity_auto=False))
    serve(router, chat([], None, "bigger"), 2, [Backend(A)])
    assert router.index.entries_by_backend()[A] > 4  # a fixed capacity replaces the reported one
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", block_size=256))
    serve(router, chat([], None, "big"), 3, [Backend(A)])
    assert router.index.entries_by_backend()[A] == 4  # a fresh index, re-sized: 512 * 4 / 256, half learned


def test_requests_learned_at_their_end_keep_their_new_blocks_room_in_the_picture_until_then():
    """Over ext_authz a request is learned only when it ends (Router.sent at its decision): while
    it is in flight its new blocks take room in its backend's picture beside every other's, and
    that room is given back once, when it is learned or ends unserved."""

    def prompt() -> PromptRequest:
        return parse_request({"model": "m", "messages": [{"role": "user", "content": text(RNG, 3000)}]}, {})

    first, second, third, fourth = prompt(), prompt(), prompt(), prompt()
    size = len(make_router().chain_of(first))
    router = make_router(capacity_blocks=3 * size, capacity_auto=False)
    only = [Backend(A)]
    for request in (first, second):
        serve(router, request, 0, only)
    held = router.index.entries_by_backend()[A]
    sent = []
    for request in (third, fourth):
        exchange = router.begin(request, only, 1)
        router.sent(exchange, 1)
        sent.append(exchange)
    rooms = sum(e.decision.total_blocks - e.predicted_blocks for e in sent)
    assert rooms >= 2 * size - 2 and router.index.entries_by_backend()[A] <= 3 * size - rooms < held
    assert router.response_started(sent[0], ok(A), 2).learned  # its end: learned, its room given back
    assert sent[0].end()
    assert router.index.entries_by_backend()[A] <= 3 * size - (sent[1].decision.total_blocks - sent[1].predicted_blocks)
    failed = ResponseStart(upstream=A, known=True, status=500, from_upstream=True)
    assert not router.response_started(sent[1], failed, 3).learned
    assert sent[1].end() and not sent[1].end()
    serve(router, prompt(), 4, only)
    assert router.index.entries_by_backend()[A] == 3 * size  # every room back, once


def test_a_request_sent_makes_room_for_what_the_picture_lacks_not_for_what_trust_discounts():
    """Trust (trust.py) discounts what the decision expects cached where the engine has delivered
    less than the picture shows; the picture itself must still only make room for the blocks it
    does not hold, or every request sent over ext_authz to a backend trusted below 1 would evict
    others' blocks from the picture that the engine keeps."""

    def prompt() -> PromptRequest:
        return parse_request({"model": "m", "messages": [{"role": "user", "content": text(RNG, 3000)}]}, {})

    older, recent = prompt(), prompt()
    size = len(make_router().chain_of(older))
    router = make_router(capacity_blocks=2 * size, capacity_auto=False)
    only = [Backend(A)]
    for request in (older, recent):
        serve(router, request, 0, only)
    router.trust.values[A] = 0.5  # the engine has delivered half of what the picture predicted
    again = router.begin(recent, only, 1)
    assert again.decision.picture_blocks == size and again.predicted_blocks == size // 2
    router.sent(again, 1)
    assert router.index.entries_by_backend()[A] == 2 * size  # nothing new stored: nothing evicted
    assert router.index.lookup(router.chain_of(older), [A], 2)[A] == size


def test_over_ext_authz_a_head_in_flight_is_held_there_for_the_next_request_not_room_to_make_again():
    """Two conversations with one long head sent to one backend, the first still in flight (over
    ext_authz it is learned only at its end): the second saw none of the head there, reserved its
    whole prefill again and made the picture evict room for all of it, taking other conversations'
    contexts out of the picture that the engine kept (a review's reading, 2026-12-07)."""
    head = text(RNG, 3000)

    def turn(session: str, question: str) -> PromptRequest:
        body = {"model": "m", "messages": [{"role": "system", "content": head}, {"role": "user", "content": question}]}
        return parse_request(body, {"x-session-id": session})

    size = len(make_router().chain_of(turn("x", "go")))
    router = make_router(capacity_blocks=3 * size, capacity_auto=False)
    only = [Backend(A)]
    for _ in range(2):  # two other contexts fill two thirds of the picture
        serve(
            router,
            parse_request({"model": "m", "messages": [{"role": "user", "content": text(RNG, 3000)}]}, {}),
            0,
            only,
        )
    held = router.index.entries_by_backend()[A]
    first, second = router.begin(turn("a", "go"), only, 1), router.begin(turn("b", "go"), only, 1)
    router.sent(first, 1)
    router.sent(second, 1)
    assert second.decision.matched_blocks >= size - 1  # the head (all but the question's last block)
    assert router.loads.get(A).reserved_blocks <= first.decision.total_blocks + 1
    assert router.index.entries_by_backend()[A] == held  # room for one prompt's blocks: nothing evicted


def test_a_prefix_a_request_uses_is_seen_then_and_does_not_age_out_while_it_runs():
    """Router.sent counts the prefix a request uses as just used: it only reordered it, so a
    prefix learned 590 s earlier went out of the picture (location_ttl_s 600) while in use."""
    router = make_router()
    request = chat([], None, "long lived")
    backend = serve(router, request, 0).backend
    again = router.begin(chat([], None, "long lived"), [Backend(backend)], 590)
    router.sent(again, 590)
    assert router.index.lookup(router.chain_of(again.request), [backend], 601)[backend] > 0


@pytest.mark.parametrize("follows", [True, False])
def test_a_conversation_whose_backend_lost_its_context_goes_where_the_prompt_is(follows):
    """Two agent conversations start with the same long prompt (as capped agent contexts do), one
    on each backend; the first one's backend then evicts it for other work. Its next turn goes to
    the backend still holding the prompt, not back to compute it all again; it stays where it
    was only with `session_follows_context` and `release_evicted_sessions` off."""
    shared = text(RNG, 3000)

    def turn(session: str, content: str) -> PromptRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        return parse_request(body, {"x-session-id": session})

    size = len(make_router().chain_of(turn("x", shared)))
    off = {"session_follows_context": follows, "release_evicted_sessions": follows}
    router = make_router(capacity_blocks=2 * size, capacity_auto=False, **off)
    serve(router, turn("first", shared), 0, [Backend(A)])
    serve(router, turn("second", shared), 1, [Backend(B)])
    for i in range(2):  # other work evicts it from A
        serve(router, turn(f"other-{i}", text(RNG, 3000)), 2 + i, [Backend(A)])
    assert router.index.lookup(router.chain_of(turn("x", shared)), [A, B], 4) == {A: 0, B: size}
    decision = serve(router, turn("first", shared), 5, [Backend(A), Backend(B)])
    if follows:
        assert (decision.label, decision.backend, decision.matched_blocks) == (Label.PREFIX_MATCH, B, size)
        assert router.sessions.get("session:first", 6) == B  # its next turns follow
    else:
        assert (decision.label, decision.backend, decision.matched_blocks) == (Label.SESSION_MATCH, A, 0)


@pytest.mark.parametrize("follows", [True, False])
def test_a_conversation_whose_context_is_gone_is_placed_by_the_cost_unless_its_prompts_do_not_extend(follows):
    """A conversation's backend evicts its context and no backend holds it: its next turn,
    continuing the last prompt, is placed by the cost (here the idle backend) rather than kept on
    the busy one. A turn that does not extend the last prompt says nothing of what was evicted:
    x-session-id keeps it where it was, as with `release_evicted_sessions` off."""
    first = text(RNG, 3000)

    def turn(session: str, *contents: str) -> PromptRequest:
        roles = ("user", "assistant")
        body = {"model": "m", "messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}
        return parse_request(body, {"x-session-id": session})

    size = len(make_router().chain_of(turn("x", first)))
    router = make_router(capacity_blocks=2 * size, capacity_auto=False, release_evicted_sessions=follows)
    serve(router, turn("s", first), 0, [Backend(A)])
    for i in range(2):  # other work evicts it from A
        serve(router, turn(f"other-{i}", text(RNG, 3000)), 1 + i, [Backend(A)])
    held = occupy(router, A, 1)  # A is busy, B idle: load alone would not move a bound conversation
    continuing = router.query(turn("s", first, "an answer", "a question"), [Backend(A), Backend(B)], 3)
    unrelated = router.query(turn("s", text(RNG, 3000)), [Backend(A), Backend(B)], 3)
    assert (unrelated.label, unrelated.backend) == (Label.SESSION_MATCH, A)
    if follows:
        assert (continuing.label, continuing.backend) == (Label.LOAD_OVERRIDE, B)
    else:
        assert (continuing.label, continuing.backend) == (Label.SESSION_MATCH, A)
    for r in held:
        r.finish()


def test_a_session_sent_bound_is_put_back_when_its_request_is_not_served():
    """ext_authz binds a conversation when it sends it (its next turn may come before the end is
    reported); served, the binding stays; not served, it is as the ext_proc transport, which
    binds only on a 2xx, would have left it: the one before, or none."""
    router = make_router()
    failed = ResponseStart(upstream=B, known=True, status=503, from_upstream=True)
    first = router.begin(chat([], "s", "one"), [Backend(B)], 0)
    router.sent(first, 0)
    assert router.sessions.get("session:s", 0) == B
    router.response_started(first, failed, 1)
    assert router.sessions.get("session:s", 1) is None  # a first turn not served: unbound
    serve(router, chat([], "s", "two"), 2, [Backend(A)])
    before = router.sessions.binding("session:s", 2)
    assert before is not None and before[0] == A and before[1][0] > 0
    again = router.begin(chat([], "s", "three"), [Backend(A), Backend(B)], 3)
    router.sent(again, 3)
    assert router.sessions.binding("session:s", 3) == (A, NO_CONTEXT)  # bound ahead, its prompt not known yet
    router.response_started(again, ResponseStart(upstream=A, known=True, status=503, from_upstream=True), 4)
    assert router.sessions.binding("session:s", 4) == before  # the binding it replaced is back
    served = router.begin(chat([], "s", "four"), [Backend(B)], 5)
    router.sent(served, 5)
    assert router.response_started(served, ok(B), 6).learned and router.sessions.get("session:s", 6) == B


def test_backends_replaced_by_the_thousand_leave_nothing_behind_but_a_bounded_memory():
    """A rollout replaces every backend, each reporting its size, serving, and leaving while its
    request still streams (it ends afterwards): the tables keyed by backend keep the last
    GONE_MOST departed (a flapping backend comes back with its size known), not all of them, and
    the reuse sums of departed backends add up in one `departed` entry."""
    from extproc.core.attribution import DEPARTED
    from extproc.core.departures import GONE_MOST
    from extproc.core.engine import EngineSample

    router = make_router()
    for i in range(GONE_MOST + 2_000):
        backend = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000"
        router.engine_sample(backend, EngineSample(0, 0, 0.0, 1.0, 262_144, 16, 1000.0 + i), float(i))
        exchange = router.begin(chat([], None, f"q{i}"), [Backend(backend)], float(i))
        router.response_started(exchange, ok(backend), float(i))
        router.engine_reported(exchange, 100)
        router.remove_backend(backend)
        exchange.end()
    assert len(router._kv_tokens) <= GONE_MOST and len(router.index._capacities) <= GONE_MOST
    assert router.bytes_per_token.sent == {}
    attribution = router.attribution
    for sums in (attribution.routed, attribution.reported, attribution.reported_routed):
        assert set(sums) <= {DEPARTED}
    assert attribution.reported[DEPARTED] == 100 * (GONE_MOST + 2_000)  # (counters: nothing lost)
    last, first = backend, "10.0.0.0:8000"
    assert router._kv_tokens.get(last) == 262_144 and first not in router._kv_tokens  # kept a while, then not
