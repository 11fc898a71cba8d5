"""Disaggregated fleets in the core (extproc/core/pairs.py, Router.prefill_leg): a request is
decided among the backends that serve whole requests, and split onto a prefill backend only when
enough of its prompt is uncached where it decodes."""

from __future__ import annotations

from extproc.core.backends import Backend, Role
from extproc.core.decision import Label
from extproc.core.engine import BlockStored, EngineSample
from extproc.core.request import parse_request
from extproc.core.router import Router
from tests.test_router import chat, make_router, ok, serve

DECODE, OTHER_DECODE = Backend("10.0.1.1:8000", role=Role.DECODE), Backend("10.0.1.2:8000", role=Role.DECODE)
PREFILL, OTHER_PREFILL = Backend("10.0.2.1:8000", role=Role.PREFILL), Backend("10.0.2.2:8000", role=Role.PREFILL)
FLEET = [DECODE, PREFILL, OTHER_PREFILL]


def test_prefill_backends_never_serve_whole_requests():
    router = make_router()
    for i in range(20):
        assert router.begin(chat([], user_text=f"q{i}"), FLEET, i).decision.backend == DECODE.address
    assert router.begin_unreadable([PREFILL, DECODE], 0).decision.backend == DECODE.address
    assert router.begin(chat([]), [PREFILL], 0).decision.label is Label.NO_CANDIDATES


def test_a_long_uncached_prompt_is_split_onto_the_prefill_backend_holding_its_prefix():
    router = make_router(pd_threshold_tokens=256)
    warm = router.begin(chat([], user_text="first"), FLEET, 0)
    leg = router.prefill_leg(warm, FLEET, 0)
    assert leg is not None and leg.decision.label is Label.PREFILL and leg.decision.backend != DECODE.address
    first_prefill = leg.decision.backend
    assert leg.reservation is not None and leg.reservation.blocks == leg.decision.total_blocks  # nothing cached
    assert router.response_started(leg, ok(first_prefill), 1).learned  # the prefill backend holds it now
    assert leg.end() and not leg.end()  # released once
    router.response_started(warm, ok(DECODE.address), 1)
    warm.end()
    # the next prompt sharing that prefix: the decode backend learned it too (the transferred blocks)
    again = router.begin(chat([], user_text="second"), FLEET, 2)
    assert again.decision.backend == DECODE.address and again.predicted_blocks > 0
    uncached = router.begin(chat([], user_text="third"), [OTHER_DECODE, PREFILL, OTHER_PREFILL], 3)
    leg = router.prefill_leg(uncached, [OTHER_DECODE, PREFILL, OTHER_PREFILL], 3)
    assert leg is not None and leg.decision.backend == first_prefill  # where the prefix is cached
    assert leg.decision.matched_blocks > 0


def test_the_prefill_leg_is_judged_and_timed_by_the_prefill_backend_s_own_picture_and_queue():
    """Trust and the TTFT fit read the leg's decision and reservation: what the prefill backend's
    picture held (not the decode backend's) and the work queued there."""
    router = make_router(pd_threshold_tokens=64)
    warm = router.begin(chat([], user_text="warm"), [DECODE], 0)  # the decode backend holds the head
    router.response_started(warm, ok(DECODE.address), 0)
    warm.end()
    busy = router.loads.reserve(PREFILL.address, 3)
    busier = router.loads.reserve(DECODE.address, 40)  # queued deeper than the prefill backend
    exchange = router.begin(chat([], user_text="a long new question " * 200), [DECODE, PREFILL], 1)
    assert exchange.decision.picture_blocks > 0
    leg = router.prefill_leg(exchange, [DECODE, PREFILL], 1)
    assert leg is not None and leg.decision.backend == PREFILL.address and leg.reservation is not None
    assert leg.decision.picture_blocks == 0  # nothing of it pictured on the prefill backend
    assert leg.reservation.in_flight == 1 and leg.reservation.work == 3 + leg.reservation.blocks
    busy.finish()
    busier.finish()


