"""Trace reading, prompt building and the oracle, offline."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.harness import oracle
from bench.harness.replay import METRICS, Record, summarize
from bench.simulator import sim
from bench.workloads.prompts import PromptBuilder
from bench.workloads.trace import TraceRequest, chains, read, truncate, working_set_blocks
from extproc.core.request import parse_request

TRACES = Path(__file__).resolve().parent / "data" / "mooncake"


def mooncake(index: int, ids: tuple[int, ...], tokens: int, session: str | None = None) -> TraceRequest:
    return TraceRequest(index, index * 100.0, tokens, 8, ids, session)


def test_reads_mooncake_and_ready_requests(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b'{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2], "session_id": 7}\n\n'
        + orjson.dumps({"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "session_id": "s"})
        + b"\n"
    )
    first, second = read(path)
    assert (first.hash_ids, first.session_id, first.input_tokens) == ((1, 2), "7", 700)
    assert second.body is not None and second.output_tokens == 4 and second.session_id == "s"
    assert len(read(path, limit=1)) == 1
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        read(path)


def test_working_set_counts_prefix_blocks_once():
    requests = [mooncake(0, (0, 1, 2), 1536), mooncake(1, (0, 1, 3), 1536), mooncake(2, (9, 1), 1024)]
    assert working_set_blocks(requests) == 6  # 0, 0-1, 0-1-2, 0-1-3, 9, 9-1


def test_chains_keep_sessions_in_order():
    requests = [mooncake(0, (1,), 10, "a"), mooncake(1, (2,), 10), mooncake(2, (3,), 10, "a")]
    assert [[r.index for r in chain] for chain in chains(requests)] == [[0, 2], [1]]


def test_shared_hash_ids_give_shared_prompt_prefixes_of_the_right_length():
    builder = PromptBuilder("sim-model", 4.0, 16)
    a = builder.body(mooncake(0, (0, 1, 2), 1400))
    b = builder.body(mooncake(1, (0, 1, 5, 6), 2048))
    assert a["messages"][:2] == b["messages"][:2] and a["messages"][2] != b["messages"][2]
    assert len(a["messages"][2]["content"]) == round((1400 - 1024) * 4.0)
    tokens, _ = sim.prompt_blocks(b, 16)
    assert abs(tokens - 2048) < 40  # the template adds a few tokens per message
    chain_a, chain_b = (parse_request(x) for x in (a, b))
    shared = len(orjson.dumps(a["messages"][:2]))
    assert chain_a.cbr[: shared // 2] == chain_b.cbr[: shared // 2]
    assert builder.body(mooncake(0, (0, 1, 2), 1400)) == a  # deterministic


def test_oracle_bounds():
    builder = PromptBuilder("sim-model", 4.0, 16)
    repeated = [mooncake(i, (0, 1, 2, 3), 2048) for i in range(10)]
    bodies = [builder.body(r) for r in repeated]
    prompts = oracle.simulated_prompts(bodies, 16)
    assert oracle.lru(prompts, 16, capacity_blocks=10_000) == pytest.approx(0.9, abs=0.01)
    assert oracle.lru(prompts, 16, capacity_blocks=1) < 0.01  # only the head block survives
    same = oracle.token_prompts([list(range(300))] * 4, 128)
    assert oracle.lru(same, 128, 100) == oracle.bound(same, 128, 100) == pytest.approx(3 * 256 / 1200)
    assert oracle.lru(oracle.token_prompts([list(range(300)), list(range(1, 301))], 128), 128, 100) == 0.0


def test_oracle_of_the_real_trace_rises_with_capacity():
    requests = read(TRACES / "conversation_trace_head.jsonl", 300)
    builder = PromptBuilder("sim-model", 4.0, 16)
    blocks = working_set_blocks(requests) * 512 // 16
    prompts = oracle.simulated_prompts((builder.body(r) for r in requests), 16)
    rates = [oracle.lru(prompts, 16, int(blocks * r)) for r in (0.25, 0.5, 1.0)]
    assert 0 < rates[0] <= rates[1] <= rates[2] < 1


def test_truncate_keeps_whole_leading_blocks():
    (short,) = truncate([mooncake(0, (1, 2, 3, 4), 1900)], 1200)
    assert (short.hash_ids, short.input_tokens) == ((1, 2), 1024)


def test_skew_trace_has_heavy_sessions_in_order(tmp_path):
    from bench.workloads import skew

    path = tmp_path / "skew.jsonl"
    skew.write(path)
    requests = read(path)
    by_session: dict[str, list[TraceRequest]] = {}
    for request in requests:
        by_session.setdefault(request.session_id, []).append(request)
    heavy = [s for s in by_session if s.startswith("heavy")]
    assert len(heavy) == 4 and len(by_session) == 64
    for turns in by_session.values():
        assert all(a.hash_ids == b.hash_ids[: len(a.hash_ids)] for a, b in itertools.pairwise(turns))
        assert all(t.hash_ids[0] == 0 for t in turns)
    heavy_tokens = sum(r.input_tokens for r in requests if r.session_id.startswith("heavy"))
    assert heavy_tokens > sum(r.input_tokens for r in requests) / 2  # a few sessions carry most of the work


def test_mixed_trace_adds_short_prompts_with_long_answers_that_share_nothing(tmp_path):
    from bench.workloads import mixed

    agent, path = tmp_path / "agent.jsonl", tmp_path / "mixed.jsonl"
    turns = [
        {"timestamp": i, "input_length": 2048, "output_length": 300, "hash_ids": [0, 1, 2, 3 + i], "session_id": "a"}
        for i in range(14)
    ]
    agent.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in turns))
    mixed.main([str(agent), str(path), "--limit", "12", "--every", "3"])
    requests = read(path)
    short = [r for r in requests if r.session_id.startswith("short_")]
    assert len(requests) == 16 and len(short) == 4
    assert all(r.input_tokens == 256 and r.output_tokens == 128 for r in short)
    assert all(r.output_tokens == 16 and r.input_tokens > 1000 for r in requests if r not in short)
    others = {h for r in requests if r not in short for h in r.hash_ids}
    assert len({r.hash_ids for r in short}) == 4 and not others & {h for r in short for h in r.hash_ids}
    assert [r.session_id for r in requests[2:4]] == ["a", "short_0000"]  # after every third agent turn


def test_adapter_trace_skews_popularity_and_shares_a_system_prompt_per_adapter(tmp_path):
    from bench.workloads import adapters
    from bench.workloads.prompts import PromptBuilder

    path = tmp_path / "adapters.jsonl"
    adapters.main([str(path), "--adapters", "8", "--requests", "400", "--seed", "3"])
    requests = read(path)
    counts = collections.Counter(r.adapter for r in requests)
    assert set(counts) <= {f"adapter-{k}" for k in range(8)} and len(counts) >= 6
    assert counts["adapter-0"] > 2 * counts["adapter-3"] > 0  # Zipf: the first is the most asked for
    by_adapter = collections.defaultdict(set)
    for r in requests:
        by_adapter[r.adapter].add(r.hash_ids[:2])
    assert all(len(heads) == 1 for heads in by_adapter.values())  # one system prompt per adapter
    assert len({heads.pop() for heads in by_adapter.values()}) == len(by_adapter)  # not shared across them
    assert len({r.hash_ids[-1] for r in requests}) == 400  # every question its own
    body = PromptBuilder("base", 4.0, 32).body(requests[0])
    assert body["model"] == requests[0].adapter  # the adapter is the request's model, as vLLM serves it


def test_agentic_trace_shares_eight_system_prompts_among_120_sessions(tmp_path):
    from bench.workloads import skew

    path = tmp_path / "agentic.jsonl"
    skew.write(path, skew.SHAPES["agentic"])
    requests = read(path)
    by_session: dict[str, list[TraceRequest]] = {}
    for request in requests:
        by_session.setdefault(request.session_id, []).append(request)
    assert len(requests) == 480 and len(by_session) == 120
    assert len({r.hash_ids[:4] for r in requests}) == 8  # the shared system prompts, 4 blocks each
    for turns in by_session.values():
        assert len(turns) == 4 and len({t.hash_ids[:4] for t in turns}) == 1
        assert all(a.hash_ids == b.hash_ids[: len(a.hash_ids)] for a, b in itertools.pairwise(turns))
        assert [len(t.hash_ids) for t in turns] == [6, 7, 8, 9]


def test_min_beats_lru_where_sessions_take_turns():
    """Three 4-block conversations in turn through a 9-block cache: LRU evicts most of each one
    just before it comes back; MIN keeps two of them whole."""
    turns = [(4 * 16 + 1, [c * 100 + b for b in range(4)]) for _ in range(5) for c in range(3)]
    assert oracle.lru(turns, 16, 9) < 0.2 < 0.45 < oracle.bound(turns, 16, 9)
    assert oracle.lru(turns, 16, 12) == oracle.bound(turns, 16, 12)  # room for all: both keep everything


@given(
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1, max_size=30),
    st.integers(1, 20),
)
def test_min_is_never_below_lru(chains, capacity):
    prompts = []
    for chain in chains:
        hashes, parent = [], 0
        for block in chain:
            parent = hash((parent, block))
            hashes.append(parent)
        prompts.append((len(hashes) * 16 + 1, hashes))
    assert oracle.bound(prompts, 16, capacity) >= oracle.lru(prompts, 16, capacity) - 1e-12


def test_summary_sets_the_engines_own_ttft_beside_the_clients():
    """What the path to the engines adds shows as the client's mean TTFT minus the engines' own;
    the engines' preemptions say whether running requests ran out of KV blocks."""
    zero = dict.fromkeys(METRICS, 0.0)
    after = {
        "a": {**zero, "vllm:time_to_first_token_seconds_sum": 0.3, "vllm:time_to_first_token_seconds_count": 2},
        "b": {**zero, "vllm:time_to_first_token_seconds_sum": 0.1, "vllm:time_to_first_token_seconds_count": 2},
    }
    after["b"]["vllm:num_preemptions_total"] = 3
    records = [Record(i, 200, ttft, 200.0, 10, 0, "a") for i, ttft in enumerate((110.0, 120.0, 130.0, 140.0))]
    summary = summarize(records, {"a": zero, "b": zero}, after, wall_s=1.0)
    assert summary["engine_ttft_mean_ms"] == 100.0
    assert summary["ttft_mean_ms"] == 125.0
    assert summary["engine_preemptions"] == 3
    assert summarize(records, {"a": zero}, {"a": zero}, wall_s=1.0)["engine_ttft_mean_ms"] is None  # simulators


