"""The flow-control queue (extproc/core/flow.py): order, fair shares, bounds, expiry, eviction."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.flow import OVERFLOW_FLOW, YIELD_S, FlowQueue, Held, QueueLimits, Refusal, State
from extproc.core.objectives import DEFAULT_FLOW


def _held(result: Held | Refusal) -> Held:
    assert isinstance(result, Held), result
    return result


@contextlib.contextmanager
def _comparisons() -> Iterator[list[int]]:
    """Counts the held requests' comparisons (the queue's heap work) while inside."""
    compared = [0]
    lt = Held.__lt__

    def counted(self: Held, other: Held) -> bool:
        compared[0] += 1
        return lt(self, other)

    Held.__lt__ = counted  # type: ignore[method-assign]
    try:
        yield compared
    finally:
        Held.__lt__ = lt  # type: ignore[method-assign]


def _drain(queue: FlowQueue) -> list[Held]:
    out = []
    while (held := queue.pop()) is not None:
        out.append(held)
    return out


def test_a_higher_band_goes_first_whatever_arrived_before():
    queue = FlowQueue(QueueLimits())
    low = _held(queue.hold(0, "a", 10, 100, now=0))
    sheddable = _held(queue.hold(-1, "a", 10, 100, now=0))
    critical = _held(queue.hold(5, "b", 10, 100, now=1))
    assert _drain(queue) == [critical, low, sheddable]
    assert all(h.state is State.DISPATCHED for h in (low, sheddable, critical))
    assert len(queue) == 0


def test_backlogged_flows_share_by_the_tokens_they_cost_not_by_requests():
    queue = FlowQueue(QueueLimits())
    for i in range(200):
        queue.hold(0, "big", 1_000, 10, now=i)  # ten times the cost per request
        queue.hold(0, "small", 100, 10, now=i)
    served: Counter[str] = Counter()
    for _ in range(110):
        held = queue.pop()
        assert held is not None
        served[held.flow] += held.cost
    assert abs(served["big"] - served["small"]) <= 1_000  # level within one request's cost


def test_weights_two_to_one():
    queue = FlowQueue(QueueLimits(), weights={"gold": 2.0})
    for i in range(300):
        queue.hold(0, "gold", 100, 10, now=i)
        queue.hold(0, "bronze", 100, 10, now=i)
    served = Counter(h.flow for h in (queue.pop() for _ in range(300)) if h is not None)
    assert served["gold"] == 2 * served["bronze"]


def test_a_flow_back_from_idle_banks_no_credit():
    queue = FlowQueue(QueueLimits())
    for i in range(50):  # "a" alone for a while: it attains 5,000
        queue.hold(0, "a", 100, 10, now=i)
    for _ in range(50):
        queue.pop()
    for i in range(10):
        queue.hold(0, "a", 100, 10, now=100 + i)
        queue.hold(0, "b", 100, 10, now=100 + i)  # "b" never ran, but its idle time is not owed to it
    flows = [h.flow for h in _drain(queue)]
    assert flows[:6].count("a") >= 2  # they alternate from the start instead of "b" running ten in a row


def test_within_a_flow_an_earlier_deadline_goes_first_and_the_rest_in_arrival_order():
    queue = FlowQueue(QueueLimits(ttl_s=30))
    first = _held(queue.hold(0, "a", 1, 1, now=0))
    second = _held(queue.hold(0, "a", 1, 1, now=1))
    urgent = _held(queue.hold(0, "a", 1, 1, now=2, ttft_s=1.0))  # due at 3, before the others' 30 and 31
    late = _held(queue.hold(0, "a", 1, 1, now=3, ttft_s=100.0))  # an objective beyond the TTL: the TTL's
    after = _held(queue.hold(0, "a", 1, 1, now=4))
    assert _drain(queue) == [urgent, first, second, late, after]


def test_held_past_the_ttl_is_ended_once_and_frees_its_place():
    queue = FlowQueue(QueueLimits(ttl_s=10, max_requests=2))
    old = _held(queue.hold(0, "a", 1, 1, now=0))
    young = _held(queue.hold(0, "a", 1, 1, now=5))
    assert queue.hold(0, "a", 1, 1, now=6) is Refusal.BAND_FULL
    assert queue.ended(now=9.9) == []
    assert queue.ended(now=10) == [old]
    assert old.state is State.EXPIRED and young.state is State.WAITING
    assert queue.ended(now=10) == []
    assert isinstance(queue.hold(0, "a", 1, 1, now=10), Held)
    assert queue.pop() is young


def test_a_sheddable_request_held_past_its_ttft_objective_expires_then_not_at_the_ttl():
    queue = FlowQueue(QueueLimits(ttl_s=30))
    late = _held(queue.hold(-1, "a", 1, 1, now=0, ttft_s=1.0))
    later = _held(queue.hold(-1, "a", 1, 1, now=0, ttft_s=2.0))
    plain = _held(queue.hold(-1, "b", 1, 1, now=0))  # no objective: the TTL
    critical = _held(queue.hold(0, "c", 1, 1, now=0, ttft_s=1.0))  # not sheddable: served late rather than not
    assert queue.ended(now=0.9) == []
    assert queue.ended(now=1.0) == [late] and late.state is State.EXPIRED
    assert queue.ended(now=5.0) == [later] and len(queue) == 2
    assert queue.ended(now=29.9) == []
    assert sorted(queue.ended(now=30.0), key=lambda h: h.seq) == [plain, critical]


def test_band_bounds_in_requests_and_bytes():
    queue = FlowQueue(QueueLimits(max_requests=3, max_bytes=1_000))
    assert isinstance(queue.hold(0, "a", 1, 600, now=0), Held)
    assert queue.hold(0, "a", 1, 500, now=0) is Refusal.BAND_FULL  # bytes
    assert isinstance(queue.hold(0, "a", 1, 400, now=0), Held)
    assert isinstance(queue.hold(1, "a", 1, 900, now=0), Held)  # another band has its own bounds
    assert isinstance(queue.hold(0, "b", 1, 0, now=0), Held)
    assert queue.hold(0, "b", 1, 0, now=0) is Refusal.BAND_FULL  # requests ("a" holds no more than "b" would)
    assert queue.hold(0, "a", 1, 0, now=0) is Refusal.BAND_FULL  # nor would "a" gain from its own


def test_one_flow_cannot_keep_the_others_out_by_filling_the_queue_first():
    """A flow holding more than another's newcomer would gives up its newest (evicted, answered
    429) for it, in requests and in bytes, down to level shares; the flooding flow itself is refused."""
    queue = FlowQueue(QueueLimits(max_requests=6, max_bytes=1_000, max_total=6))
    flood = [_held(queue.hold(0, "flood", 1, 100, now=i)) for i in range(6)]
    assert queue.hold(0, "flood", 1, 1, now=6) is Refusal.BAND_FULL
    light = _held(queue.hold(0, "light", 1, 1, now=7))
    assert flood[-1].state is State.EVICTED and queue.ended(now=7) == [flood[-1]]
    big = _held(queue.hold(0, "other", 1, 600, now=8))  # bytes: two more of the flood's go
    assert [h.state for h in flood] == [State.WAITING] * 3 + [State.EVICTED] * 3
    assert queue.ended(now=8) == [flood[4], flood[3]]
    assert isinstance(queue.hold(0, "fourth", 1, 1, now=9), Held)  # there is room for it
    assert isinstance(queue.hold(0, "fifth", 1, 1, now=10), Held) and flood[2].state is State.EVICTED
    assert isinstance(queue.hold(0, "sixth", 1, 1, now=11), Held) and flood[1].state is State.EVICTED
    assert queue.hold(0, "seventh", 1, 1, now=12) is Refusal.BAND_FULL  # every flow holds one: level
    assert [h.flow for h in _drain(queue)].count("flood") == 1
    assert light.state is big.state is State.DISPATCHED


def test_a_full_queue_of_another_band_is_made_room_for_within_the_requests_own_band():
    queue = FlowQueue(QueueLimits(max_total=3))
    flood = [_held(queue.hold(0, "flood", 1, 1, now=i)) for i in range(3)]
    assert queue.hold(0, "flood", 1, 1, now=3) is Refusal.QUEUE_FULL
    assert isinstance(queue.hold(0, "light", 1, 1, now=3), Held) and flood[-1].state is State.EVICTED


def test_a_full_queue_sheds_the_newest_sheddable_request_first():
    queue = FlowQueue(QueueLimits(max_total=3))
    older = _held(queue.hold(-2, "a", 1, 1, now=0))
    newest = _held(queue.hold(-2, "a", 1, 1, now=1))
    kept = _held(queue.hold(-1, "a", 1, 1, now=2))
    critical = _held(queue.hold(0, "a", 1, 1, now=3))
    assert newest.state is State.EVICTED and older.state is State.WAITING
    assert queue.ended(now=3) == [newest]
    assert queue.hold(-2, "a", 1, 1, now=4) is Refusal.QUEUE_FULL  # nothing below a sheddable band's own
    assert isinstance(queue.hold(0, "b", 1, 1, now=4), Held)  # evicts the older -2 one
    assert older.state is State.EVICTED
    assert isinstance(queue.hold(1, "b", 1, 1, now=4), Held)  # then the -1 one
    assert queue.hold(2, "b", 1, 1, now=4) is Refusal.QUEUE_FULL  # only non-sheddable ones are left
    assert kept.state is State.EVICTED and critical.state is State.WAITING


def test_a_client_that_leaves_frees_its_slot_at_once_and_is_never_dispatched():
    queue = FlowQueue(QueueLimits(max_requests=1))
    gone = _held(queue.hold(0, "a", 1, 1, now=0))
    assert queue.hold(0, "a", 1, 1, now=0) is Refusal.BAND_FULL
    assert queue.cancel(gone) and not queue.cancel(gone)
    assert len(queue) == 0
    stays = _held(queue.hold(0, "a", 1, 1, now=0))
    assert _drain(queue) == [stays]
    assert gone.state is State.CANCELLED
    assert not queue.cancel(stays)  # already dispatched


def test_a_flood_of_distinct_flow_ids_is_bounded_and_cannot_starve_a_known_flow():
    queue = FlowQueue(QueueLimits(max_flows=4, max_requests=100_000, max_total=100_000))
    for i in range(20):
        queue.hold(0, "default", 100, 1, now=i)
    for i in range(5_000):
        queue.hold(0, f"flood-{i}", 100, 1, now=i)
    flows = [h.flow for h in (queue.pop() for _ in range(40)) if h is not None]
    assert flows.count("default") >= 8  # one of at most five flows: a fifth of the dispatches
    assert set(flows) <= {"default", OVERFLOW_FLOW, "flood-0", "flood-1", "flood-2"}
    assert len(queue.waiting()[0]) <= 5


def test_a_flood_of_distinct_flow_ids_cannot_lump_the_default_or_a_weighted_flow_with_it():
    """The default flow (and a flow the policy weighs) idle when the flood comes: its next request
    still gets its own flow, not a place at the back of the flood's overflow."""
    queue = FlowQueue(QueueLimits(max_flows=4, max_requests=100_000, max_total=100_000), {"gold": 2.0})
    queue.hold(0, DEFAULT_FLOW, 100, 1, now=0)
    queue.hold(0, "gold", 100, 1, now=0)
    assert {h.flow for h in (queue.pop(), queue.pop()) if h is not None} == {DEFAULT_FLOW, "gold"}  # both idle now
    for i in range(5_000):
        queue.hold(0, f"flood-{i}", 100, 1, now=i)
    late = _held(queue.hold(0, DEFAULT_FLOW, 100, 1, now=5_000))
    weighted = _held(queue.hold(0, "gold", 100, 1, now=5_000))
    assert late.flow == DEFAULT_FLOW and weighted.flow == "gold"
    first = [h for h in (queue.pop() for _ in range(8)) if h is not None]
    assert late in first and weighted in first
    assert len(queue.waiting()[0]) <= 6
    fresh = FlowQueue(QueueLimits(max_flows=4, max_requests=100_000, max_total=100_000))
    for i in range(100):  # the flood first: the default flow's first request still gets its own
        fresh.hold(0, f"flood-{i}", 100, 1, now=i)
    assert _held(fresh.hold(0, DEFAULT_FLOW, 100, 1, now=100)).flow == DEFAULT_FLOW


