"""The simulator's engine, step by step: what vLLM's scheduler puts into each step, and what the
block pool holds meanwhile. Steps are planned and ended by hand, so nothing here depends on time."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.simulator.sim_engine import ENGINE_FAILED, BlockPool, Engine, Request, StepCost
from bench.simulator.sim_events import EventPublisher

BLOCK = 4


def engine(
    capacity: int = 64, budget: int = 16, max_num_seqs: int = 8, events: EventPublisher | None = None
) -> tuple[Engine, list[int]]:
    """An engine over a fresh pool, and the list its preemptions are counted in."""
    preempted: list[int] = []
    built = Engine(
        BlockPool(capacity),
        BLOCK,
        max_num_seqs,
        budget,
        StepCost(0.0, 0.0, 0.0),
        events,
        on_admit=lambda request: None,
        on_preempt=lambda: preempted.append(1),
    )
    return built, preempted


def request(tokens: list[int], output_tokens: int = 2) -> tuple[Request, list[int]]:
    """A request whose block hashes are its tokens' block contents (equal prefixes, equal hashes)."""
    hashes = [hash(tuple(tokens[: end + BLOCK])) for end in range(0, len(tokens) - BLOCK + 1, BLOCK)]
    out: list[int] = []
    return Request(tokens, hashes, output_tokens, out.append), out


def step(built: Engine) -> dict[int, int]:
    """Plan and end one step; return the tokens it computed per request (by id)."""
    planned = built.plan_step()
    scheduled = {id(r): r.scheduled for r in planned}
    built.end_step(planned)
    return scheduled


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget_and_then_decodes():
    built, _ = engine(budget=16)
    long, out = request(list(range(40)), output_tokens=3)
    built.waiting.append(long)
    assert [step(built)[id(long)] for _ in range(3)] == [16, 16, 8]  # the third chunk ends the prompt
    assert out == [0]  # the step that computes a prompt's last token makes its first output token
    assert step(built)[id(long)] == 1 and out == [0, 1]
    assert step(built)[id(long)] == 1 and out == [0, 1, 2]
    assert long.ended and built.pool.pinned == 0 and not built.running  # freed as its last token came


def test_running_requests_come_first_and_waiting_ones_get_what_budget_is_left():
    built, _ = engine(budget=16)
    decoding, _ = request([1] * 8, output_tokens=10)
    built.waiting.append(decoding)
    step(built)  # its whole prompt: now it decodes, one token a step
    first, _ = request([2] * 40)
    second, _ = request([3] * 8)
    built.waiting.extend([first, second])
    planned = step(built)
    assert planned == {id(decoding): 1, id(first): 15}  # the budget ran out before the second
    planned = step(built)
    assert planned == {id(decoding): 1, id(first): 15}  # the running prefill keeps its place
    assert planned.get(id(second)) is None and list(built.waiting) == [second]


def test_a_request_hits_blocks_scheduled_earlier_even_in_the_same_step():
    """vLLM caches a block when it schedules its tokens: the second of two copies admitted in one
    step finds what the first scheduled; only the last prompt token is computed again."""
    built, _ = engine(budget=64)
    a, _ = request(list(range(20)))
    b, _ = request(list(range(20)))
    built.waiting.extend([a, b])
    planned = step(built)
    assert planned == {id(a): 20, id(b): 4} and (a.cached, b.cached) == (0, 16)
    assert built.pool.pinned == 5 + 0  # five shared blocks, held by both
    c, _ = request(list(range(10)) + [99] * 10)  # shares only the first two blocks
    built.waiting.append(c)
    step(built)
    assert c.cached == 8


def test_the_head_of_the_queue_waits_for_room_for_its_whole_prompt_and_nothing_overtakes_it():
    built, _ = engine(capacity=10, budget=64)
    hog, _ = request([7] * 24, output_tokens=50)  # 6 blocks, then more as it decodes
    built.waiting.append(hog)
    step(built)
    big, _ = request([8] * 20)  # 5 blocks: 6 + 5 > 10
    small, _ = request([9] * 4)  # 1 block would fit, but waits behind the head
    built.waiting.extend([big, small])
    planned = step(built)
    assert planned == {id(hog): 1} and list(built.waiting) == [big, small]
    built.finish(hog)
    assert step(built) == {id(big): 20, id(small): 4}


def test_a_running_request_that_cannot_grow_preempts_the_latest_one_which_recomputes_later():
    built, preempted = engine(capacity=8, budget=64)
    older, _ = request([1] * 16, output_tokens=20)  # 4 blocks, growing a block every 4 tokens
    newer, _ = request([2] * 12, output_tokens=20)  # 3 blocks
    built.waiting.extend([older, newer])
    step(built)
    assert built.pool.pinned == 7  # both prompts (a first output token is written by the next step)
    step(built)  # older takes the last free block for its token; newer needs one too, and is the latest
    assert preempted == [1] and built.running == [older] and list(built.waiting) == [newer]
    assert newer.computed == 0 and newer.cached == 0  # its first admission's count is kept
    assert built.pool.match(newer.hashes, 3) == 3  # its blocks went to the free queue, still cached


def test_a_chunk_that_completes_a_partial_block_needs_no_extra_block():
    """The first chunk ends inside a block (held unhashed); the next fills it, and it becomes a
    cached block in place: a cache with room for exactly the prompt must not preempt."""
    built, preempted = engine(capacity=3, budget=6)
    full, out = request(list(range(12)), output_tokens=1)  # three blocks exactly
    built.waiting.append(full)
    assert step(built) == {id(full): 6} and built.pool.pinned == 2  # one full block, one partial
    assert step(built) == {id(full): 6} and preempted == [] and out == [0]


