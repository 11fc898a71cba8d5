"""vLLM's prefill/decode hand-off by hand, on two vLLM-CPU servers with NIXL: is a decode fed by a
transfer the same as one server serving the prompt whole? For each prompt, at temperature 0: a
prefill for a remote decode on one server, the decode on the other with the parameters it gave,
and the same prompt served whole; the share of prompts whose outputs are equal, and how much of
each decoded prompt the decode server counted as transferred (`kvroute-dev bench handoff`).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from bench.harness.fleets import VllmFleet, counter
from bench.workload import text
from extproc.core.handoff import ASK_REMOTE_DECODE

MODEL = "tiny-llama"
TRANSFERRED = "vllm:prompt_tokens_by_source_total"


def completion(backend: str, prompt: str, max_tokens: int, **extra: object) -> dict[str, Any]:
    """A greedy completion from one server."""
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, **extra}
    request = urllib.request.Request(
        f"http://{backend}/v1/completions", orjson.dumps(body), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        result: dict[str, Any] = orjson.loads(response.read())
        return result


def transferred(backend: str) -> float:
    """Prompt tokens the server took from a KV transfer rather than computed."""
    return counter(backend, TRANSFERRED, source="external_kv_transfer")


def connect(prefill: str, decode: str) -> None:
    """The first hand-off between two servers sets up their NIXL connection: its handshake has 5 s
    (vLLM's own limit), which two engines starting on two shared cores sometimes miss. The decode
    then recomputes (`kv_load_failure_policy: recompute`); tries until one transfer went through."""
    for attempt in range(3):
        first = completion(prefill, f"warm-up {attempt} " * 200, 1, kv_transfer_params=ASK_REMOTE_DECODE)
        completion(decode, f"warm-up {attempt} " * 200, 16, kv_transfer_params=first["kv_transfer_params"])
        if counter(decode, "vllm:nixl_xfer_time_seconds_count") > 0:
            return
    raise AssertionError("no NIXL transfer between the two servers in three tries")


def hand_off(prefill: str, decode: str, prompt: str, max_tokens: int) -> tuple[dict[str, Any], float]:
    """The prompt prefilled on `prefill`, decoded on `decode` from the transfer: the decode's
    answer, and the prompt tokens the decode server counted as transferred for it."""
    before = transferred(decode)
    first = completion(prefill, prompt, 1, kv_transfer_params=ASK_REMOTE_DECODE)
    params = first["kv_transfer_params"]
    if not params or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        raise AssertionError(f"the prefill server gave no usable transfer parameters: {params!r}")
    handed = completion(decode, prompt, max_tokens, kv_transfer_params=params)
    return handed, transferred(decode) - before


def run(prompts: int, max_tokens: int, seed: int, workdir: Path | None = None) -> dict[str, Any]:
    """`prompts` random prompts of about 1,000 to 2,500 tokens through a 1P1D pair and whole."""
    rng = random.Random(seed)
    texts = [text(rng, rng.randint(3000, 7500)) for _ in range(prompts)]
    with tempfile.TemporaryDirectory() as scratch:
        fleet = VllmFleet(2, 2 * 256 * 128, 8192, workdir or Path(scratch), roles=("prefill", "decode"))
        try:
            prefill, decode = fleet.backends
            connect(prefill, decode)
            equal, moved_share, prompt_tokens = 0, [], []
            for prompt in texts:
                handed, moved = hand_off(prefill, decode, prompt, max_tokens)
                alone = completion(prefill, prompt, max_tokens)
                equal += handed["choices"][0]["text"] == alone["choices"][0]["text"]
                tokens = handed["usage"]["prompt_tokens"]
                moved_share.append(moved / tokens)
                prompt_tokens.append(tokens)
            xfers = counter(decode, "vllm:nixl_xfer_time_seconds_count")
            xfer_s = counter(decode, "vllm:nixl_xfer_time_seconds_sum")
        finally:
            fleet.stop()
    return {
        "prompts": prompts,
        "output_tokens": max_tokens,
        "seed": seed,
        "equal_outputs": equal,
        "equal_share": round(equal / prompts, 3),
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "transferred_share_min": round(min(moved_share), 3),
        "transferred_share_median": round(statistics.median(moved_share), 3),
        "nixl_transfers": xfers,
        "nixl_mean_ms": round(1000 * xfer_s / xfers, 1) if xfers else None,
    }