def test_idle_flows_are_forgotten_when_new_ones_arrive():
    queue = FlowQueue(QueueLimits(max_flows=2))
    for i in range(10):
        queue.hold(0, f"tenant-{i}", 1, 1, now=i)
        queue.pop()
    held = _held(queue.hold(0, "new", 1, 1, now=20))
    assert held.flow == "new"  # an idle flow made room: new ones are not lumped together needlessly


def test_newcomers_past_max_flows_are_weighed_as_the_overflow_flow_they_join():
    """Past max_flows every new flow joins the overflow flow, so room is made for it only while
    the heaviest flow would still hold more than the overflow flow then: a flood of fresh flow
    ids gets its fair part, not every place of the flows already there."""
    queue = FlowQueue(QueueLimits(max_flows=2, max_requests=10, max_total=100))
    for flow in ("A", "B"):
        for i in range(5):
            _held(queue.hold(0, flow, 1, 1, now=i))
    outcomes = [queue.hold(0, f"fresh-{i}", 1, 1, now=10 + i) for i in range(20)]
    evicted = queue.ended(now=20)
    held = queue.waiting()[0]
    assert sorted(held.values()) == [3, 3, 4] and held.get(OVERFLOW_FLOW) in (3, 4), held
    assert len(evicted) == 3 and sum(o is Refusal.BAND_FULL for o in outcomes) == 17


