"""KV cache events: decoding both wire forms, refusing garbage, and the precise index they feed."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.backends import Backend
from extproc.core.chain import TokenHasher, extra_digest
from extproc.core.engine import AllBlocksCleared, BlockRemoved, BlockStored, EngineSample
from extproc.core.exchange import Exchange, Reset, ResponseStart
from extproc.core.modes import PreciseMode
from extproc.core.precise import PreciseIndex
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.vllm.events import EventError, decode

KEY = bytes(range(16))
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def frames(events: list, sequence: int = 0) -> list[bytes]:
    return [b"kv", sequence.to_bytes(8, "big"), msgpack.packb([1.5, events, 0])]


def stored_map(hashes, parent, tokens, size=4, extra=None) -> dict:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
    event.update(block_size=size, lora_id=None, medium="GPU", lora_name=None)
    if extra is not None:
        event["extra_keys"] = extra
    return event


def test_both_wire_forms_decode_to_the_same_events():
    tokens = list(range(8))
    as_maps = [stored_map([11, 12], None, tokens), {"type": "BlockRemoved", "block_hashes": [11]}]
    as_maps.append({"type": "AllBlocksCleared"})
    as_arrays = [["BlockStored", [11, 12], None, tokens, 4, None, "GPU", None], ["BlockRemoved", [11], "GPU"]]
    as_arrays.append(["AllBlocksCleared"])
    one, two = decode(frames(as_maps, 7)), decode(frames(as_arrays, 7))
    assert one == two and one.sequence == 7 and one.unknown == 0
    assert one.events == [
        BlockStored((11, 12), None, tuple(tokens), 4, ()),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    ]


def test_unknown_event_types_are_skipped_and_counted():
    batch = decode(frames([{"type": "BlockPinned", "x": 1}, ["Future", 1], {"type": "AllBlocksCleared"}]))
    assert batch.events == [AllBlocksCleared()] and batch.unknown == 2


@pytest.mark.parametrize(
    "bad",
    [
        [b"kv", b"\x00" * 8],  # two frames
        [b"kv", b"\x00" * 7, msgpack.packb([0, [], 0])],  # short sequence
        [b"kv", b"\x00" * 8, b"\xc1garbage"],  # not msgpack
        [b"kv", b"\x00" * 8, msgpack.packb([0, [], 0])[:-2]],  # truncated
        [b"kv", b"\x00" * 8, msgpack.packb({"events": []})],  # not a batch
        [b"kv", b"\x00" * 8, bytes.fromhex("9200918181000000")],  # a map as a map's key (TypeError)
        [b"kv", b"\x00" * 8, b"\x91" * (4 << 20)],  # larger than a step stores: refused unread
    ],
)
def test_malformed_messages_raise_event_error_only(bad):
    with pytest.raises(EventError):
        decode(bad)


@pytest.mark.parametrize(
    "bad",
    [
        42,  # neither map nor tagged array
        {"type": "BlockStored", "block_hashes": 5},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        *(["BlockStored", [1], None, [1, 2], size] for size in (-16, 0, True, 1 << 20)),  # no engine's block size
    ],
)
def test_a_malformed_event_is_skipped_and_counted_and_its_batch_kept(bad):
    """One bad event refused its whole batch, which a replay then could not fix: the backend's
    precise picture was dropped for it."""
    batch = decode(frames([stored_map([11], None, [1, 2, 3, 4]), bad, {"type": "AllBlocksCleared"}]))
    assert batch.events == [BlockStored((11,), None, (1, 2, 3, 4), 4, ()), AllBlocksCleared()]
    assert batch.malformed == 1


def test_an_offloading_tiers_events_are_skipped_and_counted():
    """vLLM's offloading connector puts its CPU tier's events in the GPU's batch: a store with no
    tokens and block size 0 (it refused the batch, and so the backend's picture), removals under
    the GPU blocks' own hashes (they dropped blocks the GPU still held)."""
    placeholder = {**stored_map([12], None, []), "block_size": 0, "medium": "CPU"}
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"}
    batch = decode(frames([stored_map([11], None, [1, 2, 3, 4]), placeholder, removed]))
    assert batch.events == [BlockStored((11,), None, (1, 2, 3, 4), 4, ())] and batch.other_tier == 2
    assert decode(frames([["BlockRemoved", [11], "STORAGE"]])).other_tier == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_any_bytes_either_decode_or_raise_event_error(parts):
    with contextlib.suppress(EventError):  # anything else fails the test
        decode(parts)


def router(**kw) -> Router:
    routing = Router(Settings(hash_key=KEY, **kw))
    routing.use_precise(tokenizer=None)  # type: ignore[arg-type]  # events only: no requests tokenized here
    return routing


def test_keys_from_events_equal_keys_from_the_tokenized_request():
    hasher = TokenHasher(KEY)
    tokens = list(range(100, 112))  # three blocks of 4
    index = PreciseIndex(hasher, 1000)
    index.stored(A, BlockStored((1, 2), None, tuple(tokens[:8]), 4, ()))
    index.stored(A, BlockStored((3,), 2, tuple(tokens[8:]), 4, ()))  # extends block 2 by its parent link
    chain = hasher.chain(tokens, 4)
    assert index.lookup(chain, [A, B], 0) == {A: 3, B: 0}
    index.removed(A, BlockRemoved((2,)))
    assert index.lookup(chain, [A], 0) == {A: 1}  # a hole ends the prefix


def test_cache_salt_keys_the_first_block_as_the_engine_does():
    hasher = TokenHasher(KEY)
    tokens = list(range(8))
    index = PreciseIndex(hasher, 1000)
    index.stored(A, BlockStored((1, 2), None, tuple(tokens), 4, (("tenant-a",), None)))
    salted = hasher.chain(tokens, 4, (extra_digest(("tenant-a",)),))
    assert index.lookup(salted, [A], 0) == {A: 2}
    assert index.lookup(hasher.chain(tokens, 4), [A], 0) == {A: 0}  # no salt, no share


def test_orphans_size_mismatches_and_overflow_are_counted_not_applied():
    index = PreciseIndex(TokenHasher(KEY), max_blocks=3)
    assert index.stored(A, BlockStored((9,), 12345, (1, 2, 3, 4), 4, ())) == [] and index.orphans == 1
    index.stored(A, BlockStored((1,), None, (1, 2, 3, 4), 4, ()))
    assert index.stored(A, BlockStored((5,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8, ())) == []
    assert index.size_mismatches == 1
    with pytest.raises(ValueError):
        index.stored(A, BlockStored((6, 7), None, (1, 2, 3), 4, ()))
    index.stored(A, BlockStored((2, 3, 4), 1, tuple(range(12)), 4, ()))  # four blocks > max_blocks
    assert index.overflows == 1 and index.entries_by_backend() == {}


def test_a_cleared_cache_drops_the_backend_and_its_sessions_in_both_modes():
    for precise in (False, True):
        routing = router() if precise else Router(Settings(hash_key=KEY))
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}
        request = parse_request(body, {"x-session-id": "s"})
        routing.learn(request, A, 0)
        if precise:
            routing.engine_events(A, [BlockStored((1,), None, (1, 2, 3, 4), 4, ())])
        assert routing.index.entries_by_backend()[A] > 0 and len(routing.sessions) == 1
        routing.engine_events(A, [AllBlocksCleared()])
        assert routing.index.entries_by_backend().get(A, 0) == 0 and len(routing.sessions) == 0
        assert routing.stats.resets[Reset.CACHE_CLEARED] == 1


def _served(routing: Router, content: str, session: str, now: float) -> Exchange:
    """A request kvroute sent to A and learned there when its response started, at `now`."""
    body = {"model": "m", "messages": [{"role": "user", "content": content * 3000}]}
    exchange = routing.begin(parse_request(body, {"x-session-id": session}), [Backend(A)], now)
    routing.response_started(exchange, ResponseStart(A, True, 200, True), now)
    return exchange


SERVED = (("a", "before-the-last-batch", 1.0), ("b", "ended-after-it", 3.0), ("c", "in-flight", 4.0))


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
def test_a_clear_reported_late_keeps_what_the_requests_still_in_flight_taught(precise: bool):
    # vLLM publishes a clear with its next step: on an idle engine, the step of the first requests
    # sent after it, which kvroute learned at their response start, before the clear arrives.
    routing = router() if precise else Router(Settings(hash_key=KEY))
    exchanges = {c: _served(routing, c, name, now) for c, name, now in SERVED}
    exchanges["a"].end()
    exchanges["b"].end()  # ran to its end after the last batch: the clear still came later
    routing.engine_events(A, [AllBlocksCleared()], previous=2.0)
    bound = {name: routing.sessions.get(f"session:{name}", 5.0) for _, name, _ in SERVED}
    assert bound == {"before-the-last-batch": None, "ended-after-it": None, "in-flight": A}
    if not precise:  # the precise index holds only what the engine's events say, so it starts empty
        held = {c: routing.index.lookup(e.request.chain or [], [A], 5.0)[A] for c, e in exchanges.items()}
        assert held["a"] == held["b"] == 0 < held["c"], held
    routing.engine_events(A, [AllBlocksCleared()])  # no arrival time known: everything goes
    assert routing.sessions.get("session:in-flight", 5.0) is None


def test_events_refused_by_the_index_are_counted_and_the_rest_applied():
    routing = router()
    bad = BlockStored((1,), None, (2**40, 1, 2, 3), 4, ())  # a token id out of range
    good = BlockStored((2,), None, (1, 2, 3, 4), 4, ())
    routing.engine_events(A, [bad, good, BlockStored((3,), None, (1, 2, 3, 4), 4, (({"x": b"\x00"},),))])
    assert routing.stats.bad_events == 2 and routing.index.entries_by_backend()[A] == 1


def test_a_new_process_start_time_resets_the_backend_and_engine_load_counts():
    routing = Router(Settings(hash_key=KEY))
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "y" * 3000}]})
    routing.engine_sample(A, EngineSample(0, 0, 0.0, 100.0, 131072, 128), 0)
    routing.learn(request, A, 0)
    routing.engine_sample(A, EngineSample(3, 2, 0.5, 100.0, 131072, 128), 1)
    assert routing.index.entries_by_backend()[A] > 0  # same process: nothing dropped
    assert routing.loads.get(A).requests(1) == 5  # the engine sees five requests kvroute never sent
    assert routing.state().load[A].engine_kv_usage == 0.5
    assert routing.loads.get(A).requests(10) == 0  # a sample that old says nothing
    routing.engine_sample(A, EngineSample(0, 0, 0.0, 200.0, 131072, 128), 2)
    assert routing.index.entries_by_backend().get(A, 0) == 0 and routing.stats.resets[Reset.RESTART] == 1


