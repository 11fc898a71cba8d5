"""The backend pool: health transitions, removal, and KV cache sizes read from vLLM metrics."""

from __future__ import annotations

import asyncio
import contextlib

from bench.sim import SimConfig, serve
from extproc.core.backends import Backend
from extproc.runtime.pool import BackendPool, kv_cache_tokens

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_down_after_threshold_up_after_one_success():
    dropped: list[str] = []
    pool = BackendPool([Backend(A), Backend(B)], dropped.append, unhealthy_after=2)
    pool.mark(A, False)
    assert pool.healthy_count() == 2 and not dropped
    pool.mark(A, False)
    assert pool.healthy_count() == 1 and dropped == [A]
    pool.mark(A, False)
    assert dropped == [A]  # dropped once, not on every failure
    pool.mark(A, True)
    assert pool.healthy_count() == 2


def test_replace_drops_leavers_and_keeps_health_of_stayers():
    dropped: list[str] = []
    pool = BackendPool([Backend(A), Backend(B)], dropped.append, unhealthy_after=1)
    pool.mark(B, False)
    pool.replace([Backend(B, frozenset({"m"})), Backend("10.0.0.3:8000")])
    assert dropped == [B, A]
    assert {b.address: (b.healthy, b.models) for b in pool.backends} == {
        B: (False, frozenset({"m"})),
        "10.0.0.3:8000": (True, frozenset()),
    }
    assert not pool.is_known(A)


def test_kv_cache_tokens_from_vllm_metrics():
    text = 'vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="1024"} 1.0\n'
    assert kv_cache_tokens(text) == 131072
    assert kv_cache_tokens("vllm:num_requests_running 0\n") is None
    assert kv_cache_tokens('vllm:cache_config_info{block_size="x",num_gpu_blocks="1"} 1.0') is None


def test_probes_find_health_and_capacity_of_real_servers():
    async def scenario() -> None:
        runners = await serve([0], SimConfig(block_size=16, capacity_blocks=300))
        address = f"127.0.0.1:{runners[0].addresses[0][1]}"
        sized: list[tuple[str, int]] = []
        pool = BackendPool(
            [Backend(address), Backend("127.0.0.1:9")], lambda _a: None, 1, lambda a, t: sized.append((a, t))
        )
        probes = asyncio.create_task(pool.probe_forever(0.05, 1.0))
        try:
            for _ in range(100):
                if sized and pool.healthy_count() == 1:
                    break
                await asyncio.sleep(0.05)
        finally:
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            for runner in runners:
                await runner.cleanup()
        assert sized == [(address, 4800)]
        assert [b.address for b in pool.backends if b.healthy] == [address]

    asyncio.run(scenario())