def test_weighing_a_held_request_reads_a_bounded_part_of_a_long_queue():
    """A head that cannot run costs its flow's next SCAN_DEPTH entries, not its whole heap; making
    room for a large newcomer reads the band's arrivals once, however many it evicts."""
    queue = FlowQueue(QueueLimits(max_requests=9_000, max_total=9_000, max_bytes=1 << 40))
    for i in range(8_000):
        _held(queue.hold(0, f"f{i % 2}", 1, 1, now=i * 1e-3))
    band = queue._bands[0]
    with _comparisons() as compared:
        assert queue.pop(lambda held: False) is None  # every head passed over
    assert compared[0] < 2_000, compared  # two flows of 4,000: a part of each, not all of them

    read = 0

    class Counted(deque):
        def __reversed__(self):
            nonlocal read
            for held in super().__reversed__():
                read += 1
                yield held

    band.arrivals = Counted(band.arrivals)
    queue.limits = QueueLimits(max_requests=9_000, max_total=9_000, max_bytes=6_000)
    big = _held(queue.hold(0, "new", 1, 1_000, now=10))  # room for 1,000 bytes: some 3,000 evicted
    assert big.flow == "new" and len(queue.ended(now=10)) == 3_000 and read <= 8_000, read


def test_taking_a_request_behind_a_head_that_cannot_run_compares_a_bounded_part_of_its_flow():
    """The request dispatched from behind a blocked head is left where it is in its flow's heap
    (passed over once no longer waiting), not removed from it and the heap rebuilt: that cost the
    flow's length at each dispatch (16,000 held: 2.8 ms a dispatch)."""
    queue = FlowQueue(QueueLimits(max_requests=20_000, max_total=20_000, max_bytes=1 << 40))
    stuck = _held(queue.hold(0, "f", 10, 1, now=0.0))  # the earliest: its model's backends are full
    for i in range(16_000):
        _held(queue.hold(0, "f", 10, 1, now=1e-6 * (i + 1)))
    with _comparisons() as compared:
        for _ in range(100):
            held = queue.pop(lambda h: h is not stuck)
            assert held is not None and held is not stuck
    # a scan's worth a dispatch and a rebuild every COMPACT_AT of them (about 50,000 comparisons),
    # not a rebuild of all 16,000 at each dispatch (some 2.5 million)
    assert compared[0] < 200_000, compared
    assert queue.pop() is stuck  # its turn once it can run