def test_precise_mode_takes_the_block_size_from_the_engines_cache_config_before_any_event():
    routing = router()
    assert routing.index.block_size is None
    routing.engine_sample(A, EngineSample(0, 0, 0.0, 1.0, 131072, 128), 0)
    assert routing.index.block_size == 128


def test_lost_events_drop_the_picture_only_where_it_came_from_events():
    approximate = Router(Settings(hash_key=KEY))
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "z" * 3000}]})
    approximate.learn(request, A, 0)
    approximate.events_lost(A, Reset.EVENTS_LOST)
    assert approximate.index.entries_by_backend()[A] > 0
    approximate.events_lost(A, Reset.SEQUENCE_RESTART)  # a new publisher is a restart
    assert approximate.index.entries_by_backend().get(A, 0) == 0
    precise = router()
    precise.engine_events(A, [BlockStored((1,), None, (1, 2, 3, 4), 4, ())])
    precise.events_lost(A, Reset.EVENTS_LOST)
    assert precise.index.entries_by_backend().get(A, 0) == 0


def test_blocks_routed_but_unconfirmed_are_pending_until_the_engine_confirms_or_time_passes():
    hasher = TokenHasher(KEY)
    index = PreciseIndex(hasher, 1000)
    tokens = list(range(12))
    chain = hasher.chain(tokens, 4)
    assert index.learn(chain, A, 0.0) == 3  # sent to A: on its way there
    assert index.lookup(chain, [A, B], 1.0) == {A: 3, B: 0}  # a concurrent request follows it
    assert index.confirmed(chain, A) == 0  # but nothing is cached yet: predictions stay exact
    index.stored(A, BlockStored((1, 2), None, tuple(tokens[:8]), 4, ()))
    assert index.confirmed(chain, A) == 2 and index.lookup(chain, [A], 1.0) == {A: 3}
    assert index.lookup(chain, [A], 11.0) == {A: 2}  # the unconfirmed third block expired
    assert index.learn(chain, A, 12.0) == 1  # only the unconfirmed block is new


