"""The simulated vLLM server: prefix caching, queueing, streaming, metrics and the OpenAI surface.

Every test serves real sockets through `serve()` inside `asyncio.run`. Timing only ever bounds a
wait generously or is a lower bound that noise cannot break.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from bench.simulator.sim import SimConfig, add_arguments, config_from_args, serve, tokenize, tokenize_words

MODEL = '{model_name="sim-model"}'
FAST = SimConfig(block_size=16, token_s=0.0, step_s=0.0)

Test = Callable[[aiohttp.ClientSession, list[str]], Awaitable[None]]


def run(test: Test, config: SimConfig = FAST, backends: int = 1) -> None:
    """Serve `backends` simulated backends on free ports and run `test` against their base URLs."""

    async def main() -> None:
        runners = await serve([0] * backends, config)
        try:
            async with aiohttp.ClientSession() as session:
                await test(session, [f"http://127.0.0.1:{runner.addresses[0][1]}" for runner in runners])
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any], str]:
    """POST a JSON body (or raw bytes); return status, parsed JSON body and the serving backend's name."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, orjson.loads(await response.read()), response.headers["x-sim-backend"]


async def cached(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    """Complete a request (chat if it has messages) and return its cached prompt tokens."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, reply, _ = await post(session, url + path, body)
    assert status == 200, reply
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Metric samples keyed as exposed, `name{label="value",...}` with labels sorted."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


async def wait_for(
    session: aiohttp.ClientSession, url: str, condition: Callable[[dict[str, float]], bool], timeout: float = 20.0
) -> dict[str, float]:
    """Scrape until `condition` holds; the timeout is generous because the test machine is noisy."""
    deadline = time.monotonic() + timeout
    while not condition(samples := await scrape(session, url)):
        assert time.monotonic() < deadline, f"condition never held; last metrics: {samples}"
        await asyncio.sleep(0.01)
    return samples


def running(samples: dict[str, float]) -> float:
    return samples["vllm:num_requests_running" + MODEL]


def waiting(samples: dict[str, float]) -> float:
    return samples["vllm:num_requests_waiting" + MODEL]


def chat(*contents: str, max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    """A chat body alternating user and assistant turns, starting with the user."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": content} for i, content in enumerate(contents)]
    return {"model": "sim-model", "messages": messages, "max_tokens": max_tokens, **fields}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# Tokenizer


def test_tokenizer_cuts_utf8_into_four_byte_groups():
    assert tokenize("abcd") == [int.from_bytes(b"abcd", "little") % 50_000 + 100]
    assert tokenize("abcde") == [*tokenize("abcd"), int.from_bytes(b"e\0\0\0", "little") % 50_000 + 100]
    assert tokenize("") == []
    assert len(tokenize("é" * 3)) == 2  # six UTF-8 bytes


@given(st.text(), st.text())
def test_tokenizer_is_deterministic_and_prefix_stable(head: str, tail: str):
    tokens = tokenize(head)
    assert tokens == tokenize(head)
    assert len(tokens) == math.ceil(len(head.encode()) / 4)
    assert all(100 <= token < 50_100 for token in tokens)
    aligned = head + "\0" * (-len(head.encode()) % 4)  # a prefix whose bytes end on a group boundary
    assert tokenize(aligned + tail)[: len(tokenize(aligned))] == tokenize(aligned)


# Prefix cache


def test_repeated_prompt_hits_all_full_blocks_but_recomputes_the_last_token():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        prompt = {"prompt": "x" * 400, "max_tokens": 2}  # 100 tokens: 6 full blocks of 16
        assert await cached(session, url, prompt) == 0
        assert await cached(session, url, prompt) == 96
        exact = {"prompt": "y" * 256, "max_tokens": 2}  # 64 tokens, 4 full blocks: the last one is recomputed
        assert await cached(session, url, exact) == 0
        assert await cached(session, url, exact) == 48
        body = chat("What is a prefix cache? " * 10)
        assert await cached(session, url, body) == 0
        status, tokenized, _ = await post(session, url + "/tokenize", body)
        assert status == 200
        assert await cached(session, url, body) == (tokenized["count"] - 1) // 16 * 16 > 0

    run(test)


