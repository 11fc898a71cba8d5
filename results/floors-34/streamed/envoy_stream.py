"""Envoy's and the ext_proc's CPU per request for streamed responses of 1 and 32 tokens, kvroute over
ext_authz, two simulated backends whose steps take 5 ms (each SSE chunk written on its own).

    python results/floors-34/streamed/envoy_stream.py   # from the checkout, in .venv (2026-12-05)
"""
import asyncio, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "/work/main")
import aiohttp
from bench.harness.stack import Stack
from bench.harness.processes import cpu_seconds

SIM = ["--step-s", "0.005", "--token-s", "0"]

async def send(url, n, tokens, conc=16):
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession() as s:
        async def one(i):
            body = {"model": "sim-model", "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": f"q{i} " + "word " * 1500}]}
            async with sem:
                async with s.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}) as r:
                    assert r.status == 200, (r.status, await r.text())
                    chunks = 0
                    async for _ in r.content:
                        chunks += 1
                    return chunks
        res = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(res) / len(res)

with tempfile.TemporaryDirectory() as d, Stack(Path(d), sims=2, sim_args=SIM, transport="ext_authz") as stack:
    time.sleep(3)
    asyncio.run(send(stack.url, 100, 4))
    for rnd in range(2):
        for tokens in (1, 32):
            pids = {n: stack.processes[n].pid for n in ("envoy", "extproc")}
            before = {n: cpu_seconds([p]) for n, p in pids.items()}
            t = time.monotonic()
            lines = asyncio.run(send(stack.url, 800, tokens))
            el = time.monotonic() - t
            used = {n: (cpu_seconds([p]) - before[n]) / 800 * 1e6 for n, p in pids.items()}
            print(f"round {rnd} max_tokens {tokens}: lines/resp {lines:.0f}, envoy {used['envoy']:.0f} us/req, extproc {used['extproc']:.0f} us/req, {el:.1f} s")