def test_a_precise_router_co_locates_concurrent_requests_and_predicts_only_confirmed_blocks():
    routing = router(decision_headers=True)
    routing.index.block_size = 4  # as learned from the engines' events
    backends = [Backend(A), Backend(B)]

    def request():
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
        parsed = parse_request(body, {})
        parsed.tokens = list(range(40))
        return parsed

    first = routing.begin(request(), backends, 0.0)
    second = routing.begin(request(), backends, 0.1)  # before the first one's events arrive
    assert second.decision.backend == first.decision.backend and second.decision.matched_blocks == 10
    served = ResponseStart(second.decision.backend, known=True, status=200, from_upstream=True)
    headers = dict(routing.response_started(second, served, 0.5).headers)
    assert headers["x-kvroute-cached-tokens"] == "0"  # pending blocks are not predicted as cached


def test_precise_mode_holds_a_prefill_reservation_until_the_engine_stores_the_last_block():
    routing = router()
    routing.index.block_size = 4
    parsed = parse_request({"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}, {})
    parsed.tokens = list(range(12))
    exchange = routing.begin(parsed, [Backend(A)], 0.0)
    assert routing.loads.snapshot()[A] == (3, 1)
    started = ResponseStart(A, known=True, status=200, from_upstream=True)
    routing.response_started(exchange, started, 0.1)  # streaming headers come before the prefill
    assert routing.loads.snapshot()[A] == (3, 1)
    routing.engine_events(A, [BlockStored((1, 2), None, tuple(range(8)), 4, ())])
    assert routing.loads.snapshot()[A] == (3, 1)  # two of three blocks: still prefilling
    routing.engine_events(A, [BlockStored((3,), 2, tuple(range(8, 12)), 4, ())])
    assert routing.loads.snapshot()[A] == (0, 1)  # the last block is stored: prefill done
    exchange.end()
    assert routing.loads.snapshot()[A] == (0, 0)


def test_approximate_mode_holds_a_streamed_prefill_until_the_engines_progress_covers_it():
    routing = Router(Settings(hash_key=KEY, block_size=512))  # 512 CBR bytes a block
    started = ResponseStart(A, known=True, status=200, from_upstream=True)

    def send(stream: bool, text: str):
        body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": text * 2048}]}
        exchange = routing.begin(parse_request(body, {}), [Backend(A)], 0.0)
        routing.response_started(exchange, started, 0.1)
        return exchange

    unheard = send(True, "a")  # A has published nothing yet: the response start is all there is
    assert routing.loads.snapshot()[A] == (0, 1)
    unheard.end()
    routing.engine_events(A, [BlockStored((1,), None, tuple(range(16)), 16, ())])  # A reports progress
    streamed = send(True, "b")
    held = streamed.reservation.blocks
    assert held >= 4 and routing.loads.snapshot()[A] == (held, 1)  # headers came before the prefill
    tokens_per_block = 512 / routing.bytes_per_token.value
    routing.engine_events(A, [BlockStored((2, 3), None, tuple(range(32)), 16, ())])
    assert routing.loads.snapshot()[A][0] == held - int(32 / tokens_per_block)
    blocks = round(held * tokens_per_block / 16) + 1
    routing.engine_events(A, [BlockStored(tuple(range(blocks)), None, tuple(range(16 * blocks)), 16, ())])
    assert routing.loads.snapshot()[A] == (0, 1)  # the engine stored the whole prompt
    streamed.end()
    send(False, "c").end()  # not streamed: the response starts after the prefill
    lost = send(True, "d")
    assert routing.loads.snapshot()[A][0] > 0
    routing.events_lost(A, Reset.EVENTS_LOST)  # progress can no longer be followed: released now
    assert routing.loads.snapshot()[A] == (0, 1)
    lost.end()
    send(True, "e")
    assert routing.loads.snapshot()[A] == (0, 1)  # and released at response start again


def test_an_error_or_another_backend_serving_releases_the_held_prefill_at_response_start():
    routing = Router(Settings(hash_key=KEY))
    routing.engine_events(A, [BlockStored((1,), None, tuple(range(16)), 16, ())])
    routing.engine_events(B, [BlockStored((1,), None, tuple(range(16)), 16, ())])
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "z" * 8000}]}
    for start in (
        ResponseStart(A, known=True, status=503, from_upstream=True),
        ResponseStart(B, known=True, status=200, from_upstream=True),  # the retry went to B
    ):
        exchange = routing.begin(parse_request(body, {}), [Backend(A)], 0.0)
        routing.response_started(exchange, start, 0.1)
        assert routing.loads.snapshot()[A] == (0, 1)
        exchange.end()