def test_multi_turn_conversation_reuses_the_previous_turn():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        turns = ["You are a helpful assistant. " * 8 + "Tell me about caches.", "Caches keep data close. " * 6]
        previous: list[int] = []
        hits = []
        for question in ("And KV caches?", "And prefix caching?", "Thanks, and eviction?"):
            body = chat(*turns, question)
            status, rendered, _ = await post(session, url + "/v1/chat/completions/render", body)
            assert status == 200
            tokens = rendered["prompt_token_ids"]
            hit = await cached(session, url, body)
            assert hit == common_prefix(previous, tokens) // 16 * 16
            hits.append(hit)
            previous = tokens
            turns += [question, "Here is an answer. " * 4]
        assert 0 < hits[1] < hits[2]

    run(test, FAST)


def test_full_cache_evicts_old_prompts_and_refuses_a_prompt_larger_than_itself():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        a = {"prompt": "a" * 128, "max_tokens": 1}  # 32 tokens: 8 blocks of 4, the whole capacity
        b = {"prompt": "b" * 128, "max_tokens": 1}
        assert await cached(session, url, a) == 0
        assert await cached(session, url, a) == 28
        assert await cached(session, url, b) == 0  # evicts every block of a
        assert await cached(session, url, a) == 0
        long = {"prompt": "c" * 320, "max_tokens": 1}  # 80 tokens, 20 blocks: never fits the cache
        status, reply, _ = await post(session, url + "/v1/completions", long)
        assert status == 400 and "KV blocks" in reply["error"]["message"]
        async with session.post(url + "/reset_prefix_cache") as response:
            assert response.status == 200 and (await response.json()) == {"success": True}
        assert await cached(session, url, b) == 0

    run(test, SimConfig(block_size=4, capacity_blocks=8, token_s=0.0, step_s=0.0))


def test_a_reset_while_a_request_holds_blocks_fails_and_resets_nothing_as_vllms():
    """vLLM 0.32 answers `{"success": false}` while any blocks are held; the harness retries until
    it succeeds (bench/harness/fleets.py), so no router starts on the one before's cache."""

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        a = {"prompt": "a" * 128, "max_tokens": 1}
        assert await cached(session, url, a) == 0
        slow = asyncio.create_task(post(session, url + "/v1/completions", {"prompt": "b" * 64, "max_tokens": 50}))
        await asyncio.sleep(0.2)  # it holds its blocks while it decodes
        async with session.post(url + "/reset_prefix_cache") as response:
            assert (await response.json()) == {"success": False}
        await slow
        assert await cached(session, url, a) == 28  # nothing was reset
        async with session.post(url + "/reset_prefix_cache") as response:
            assert (await response.json()) == {"success": True}
        assert await cached(session, url, a) == 0

    run(test, SimConfig(block_size=4, capacity_blocks=64, token_s=0.0, step_s=0.01))