def test_a_failed_split_s_prefill_is_drained_by_the_decode_engine_s_progress_again():
    """The split released the decode backend's prefill, and its engine's progress meanwhile passed
    it over; once the hand-off fails, that progress must drain it again, not the stream's end."""
    router = make_router(pd_threshold_tokens=64)
    stored = BlockStored((1,), None, tuple(range(16)), 16, (None,))
    router.engine_events(DECODE.address, [stored], now=0.0)  # the decode engine reports its progress
    busy = router.loads.reserve(DECODE.address, 100)  # queued deeper than the prefill backend: it splits
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q " * 3000}]}
    exchange = router.begin(parse_request(body, {}), [DECODE, PREFILL], 1)
    leg = router.prefill_leg(exchange, [DECODE, PREFILL], 1)
    assert leg is not None and exchange.reservation is not None
    router.engine_events(DECODE.address, [stored], now=2.0)  # other work stored there meanwhile
    busy.finish()
    leg.end()
    router.prefill_again(exchange)  # the hand-off failed: served whole
    assert router.loads.get(DECODE.address).reserved_blocks == exchange.reservation.blocks
    router.response_started(exchange, ok(DECODE.address), 3.0)
    for t in range(4, 40):  # the engine prefills it
        router.engine_events(DECODE.address, [BlockStored((t,), None, tuple(range(640)), 640, (None,))], now=t)
    assert router.loads.get(DECODE.address).reserved_blocks == 0  # before the stream's end
    exchange.end()


def test_a_prefill_leg_teaches_its_prompt_but_binds_no_conversation_to_the_prefill_server():
    router = make_router(pd_threshold_tokens=64)
    exchange = router.begin(chat([], session="s1", user_text="a long new question " * 200), FLEET, 0)
    leg = router.prefill_leg(exchange, FLEET, 0)
    assert leg is not None and leg.decision.backend != DECODE.address
    assert router.response_started(leg, ok(leg.decision.backend), 0.1).learned
    leg.end()
    assert router.sessions.get("session:s1", 0.2) is None  # the decode leg failed: no turn was served
    exchange.end()


def test_short_prompts_or_fleets_without_prefill_backends_are_served_whole():
    router = make_router(pd_threshold_tokens=1_000_000)
    exchange = router.begin(chat([]), FLEET, 0)
    assert router.prefill_leg(exchange, FLEET, 0) is None  # below the threshold
    router = make_router(pd_threshold_tokens=256)
    exchange = router.begin(chat([]), [DECODE, OTHER_DECODE], 0)
    assert router.prefill_leg(exchange, [DECODE, OTHER_DECODE], 0) is None  # nothing to prefill on
    aggregated = [Backend("10.0.3.1:8000"), Backend("10.0.3.2:8000")]  # every backend both: never split
    assert router.prefill_leg(router.begin(chat([], user_text="x"), aggregated, 0), aggregated, 0) is None
    off = make_router(pd_threshold_tokens=0)
    assert off.prefill_leg(off.begin(chat([]), FLEET, 0), FLEET, 0) is None


def test_prefill_backends_queued_deeper_than_the_decode_backend_leave_the_request_whole():
    router = make_router(pd_threshold_tokens=256)
    fleet = [DECODE, PREFILL]
    queued = router.loads.reserve(PREFILL.address, 10_000)  # legs of earlier requests, still prefilling
    exchange = router.begin(chat([]), fleet, 0)
    assert router.prefill_leg(exchange, fleet, 0) is None  # the decode backend prefills it sooner
    assert router.loads.get(DECODE.address).reserved_blocks == exchange.reservation.blocks > 0
    queued.finish()
    exchange.end()  # (unserved: in flight, its prompt would count as held on the decode backend)
    exchange = router.begin(chat([], user_text="again"), fleet, 1)
    ahead = router.loads.get(DECODE.address).reserved_blocks
    leg = router.prefill_leg(exchange, fleet, 1)
    assert leg is not None and leg.decision.backend == PREFILL.address
    # split: the decode backend no longer counts this prefill as its own, the prefill backend does
    assert router.loads.get(DECODE.address).reserved_blocks == ahead - exchange.reservation.blocks
    assert router.loads.get(PREFILL.address).reserved_blocks == leg.reservation.blocks
    # the leg failed: the decode backend computes the whole prompt, its prefill its own again, once
    leg.end()
    router.prefill_again(exchange)
    router.prefill_again(exchange)
    assert router.loads.get(DECODE.address).reserved_blocks == ahead
    exchange.end()
    assert router.loads.get(DECODE.address).reserved_blocks == ahead - exchange.reservation.blocks