def test_precise_mode_releases_the_held_prefill_on_an_error_or_where_another_backend_served():
    """In precise mode the engine's store of the prompt's last block releases a streamed request's
    prefill; a response not streamed starts after it, and an error, or a retry served elsewhere,
    says that store will not come from this engine."""
    routing = router()
    routing.index.block_size = 4
    ok = ResponseStart(A, known=True, status=200, from_upstream=True)
    for token, (stream, start, held) in enumerate(
        (
            (True, ok, True),
            (False, ok, False),
            (True, ResponseStart(A, known=True, status=503, from_upstream=True), False),
            (True, ResponseStart(B, known=True, status=200, from_upstream=True), False),
        )
    ):
        body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "q"}]}
        parsed = parse_request(body, {})
        parsed.tokens = [token] * 8  # a prompt of its own, so nothing of it is in flight already
        exchange = routing.begin(parsed, [Backend(A)], 0.0)
        assert routing.loads.snapshot()[A][0] == 2
        routing.response_started(exchange, start, 0.1)
        assert (routing.loads.snapshot()[A][0] > 0) is held
        exchange.end()


def test_prefill_waits_of_ended_requests_are_swept():
    routing = router()
    routing.index.block_size = 4
    for i in range(3000):
        parsed = parse_request({"model": "m", "messages": [{"role": "user", "content": "q"}]}, {})
        parsed.tokens = [i] * 8
        routing.begin(parsed, [Backend(A)], float(i)).end()  # never confirmed by the engine
    assert isinstance(routing.mode, PreciseMode) and len(routing.mode._prefilling) <= 2048
    assert routing.loads.snapshot()[A] == (0, 0)