def test_kv_events_report_what_the_cache_stores_evicts_and_clears_as_vllm_publishes_them():
    """Decoded by kvroute's own decoder: computed blocks once (a hit stores nothing), evictions,
    a cleared cache; `--kv-events` on the command line turns it on."""
    import msgpack
    import zmq
    import zmq.asyncio

    from extproc.core.engine import AllBlocksCleared, BlockRemoved, BlockStored
    from extproc.vllm.events import decode

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        async with session.get(url + "/kv_event_sources") as response:
            (source,) = (await response.json()).values()
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source["topic"].encode())
        sub.connect(source["endpoint"].replace("*", "127.0.0.1"))
        await asyncio.sleep(0.3)  # ZMQ's slow joiner
        try:
            a, b = {"prompt": "a" * 128, "max_tokens": 1}, {"prompt": "b" * 128, "max_tokens": 1}
            await cached(session, url, a)  # 32 tokens: 7 full blocks cached (the last token is computed)
            await cached(session, url, a)  # a hit: nothing new stored
            await cached(session, url, b)  # evicts a's blocks
            async with session.post(url + "/reset_prefix_cache") as response:
                assert response.status == 200
            events = []
            while len(events) < 3:  # a's store, its removal and b's store
                events += decode(await asyncio.wait_for(sub.recv_multipart(), 5)).events
            with pytest.raises(TimeoutError):  # as vLLM, the clear waits for the engine's next step
                await asyncio.wait_for(sub.recv_multipart(), 0.3)
            await cached(session, url, a)
            while not any(isinstance(e, AllBlocksCleared) for e in events):
                frames = await asyncio.wait_for(sub.recv_multipart(), 5)
                batch = decode(frames)
                assert msgpack.unpackb(frames[2])[1][0]["type"]  # vLLM 0.32's map form
                events += batch.events
        finally:
            context.destroy(linger=0)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [len(e.block_hashes) for e in stored[:2]] == [8, 8] and all(len(e.token_ids) == 32 for e in stored)
        assert stored[0].parent_hash is None and stored[0].block_size == 4
        removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removed == set(stored[0].block_hashes)  # b took the whole cache

    config = SimConfig(block_size=4, capacity_blocks=8, token_s=0.0, step_s=0.0)
    run(test, dataclasses.replace(config, kv_events=True))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--port", "1", "--kv-events"])).kv_events


def test_kv_events_carry_the_adapter_and_cache_salt_as_vllm_so_precise_keys_match_the_requests():
    """vLLM publishes each block's extra keys (the LoRA name on every block, the cache_salt on the
    first) and the LoRA name; kvroute's precise index keys blocks by them. The simulator sent none,
    so on it an adapter's or a salted prompt's blocks were indexed as the base model's."""
    import zmq
    import zmq.asyncio

    from extproc.core.chain import TokenHasher
    from extproc.core.engine import BlockStored
    from extproc.core.modes import _extra_keys
    from extproc.core.precise import PreciseIndex
    from extproc.vllm.events import decode

    ids = list(range(1000, 1020))  # 5 full blocks of 4

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        async with session.get(urls[0] + "/kv_event_sources") as response:
            (source,) = (await response.json()).values()
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(source["endpoint"].replace("*", "127.0.0.1"))
        await asyncio.sleep(0.3)  # ZMQ's slow joiner
        try:
            for body in ({"model": "ada"}, {"model": "ada", "cache_salt": "s1"}, {"cache_salt": "s1"}, {}):
                await cached(session, urls[0], {**body, "prompt": ids})
            events: list[BlockStored] = []
            while len(events) < 4:
                batch = decode(await asyncio.wait_for(sub.recv_multipart(), 5))
                events += [e for e in batch.events if isinstance(e, BlockStored)]
        finally:
            context.destroy(linger=0)
        assert [e.lora_name for e in events] == ["ada", "ada", None, None]
        assert events[1].extra_keys[:2] == (("ada", "s1"), ("ada",)) and events[2].extra_keys[0] == ("s1",)
        hasher = TokenHasher(b"k" * 16)
        for event, (lora, salt) in zip(events, [("ada", None), ("ada", "s1"), (None, "s1"), (None, None)], strict=True):
            index = PreciseIndex(hasher, 1000)
            assert index.stored("b", event) == hasher.chain(ids, 4, _extra_keys(lora, salt, 5))

    run(test, SimConfig(block_size=4, token_s=0.0, step_s=0.0, kv_events=True, lora_modules="ada"))


