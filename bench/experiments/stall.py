"""`kvroute-dev bench stall`: how long one hostile body stalls the ext_proc's event loop.

One 16 MiB chat body of 5.5 million empty content parts goes through the local stack (Envoy,
ext_proc, simulated backends) while another thread polls the ext_proc's /healthz every 5 ms; the
worst /healthz latency is the stall every other request would also have seen.
"""

from __future__ import annotations

import http.client
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import orjson

from bench.harness.stack import Stack


def _request(url: str, method: str, path: str, body: bytes | None = None) -> int:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def main(parts: int = 5_500_000) -> dict[str, float]:
    """Route the hostile body once; return its latency and the /healthz latencies meanwhile."""
    body = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": [""] * parts}]})
    with Stack(Path(tempfile.mkdtemp(prefix="kvroute-stall-"))) as stack:
        warm = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "warm"}]})
        for _ in range(3):
            _request(stack.url, "POST", "/v1/chat/completions", warm)
        latencies: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                started = time.perf_counter()
                _request(stack.admin_url, "GET", "/healthz")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

        thread = threading.Thread(target=probe)
        thread.start()
        started = time.perf_counter()
        status = _request(stack.url, "POST", "/v1/chat/completions", body)
        took = time.perf_counter() - started
        time.sleep(0.2)
        done.set()
        thread.join()
    latencies.sort()
    result = {
        "body_mib": round(len(body) / 2**20, 1),
        "status": status,
        "request_s": round(took, 3),
        "healthz_max_ms": round(latencies[-1] * 1000, 1),
        "healthz_p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
    }
    print(orjson.dumps(result).decode())
    return result