def test_prefill_waits_of_ended_requests_repeating_one_prompt_are_swept():
    """One prompt sent again and again, its last block never reported (the engine had it before the
    picture did): the block's list of waits is swept as a table of many blocks is."""
    routing = router()
    routing.index.block_size = 4
    for i in range(5000):
        parsed = parse_request({"model": "m", "messages": [{"role": "user", "content": "q"}]}, {})
        parsed.tokens = [7] * 8
        routing.begin(parsed, [Backend(A)], float(i)).end()
    assert isinstance(routing.mode, PreciseMode)
    assert sum(len(held) for held in routing.mode._prefilling.values()) <= 2048
    assert routing.loads.snapshot()[A] == (0, 0)


def test_lora_blocks_serve_only_requests_for_that_adapter():
    routing = router()
    tokens = tuple(range(12))
    extras = (("sql-adapter", "salt-1"), ("sql-adapter",), ("sql-adapter",))  # as vLLM publishes them
    wire = stored_map([1, 2, 3], None, list(tokens), extra=[list(e) for e in extras])
    wire["lora_name"] = "sql-adapter"
    (event,) = decode(frames([wire])).events
    assert event.lora_name == "sql-adapter"
    routing.engine_events(A, [event])

    def matched(model: str, salt: str | None) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": "q"}]}
        if salt:
            body["cache_salt"] = salt
        parsed = parse_request(body, {})
        parsed.tokens = list(tokens)
        return routing.index.lookup(routing.chain_of(parsed), [A], 0.0)[A]

    assert matched("sql-adapter", "salt-1") == 3
    assert matched("base-model", "salt-1") == 0  # the base model never reuses an adapter's blocks
    assert matched("sql-adapter", None) == 0  # nor another salt