def test_arrival_order_sends_the_earliest_ready_turn_and_keeps_sessions_in_order():
    """A closed loop in arrival order: with two workers, the three sessions' turns go out by
    arrival, a session never has two turns in flight, and a turn waits for its session's last."""
    import asyncio

    from bench.harness.replay import _arrival_order

    turns = [
        TraceRequest(0, 0.0, 10, 1, (1,), "a"),
        TraceRequest(1, 1.0, 10, 1, (2,), "b"),
        TraceRequest(2, 2.0, 10, 1, (1,), "a"),
        TraceRequest(3, 3.0, 10, 1, (3,), "c"),
        TraceRequest(4, 4.0, 10, 1, (2,), "b"),
        TraceRequest(5, 5.0, 10, 1, (4,), None),
    ]
    sent: list[int] = []
    flying: set[str | None] = set()
    most = 0

    async def send(request: TraceRequest) -> None:
        nonlocal most
        assert request.session_id is None or request.session_id not in flying
        flying.add(request.session_id)
        most = max(most, len(flying))
        sent.append(request.index)
        await asyncio.sleep(0.01 * (3 if request.session_id == "a" else 1))
        flying.discard(request.session_id)

    asyncio.run(_arrival_order(chains(turns), 2, send))
    # a (slow) and b start; b ends first: its next turn (4) and c's first (3) are ready, c's
    # arrived first; when c ends, a's second turn (2), the earliest of all, is still waiting for
    # a's first, so b's goes; a's second goes when a's first ends
    assert sent == [0, 1, 3, 4, 2, 5]
    assert most == 2