def test_a_request_that_costs_nothing_is_charged_the_least_cost_so_others_get_turns():
    """A fully cached prompt with max_tokens 0 costs 0 by its count: charged nothing, its flow's
    share never grew and took every turn while it held requests (the other flow's expired)."""
    queue = FlowQueue(QueueLimits())
    for _ in range(3):
        queue.hold(0, "free", 0.0, 1, now=0.0)
    queue.pop()
    others = [_held(queue.hold(0, "paying", 300.0, 1, now=0.0)) for _ in range(5)]
    served = []
    for _ in range(200):
        held = _held(queue.pop())
        served.append(held.flow)
        queue.hold(0, "free", 0.0, 1, now=0.0)  # its client keeps one more coming
    assert served.count("paying") == 5 and all(h.state is State.DISPATCHED for h in others)


def test_cancel_churn_keeps_the_queue_small():
    queue = FlowQueue(QueueLimits())
    first = _held(queue.hold(0, "a", 1, 1, now=0))  # a long-waiting head
    for i in range(10_000):
        queue.cancel(_held(queue.hold(0, "a", 1, 1, now=1 + i * 1e-4)))
    band = queue._bands[0]
    assert len(band.arrivals) < 200 and len(band.flows["a"].waiting) < 200
    assert _drain(queue) == [first]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["hold", "pop", "cancel", "tick"]),
            st.integers(-2, 2),
            st.sampled_from(["a", "b", "c", "d"]),
            st.integers(1, 500),
        ),
        max_size=120,
    )
)
def test_every_request_is_held_dispatched_or_ended_exactly_once(steps):
    queue = FlowQueue(QueueLimits(max_requests=6, max_bytes=2_000, max_total=10, ttl_s=5, max_flows=2))
    now = 0.0
    everyone: list[Held] = []
    popped: list[Held] = []
    ended: list[Held] = []
    for action, priority, flow, size in steps:
        now += 0.5
        if action == "hold":
            result = queue.hold(priority, flow, size, size, now)
            if isinstance(result, Held):
                everyone.append(result)
        elif action == "pop" and (held := queue.pop()) is not None:
            assert all(h.band <= held.band for h in everyone if h.state is State.WAITING)  # strict priority
            popped.append(held)
        elif action == "cancel" and everyone:
            queue.cancel(everyone[size % len(everyone)])
        ended += queue.ended(now)
        assert len(queue) == sum(h.state is State.WAITING for h in everyone)
    assert len(set(map(id, popped))) == len(popped)
    assert all(h.state is State.DISPATCHED for h in popped)
    assert all(h.state in (State.EXPIRED, State.EVICTED) for h in ended)
    assert not set(map(id, popped)) & set(map(id, ended))