def test_a_decode_reports_the_prefill_servers_cached_tokens_as_vllm_does():
    """vLLM 0.32's prefill server puts its own hits in the transfer parameters it answers
    (`remote_prefill_cached_tokens`) and the decode server reports those in its usage, not its
    own near-total hit from the transfer; the simulator's decode reported its local hits."""

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        prefill, decode = urls
        ids = list(range(1000, 1064))  # 4 blocks of 16
        await cached(session, prefill, {"prompt": ids})  # the prefill server holds the prompt now
        leg = {"prompt": ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, reply, _ = await post(session, prefill + "/v1/completions", leg)
        assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        parameters = reply["kv_transfer_params"]
        assert parameters["remote_prefill_cached_tokens"] == 48
        status, reply, _ = await post(
            session, decode + "/v1/completions", {"prompt": ids, "kv_transfer_params": parameters}
        )
        assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 48

    run(test, dataclasses.replace(FAST, kv_connector=True), backends=2)


def test_media_and_cache_salt_key_the_blocks_like_vllm():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]

        def with_image(image: str) -> dict[str, Any]:
            parts = [{"type": "text", "text": "t" * 200}, {"type": "image_url", "image_url": {"url": image}}]
            return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "u" * 200}]}]}

        assert await cached(session, url, with_image("cat.png")) == 0
        full = await cached(session, url, with_image("cat.png"))
        # Same text, another image: only the blocks before the one holding the placeholder are shared.
        assert 0 < await cached(session, url, with_image("dog.png")) < full
        body = chat("s" * 400)
        assert await cached(session, url, {**body, "cache_salt": "alice"}) == 0
        assert await cached(session, url, {**body, "cache_salt": "bob"}) == 0
        assert await cached(session, url, {**body, "cache_salt": "alice"}) > 0

    run(test)


# OpenAI surface