def test_a_busy_prefill_backend_loses_to_an_idle_one_that_would_compute_the_same():
    router = make_router(pd_threshold_tokens=256)
    queued = [router.loads.reserve(PREFILL.address, 500) for _ in range(3)]
    exchange = router.begin(chat([]), FLEET, 0)
    leg = router.prefill_leg(exchange, FLEET, 0)
    assert leg is not None and leg.decision.backend == OTHER_PREFILL.address
    for reservation in queued:
        reservation.finish()


def test_a_flexible_fleet_splits_only_where_the_prefill_costs_strictly_less_than_at_home():
    left, right = Backend("10.0.3.1:8000"), Backend("10.0.3.2:8000")  # role both, each a KV connector
    fleet = [left, right]
    router = make_router(pd_threshold_tokens=256, pd_flexible=True)
    idle = router.begin(chat([], user_text="idle"), fleet, 0)
    assert router.prefill_leg(idle, fleet, 0) is None  # equals: a hand-off adds the transfer only
    idle.end()
    home = router.begin(chat([], user_text="deep"), fleet, 1)
    other = right if home.decision.backend == left.address else left
    router.loads.reserve(home.decision.backend, 10_000)  # its own prefill queue is long, the other's empty
    leg = router.prefill_leg(home, fleet, 1)
    assert leg is not None and leg.decision.label is Label.PREFILL and leg.decision.backend == other.address
    unhealthy = [Backend(other.address, healthy=False), Backend(home.decision.backend)]
    queued = router.begin(chat([], user_text="sick"), unhealthy, 2)
    assert router.prefill_leg(queued, unhealthy, 2) is None  # nowhere healthy to prefill
    rigid = make_router(pd_threshold_tokens=256)  # not flexible: a fleet of role both is never split
    rigid.loads.reserve(left.address, 10_000)
    exchange = rigid.begin(chat([], user_text="deep"), [left], 3)
    assert rigid.prefill_leg(exchange, fleet, 3) is None


KV_TOKENS = 100_000  # each engine's KV cache, in tokens
DECODES = [DECODE, OTHER_DECODE, PREFILL]


def report(router: Router, backend: Backend, kv_usage: float, now: float, running: int = 1) -> None:
    """One scrape of `backend`: `running` requests pinning `kv_usage` of its KV cache."""
    router.engine_sample(backend.address, EngineSample(running, 0, kv_usage, 100.0, KV_TOKENS, 16), now)


def test_a_decode_backend_whose_running_requests_fill_its_kv_cache_loses_new_requests():
    router = make_router(pd_threshold_tokens=256)
    report(router, DECODE, 0.999, 0)  # one long conversation pins nearly all of it
    report(router, OTHER_DECODE, 0.2, 0)  # as many running, room to spare
    for i in range(4):
        exchange = router.begin(chat([], user_text=f"new {i}"), DECODES, 0.1)
        decision = exchange.decision
        assert decision.backend == OTHER_DECODE.address
        full = next(c for c in decision.candidates if c.backend == DECODE.address)
        assert full.kv_room_cost > 0 and decision.explain()["candidates"][0]["kv_room_cost"] > 0
        if i == 0:  # equal costs but for this term (later ones follow the prompt head's home)
            assert decision.label is Label.KV_ROOM
        exchange.end()