def test_bytes_per_token_is_learned_from_what_ended_and_the_engine_counted():
    from extproc.core.calibration import BytesPerToken

    ratio = BytesPerToken()
    ratio.ended(A, 1_000_000)  # before the first sample: not counted
    ratio.engine_tokens(A, 500.0)  # the first sample is the baseline
    ratio.ended(A, 15_000)  # 3 bytes a token: one request of 5,000 tokens
    ratio.engine_tokens(A, 5_500.0)  # 5,000 tokens: too few to judge, keep accumulating
    assert ratio.value == 4.0
    # The engine counted three more such requests whose end kvroute has not seen yet: alone this
    # window would say 0.75 bytes a token; against the prior it moves the ratio part of the way.
    ratio.engine_tokens(A, 20_500.0)
    assert 2.5 < ratio.value < 4.0
    ratio.engine_tokens(A, 100.0)  # a restarted engine's counter starts over: a new baseline
    for _ in range(60):
        ratio.ended(A, 60_000)
        ratio.engine_tokens(A, ratio._tokens[A] + 20_000)
    assert ratio.value == pytest.approx(3.0, abs=0.01)  # 3 bytes a token from here on


def test_a_learned_ratio_resizes_the_approximate_index_and_the_prediction():
    routing = Router(Settings(hash_key=KEY))  # 512-byte blocks
    routing.engine_sample(A, EngineSample(0, 0, 0.0, 1.0, 128_000, 128, 0.0), 0)
    assert routing.index._capacities[A] == 128_000 * 4 // 512  # 4 bytes a token until measured
    for step in range(1, 60):
        routing.bytes_per_token.ended(A, 40_000)
        routing.engine_sample(A, EngineSample(0, 0, 0.0, 1.0, 128_000, 128, step * 20_000.0), step)
    assert routing.bytes_per_token.value == pytest.approx(2.0, abs=0.05)
    assert routing.index._capacities[A] == pytest.approx(128_000 * 2 / 512, rel=0.05)
    assert routing.block_tokens() == pytest.approx(256, rel=0.05)  # 512 bytes are 256 tokens here


def test_a_new_hash_key_in_precise_mode_forgets_the_old_index_and_its_turnover():
    import dataclasses

    routing = router()
    routing.engine_events(A, [BlockStored((1,), None, (1, 2, 3, 4), 4, ())])
    routing.churn.add(A, 5, 0.0)
    routing.reconfigure(dataclasses.replace(routing.settings, hash_key=bytes(16)))
    assert routing.precise and routing.index.entries_by_backend() == {}
    assert routing.churn.rate(A, 0.0) == 0