def test_streaming_chat_sends_sse_chunks_then_usage_then_done():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        body = chat("Stream to me, please.", max_tokens=6, stream=True, stream_options={"include_usage": True})
        async with session.post(urls[0] + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = await response.text()
        events = raw.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert all(event.startswith("data: ") for event in events[:-1])
        chunks = [orjson.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
        assert len({chunk["id"] for chunk in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        content = chunks[1:-1]
        assert len(content) > 1  # tokens arrive as they are decoded, not all at once
        assert [chunk["choices"][0]["finish_reason"] for chunk in content][-1] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in content)
        status, whole, _ = await post(session, urls[0] + "/v1/chat/completions", {**body, "stream": False})
        assert status == 200 and whole["choices"][0]["message"]["content"] == text

    run(test, SimConfig(step_s=0.005))


def test_completions_from_text_or_token_ids():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0] + "/v1/completions"
        status, reply, _ = await post(
            session, url, {"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 3}
        )
        assert status == 200
        assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 3
        assert reply["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 3,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        ids = list(range(1000, 1040))
        assert await cached(session, urls[0], {"prompt": ids}) == 0
        status, reply, _ = await post(session, url, {"prompt": ids})  # no limit: default length, as if EOS
        assert reply["usage"]["prompt_tokens"] == 40 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "stop"
        async with session.post(url, json={"prompt": "streamed", "max_tokens": 2, "stream": True}) as response:
            events = (await response.text()).split("\n\n")
        assert events[-2] == "data: [DONE]"
        chunks = [orjson.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert all("usage" not in chunk for chunk in chunks)  # include_usage was not asked for
        assert len("".join(chunk["choices"][0]["text"] for chunk in chunks).split()) == 2

    run(test)


def test_errors_are_openai_json():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        status, reply, backend = await post(session, url + "/v1/chat/completions", {**chat("hi"), "model": "other"})
        assert status == 404 and reply["error"]["code"] == 404 and reply["error"]["type"] == "NotFoundError"
        assert "other" in reply["error"]["message"] and backend == url.removeprefix("http://")
        for path, body in [
            ("/v1/chat/completions", b"{not json"),
            ("/v1/chat/completions", {"model": "sim-model"}),
            ("/v1/chat/completions", {"messages": []}),
            ("/v1/chat/completions", [1, 2]),
            ("/v1/completions", {"model": "sim-model"}),
            ("/v1/completions", {"prompt": ""}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
            ("/v1/completions", {"prompt": "hi", "model": []}),  # was a 500 (an unhashable name)
            ("/tokenize", b""),
            ("/v1/load_lora_adapter", b"{not json"),  # the runtime LoRA endpoints answered 500
            ("/v1/load_lora_adapter", [1]),
            ("/v1/load_lora_adapter", {"lora_name": "sim-model", "lora_path": "/a"}),  # the base model's name
            ("/v1/load_lora_adapter", {"lora_name": "ada", "lora_path": "/a"}),  # served already
            ("/v1/unload_lora_adapter", b"{not json"),
        ]:
            status, reply, _ = await post(session, url + path, body)
            assert status == 400, (path, body)
            assert set(reply["error"]) >= {"message", "type", "code"}
            assert reply["error"]["type"] == "BadRequestError" and reply["error"]["code"] == 400
        inplace = {"lora_name": "ada", "lora_path": "/b", "load_inplace": True}
        async with session.post(url + "/v1/load_lora_adapter", json=inplace) as response:
            assert response.status == 200

    run(test, dataclasses.replace(FAST, runtime_lora=True, lora_modules="ada"))


def test_what_vllm_refuses_at_once_is_refused_at_once():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        started = time.monotonic()
        too_long = chat("x" * (4 * 300))  # about 300 tokens against a 256-token context
        status, reply, _ = await post(session, url + "/v1/chat/completions", too_long)
        assert status == 400 and "maximum context length is 256 tokens" in reply["error"]["message"]
        status, reply, _ = await post(session, url + "/v1/completions", {"prompt": "hi", "max_tokens": 300})
        assert status == 400  # prompt + max_tokens past the context
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip", "Connection": "close"}
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(chat("hi")), headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"  # labelled gzip, is not
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(chat("hi"))) as r:
            assert r.status == 400 and "application/json" in (await r.json())["error"]["message"]  # no media type
        assert time.monotonic() - started < 5  # no prefill was modelled for any of them
        status, _, _ = await post(session, url + "/v1/chat/completions", chat("fits"))
        assert status == 200

    run(test, dataclasses.replace(FAST, max_model_len=256))


def test_models_health_tokenize_and_render():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        async with session.get(url + "/v1/models") as response:
            assert [model["id"] for model in (await response.json())["data"]] == ["sim-model"]
        async with session.get(url + "/health") as response:
            assert response.status == 200 and await response.read() == b""
        status, reply, _ = await post(session, url + "/tokenize", {"prompt": "hello world"})
        assert reply == {"tokens": tokenize("hello world"), "count": 3, "max_model_len": 131072}
        body = {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {}}],
                },
            ],
        }
        status, rendered, _ = await post(session, url + "/v1/chat/completions/render", body)
        assert status == 200
        assert rendered["prompt"] == (
            '<|tools|>[{"function":{"name":"f"},"type":"function"}]\n'
            "<|system|>\nBe brief.<|end|>\n<|user|>\nLook: <|image|><|end|>\n<|assistant|>\n"
        )
        assert rendered["prompt_token_ids"] == tokenize(rendered["prompt"])
        status, tokenized, _ = await post(session, url + "/tokenize", body)
        assert tokenized["tokens"] == rendered["prompt_token_ids"]

    run(test)


# Metrics and scheduling


def test_metrics_expose_vllm_names_and_values():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        prompt = {"prompt": "m" * 400, "max_tokens": 1}  # 100 tokens
        await cached(session, url, prompt)
        await cached(session, url, prompt)
        samples = await scrape(session, url)
        assert samples["vllm:prefix_cache_queries_total" + MODEL] == 200
        assert samples["vllm:prefix_cache_hits_total" + MODEL] == 96
        assert samples['vllm:request_success_total{finished_reason="length",model_name="sim-model"}'] == 2
        assert running(samples) == 0 and waiting(samples) == 0
        assert samples["vllm:kv_cache_usage_perc" + MODEL] == 0
        assert samples['vllm:cache_config_info{block_size="16",num_gpu_blocks="64"}'] == 1
        # One step each (the budget holds the prompt, the first token is the last): 100 tokens, then 4.
        assert samples["vllm:iteration_tokens_total_count" + MODEL] == 2
        assert samples["vllm:iteration_tokens_total_sum" + MODEL] == 104
        timing = ("request_queue_time", "request_prefill_time", "time_to_first_token")
        assert all(samples[f"vllm:{name}_seconds_count" + MODEL] == 2 for name in timing)
        queued, ttft = (samples[f"vllm:{name}_seconds_sum" + MODEL] for name in (timing[0], timing[2]))
        assert queued <= ttft == pytest.approx(queued + samples["vllm:request_prefill_time_seconds_sum" + MODEL])
        # Two running requests on one 100-token prompt hold its 6 full blocks once and a partial block
        # each, until their 12th output token needs another (0.6 s of steps away).
        slow = {"prompt": "k" * 400, "max_tokens": 300}
        tasks = [asyncio.create_task(cached(session, url, slow)) for _ in range(2)]
        samples = await wait_for(session, url, lambda samples: running(samples) == 2)
        assert samples["vllm:kv_cache_usage_perc" + MODEL] == pytest.approx(8 / 64)
        for task in tasks:
            task.cancel()
        await wait_for(session, url, lambda samples: running(samples) == 0)
        assert (await scrape(session, url))["vllm:kv_cache_usage_perc" + MODEL] == 0

    run(test, SimConfig(capacity_blocks=64, token_s=0.0, step_s=0.05))


def test_requests_beyond_max_num_seqs_wait_fifo_and_all_finish():
    per_request = 0.4  # 4 output tokens of 0.1 s

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        finished: list[int] = []
        peak_waiting = 0.0

        async def request(index: int) -> None:
            assert await cached(session, url, {"prompt": f"request {index}", "max_tokens": 4}) == 0
            finished.append(index)

        start = time.monotonic()
        tasks = []
        for index in range(5):  # one at a time, so the arrival order is known
            tasks.append(asyncio.create_task(request(index)))
            samples = await wait_for(session, url, lambda s, n=index + 1: running(s) + waiting(s) + len(finished) >= n)
            assert running(samples) <= 2
            peak_waiting = max(peak_waiting, waiting(samples))
        await asyncio.gather(*tasks)
        assert peak_waiting > 0
        assert time.monotonic() - start >= 3 * per_request  # five requests, two slots: at least three rounds
        assert set(finished[:2]) == {0, 1} and set(finished[2:4]) == {2, 3} and finished[4] == 4
        samples = await scrape(session, url)
        assert running(samples) == 0 and waiting(samples) == 0
        assert samples['vllm:request_success_total{finished_reason="length",model_name="sim-model"}'] == 5

    run(test, SimConfig(max_num_seqs=2, token_s=0.0, step_s=per_request / 4))


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_frees_running_and_waiting_slots(stream: bool):
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]

        async def request() -> None:
            body = {"prompt": "never finishes", "max_tokens": 60_000, "stream": stream}  # 3,000 s of steps
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()

        first = asyncio.create_task(request())
        await wait_for(session, url, lambda samples: running(samples) == 1)
        second = asyncio.create_task(request())
        await wait_for(session, url, lambda samples: waiting(samples) == 1)
        second.cancel()
        await wait_for(session, url, lambda samples: waiting(samples) == 0 and running(samples) == 1)
        first.cancel()
        await wait_for(session, url, lambda samples: running(samples) == 0)
        third = asyncio.create_task(request())  # the freed slot admits the next request at once
        await wait_for(session, url, lambda samples: running(samples) == 1 and waiting(samples) == 0)
        third.cancel()
        samples = await wait_for(session, url, lambda samples: running(samples) == 0)
        assert samples['vllm:request_success_total{finished_reason="length",model_name="sim-model"}'] == 0
        assert samples['vllm:request_success_total{finished_reason="abort",model_name="sim-model"}'] == 3  # as vLLM

    run(test, SimConfig(max_num_seqs=1, token_s=0.0, step_s=0.05))