def test_a_flow_the_siblings_served_waits_for_the_others_here():
    queue = FlowQueue(QueueLimits())
    for i in range(6):
        queue.hold(0, "a", 100, 1, now=i)
        queue.hold(0, "b", 100, 1, now=i)
    queue.set_peers({0: {"a": 300.0}}, held=0)  # other replicas served "a" three requests' worth
    flows = [h.flow for h in (queue.pop() for _ in range(6)) if h is not None]
    assert flows[:3] == ["b", "b", "b"] and sorted(flows[3:]) == ["a", "a", "b"]
    own, held = queue.shares()
    assert own == {0: {"a": 200.0, "b": 400.0}} and held == 6


def test_a_flow_back_from_idle_is_levelled_with_the_fleet_not_just_this_replica():
    queue = FlowQueue(QueueLimits())
    queue.hold(0, "a", 100, 1, now=0)
    queue.set_peers({0: {"a": 1_000.0, "b": 400.0}}, held=0)
    queue.hold(0, "b", 100, 1, now=1)  # levelled to "a"'s fleet total: 1,000, of which 400 elsewhere
    assert queue._bands[0].flows["b"].attained == 600.0


def test_the_queue_bound_counts_what_the_siblings_hold():
    queue = FlowQueue(QueueLimits(max_total=4))
    queue.set_peers({}, held=3)
    assert isinstance(queue.hold(0, "a", 1, 1, now=0), Held)
    assert queue.hold(0, "a", 1, 1, now=0) is Refusal.QUEUE_FULL
    queue.set_peers({}, held=0)  # the siblings' store went away: this replica's own bound again
    assert isinstance(queue.hold(0, "a", 1, 1, now=0), Held)


def test_a_flow_back_after_the_queue_drained_banks_no_credit_either():
    queue = FlowQueue(QueueLimits())
    for i in range(50):  # "a" alone: it attains 5,000, then the queue drains
        queue.hold(0, "a", 100, 10, now=i)
    _drain(queue)
    for i in range(10):  # this time the newcomer "b" arrives first, with nobody waiting
        queue.hold(0, "b", 100, 10, now=100 + i)
        queue.hold(0, "a", 100, 10, now=100 + i)
    flows = [h.flow for h in _drain(queue)]
    assert flows[:6].count("a") >= 2  # levelled with the last one dispatched: they alternate