def test_a_conversation_leaves_its_decode_backend_when_waiting_for_room_costs_more_than_moving():
    router = make_router(pd_threshold_tokens=256, kv_room_cost=2)  # a block short outweighs one recomputed
    report(router, DECODE, 0.2, 0)
    report(router, OTHER_DECODE, 0.2, 0)
    first = serve(router, chat([], session="s1"), 0.1, DECODES)
    stays = serve(router, chat([{"role": "assistant", "content": "a"}], session="s1", user_text="b"), 0.2, DECODES)
    assert stays.backend == first.backend and stays.label is Label.SESSION_MATCH
    home = DECODE if first.backend == DECODE.address else OTHER_DECODE
    report(router, home, 0.9999, 0.3)  # its cache is now pinned by others' running requests
    history = [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    moved = router.begin(chat(history, session="s1", user_text="d"), DECODES, 0.4).decision
    assert moved.backend != home.address and moved.label is Label.KV_ROOM


def test_kv_room_is_weighed_only_with_a_fresh_sample_in_fleets_that_split():
    def costs(router: Router, fleet: list[Backend], now: float) -> list[float]:
        return [c.kv_room_cost for c in router.begin(chat([], user_text=f"q{now}"), fleet, now).decision.candidates]

    router = make_router(pd_threshold_tokens=256, kv_room_everywhere=False)
    report(router, DECODE, 1.0, 0)
    assert max(costs(router, DECODES, 1)) > 0
    assert costs(router, DECODES, 10) == [0, 0]  # the sample is too old to say anything
    aggregated = [Backend(DECODE.address), Backend(OTHER_DECODE.address)]  # role both: never split
    report(router, DECODE, 1.0, 20)
    assert costs(router, aggregated, 20) == [0, 0]
    # ... unless any may prefill for another
    flexible = make_router(pd_threshold_tokens=256, pd_flexible=True, kv_room_everywhere=False)
    report(flexible, DECODE, 1.0, 0)
    assert max(costs(flexible, aggregated, 1)) > 0
    for off in (
        make_router(pd_threshold_tokens=256, kv_room_cost=0),
        make_router(pd_threshold_tokens=0, kv_room_everywhere=False),
    ):
        report(off, DECODE, 1.0, 0)
        assert costs(off, DECODES, 1) == [0, 0]


def test_kv_usage_out_of_range_counts_as_a_full_or_empty_cache():
    def full_cost(usage: float, now: float) -> float:
        router = make_router(pd_threshold_tokens=256)
        report(router, DECODE, usage, now)
        decision = router.begin(chat([], user_text="same prompt"), DECODES, now)
        return next(c.kv_room_cost for c in decision.decision.candidates if c.backend == DECODE.address)

    assert full_cost(1.5, 0) == full_cost(1.0, 0) > 0  # a gauge past 1 charges no more than a full cache
    assert full_cost(-0.5, 0) == full_cost(0.0, 0) == 0


def _own(tag: str) -> str:
    """A user message of many blocks that no other prompt shares (tags of one length: one size)."""
    return " ".join(f"{tag}-{k}" for k in range(600))


def _two_in_flight_fleet(blocks_short: int, **settings: object) -> tuple[Router, Backend, Backend, int]:
    """A router over two backends whose caches hold, beside two prompts of distinct text in flight,
    `blocks_short` blocks less than a third such prompt needs (negative: more); their KV sizes
    come from one sample, long before, so only the footprint is current. Also the prompts' size."""
    first, second = Backend("10.0.3.1:8000"), Backend("10.0.3.2:8000")
    probe = make_router(**settings)
    chains = [probe.chain_of(chat([], user_text=_own(tag))) for tag in ("run-0", "run-1")]
    size = len(chains[0])
    head = next(i for i, (x, y) in enumerate(zip(*chains, strict=False)) if x != y)  # the system prompt's
    router = make_router(**settings)
    cache_blocks = 3 * size - 2 * head - blocks_short  # two held (their head once) and the third's own part
    for backend in (first, second):
        sample = EngineSample(0, 0, 0.0, 100.0, int(cache_blocks * router.block_tokens()), 16)
        router.engine_sample(backend.address, sample, 0)
    return router, first, second, size


def test_in_any_fleet_a_prompt_that_does_not_fit_beside_the_requests_in_flight_goes_where_it_fits():
    """`kv_room_everywhere` (the default): kvroute's own requests in flight take their whole prompts' room at
    once, waiting ones too, which no engine sample shows yet; so a prompt does not queue behind them
    on an engine whose cache cannot hold them all, its cached prefix evicted while it waits (on the
    skewed workload on vLLM-CPU, long conversations found 0.02-0.05 of their prompts cached there).
    Their room is given back as they end."""
    router, first, second, _ = _two_in_flight_fleet(2, kv_room_everywhere=True)
    held = [router.begin(chat([], user_text=_own(f"run-{i}")), [first], 1) for i in range(2)]
    for exchange in held:
        router.response_started(exchange, ok(first.address), 2)  # learned there: its prefix is held
    decision = router.begin(chat([], user_text=_own("nxt-2")), [first, second], 100).decision
    assert decision.backend == second.address
    assert [c.kv_room_cost > 0 for c in decision.candidates if c.backend == first.address] == [True]
    for exchange in held:
        exchange.end()
    assert router.loads.get(first.address).footprint == 0
    back = router.begin(chat([], user_text=_own("aft-3")), [first, second], 101).decision
    assert back.backend == first.address and back.label is not Label.KV_ROOM
    router, first, second, _ = _two_in_flight_fleet(2, kv_room_everywhere=False)  # only in fleets that split
    for i in range(2):
        exchange = router.begin(chat([], user_text=_own(f"run-{i}")), [first], 1)
        router.response_started(exchange, ok(first.address), 2)
    assert router.begin(chat([], user_text=_own("nxt-2")), [first, second], 100).decision.backend == first.address


def test_prompts_in_flight_that_share_a_head_take_its_room_once():
    """The system prompt and tools that requests in flight share are pinned once in the engine, and
    a prompt that starts with them needs room only for the rest: counting every whole prompt (as
    kvroute did) sent a conversation away from the backend holding its prefix for room it had."""
    router, first, second, size = _two_in_flight_fleet(-2)
    held = [router.begin(chat([], user_text=_own(f"run-{i}")), [first], 1) for i in range(2)]
    for exchange in held:
        router.response_started(exchange, ok(first.address), 2)
    assert router.loads.get(first.address).footprint < 2 * size  # the shared head counted once
    decision = router.begin(chat([], user_text=_own("run-0")), [first, second], 100).decision
    assert decision.backend == first.address  # a third copy of a prompt in flight there needs no room
    assert all(c.kv_room_cost == 0 for c in decision.candidates)
    other = router.begin(chat([], user_text=_own("nxt-2")), [first, second], 100).decision
    assert all(c.kv_room_cost == 0 for c in other.candidates)  # the rest of a new prompt fits: two blocks over


def test_the_requests_sibling_replicas_have_in_flight_take_their_room_too():
    """With several ext_proc replicas, each publishes its footprint with its load (the replica store,
    `PeerLoads`): a prompt does not go where a sibling's requests, still waiting in the engine where
    no sample shows them, leave no room for it, though its prefix is there."""
    first, second = Backend("10.0.3.1:8000"), Backend("10.0.3.2:8000")
    router = make_router()
    size = router.begin(chat([], user_text="size"), [first], 0).decision.total_blocks
    router = make_router()
    cache = int(2.5 * size * router.block_tokens())
    for backend in (first, second):
        router.engine_sample(backend.address, EngineSample(0, 0, 0.0, 100.0, cache, 16), 0)
    earlier = router.begin(chat([], user_text="next"), [first], 1)
    router.response_started(earlier, ok(first.address), 2)
    earlier.end()  # its prefix stays cached on the first backend

    def where(sibling_footprint: int) -> tuple[str | None, float]:
        router.loads.set_peers({first.address: (0, 2, sibling_footprint)})  # a sibling's two requests there
        exchange = router.begin(chat([], user_text="next"), [first, second], 100)
        exchange.end()
        decision = exchange.decision
        return decision.backend, next(c.kv_room_cost for c in decision.candidates if c.backend == first.address)

    assert where(0) == (first.address, 0)  # the same requests, their size unknown: the prefix keeps it
    backend, cost = where(2 * size)
    assert backend == second.address and cost > 0