def test_two_backends_in_one_process_keep_separate_caches_and_metrics():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        first, second = urls
        body = {"prompt": "shared " * 50, "max_tokens": 1}
        for url, hit in [(first, False), (first, True), (second, False)]:
            status, reply, backend = await post(session, url + "/v1/completions", body)
            assert status == 200 and backend == url.removeprefix("http://")
            assert (reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is hit
        prompt_tokens = reply["usage"]["prompt_tokens"]
        assert (await scrape(session, first))["vllm:prefix_cache_queries_total" + MODEL] == 2 * prompt_tokens
        assert (await scrape(session, second))["vllm:prefix_cache_queries_total" + MODEL] == prompt_tokens
        assert (await scrape(session, second))["vllm:prefix_cache_hits_total" + MODEL] == 0

    run(test, backends=2)


# Command line


def test_command_line_flags_build_the_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--port", "8001", "--port", "8002", "--block-size", "32", "--token-s", "0.001", "--model", "m"]
    )
    assert args.port == [8001, 8002] and args.host == "127.0.0.1"
    assert config_from_args(args) == SimConfig(model="m", block_size=32, token_s=0.001)
    defaults = parser.parse_args(["--port", "1"])
    assert config_from_args(defaults) == SimConfig()
    with pytest.raises(ValueError, match="max_num_seqs"):
        config_from_args(parser.parse_args(["--port", "1", "--max-num-seqs", "0"]))


