"""Helpers for tests that drive a real Envoy + ext_proc + simulated backends."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.stack import dev_command

# Simulated backends for multi-MB prompts (about a million tokens): a long context, a KV cache to
# hold it, fast prefill, and a step budget that prefills it in one step (at the default budget the
# fixed cost of some 500 steps would add seconds to each request).
LONG_PROMPT_SIM = (
    "--token-s",
    "0.000001",
    "--max-num-batched-tokens",
    "2000000",
    "--max-model-len",
    "2000000",
    "--capacity-blocks",
    "70000",
)


def post(url: str, body: Any, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"):
    """POST and read the whole response: (status, headers, parsed or raw body)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    try:
        conn.request("POST", path, body=raw, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        try:
            content: Any = orjson.loads(data)
        except orjson.JSONDecodeError:
            content = data
        return response.status, {k.lower(): v for k, v in response.getheaders()}, content
    finally:
        conn.close()


def get(url: str, path: str, headers: dict[str, str] | None = None):
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def metric(admin_url: str, line_prefix: str) -> float:
    """The value of the first exposition line starting with `line_prefix` (0 if absent)."""
    for line in get(admin_url, "/metrics")[2].decode().splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def envoy_stat(stack: Any, name: str) -> int:
    """One counter or gauge from a stack's Envoy admin `/stats` (0 when Envoy has none)."""
    _, _, body = get(f"http://127.0.0.1:{stack.envoy_admin_port}", f"/stats?filter=^{name}$")
    return int(body.decode().split(":")[1]) if body.strip() else 0


def log_tails(workdir: Any, names: tuple[str, ...] = ("extproc", "envoy")) -> str:
    """The ends of a stack's process logs (`workdir`/NAME.log), for a failure's message."""
    return "\n".join(f"{name}: ...{(workdir / f'{name}.log').read_text()[-2000:]}" for name in names)


def eventually(check: Callable[[], bool], timeout_s: float = 15.0, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{message} not reached within {timeout_s}s")


async def until(check: Callable[[], bool], timeout_s: float = 10.0, message: str = "condition") -> None:
    """`eventually` for async tests: polls without blocking the event loop the code under test runs on."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} not reached within {timeout_s}s")
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def sim_servers(log: Path, count: int, *flags: str) -> Iterator[list[str]]:
    """`count` simulated servers in one `kvroute-dev sim` process with `flags`: their addresses,
    stopped on exit."""
    ports = [free_port() for _ in range(count)]
    sim = spawn(dev_command("sim", *[a for p in ports for a in ("--port", str(p))], *flags), log)
    try:
        backends = [f"127.0.0.1:{p}" for p in ports]
        for backend in backends:
            wait_http(f"http://{backend}/health", process=sim)
        yield backends
    finally:
        stop(sim)