def test_a_step_costs_its_fixed_part_plus_its_tokens_plus_their_context():
    cost = StepCost(step_s=0.01, token_s=0.001, pair_s=0.0001)
    assert cost.of(0, 4) == pytest.approx(4 * 0.001 + (1 + 2 + 3 + 4) * 0.0001)  # each token sees those before it
    assert cost.of(100, 1) == pytest.approx(0.001 + 101 * 0.0001)  # a decode token sees the whole context
    built, _ = engine()
    a, _ = request(list(range(8)))
    built.waiting.append(a)
    built._cost = cost
    planned = built.plan_step()
    assert built.duration(planned) == pytest.approx(0.01 + cost.of(0, 8))


def test_the_vllm_cpu_preset_is_flags_the_simulator_takes_and_later_sim_args_override_it():
    import argparse

    from bench import cli
    from bench.harness.fleets import VLLM_BLOCK_TOKENS, VLLM_CPU_SIM_ARGS
    from bench.simulator import sim

    args = cli._parser().parse_args(
        ["bench", "compare", "--trace", "t.jsonl", "--out", "o", "--sim-as-vllm-cpu", "--sim-arg=--step-s=0.01"]
    )
    options = cli._compare_options(args)
    assert options.sim_block_tokens == VLLM_BLOCK_TOKENS and options.sim_tokenizer == "words"
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    config = sim.config_from_args(parser.parse_args(["--port", "0", *options.sim_args]))
    assert (config.max_num_seqs, config.token_s, config.step_s) == (128, 0.0000235, 0.01)
    assert config.attention_s > 0 and options.sim_args[: len(VLLM_CPU_SIM_ARGS)] == VLLM_CPU_SIM_ARGS


def test_each_step_reports_its_tokens_and_the_requests_it_gave_a_first_token():
    steps: list[tuple[int, list[int]]] = []
    built = Engine(
        BlockPool(64),
        BLOCK,
        8,
        16,
        StepCost(0.0, 0.0, 0.0),
        None,
        on_admit=lambda request: None,
        on_preempt=lambda: None,
        on_step=lambda tokens, firsts: steps.append((tokens, [id(r) for r in firsts])),
    )
    long, _ = request(list(range(20)), output_tokens=2)
    short, _ = request([99] * 4, output_tokens=2)
    built.waiting.extend([long, short])
    for _ in range(3):
        step(built)
    # 16 of the long prompt; its last 4 and the short one's 4, which give both their first token;
    # then a decode token each.
    assert steps == [(16, []), (8, [id(long), id(short)]), (2, [])]


def test_a_step_that_raises_fails_every_request_in_the_engine_and_the_next_submit_starts_afresh(monkeypatch):
    built, _ = engine()
    running, running_out = request([1] * 8, output_tokens=5)
    waiting, waiting_out = request([2] * 8)
    built.waiting.append(running)
    step(built)  # running holds blocks now
    built.waiting.append(waiting)
    planned = built.plan_step

    def broken() -> list[Request]:
        raise RuntimeError("a bug in a step")

    async def scenario() -> list[int]:
        monkeypatch.setattr(built, "plan_step", broken)
        later, later_out = request([3] * 8, output_tokens=1)
        built.submit(later)  # starts the loop, whose first step raises
        await asyncio.sleep(0.01)
        assert built.pool.pinned == 0 and not built.running and not built.waiting
        monkeypatch.setattr(built, "plan_step", planned)
        again, again_out = request([4] * 8, output_tokens=1)
        built.submit(again)
        await asyncio.sleep(0.01)
        await built.close()
        assert later_out == [ENGINE_FAILED]
        return again_out

    assert asyncio.run(scenario()) == [0]  # served by a fresh loop
    assert running_out == [0, ENGINE_FAILED] and waiting_out == [ENGINE_FAILED]


def test_a_step_publishes_one_batch_after_it_ran_with_the_blocks_of_a_request_whose_client_left():
    """As vLLM's scheduler: the step's events (evictions, stores) go out together once it ran, and a
    request cancelled during the step still reports the blocks it cached when it was planned (a
    later request hits them; before, their store was never sent, and only their removal was)."""
    import msgpack
    import zmq

    events = EventPublisher("127.0.0.1")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{events.port}")
        built, _ = engine(capacity=4, events=events)

        def batches() -> list[list[str]]:
            out = []
            while sub.poll(300):
                frames = sub.recv_multipart()
                ts, batch, rank = msgpack.unpackb(frames[2])
                assert rank == 0 and ts > 0
                out.append([event["type"] for event in batch])
            return out

        time.sleep(0.3)  # ZMQ's slow joiner
        first, _ = request([1] * 9)  # 2 full blocks (the 9th token's block is not full)
        built.waiting.append(first)
        planned = built.plan_step()
        assert batches() == []  # nothing before the step ran
        built.finish(first)  # the client left during the step
        built.end_step(planned)
        assert batches() == [["BlockStored"]]
        second, _ = request([2] * 16)  # the whole pool: evicts the first's two blocks
        built.waiting.append(second)
        step(built)
        assert batches() == [["BlockRemoved", "BlockStored"]]
    finally:
        context.destroy(linger=0)
        events.close()