def test_main_serves_until_sigterm():
    async def main() -> None:
        command = ["-m", "bench.simulator.sim", "--port", "0", "--port", "0", "--step-s", "0"]
        root = Path(__file__).resolve().parent.parent
        process = await asyncio.create_subprocess_exec(sys.executable, *command, cwd=root, stdout=subprocess.PIPE)
        try:
            lines = [await asyncio.wait_for(process.stdout.readline(), 30) for _ in range(2)]
            async with aiohttp.ClientSession() as session:
                for line in lines:
                    address = line.decode().split(" on ")[1].strip()
                    async with session.get(address + "/health") as response:
                        assert response.status == 200 and address.endswith(response.headers["x-sim-backend"])
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 30) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    asyncio.run(main())


def test_block_pool_pins_running_blocks_and_evicts_finished_prompts_tail_first():
    from bench.simulator.sim_engine import BlockPool

    pool = BlockPool(6)
    pool.acquire([1, 2, 3], 1)  # a running prompt: three full blocks and its partial last one
    assert pool.pinned == 4 and not pool.can_acquire([7, 8, 9], 0)  # pinned blocks are never evicted
    pool.release([1, 2, 3], 1)  # finished: free queue gets 3, then 2, then 1
    assert pool.pinned == 0 and pool.match([1, 2, 3], 3) == 3  # still cached while free
    pool.acquire([7, 8, 9, 10, 11], 0)  # needs two more blocks: evicts 3 then 2, the prompt's tail first
    assert pool.match([1, 2, 3], 3) == 1
    pool.acquire([1], 0)  # a hit on a free block takes it out of the queue and pins it
    pool.release([7, 8, 9, 10, 11], 0)
    pool.acquire([12, 13, 14, 15, 16], 0)  # evicts 11, 10, 9, 8, 7 (least recently freed first), never 1
    assert pool.match([1], 1) == 1 and pool.match([7], 1) == 0