def test_a_request_that_cannot_run_now_is_passed_over_for_the_next_flows():
    queue = FlowQueue(QueueLimits())
    blocked = _held(queue.hold(0, "x", 1, 1, now=0))  # the least served, but its model has no room
    other = _held(queue.hold(0, "y", 5, 1, now=1))
    assert queue.pop(eligible=lambda h: h is not blocked) is other
    assert queue.pop(eligible=lambda h: False) is None and blocked.state is State.WAITING
    assert queue.pop() is blocked


def test_within_one_flow_a_request_that_can_run_passes_a_head_that_cannot():
    """Every request of one tenant (one flow), two models: the head's model is saturated, the
    next one's is not. It goes; the head keeps its place."""
    queue = FlowQueue(QueueLimits())
    blocked = _held(queue.hold(0, "t", 1, 1, now=0))
    later = [_held(queue.hold(0, "t", 1, 1, now=1 + i)) for i in range(3)]
    assert queue.pop(eligible=lambda h: h is not blocked) is later[0]
    assert queue.pop(eligible=lambda h: h is later[2]) is later[2]
    assert queue.pop() is blocked and queue.pop() is later[1] and queue.pop() is None


def test_the_siblings_are_told_what_was_served_not_the_levelling():
    queue = FlowQueue(QueueLimits())
    queue.set_peers({0: {"a": 10_000.0}}, held=0)
    queue.hold(0, "a", 100, 1, now=0)
    queue.hold(0, "b", 100, 1, now=0)  # levelled up to "a" locally
    assert queue.shares() == ({}, 2)  # nothing served yet: no levelling goes out
    popped = queue.pop(eligible=lambda h: h.flow == "b")
    assert popped is not None
    assert queue.shares() == ({0: {"b": 100.0}}, 1)  # "b"'s 10,000 of levelling stays here


def test_a_turn_that_is_a_siblings_is_left_to_it_for_a_while_then_taken():
    queue = FlowQueue(QueueLimits())
    queue.hold(0, "a", 100, 1, now=0)
    queue.set_peers({0: {"a": 500.0}}, held=1, heads={0: 0.0})  # a sibling holds a flow served nothing yet
    assert queue.heads() == {0: 500.0}  # "a" has had 500 of the fleet's service
    assert queue.pop(now=10.0) is None  # the sibling's turn: left to it
    assert queue.pop(now=10.0 + YIELD_S / 2) is None
    held = queue.pop(now=10.0 + YIELD_S)  # it did not take it: this replica's own goes
    assert held is not None and held.flow == "a"
    assert queue.pop() is None  # without a clock, as before: nothing to yield, nothing held


def test_a_sibling_holding_a_higher_band_takes_the_turn_and_ties_are_not_yielded():
    queue = FlowQueue(QueueLimits())
    queue.hold(0, "a", 100, 1, now=0)
    queue.set_peers({}, held=1, heads={5: 1e9})  # a more urgent band waits there, however served
    assert queue.pop(now=1.0) is None
    queue.set_peers({0: {"a": 100.0}}, held=1, heads={0: 100.0})  # the same turn as ours: no yielding
    assert queue.pop(now=1.0) is not None


def test_a_siblings_head_that_cannot_run_takes_no_turn_from_this_replica():
    """A replica holding only requests for a saturated model publishes no head, so its siblings do
    not leave each of their turns to it (every turn would wait YIELD_S: about 3 dispatches a second)."""
    sibling = FlowQueue(QueueLimits())
    stuck = sibling.hold(0, "a", 100, 1, now=0)
    assert isinstance(stuck, Held)
    assert sibling.heads() == {0: 0.0}
    assert sibling.heads(eligible=lambda h: h is not stuck) == {}  # its model's backends are all full
    assert sibling.heads(eligible=lambda h: True) == {0: 0.0}
    queue = FlowQueue(QueueLimits())
    queue.hold(0, "b", 100, 1, now=0)
    queue.set_peers({0: {"b": 500.0}}, held=1, heads=sibling.heads(eligible=lambda h: h is not stuck))
    assert queue.pop(now=1.0) is not None  # no yielding