def test_a_request_waits_for_blocks_while_others_pin_the_cache():
    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0]
        # 40 tokens: 10 of the 12 blocks, held while it decodes (its 7 output tokens fill 2 more)
        hog = {"prompt": "h" * 4 * 40, "max_tokens": 8}
        small = {"prompt": "s" * 4 * 12, "max_tokens": 1}  # 3 blocks: must wait for the hog to finish
        first = asyncio.create_task(cached(session, url, hog))
        await wait_for(session, url, lambda samples: running(samples) == 1)
        started = time.monotonic()
        assert await cached(session, url, small) == 0
        assert first.done() and time.monotonic() - started > 0.2  # it waited for the hog's blocks

    run(
        test,
        SimConfig(block_size=4, capacity_blocks=12, max_num_seqs=4, token_s=0.0, step_s=0.05),
    )


def test_the_words_tokenizer_gives_tokens_of_varying_length_as_a_real_tokenizer_does():
    from bench.workloads.prompts import PromptBuilder

    assert len(tokenize_words(" the quick brown")) == 5  # " the", " quic", "k", " brow", "n"
    same = tokenize_words(" quick quick")
    assert same[:2] == same[2:] and len(set(same[:2])) == 2  # equal pieces, equal ids
    text = PromptBuilder("sim-model", 4.0, 1).block_text(7) * 4
    assert 3.0 < len(text) / len(tokenize_words(text)) < 4.0  # the tiny model: about 3.5 bytes a token

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        status, reply, _ = await post(session, urls[0] + "/v1/completions", {"prompt": text, "max_tokens": 1})
        assert status == 200 and reply["usage"]["prompt_tokens"] == len(tokenize_words(text))

    run(test, SimConfig(tokenizer="words", token_s=0.0, step_s=0.0))
    with pytest.raises(ValueError, match="tokenizer"):
        SimConfig(tokenizer="sentencepiece")


def test_a_failing_engine_step_answers_500_or_an_error_event_and_the_next_request_is_served(monkeypatch):
    from bench.simulator.sim_engine import Engine

    plan = Engine.plan_step
    failures = [1, 1]  # the next two steps raise: one per request below

    def plan_or_fail(self: Engine) -> list:
        if failures and (self.waiting or self.running):
            failures.pop()
            raise RuntimeError("a bug in a step")
        return plan(self)

    monkeypatch.setattr(Engine, "plan_step", plan_or_fail)

    async def test(session: aiohttp.ClientSession, urls: list[str]) -> None:
        await asyncio.wait_for(requests(session, urls), timeout=20)  # a request left waiting fails, not hangs

    async def requests(session: aiohttp.ClientSession, urls: list[str]) -> None:
        url = urls[0] + "/v1/chat/completions"
        status, reply, _ = await post(session, url, chat("one"))
        assert status == 500 and reply["error"]["type"] == "InternalServerError" and reply["error"]["code"] == 500
        async with session.post(url, json=chat("two", stream=True)) as response:
            assert response.status == 200  # the headers went out before the engine ran it
            events = (await response.text()).split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert orjson.loads(events[-3].removeprefix("data: "))["error"]["code"] == 500
        status, reply, _ = await post(session, url, chat("three"))
        assert status == 200 and reply["usage"]["completion_tokens"] == 4  # a fresh engine loop served it
        samples = await scrape(session, urls[0])
        assert running(samples) == 0 and waiting(samples) == 0

    run(test)


def test_block_hashes_are_the_same_in_every_process():
    """A decode server pulls a prefill's blocks by their hashes, and the benchmark's oracle counts
    blocks as the backends do: hashing a str, bytes or None gave each process its own values."""
    code = (
        "from bench.simulator.sim import _Prompt, _block_hashes;"
        "print(_block_hashes(_Prompt(list(range(40)), {0: (b'cache_salt=x',), 2: (b'img',)}, 'ada'), 4))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
